"""pull(): resolve, download (whole, resumed, or up to a level), verify, install atomically."""

from __future__ import annotations

import json
import os
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from device_sdk import registry as registry_module
from device_sdk.format import MANIFEST, WEIGHTS, PackageError, canonical_json, check_files
from device_sdk.registry import pull, read_local_state
from device_sdk.runtime import ElasticModel
from tests.support.sdk_packages import (
    add_recovery_adapters,
    public_bytes,
    publish,
    random_package,
    signing_key,
)

KEY = signing_key()


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Path:
    """A registry directory holding one tiny package (with per-level adapters) as tiny 1.0.0 / latest."""
    root = tmp_path_factory.mktemp("registry")
    package = random_package("qwen2_bias", root.parent / "built", KEY)
    add_recovery_adapters(package, KEY)
    publish(package, root)
    return root


@pytest.fixture
def bad_registry(registry, tmp_path) -> Path:
    """A private copy of the registry that a test may corrupt."""
    import shutil

    copy = tmp_path / "bad-registry"
    shutil.copytree(registry, copy)
    return copy


class RangeHandler(SimpleHTTPRequestHandler):
    """Static files with single-range GETs; can cut one response short to simulate a dropped link."""

    cut_after: dict[str, int] = {}  # path -> bytes to send before closing, once
    seen_ranges: list[tuple[str, str | None]] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        header = self.headers.get("Range")
        self.seen_ranges.append((self.path, header))
        start, end = 0, len(data)
        if header:
            first, last = header.removeprefix("bytes=").split("-")
            start, end = int(first), min(len(data), int(last) + 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:end]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = self.cut_after.pop(self.path, None)
        self.wfile.write(body if cut is None else body[:cut])
        if cut is not None:
            self.close_connection = True


@pytest.fixture
def http_registry(registry):
    RangeHandler.cut_after, RangeHandler.seen_ranges = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(RangeHandler, directory=str(registry)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def nothing_installed(cache: Path) -> bool:
    return not any(p.is_file() for p in cache.rglob("*")) if cache.exists() else True


def test_sdk_pull_from_directory_and_alias(registry, tmp_path):
    cache = tmp_path / "cache"
    path = pull("tiny", "latest", registry=registry, public_key=public_bytes(KEY), cache_dir=cache)
    assert path == cache / "tiny" / "1.0.0"
    assert read_local_state(path)["max_level"] is None
    again = pull("tiny", "1.0.0", registry=f"file://{registry}", public_key=public_bytes(KEY), cache_dir=cache)
    assert again == path
    model = ElasticModel.load(path, public_key=public_bytes(KEY))
    assert model.available_levels() == ["0.25", "0.5", "0.75", "1.0"] and set(model.adapters) == set(
        model.available_levels()
    )


def test_sdk_pull_over_http_in_parallel(http_registry, registry, tmp_path):
    path = pull("tiny", "latest", registry=http_registry, public_key=public_bytes(KEY), cache_dir=tmp_path, workers=4)
    for entry in json.loads((registry / "packages/tiny/1.0.0" / MANIFEST).read_text())["files"]:
        assert (path / entry["path"]).stat().st_size == entry["size"]
    fetched = {p for p, _ in RangeHandler.seen_ranges}
    assert "/packages/tiny/1.0.0/model/weights.safetensors" in fetched


def test_sdk_interrupted_download_resumes_with_range(http_registry, tmp_path, monkeypatch):
    monkeypatch.setattr(registry_module, "CHUNK", 4096)  # small blocks, so progress is recorded often
    monkeypatch.setattr(registry_module, "ATTEMPTS", 1)
    weights = f"/packages/tiny/1.0.0/{WEIGHTS}"
    RangeHandler.cut_after[weights] = 50_000
    with pytest.raises(ConnectionError, match="pull again to resume"):
        pull("tiny", "1.0.0", registry=http_registry, public_key=public_bytes(KEY), cache_dir=tmp_path)
    assert not (tmp_path / "tiny" / "1.0.0").exists()  # nothing half-downloaded is loadable
    path = pull("tiny", "1.0.0", registry=http_registry, public_key=public_bytes(KEY), cache_dir=tmp_path)
    resumed = [r for p, r in RangeHandler.seen_ranges if p == weights][-1]
    assert resumed.startswith("bytes=") and int(resumed[6:].split("-")[0]) >= 45_000  # not from zero
    ElasticModel.load(path, public_key=public_bytes(KEY), verify=True)


def corrupt_weights_byte(root: Path) -> None:
    path = root / "packages/tiny/1.0.0" / WEIGHTS
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_manifest(root: Path) -> None:
    path = root / "packages/tiny/1.0.0" / MANIFEST
    data = json.loads(path.read_text())
    data["elastic"]["levels"][0]["active_fraction"] = 0.99
    path.write_bytes(canonical_json(data))


def truncate_weights(root: Path) -> None:
    path = root / "packages/tiny/1.0.0" / WEIGHTS
    path.write_bytes(path.read_bytes()[:-1000])


def bump_format_version(root: Path) -> None:
    path = root / "packages/tiny/1.0.0" / MANIFEST
    data = json.loads(path.read_text())
    data["format_version"] = 2
    path.write_bytes(canonical_json(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (corrupt_weights_byte, "does not match its sha256"),
        (edit_manifest, "signature does not verify"),
        (truncate_weights, "truncated"),
        (bump_format_version, "format_version is 2"),
    ],
)
def test_sdk_bad_package_is_refused_and_deleted(damage, message, bad_registry, tmp_path):
    damage(bad_registry)
    cache = tmp_path / "cache"
    with pytest.raises(PackageError, match=message):
        pull("tiny", "1.0.0", registry=bad_registry, public_key=public_bytes(KEY), cache_dir=cache)
    assert nothing_installed(cache)


def test_sdk_wrong_key_is_refused_before_download(registry, tmp_path):
    other = Ed25519PrivateKey.generate()
    with pytest.raises(PackageError, match="signature does not verify"):
        pull("tiny", "1.0.0", registry=registry, public_key=public_bytes(other), cache_dir=tmp_path)
    assert nothing_installed(tmp_path)
    with pytest.raises(PackageError, match="pinned public key"):
        pull("tiny", "1.0.0", registry=registry, public_key=None, cache_dir=tmp_path)
    with pytest.raises(PackageError, match="no version or alias"):
        pull("tiny", "9.9.9", registry=registry, public_key=public_bytes(KEY), cache_dir=tmp_path)
    with pytest.raises(PackageError, match="may use only"):
        pull("../tiny", "1.0.0", registry=registry, public_key=public_bytes(KEY), cache_dir=tmp_path)


def test_sdk_partial_pull_fetches_only_the_needed_bytes(http_registry, registry, tmp_path):
    key = public_bytes(KEY)
    partial_path = pull("tiny", "1.0.0", registry=http_registry, public_key=key, max_level=0.5, cache_dir=tmp_path / "a")
    state = read_local_state(partial_path)
    full_path = pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path / "b")
    full_bytes = read_local_state(full_path)["bytes"]
    assert state["max_level"] == "0.5" and state["bytes"] < 0.8 * full_bytes
    assert "adapters/recovery/1.0.safetensors" not in state["files"]
    assert not (partial_path / "adapters/recovery/1.0.safetensors").exists()

    partial_model = ElasticModel.load(partial_path, public_key=key, verify=True)
    full_model = ElasticModel.load(full_path, public_key=key)
    assert partial_model.level == "0.5"
    full_model.set_level("0.5")
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(partial_model.logits(ids), full_model.logits(ids), rtol=0, atol=0)
    with pytest.raises(PackageError, match="partial copy"):
        partial_model.set_level("0.75")

    # Asking for more later upgrades the copy in place.
    upgraded = pull("tiny", "1.0.0", registry=http_registry, public_key=key, cache_dir=tmp_path / "a")
    assert upgraded == partial_path and read_local_state(upgraded)["max_level"] is None


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Flip one byte in place: same size, same inode, the mtime set back as it was."""
    before = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(before.st_size // 2 if offset is None else offset)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_sdk_load_with_a_key_hashes_a_pulled_copy_whatever_its_local_record_says(registry, tmp_path):
    """The local record beside a pulled copy is unsigned: it must not turn hashing off (issue 16, item 10)."""
    key = public_bytes(KEY)
    path = pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path)
    flip_byte(path / WEIGHTS)
    with pytest.raises(PackageError, match="does not match its sha256"):
        ElasticModel.load(path, public_key=key)

    # A partial copy's record could name fewer files to check; which files it holds comes from the manifest.
    partial = pull("tiny", "1.0.0", registry=registry, public_key=key, max_level=0.5, cache_dir=tmp_path / "p")
    state = read_local_state(partial)
    state["files"] = [f for f in state["files"] if not f.startswith("adapters/")]
    (partial / registry_module.LOCAL_STATE).write_bytes(canonical_json(state))
    flip_byte(partial / "adapters/recovery/0.5.safetensors")
    with pytest.raises(PackageError, match="0.5.safetensors does not match"):
        ElasticModel.load(partial, public_key=key)
    (partial / registry_module.LOCAL_STATE).write_text("{")  # an unreadable record: checked as a whole package
    with pytest.raises(PackageError, match=r"adapters/recovery/\S+ (does not match|is missing)"):
        ElasticModel.load(partial, public_key=key)


def test_sdk_a_verified_copy_is_not_hashed_again_until_a_file_changes(registry, tmp_path, monkeypatch):
    """The in-memory memo of verified copies is keyed by each file's ctime, which a writer cannot set back."""
    monkeypatch.setattr(registry_module, "RACY_SECONDS", 0.0)
    key = public_bytes(KEY)
    path = pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path)
    hashed = []
    monkeypatch.setattr(registry_module, "check_files", lambda *args: hashed.append(args[0]) or check_files(*args))
    registry_module.verify_local(path, key)
    registry_module.verify_local(path, key)
    assert hashed == [path]  # the second check of an unchanged copy is the memo's
    time.sleep(0.02)  # past one tick of the file-time clock
    flip_byte(path / WEIGHTS)
    with pytest.raises(PackageError, match="does not match its sha256"):
        registry_module.verify_local(path, key)


def test_sdk_pull_reverifies_an_installed_copy_and_replaces_a_changed_one(registry, tmp_path, caplog):
    """An installed copy altered after install is not handed out again (issue 16, item 11)."""
    key = public_bytes(KEY)
    path = pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path)
    published = registry / "packages/tiny/1.0.0"
    flip_byte(path / WEIGHTS)
    with caplog.at_level("WARNING", logger="device_sdk.registry"):
        again = pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path)
    assert again == path and "does not verify" in caplog.text
    assert (path / WEIGHTS).read_bytes() == (published / WEIGHTS).read_bytes()

    # A different (validly signed) manifest put in place of the installed one is replaced too.
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_bytes(json.dumps(manifest, indent=1).encode())
    pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path)
    assert (path / MANIFEST).read_bytes() == (published / MANIFEST).read_bytes()
    ElasticModel.load(path, public_key=key)


class _Terminal:
    """A stderr that says it is a terminal, keeping what was written."""

    def __init__(self):
        import io

        self.buffer = io.StringIO()

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return self.buffer.write(text)

    def flush(self) -> None:
        pass


def test_sdk_pull_cli_draws_a_progress_bar_only_on_a_terminal(registry, tmp_path, monkeypatch, capsys):
    import base64
    import re

    from device_sdk.cli import main as device_cli

    key = base64.b64encode(public_bytes(KEY)).decode()
    args = ["pull", "tiny", "latest", "--registry", str(registry), "--public-key", key]
    assert device_cli([*args, "--cache-dir", str(tmp_path / "piped")]) == 0
    piped = capsys.readouterr()
    assert piped.out.startswith("ok: tiny 1.0.0") and piped.err == ""  # not a terminal: no bar

    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert device_cli([*args, "--cache-dir", str(tmp_path / "tty")]) == 0
    drawn = terminal.buffer.getvalue()
    state = read_local_state(tmp_path / "tty" / "tiny" / "1.0.0")
    assert "tiny latest" in drawn and "━" in drawn
    done, total, unit = re.findall(r"([\d.]+)/([\d.]+) (\w?B)", drawn)[-1]
    shown = float(total) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    assert done == total and abs(shown - state["bytes"]) <= 0.01 * state["bytes"]  # the bar ends full, at the size
    assert "ok: tiny 1.0.0" in capsys.readouterr().out


def test_sdk_pull_cli_says_when_the_registry_cannot_be_reached(tmp_path, capsys):
    import base64

    from device_sdk.cli import main as device_cli

    key = base64.b64encode(public_bytes(KEY)).decode()
    for registry, says in (("http://127.0.0.1:9/", "cannot reach the registry at http://127.0.0.1:9/: "),
                           ("http://127.0.0.1:9/v1", "cannot reach the server at http://127.0.0.1:9: ")):
        assert device_cli(["pull", "tiny", "latest", "--registry", registry, "--public-key", key,
                           "--cache-dir", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert says + "Connection refused" in err and "Traceback" not in err and " 0 " not in err
