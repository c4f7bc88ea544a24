"""pull(): resolve a package version, download it (whole or up to a level), verify, install.

Registry layout (a bucket or directory; the REST API will resolve to the same files):

    <registry>/packages/<name>/<version>/manifest.json      signed, canonical JSON
    <registry>/packages/<name>/<version>/<file>             every file the manifest lists
    <registry>/packages/<name>/aliases/<alias>              text: the version it points to

`registry` is a local path, a file:// URL, an http(s):// base URL (GET with Range), or the
Elastify REST API: an http(s) URL whose path ends in /v1 (e.g. http://host:8000/v1) or an
ElastifyClient. Through the API, the server resolves versions and aliases and serves each
file with Range (or redirects to a presigned object-store URL); the keys, resume, parallel
fetch and verification below are the same code for every kind of registry.

Order of trust: the manifest is fetched first and must carry `format_version` 1, the
requested name and version, and a valid Ed25519 signature by the pinned `public_key`; only
then are files fetched (in parallel) and each checked against the manifest's sha256 — or,
for a `max_level` pull, each needed byte range against its signed range digest. Anything
that fails is deleted and PackageError raised. Downloads go to a staging directory in the
cache (interrupted transfers resume there with HTTP Range) and are renamed into place only
once verified, so a half-downloaded package is never loadable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
import urllib.parse
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timezone
from pathlib import Path

import httpx

try:
    import fcntl
except ImportError:  # Windows: no advisory lock; concurrent pulls there may race on the sequence record
    fcntl = None

from device_sdk.client import ElastifyAPIError, ElastifyClient, reason
from device_sdk.format import (
    MANIFEST,
    SAFE_NAME,
    WEIGHTS,
    Level,
    Manifest,
    PackageError,
    atomic_write_bytes,
    canonical_json,
    check_files,
    level_byte_ranges,
    parse_manifest,
    read_manifest_bytes,
    verify_signature,
    weights_ranges,
)
from device_sdk.trust import check_signature, signing_key

log = logging.getLogger(__name__)
LOCAL_STATE = ".elastify-local.json"  # written by pull into the installed copy, never in a registry
CHUNK = 1 << 20
ATTEMPTS = 3  # per byte range; each retry resumes where the last one stopped
CONNECT_RETRIES = 2  # httpx's own retries of a connection that could not be opened


def default_cache() -> Path:
    home = Path(os.environ.get("ELASTIFY_HOME", Path.home() / ".cache" / "elastify"))
    return home / "packages"


# --------------------------------------------------------------------------- registries


class Registry:
    """Read access to a bucket or directory laid out as in the module docstring."""

    @staticmethod
    def open(location, token: str | None = None) -> Registry:
        """A registry for a path, file://, http(s):// bucket, the REST API (…/v1), or an ElastifyClient."""
        if isinstance(location, ElastifyClient):
            return APIRegistry(location)
        text = str(location)
        if text.startswith(("http://", "https://")) and urllib.parse.urlsplit(text).path.rstrip("/").endswith("/v1"):
            return APIRegistry(ElastifyClient(text, token=token))
        if text.startswith(("http://", "https://")):
            return HTTPRegistry(text)
        if text.startswith("file://"):
            return DirectoryRegistry(Path(urllib.parse.urlparse(text).path))
        return DirectoryRegistry(Path(text))

    def read(self, key: str) -> bytes:
        raise NotImplementedError

    def release(self, name: str, version_or_alias: str) -> tuple[str, bytes]:
        """(version, raw manifest) of a version or alias."""
        return read_release(self, name, version_or_alias)

    def copy(self, key: str, target: Path, start: int, end: int, advanced: Callable[[int], None]) -> None:
        """Write bytes [start, end) of `key` into `target` at offset `start`.

        `advanced(position)` is called after every block that reached the file, so an
        interrupted copy can resume from there.
        """
        raise NotImplementedError


class DirectoryRegistry(Registry):
    def __init__(self, root: Path):
        self.root = Path(root)

    def read(self, key: str) -> bytes:
        path = self.root / key
        if not path.is_file():
            raise FileNotFoundError(key)
        return path.read_bytes()

    def copy(self, key: str, target: Path, start: int, end: int, advanced: Callable[[int], None]) -> None:
        with open(self.root / key, "rb") as source, open(target, "r+b") as sink:
            source.seek(start)
            sink.seek(start)
            while start < end and (block := source.read(min(CHUNK, end - start))):
                sink.write(block)
                start += len(block)
                advanced(start)
        if start < end:
            raise PackageError(f"{key} in the registry is shorter than the manifest says (truncated)")


class HTTPRegistry(Registry):
    """A bucket over plain HTTP(S): GET each key below the base URL, with Range for byte ranges."""

    def __init__(self, base_url: str, timeout: float = 30.0):
        self.base = base_url.rstrip("/") + "/"
        self.http = _http_client(timeout)

    def _url(self, key: str) -> str:
        return urllib.parse.urljoin(self.base, urllib.parse.quote(key))

    def read(self, key: str) -> bytes:
        try:
            response = self.http.get(self._url(key))
        except httpx.HTTPError as err:
            raise ConnectionError(f"cannot reach the registry at {self.base}: {reason(err)}") from None
        _check_status(response, key)
        return response.content

    def copy(self, key: str, target: Path, start: int, end: int, advanced: Callable[[int], None]) -> None:
        url = self._url(key)
        _stream_range(lambda first, last: self.http.stream("GET", url, headers={"Range": f"bytes={first}-{last - 1}"}),
                      key, target, start, end, advanced)


class APIRegistry(Registry):
    """The Elastify REST API: versions and aliases resolved by the server, files read over /v1 with Range.

    Keys keep the bucket layout (`packages/<name>/<version>/<file>`), so pull has one code
    path for every registry; only resolution and transport differ. The transport is the
    ElastifyClient's httpx client (which follows the server's redirect to a presigned object-store
    URL without the bearer token); ranges, resume, retries and stopping are pull's, as for a bucket.
    """

    def __init__(self, client: ElastifyClient):
        self.client = client

    def release(self, name: str, version_or_alias: str) -> tuple[str, bytes]:
        try:
            listing = list(self.client.iter_versions(name))
        except ElastifyAPIError as err:
            if err.status == 404:
                raise PackageError(f"the registry has no package {name!r}") from None
            raise PackageError(f"the registry could not resolve {name} {version_or_alias}: {err}") from None
        versions = {entry.version for entry in listing}
        aliases = {alias: entry.version for entry in listing for alias in entry.aliases}
        version = version_or_alias if version_or_alias in versions else aliases.get(version_or_alias)
        if version is None:
            raise PackageError(f"the registry has no version or alias {version_or_alias!r} of {name!r}")
        _check_alias_target(name, version_or_alias, version)
        return version, self.read(f"packages/{name}/{version}/{MANIFEST}")

    def _parts(self, key: str) -> tuple[str, str, str]:
        _, name, version, path = key.split("/", 3)
        return name, version, path

    def read(self, key: str) -> bytes:
        name, version, path = self._parts(key)
        try:
            if path == MANIFEST:
                return self.client.manifest_bytes(name, version)
            with self.client.open_file(name, version, path) as response:
                return response.read()
        except ElastifyAPIError as err:
            if err.status == 404:
                raise FileNotFoundError(key) from None
            raise ConnectionError(f"{key}: {err}") from None
        except httpx.HTTPError as err:
            raise ConnectionError(f"{key}: {reason(err)}") from None

    def copy(self, key: str, target: Path, start: int, end: int, advanced: Callable[[int], None]) -> None:
        name, version, path = self._parts(key)
        _stream_range(lambda first, last: self.client.open_file(name, version, path, (first, last)),
                      key, target, start, end, advanced)


def _http_client(timeout: float) -> httpx.Client:
    """One connection pool per registry, shared by the download threads (httpx.Client is thread-safe).

    The transport retries failed connects; a transfer cut mid-way is retried by the caller, from
    the last byte written.
    """
    return httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), follow_redirects=True,
                        transport=httpx.HTTPTransport(retries=CONNECT_RETRIES))


def _check_status(response: httpx.Response, key: str) -> None:
    if response.status_code == 404:
        raise FileNotFoundError(key)
    if response.status_code not in (200, 206):
        raise ConnectionError(f"{key}: the registry answered {response.status_code} {response.reason_phrase}")


def _stream_range(open_range: Callable[[int, int], AbstractContextManager[httpx.Response]], key: str, target: Path,
                  start: int, end: int, advanced: Callable[[int], None]) -> None:
    """Write bytes [start, end) of `key` into `target` at `start`, calling `advanced` after each block.

    `open_range(start, end)` opens the streamed GET of that range (a bucket's httpx client, or the
    API's ElastifyClient, whose errors come as ElastifyAPIError)."""
    wanted = f"bytes={start}-{end - 1}"
    try:
        with open_range(start, end) as response:
            _check_status(response, key)
            skip = start  # a 200 is the whole body: skip to our offset
            if response.status_code == 206:
                given = response.headers.get("Content-Range", "")
                if not given.startswith(f"bytes {start}-"):
                    raise ConnectionError(f"{key}: asked for {wanted}, the registry sent {given or 'no Content-Range'}")
                skip = 0
            with open(target, "r+b") as sink:
                sink.seek(start)
                for block in response.iter_bytes(CHUNK):
                    if skip:
                        dropped = min(skip, len(block))
                        block, skip = block[dropped:], skip - dropped
                    block = block[: end - start]
                    if not block:
                        if start >= end:
                            break
                        continue
                    sink.write(block)
                    sink.flush()
                    start += len(block)
                    advanced(start)
    except httpx.HTTPError as err:
        raise ConnectionError(f"{key}: {reason(err)}") from None
    except ElastifyAPIError as err:
        if err.status == 404:
            raise FileNotFoundError(key) from None
        raise ConnectionError(f"{key}: {err}") from None
    if start < end:
        raise ConnectionError(f"{key}: connection closed with {end - start} bytes to go")


# --------------------------------------------------------------------------- local copies


def read_local_state(package_dir: Path) -> dict | None:
    """What pull recorded about an installed copy (None: not installed by pull, or a record that is not
    readable: the copy is then checked as a whole package, the strictest reading)."""
    path = Path(package_dir) / LOCAL_STATE
    try:
        state = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def verify_local(package_dir: Path, public_key=None, *, full: bool = True, allow_unsigned: bool = False) -> Manifest:
    """Check a local copy: format and signature (`device_sdk.trust` rule) always; every byte when `full`.

    A partial copy is checked file by file for the files it holds and range by range, against
    the signed range digests, for the weights it holds.

    Threat model: whoever can write the package directory can also write `.elastify-local.json`
    (unsigned) and any cache of results kept beside it, so neither may decide what is checked.
    The local record only says how far a partial copy goes (`max_level`); which files and
    ranges that means comes from the verified manifest, and every one of them is hashed on
    every check. The one shortcut is `_VERIFIED`, a memo in this process's memory, which no
    file write can forge: a copy verified here is not hashed again while its manifest digest
    and each file's (device, inode, size, mtime_ns, ctime_ns) are unchanged. ctime cannot be set
    back without root, and a file changed within `RACY_SECONDS` of a check is never memoized
    (a change within one timestamp tick would not show in the stat). Bytes changed *after* a
    check (the model maps its weights) are out of reach of any check at load time.
    """
    package_dir = Path(package_dir)
    raw_manifest = read_manifest_bytes(package_dir)
    manifest = parse_manifest(raw_manifest, package_dir / MANIFEST)
    check_signature(manifest, public_key, allow_unsigned=allow_unsigned)
    if not full:
        return manifest
    state = read_local_state(package_dir)
    held, precision = None, None
    if state is not None:
        precision = state.get("precision")
        if state.get("max_level") is not None:
            held = manifest.elastic.level(state["max_level"]).level
            if held == manifest.elastic.levels[-1].level:
                held = None
    files = held_files(manifest, held, precision)
    weights = WEIGHTS if precision is None else weights_ranges(manifest, precision)["file"]
    memo_key = (str(package_dir.resolve()), hashlib.sha256(raw_manifest).hexdigest(),
                None if held is None else held.name, precision)
    before = _file_stats(package_dir, files)
    if before is not None and _VERIFIED.get(memo_key) == before:
        return manifest
    if held is None:
        check_files(package_dir, manifest, files)
    else:
        check_files(package_dir, manifest, [f for f in files if f != weights])
        _verify_ranges(package_dir / weights, manifest, held.name, precision)
    if before is not None and _file_stats(package_dir, files) == before and all(
        time.time() - stat[-1] / 1e9 > RACY_SECONDS for stat in before
    ):
        _VERIFIED[memo_key] = before
    return manifest


RACY_SECONDS = 2.0  # a file changed this recently may change again within one timestamp tick
_VERIFIED: dict[tuple, tuple] = {}  # (package dir, manifest sha256, held level) -> file stats when verified


def _file_stats(package_dir: Path, files: list[str]) -> tuple | None:
    """(device, inode, size, mtime_ns, ctime_ns) of each file; None if one is missing (the check will say)."""
    try:
        stats = [(package_dir / path).stat() for path in files]
    except OSError:
        return None
    return tuple((s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for s in stats)


def held_files(manifest: Manifest, level: Level | None, precision: str | None = None) -> list[str]:
    """The files a copy holding levels up to `level` (None: all) at `precision` (None: the stored one) has:
    all but larger levels' adapters, and only the one weights file of its precision."""
    skipped = {spec["file"] for spec in (manifest.precisions or {}).values()} | {WEIGHTS}
    skipped.discard(weights_ranges(manifest, precision)["file"] if precision is not None else WEIGHTS)
    if level is not None:
        skipped |= {lv.adapter for lv in manifest.elastic.levels if lv.adapter and lv.level > level}
    return [entry.path for entry in manifest.files if entry.path not in skipped]


def _verify_ranges(path: Path, manifest: Manifest, level: str, precision: str | None = None) -> None:
    ranges = weights_ranges(manifest, precision)
    digests, shown = ranges.get("sha256"), ranges.get("file", WEIGHTS)
    if digests is None:
        raise PackageError("this package has no byte-range digests, so a partial pull cannot be verified")
    with open(path, "rb") as handle:
        if hashlib.sha256(handle.read(ranges["header"][1])).hexdigest() != digests["header"]:
            raise PackageError(f"{shown}: the safetensors header does not match its signed digest")
        for name, per_level in ranges["tensors"].items():
            start, end = per_level[level]
            handle.seek(start)
            if hashlib.sha256(handle.read(end - start)).hexdigest() != digests["tensors"][name][level]:
                raise PackageError(f"{shown}: tensor {name} (level {level}) does not match its signed digest")


# --------------------------------------------------------------------------- pull


SEQUENCES = ".sequences.json"  # in the cache root: the highest manifest sequence installed per package name


def installed_sequences(cache_root: Path) -> dict[str, int]:
    """The highest sequence this device installed per name ({} before the first sequenced pull).

    A record that cannot be read is an error, not an empty record: forgetting it would let a
    rollback through.
    """
    path = Path(cache_root) / SEQUENCES
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PackageError(f"the installed-sequence record {path} cannot be read ({err}); "
                           "delete it only if you accept that rollbacks go unnoticed until the next pull") from None
    if not isinstance(data, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in data.values()):
        raise PackageError(f"the installed-sequence record {path} is malformed")
    return data


def record_sequence(cache_root: Path, name: str, sequence: int) -> None:
    """Raise the recorded sequence of `name` to `sequence` (never lowers it: a deliberate downgrade stays one)."""
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    with _sequence_lock(cache_root):
        sequences = installed_sequences(cache_root)
        if sequence > sequences.get(name, 0):
            sequences[name] = sequence
            atomic_write_bytes(cache_root / SEQUENCES, canonical_json(dict(sorted(sequences.items()))))


@contextmanager
def _sequence_lock(cache_root: Path):
    """Serialise read-modify-write of the sequence record between concurrent pulls (POSIX advisory lock)."""
    with open(cache_root / f"{SEQUENCES}.lock", "a") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def check_fresh(manifest: Manifest, cache_root: Path, *, requested: str, allow_downgrade: bool = False,
                now: datetime | None = None) -> None:
    """Refuse an expired manifest, and one older than what this device installed for its name.

    The sequence is read from the signed manifest, so whatever an alias or a registry says about
    which version is current, an older release is refused. A manifest without a sequence (0, from
    before sequences) is accepted only while this device has installed no sequenced release of the
    name; after that it counts as older.
    """
    expires = manifest.expires()
    if expires is not None and expires <= (now or datetime.now(timezone.utc)):  # noqa: UP017 (SDK runs on 3.10)
        raise PackageError(f"{manifest.name} {manifest.version} expired at {manifest.expires_at}: the registry is "
                           "serving stale metadata (or the publisher let it lapse); refusing it")
    highest = installed_sequences(cache_root).get(manifest.name, 0)
    if manifest.sequence < highest and not allow_downgrade:
        via = "" if requested == manifest.version else f" (what {requested!r} points to)"
        raise PackageError(f"{manifest.name} {manifest.version}{via} has sequence {manifest.sequence}, older than "
                           f"sequence {highest} already installed here: refusing a rollback "
                           "(allow_downgrade=True / --allow-downgrade to install it on purpose)")


def read_release(registry: Registry, name: str, version_or_alias: str) -> tuple[str, bytes]:
    """(version, raw manifest): a version directory if there is one, else the alias's target."""
    try:
        return version_or_alias, registry.read(f"packages/{name}/{version_or_alias}/{MANIFEST}")
    except FileNotFoundError:
        pass
    try:
        version = registry.read(f"packages/{name}/aliases/{version_or_alias}").decode().strip()
    except FileNotFoundError:
        raise PackageError(f"the registry has no version or alias {version_or_alias!r} of {name!r}") from None
    _check_alias_target(name, version_or_alias, version)
    try:
        return version, registry.read(f"packages/{name}/{version}/{MANIFEST}")
    except FileNotFoundError:
        raise PackageError(f"alias {version_or_alias!r} of {name!r} points to a missing version {version!r}") from None


def _check_alias_target(name: str, alias: str, version: str) -> None:
    if not SAFE_NAME.fullmatch(version) or version in (".", ".."):
        raise PackageError(f"alias {alias!r} of {name!r} points to an invalid version {version!r}")


def pull(
    name: str,
    version_or_alias: str,
    *,
    registry: str | Path | ElastifyClient,
    public_key=None,
    max_level: float | str | None = None,
    cache_dir: Path | None = None,
    workers: int = 4,
    token: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    allow_downgrade: bool = False,
    precision: str | None = None,
) -> Path:
    """Download, verify and install a package; return its local directory.

    `public_key` is the publisher's Ed25519 key (raw 32 bytes, base64, or a key object);
    without it, the key pinned for `name` in the trust store (`device_sdk.trust`) is used, and
    with neither nothing is pulled. `max_level` fetches only the bytes that levels up to it
    need; the copy records that and ElasticModel refuses any larger level. An installed copy
    that already covers the request is re-verified (its manifest must be the registry's, and
    every byte must match it) and returned without downloading; one that does not verify is
    fetched again.
    `registry` ending in /v1 (or an ElastifyClient) is the Elastify REST API; `token` is its
    bearer token (default: ELASTIFY_TOKEN). `on_progress(bytes done, bytes needed)` is called
    as blocks arrive, from the download threads.

    Rollback and freeze: an expired manifest is refused, and so is one whose signed `sequence` is
    lower than the highest this device installed for `name` (recorded in the cache root), unless
    `allow_downgrade`; an alias is only a pointer, so what it names is checked the same way.
    `precision` ("int8", "int4": one the manifest lists under `precisions`) fetches that weights
    file instead of the stored one (with `max_level`, only that level's ranges of it).
    """
    for label, value in (("name", name), ("version", version_or_alias)):
        if not SAFE_NAME.fullmatch(value) or value in (".", ".."):
            raise PackageError(f"package {label} {value!r} may use only letters, digits, '.', '_' and '-'")
    public_key = signing_key(name, public_key)
    if public_key is None:
        raise PackageError(f"pull needs the publisher's pinned public key: pass it, or pin it once with "
                           f"`elastify-device trust add {name} KEY`")
    source = Registry.open(registry, token=token)
    version, raw_manifest = source.release(name, version_or_alias)
    prefix = f"packages/{name}/{version}"
    manifest = _trusted_manifest(raw_manifest, name, version, public_key)
    level = None if max_level is None else manifest.elastic.level(max_level).level
    if level is not None and level == manifest.elastic.levels[-1].level:
        level = None  # the largest level needs every byte: a full pull
    if precision is not None:
        weights_ranges(manifest, precision)  # refuses a precision the package does not carry

    root = Path(cache_dir) if cache_dir is not None else default_cache()
    check_fresh(manifest, root, requested=version_or_alias, allow_downgrade=allow_downgrade)
    target = root / name / version
    if _covers(read_local_state(target), level, precision):
        try:
            if (target / MANIFEST).read_bytes() != raw_manifest:
                raise PackageError("its manifest is not the registry's")
            verify_local(target, public_key, full=True)
            record_sequence(root, name, manifest.sequence)
            return target
        except (OSError, PackageError) as err:  # changed since install: replace it with a verified copy
            log.warning("the installed copy %s does not verify (%s); fetching it again", target, err)
    staging = root / name / f".staging-{version}"
    staging.mkdir(parents=True, exist_ok=True)
    try:
        files, needed_bytes = _fetch(source, prefix, manifest, staging, level, workers, on_progress, precision)
        atomic_write_bytes(staging / MANIFEST, raw_manifest)
        state = {
            "name": name,
            "version": version,
            "registry": registry.base_url + "/v1" if isinstance(registry, ElastifyClient) else str(registry),
            "max_level": None if level is None else level.name,
            "precision": precision,
            "files": files,
            "bytes": needed_bytes,
            "installed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017 (SDK runs on 3.10)
        }
        atomic_write_bytes(staging / LOCAL_STATE, canonical_json(state))
        verify_local(staging, public_key, full=True)
    except PackageError:
        shutil.rmtree(staging, ignore_errors=True)  # nothing unverified is kept
        raise
    _install(staging, target)
    record_sequence(root, name, manifest.sequence)
    return target


def _trusted_manifest(raw: bytes, name: str, version: str, public_key) -> Manifest:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise PackageError(f"the registry's manifest is not valid JSON: {err}") from None
    manifest = Manifest.from_dict(data)  # refuses other format versions
    verify_signature(manifest, public_key)
    if (manifest.name, manifest.version) != (name, version):
        raise PackageError(f"manifest is for {manifest.name} {manifest.version}, not {name} {version}")
    for entry in manifest.files:
        if entry.path.startswith("/") or ".." in Path(entry.path).parts or entry.path in (MANIFEST, LOCAL_STATE):
            raise PackageError(f"manifest lists an unsafe file path {entry.path!r}")
    return manifest


def _covers(state: dict | None, level: Level | None, precision: str | None = None) -> bool:
    if state is None or state.get("precision") != precision:
        return False
    held = state.get("max_level")
    return held is None or (level is not None and level <= Level(held))


class PullInterrupted(KeyboardInterrupt):
    """Ctrl-C during a pull: the download threads were told to stop, what arrived is kept for the next pull."""


class _Stopped(Exception):
    """Raised inside a download thread, at its next block, once the pull is stopping."""


def _fetch(source: Registry, prefix: str, manifest: Manifest, staging: Path, level: Level | None, workers: int,
           on_progress: Callable[[int, int], None] | None = None,
           precision: str | None = None) -> tuple[list[str], int]:
    """Every needed (file, byte range) on `workers` threads; returns the files the copy holds and the bytes needed.

    How far each range got is saved to the staging directory while it downloads (at most every
    PROGRESS_SECONDS, always before returning or raising), so a pull killed at any point (kill -9
    included) resumes from there. What was kept is not trusted: the finished copy is hashed whole
    against the signed manifest before it is installed.
    """
    files = held_files(manifest, level, precision)
    weights = WEIGHTS if precision is None else weights_ranges(manifest, precision)["file"]
    jobs = []
    for entry in manifest.files:
        if entry.path not in files:
            continue
        path = staging / entry.path
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.stat().st_size != entry.size:
            with open(path, "ab") as handle:  # full size up front: ranges land at their offsets
                handle.truncate(entry.size)
        if entry.path == weights and level is not None:
            jobs += [(entry.path, start, end) for start, end in level_byte_ranges(manifest, level, precision)]
        else:
            jobs.append((entry.path, 0, entry.size))
    progress = _Progress(staging, jobs)
    pending = [job for job in jobs if progress.done(job) < job[2]]
    needed = sum(end - start for _, start, end in jobs)
    stop = threading.Event()
    report_lock = threading.Lock()

    def advanced(job, position: int) -> None:
        progress.advance(job, position)
        if on_progress is not None:
            with report_lock:
                on_progress(progress.fetched(), needed)
        if stop.is_set():
            raise _Stopped

    if on_progress is not None:
        on_progress(progress.fetched(), needed)
    try:
        _run_threads(pending, lambda job: _fetch_range(source, prefix, staging, job, progress, advanced, stop),
                     workers, stop)
    except KeyboardInterrupt:
        stop.set()
        progress.save()
        raise PullInterrupted(f"pull interrupted: {progress.fetched():,} of {needed:,} bytes kept in {staging}; "
                              "pull again to resume") from None
    finally:
        progress.save()
    return files, needed


def _run_threads(jobs: list, run: Callable, workers: int, stop: threading.Event) -> None:
    """run(job) for every job on up to `workers` daemon threads; the first error stops the others and is raised.

    Daemon threads, waited on in short joins, so Ctrl-C reaches the caller at once, and a thread
    still blocked on the network neither delays it nor holds the interpreter at exit.
    """
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for job in jobs:
        todo.put(job)
    errors: list[BaseException] = []

    def work() -> None:
        while not stop.is_set():
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            try:
                run(job)
            except _Stopped:
                return
            except BaseException as err:  # handed to the caller's thread, which raises it
                errors.append(err)
                stop.set()
                return

    threads = [threading.Thread(target=work, name=f"pull-{i}", daemon=True) for i in range(min(max(1, workers), len(jobs)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.1)
    if errors:
        raise errors[0]


def _fetch_range(source: Registry, prefix: str, staging: Path, job, progress: _Progress,
                 advanced: Callable, stop: threading.Event):
    """Fetch one byte range, resuming from what earlier attempts (and earlier pulls) already wrote."""
    path, _, end = job
    for attempt in range(ATTEMPTS):
        try:
            source.copy(f"{prefix}/{path}", staging / path, progress.done(job), end,
                        lambda position: advanced(job, position))
            return job
        except (OSError, ConnectionError) as err:
            if isinstance(err, FileNotFoundError):
                raise PackageError(f"the registry is missing {path}") from None
            if attempt == ATTEMPTS - 1 or stop.is_set():
                raise ConnectionError(f"{path}: download failed after {attempt + 1} attempts ({err}); "
                                      "pull again to resume") from err
            stop.wait(0.2 * (attempt + 1))
    return job


def _job_key(job) -> str:
    return f"{job[0]}@{job[1]}-{job[2]}"


PROGRESS = ".progress.json"
PROGRESS_SECONDS = 0.5  # how often a running pull saves how far each range got


class _Progress:
    """How far each byte range got: read from an earlier pull's record, advanced by the threads, saved as it goes."""

    def __init__(self, staging: Path, jobs: list):
        self.path = staging / PROGRESS
        for leftover in staging.glob(f".{PROGRESS}.*"):  # a temp file of a save that kill -9 cut short
            leftover.unlink(missing_ok=True)
        try:
            recorded = json.loads(self.path.read_text()) if self.path.is_file() else {}
        except (OSError, ValueError):
            recorded = {}  # unreadable: start the ranges over
        self.jobs = jobs
        self.position = {}
        for job in jobs:  # only what lies inside a range we still want counts
            kept = recorded.get(_job_key(job)) if isinstance(recorded, dict) else None
            self.position[_job_key(job)] = kept if isinstance(kept, int) and job[1] <= kept <= job[2] else job[1]
        self.lock = threading.Lock()
        self.saved_at = time.monotonic()

    def done(self, job) -> int:
        return self.position[_job_key(job)]

    def fetched(self) -> int:
        return sum(self.position[_job_key(job)] - job[1] for job in self.jobs)

    def advance(self, job, position: int) -> None:
        self.position[_job_key(job)] = position  # the bytes up to here are already written to the file
        if time.monotonic() - self.saved_at >= PROGRESS_SECONDS and self.lock.acquire(blocking=False):
            try:
                self._write()
            finally:
                self.lock.release()

    def save(self) -> None:
        with self.lock:
            self._write()

    def _write(self) -> None:
        atomic_write_bytes(self.path, json.dumps(dict(self.position)).encode())
        self.saved_at = time.monotonic()


def _install(staging: Path, target: Path) -> None:
    """Rename the verified copy into place (replacing a smaller partial copy, if any)."""
    (staging / PROGRESS).unlink(missing_ok=True)
    if target.exists():
        retired = target.with_name(f".retired-{target.name}")
        shutil.rmtree(retired, ignore_errors=True)
        os.rename(target, retired)
        os.rename(staging, target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(staging, target)
