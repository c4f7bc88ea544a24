"""Where a build may read from: allowed source roots, or the tenant's own uploads in the store.

A build names files the workers read: `source.model`, `source.compression_data`, the calibration
text, and every stage setting marked NAMES_FILES (corpora, instructions, backbone, encoder). Without
a check any tenant could make a worker read any file the worker can (`/etc/passwd` as calibration
text, another tenant's model directory). So at submit every such value must be

- `upload:<digest>`: a source this tenant uploaded (`POST /v1/sources`), stored content-addressed at
  `sources/<tenant>/<digest>` in the artifact store; the scheduler hands it to the worker as an
  artifact, fetched and verified like any stage input; or
- an absolute path that, with every symlink resolved, lies under one of the deployment's source
  roots (`ELASTIFY_SOURCE_ROOTS`; no `..`, and a directory may hold no symlink leading out); or
- for a corpus setting, a packaged corpus name (`ptb:train`, `lambada`), which is no path at all.

Anything else is refused before anything is written, naming the field: 422 when the value is
malformed or names no upload of the caller, 403 when it is a path outside the roots.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from cluster.models import Upload
from cluster.spec import BuildSpec, SpecError
from pipeline.settings import names_a_corpus
from workers.runner import under_roots
from workers.store import ArtifactRef

UPLOAD_SCHEME = "upload:"
DIGEST = re.compile(r"^[0-9a-f]{64}$")
MAX_WALK = 100_000  # entries of a source directory checked for symlinks leading out


class SourceRefused(SpecError):
    """A source path outside the allowed roots (HTTP 403); `problems` names each field."""


def upload_key(tenant: str, digest: str) -> str:
    """Where an upload lives in the artifact store: per tenant, by the digest of its artifact index."""
    return f"sources/{tenant}/{digest}"


def upload_digest(value: str) -> str | None:
    """The digest of an `upload:<digest>` value, or None for any other value."""
    return value[len(UPLOAD_SCHEME):] if value.startswith(UPLOAD_SCHEME) else None


def upload_ref(session: Session, tenant: str, value: str) -> ArtifactRef | None:
    """The store artifact of an `upload:<digest>` value of `tenant`; None if it names no upload of theirs."""
    digest = upload_digest(value)
    row = session.get(Upload, (tenant, digest)) if digest and DIGEST.match(digest) else None
    return None if row is None else ArtifactRef(upload_key(tenant, digest), digest, row.size)


@dataclass(frozen=True)
class SourcePolicy:
    """The deployment's source roots; `check` applies them (and the tenant's uploads) to a planned build."""

    roots: tuple[Path, ...]

    def problem(self, session: Session, tenant: str, value: str, corpus: bool) -> tuple[str, bool] | None:
        """(what is wrong, whether it is a refusal (403) rather than malformed (422)), or None if allowed."""
        if (digest := upload_digest(value)) is not None:
            if not DIGEST.match(digest):
                return f"{value!r}: an upload is named upload:<64 hex digits> (POST /v1/sources answers it)", False
            if upload_ref(session, tenant, value) is None:
                return f"no upload {digest} of this tenant; upload it with POST /v1/sources", False
            return None
        if corpus and names_a_corpus(value):
            return None
        path = Path(value).expanduser()
        if not path.is_absolute():
            return (f"{value!r} is neither an absolute path under an allowed source root nor upload:<digest>"
                    + (" nor a packaged corpus (ptb:<split>, lambada)" if corpus else "")), False
        if ".." in path.parts:
            return f"{value!r} may not contain '..'", False
        if not under_roots(path, self.roots):
            return (f"{value!r} is outside the allowed source roots "
                    f"({', '.join(map(str, self.roots)) or 'none configured'}); upload it with POST /v1/sources"), True
        if path.is_dir():
            for count, entry in enumerate(path.rglob("*")):
                if count >= MAX_WALK:
                    return f"{value!r} holds more than {MAX_WALK} entries", False
                if entry.is_symlink() and not under_roots(entry, self.roots):
                    return f"{value!r} holds a symlink leading outside the allowed source roots: {entry}", True
        return None

    def check(self, session: Session, tenant: str, spec: BuildSpec, planned) -> None:
        """Raise SourceRefused (403) or SpecError (422), naming every offending field, unless every file the
        planned build reads is an upload of `tenant`, a path under the roots, or a packaged corpus name."""
        values: dict[str, tuple[str, bool]] = {}  # field -> (value, may be a corpus name)
        read_externally = {edge.path for node in planned for edge in node.inputs.values() if hasattr(edge, "path")}
        for name in type(spec.source).model_fields:
            value = getattr(spec.source, name)
            if value is not None and str(value) in read_externally:
                values[f"source.{name}"] = (str(value), False)
        seen = set()
        if any(node.type == "profile" for node in planned):  # the build's calibration text feeds profile
            for index, value in enumerate(spec.calibration):
                values[f"calibration.{index}"] = (value, True)
                seen.add(value)
        for node in planned:
            for setting, value, corpus in node.settings.named_path_fields():
                if value not in seen:
                    values.setdefault(f"stages.{node.type}.settings.{setting}", (value, corpus))
        refused, malformed = [], []
        for field, (value, corpus) in values.items():
            found = self.problem(session, tenant, value, corpus)
            if found is not None:
                (refused if found[1] else malformed).append((field, found[0]))
        if malformed:
            raise SpecError(malformed + refused)
        if refused:
            raise SourceRefused(refused)


# --------------------------------------------------------------------------- uploads

ARCHIVES = {"application/x-tar": "tar", "application/gzip": "tar", "application/x-gzip": "tar",
            "application/x-gtar": "tar", "application/x-compressed-tar": "tar", "application/zip": "zip"}
SINGLE_FILE = "application/octet-stream"
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_MEMBERS = 10_000
# Directories a member may lie under: Path.mkdir(parents=True) recurses once per missing level, so a member
# 2,000 directories deep was a RecursionError (a 500 with megabytes of chained traceback in the log).
MAX_MEMBER_DEPTH = 64


class UploadRefused(ValueError):
    """An upload that cannot be stored: a bad archive, a member leading out, too large (`too_large`)."""

    def __init__(self, message: str, too_large: bool = False):
        super().__init__(message)
        self.too_large = too_large


def _member_path(name: str) -> Path:
    from pathlib import PurePosixPath

    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts or "\\" in name:
        raise UploadRefused(f"archive member {name!r} leads outside the upload")
    if len(relative.parts) > MAX_MEMBER_DEPTH:
        raise UploadRefused(f"archive member {name[:80]!r}… lies {len(relative.parts) - 1} directories deep; "
                            f"at most {MAX_MEMBER_DEPTH - 1} are accepted")
    return Path(*relative.parts)


def _copy_member(source, dest: Path, budget: list[int], max_bytes: int) -> None:
    """Stream one member into `dest`, counting real bytes against `budget` (a member's header may lie)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "xb") as out:  # "x": two members with one name are refused, not silently overwritten
        while block := source.read(1 << 20):
            budget[0] += len(block)
            if budget[0] > max_bytes:
                raise UploadRefused(f"the upload unpacks to more than {max_bytes} bytes", too_large=True)
            out.write(block)


def unpack_upload(body: Path, media_type: str, name: str | None, dest: Path, max_bytes: int) -> Path:
    """The upload in `body` as what a build reads: a tar (optionally gzip'd) or zip of a model directory is
    unpacked into `dest` (a single top-level directory is stripped, so `tar czf m.tgz my-model/` gives the
    model directory itself); any other file (`application/octet-stream`, `name` required, e.g. a .gguf or a
    calibration .jsonl) is kept whole as `dest/<name>`. Only regular files are admitted: a member that is a
    link or device, leads outside, or would make the content larger than `max_bytes` refuses the upload."""
    import shutil
    import stat
    import tarfile
    import zipfile

    kind = ARCHIVES.get(media_type)
    dest.mkdir(parents=True, exist_ok=True)
    if kind is None:
        if media_type != SINGLE_FILE:
            raise UploadRefused(f"send a tar, tar.gz or zip archive, or a single file as {SINGLE_FILE}")
        if not name or not FILE_NAME.match(name):
            raise UploadRefused(f"a single file needs ?name= matching {FILE_NAME.pattern} (its suffix tells "
                                "a .gguf model from a .jsonl or .txt corpus)")
        target = dest / name
        shutil.move(body, target)
        return target
    unpacked, budget = dest / "content", [0]
    try:
        if kind == "tar":
            with tarfile.open(body, "r:*") as archive:
                for count, member in enumerate(archive):
                    if count >= MAX_MEMBERS:
                        raise UploadRefused(f"the archive holds more than {MAX_MEMBERS} members")
                    if member.isdir():
                        continue
                    if not member.isreg():
                        raise UploadRefused(f"archive member {member.name!r} is not a regular file "
                                            "(links are refused: pack with `tar -h`)")
                    _copy_member(archive.extractfile(member), unpacked / _member_path(member.name), budget, max_bytes)
        else:
            with zipfile.ZipFile(body) as archive:
                members = archive.infolist()
                if len(members) > MAX_MEMBERS:
                    raise UploadRefused(f"the archive holds more than {MAX_MEMBERS} members")
                for member in members:
                    if member.is_dir():
                        continue
                    file_type = stat.S_IFMT(member.external_attr >> 16)  # 0: no Unix mode recorded, a plain file
                    if file_type and file_type != stat.S_IFREG:
                        raise UploadRefused(f"archive member {member.filename!r} is not a regular file")
                    with archive.open(member) as source:
                        _copy_member(source, unpacked / _member_path(member.filename), budget, max_bytes)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as err:
        if isinstance(err, FileExistsError):
            raise UploadRefused(f"the archive holds {err.filename} twice") from None
        raise UploadRefused(f"not a readable {kind} archive: {err}") from None
    if not unpacked.is_dir():
        raise UploadRefused("the archive holds no files")
    top = list(unpacked.iterdir())
    return top[0] if len(top) == 1 and top[0].is_dir() else unpacked
