"""A package with extra precisions (int8 / int4 weight files): every level a prefix of every file, pulled alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from device_sdk.format import (
    WEIGHTS,
    Level,
    PackageError,
    level_byte_ranges,
    precision_file,
    read_manifest,
    safetensors_layout,
)
from device_sdk.package import add_precision
from device_sdk.quant import dequantize
from device_sdk.registry import pull, read_local_state, verify_local
from tests.support.sdk_packages import public_bytes, publish, random_package, sign_package, signing_key

KEY = signing_key()
INT4 = precision_file("int4")


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Path:
    """A registry holding one tiny package, its weights stored as float32 and again as int4 (Q4_0)."""
    root = tmp_path_factory.mktemp("precision-registry")
    package = random_package("qwen2_bias", tmp_path_factory.mktemp("precision-built") / "package", None)
    add_precision(package, "int4")
    sign_package(package, KEY)
    publish(package, root)
    return root


def test_the_manifest_states_what_is_quantised_and_what_is_not(registry):
    manifest = read_manifest(registry / "packages/tiny/1.0.0")
    entry = manifest.precisions["int4"]
    with safe_open(registry / "packages/tiny/1.0.0" / WEIGHTS, framework="pt") as stored:
        matrices = {name for name in stored.keys()  # noqa: SIM118 (safe_open is not a mapping)
                    if name in manifest.elastic.tensors and len(stored.get_slice(name).get_shape()) == 2}
    assert set(entry["quantised"]) == matrices
    assert "model.embed_tokens.weight" in entry["unquantised"] and any("bias" in n for n in entry["unquantised"])
    assert set(entry["quantised"]).isdisjoint(entry["unquantised"])


def test_an_int4_pull_up_to_a_level_fetches_only_that_files_ranges_and_each_is_the_level_s_prefix(registry, tmp_path):
    key, level = public_bytes(KEY), Level("0.5")
    path = pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path, precision="int4",
                max_level="0.5")
    manifest, state = read_manifest(path), read_local_state(path)
    assert (state["precision"], state["max_level"]) == ("int4", "0.5")
    assert not (path / WEIGHTS).exists() and INT4 in state["files"] and WEIGHTS not in state["files"]
    spans = level_byte_ranges(manifest, level, "int4")
    others = sum(f.size for f in manifest.files if f.path in state["files"] and f.path != INT4)
    assert state["bytes"] == others + sum(end - start for start, end in spans)
    assert state["bytes"] < 0.5 * next(f.size for f in manifest.files if f.path == WEIGHTS)  # int4, and half of it

    # each quantised tensor's level-0.5 bytes, read from the partial copy, are the full tensor's blocks cut to 0.5
    _, header = safetensors_layout(path / INT4)
    _, stored_header = safetensors_layout(registry / "packages/tiny/1.0.0" / WEIGHTS)
    shape = manifest.elastic.level(level)
    with safe_open(registry / "packages/tiny/1.0.0" / INT4, framework="pt") as full, open(path / INT4, "rb") as partial:
        for name in manifest.precisions["int4"]["quantised"]:
            spec, (stored_rows, stored_cols) = manifest.elastic.tensors[name], stored_header[name]["shape"]
            start, end = manifest.byte_ranges["precisions"]["int4"]["tensors"][name][level.name]
            partial.seek(start)
            packed = torch.frombuffer(bytearray(partial.read(end - start)), dtype=torch.uint8)
            packed = packed.reshape(-1, header[name]["shape"][1])
            rows = (shape.attn_units if spec.unit == "attn" else shape.mlp_units)[spec.layer] * spec.rows_per_unit
            axis = "in" if spec.transposed else "out"
            expected = dequantize(full.get_tensor(name), axis, "int4", stored_rows, stored_cols)[:rows]
            assert torch.equal(dequantize(packed, axis, "int4", rows, stored_cols), expected), name
    verify_local(path, key)


def test_a_changed_byte_in_the_int4_ranges_is_caught_and_a_missing_precision_refused(registry, tmp_path):
    key = public_bytes(KEY)
    path = pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path, precision="int4",
                max_level="0.5")
    start, end = level_byte_ranges(read_manifest(path), "0.5", "int4")[-1]
    with open(path / INT4, "r+b") as handle:
        handle.seek((start + end) // 2)
        byte = handle.read(1)
        handle.seek((start + end) // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(PackageError, match=r"weights\.int4\.safetensors: tensor .* does not match its signed digest"):
        verify_local(path, key)
    with pytest.raises(PackageError, match="carries no int8 weights; it has \\['int4'\\]"):
        pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path / "b", precision="int8")
    full = pull("tiny", "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path / "c")
    assert (full / WEIGHTS).exists() and not (full / INT4).exists()  # the stored precision alone
