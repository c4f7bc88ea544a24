"""Exports never delete: `elastify-device export` refuses a non-empty target that is not an earlier export
of the same format, never replaces a package (not even with --force), and a failed export leaves nothing
behind and says so in one line."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from device_sdk import export as export_module
from device_sdk import export_gguf as export_gguf_module
from device_sdk.cli import main
from device_sdk.export import EXPORT_MARK, ExportError, export_hf, export_peft_adapters
from device_sdk.export_gguf import export_gguf
from device_sdk.format import MANIFEST
from tests.support.sdk_packages import add_recovery_adapters, random_package, sign_package, signing_key

KEY = signing_key()


def byte_level_bpe_tokenizer() -> bytes:
    """A byte-level BPE tokenizer.json of the 256 bytes (GPT-2's byte-to-character table), no merges:
    the kind of tokenizer GGUF export takes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte], extra = chr(256 + extra), extra + 1
    return json.dumps({
        "version": "1.0", "added_tokens": [],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "vocab": {chars[b]: b for b in range(256)}, "merges": []},
    }).encode()


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """An unsigned random package (exported with --allow-unsigned) whose tokenizer GGUF export takes."""
    pkg = random_package("llama_gqa", tmp_path_factory.mktemp("export") / "pkg", KEY)
    (pkg / "model" / "tokenizer.json").write_bytes(byte_level_bpe_tokenizer())
    add_recovery_adapters(pkg, KEY)
    sign_package(pkg, KEY)
    return pkg


def export(package: Path, fmt: str, out: Path, *extra: str) -> int:
    level = [] if fmt == "peft" else ["--level", "0.5"]
    return main(["export", str(package), "--allow-unsigned", "--format", fmt, *level, "--out", str(out), *extra])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_an_hf_export_refuses_a_directory_that_holds_something_else(package, tmp_path, capsys, force):
    target = tmp_path / "d"
    (target / "notes").mkdir(parents=True)
    (target / "notes" / "todo.txt").write_text("keep me")
    assert export(package, "hf", target, *force) == 1
    assert "not empty" in one_error_line(capsys)
    assert snapshot(target) == {"notes/todo.txt": b"keep me"}


@pytest.mark.parametrize("fmt", ["hf", "gguf", "peft"])
@pytest.mark.parametrize("force", [[], ["--force"]])
def test_no_export_replaces_or_writes_into_the_package(package, capsys, fmt, force):
    before = snapshot(package)
    assert export(package, fmt, package, *force) == 1
    assert "package" in one_error_line(capsys)
    assert export(package, fmt, package / "inside", *force) == 1
    assert "package" in one_error_line(capsys)
    assert snapshot(package) == before
    assert main(["verify", str(package), "--allow-unsigned"]) == 0


def test_an_export_never_replaces_a_package_even_outside_its_own(package, tmp_path, capsys):
    other = random_package("llama_mha", tmp_path / "other", None)
    before = snapshot(other)
    assert export(package, "hf", other, "--force") == 1
    assert "package" in one_error_line(capsys)
    assert snapshot(other) == before and (other / MANIFEST).is_file()


@pytest.mark.parametrize("fmt, name", [("hf", "out"), ("gguf", "out.gguf"), ("peft", "adapters")])
def test_only_force_replaces_an_earlier_export_of_the_same_format(package, tmp_path, capsys, fmt, name):
    target = tmp_path / name
    assert export(package, fmt, target) == 0
    first = snapshot(target) if target.is_dir() else target.read_bytes()
    assert export(package, fmt, target) == 1
    assert "--force" in one_error_line(capsys)
    assert export(package, fmt, target, "--force") == 0
    assert (snapshot(target) if target.is_dir() else target.read_bytes()) == first  # the same export, rewritten
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging or retired copy left


def test_force_does_not_replace_an_export_of_another_format(package, tmp_path, capsys):
    target = tmp_path / "out"
    assert export(package, "peft", target) == 0
    before = snapshot(target)
    assert export(package, "hf", target, "--force") == 1
    assert "not empty" in one_error_line(capsys)
    assert snapshot(target) == before


def test_directory_exports_are_marked_and_load_as_before(package, tmp_path):
    out = export_hf(package, tmp_path / "hf", level="0.5")
    assert json.loads((out / EXPORT_MARK).read_text())["format"] == "hf"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    peft = export_peft_adapters(package, tmp_path / "peft")
    assert json.loads((tmp_path / "peft" / EXPORT_MARK).read_text())["format"] == "peft"
    assert all((path / "adapter_config.json").is_file() for path in peft.values())


def test_a_gguf_export_refuses_a_directory_or_a_file_it_did_not_write(package, tmp_path, capsys):
    (tmp_path / "dir.gguf").mkdir()
    assert export(package, "gguf", tmp_path / "dir.gguf", "--force") == 1
    assert "directory" in one_error_line(capsys)
    foreign = tmp_path / "model.gguf"
    foreign.write_bytes(b"GGUF something else")
    assert export(package, "gguf", foreign, "--force") == 1
    assert "not an Elastify" in one_error_line(capsys)
    assert foreign.read_bytes() == b"GGUF something else"
    with pytest.raises(ExportError, match="not an Elastify"):
        export_gguf(package, foreign, level="0.5", force=True)


def disk_full(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fmt, name, module, function", [
    ("hf", "out", export_module, "save_file"),
    ("gguf", "out.gguf", export_gguf_module, "_add_tensor"),
])
def test_a_failed_export_leaves_nothing_and_prints_one_line(package, tmp_path, capsys, monkeypatch, fmt, name,
                                                              module, function):
    monkeypatch.setattr(module, function, disk_full)
    assert export(package, fmt, tmp_path / name) == 1
    assert "No space left on device" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []  # no target, no staging directory, no .partial file


def test_a_failed_forced_export_keeps_the_earlier_one(package, tmp_path, capsys, monkeypatch):
    target = tmp_path / "out.gguf"
    assert export(package, "gguf", target) == 0
    before = target.read_bytes()
    monkeypatch.setattr(export_gguf_module, "_add_tensor", disk_full)
    assert export(package, "gguf", target, "--force") == 1
    one_error_line(capsys)
    assert target.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["out.gguf"]
