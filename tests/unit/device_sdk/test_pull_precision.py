"""A package with extra precisions (int8 / int4 weight files): every level a prefix of every file, pulled alone;
the int4 file keeps the LM head at Q8_0, and the SDK runs a precision file as stored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from device_sdk import package as package_module
from device_sdk.format import (
    MANIFEST,
    WEIGHTS,
    Level,
    PackageError,
    atomic_write_bytes,
    canonical_json,
    level_byte_ranges,
    precision_file,
    precision_formats,
    read_manifest,
    safetensors_layout,
)
from device_sdk.package import add_precision
from device_sdk.quant import BLOCK_BYTES, Packed, blocks_for, dequantize, quantize
from device_sdk.registry import pull, read_local_state, verify_local
from device_sdk.runtime import ElasticModel
from tests.support.sdk_packages import (
    public_bytes,
    publish,
    random_package,
    sign_package,
    signing_key,
    token_ids,
)

KEY = signing_key()
INT4 = precision_file("int4")
TIED_HEAD, UNTIED_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Path:
    """A registry of two tiny packages, their weights stored as float32 and again as int4 (Q4_0): "tiny" with
    an untied LM head (qwen2), "tied" whose embedding is its LM head (llama GQA)."""
    root = tmp_path_factory.mktemp("precision-registry")
    for name, kind in (("tiny", "qwen2_bias"), ("tied", "llama_gqa")):
        package = random_package(kind, tmp_path_factory.mktemp(f"precision-{name}") / "package", None, name=name)
        add_precision(package, "int4")
        sign_package(package, KEY)
        publish(package, root, name=name)
    return root


def test_the_manifest_states_what_is_quantised_and_what_is_not(registry):
    manifest = read_manifest(registry / "packages/tiny/1.0.0")
    entry = manifest.precisions["int4"]
    with safe_open(registry / "packages/tiny/1.0.0" / WEIGHTS, framework="pt") as stored:
        matrices = {name for name in stored.keys()  # noqa: SIM118 (safe_open is not a mapping)
                    if name in manifest.elastic.tensors and len(stored.get_slice(name).get_shape()) == 2}
    assert set(entry["quantised"]) == matrices | {UNTIED_HEAD}
    assert entry["formats"] == {**{name: "int4" for name in matrices}, UNTIED_HEAD: "int8"}
    assert precision_formats(manifest, "int4") == entry["formats"]
    assert "model.embed_tokens.weight" in entry["unquantised"] and any("bias" in n for n in entry["unquantised"])
    assert set(entry["quantised"]).isdisjoint(entry["unquantised"])


@pytest.mark.parametrize(("name", "head"), [("tied", TIED_HEAD), ("tiny", UNTIED_HEAD)])
def test_the_int4_files_lm_head_is_q8_0_blocks_that_every_level_needs_whole(registry, name, head):
    package = registry / "packages" / name / "1.0.0"
    manifest = read_manifest(package)
    assert manifest.precisions["int4"]["formats"][head] == "int8"
    _, header = safetensors_layout(package / INT4)
    arch = manifest.architecture
    assert header[head]["dtype"] == "U8"
    assert header[head]["shape"] == [arch.vocab, blocks_for(arch.hidden) * BLOCK_BYTES["int8"]]
    with safe_open(package / WEIGHTS, framework="pt") as stored, safe_open(package / INT4, framework="pt") as int4:
        assert torch.equal(int4.get_tensor(head), quantize(stored.get_tensor(head), "out", "int8"))
    ranges = manifest.byte_ranges["precisions"]["int4"]["tensors"][head]
    begin, end = (header[head]["data_offsets"][i] + safetensors_layout(package / INT4)[0] for i in (0, 1))
    assert all(span == [begin, end] for span in ranges.values())  # never width-sliced: each level holds it all


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
        for name in sorted(set(manifest.precisions["int4"]["quantised"]) & set(manifest.elastic.tensors)):
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


def test_a_changed_byte_in_the_int4_lm_head_is_caught(registry, tmp_path):
    key = public_bytes(KEY)
    path = pull("tied", "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path, precision="int4",
                max_level="0.5")
    start, end = read_manifest(path).byte_ranges["precisions"]["int4"]["tensors"][TIED_HEAD]["0.5"]
    with open(path / INT4, "r+b") as handle:
        handle.seek(start + 3 * BLOCK_BYTES["int8"])  # a block's scale
        byte = handle.read(1)
        handle.seek(start + 3 * BLOCK_BYTES["int8"])
        handle.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(PackageError, match=rf"tensor {TIED_HEAD} \(level 0.5\) does not match its signed digest"):
        verify_local(path, key)
    with pytest.raises(PackageError, match="does not match its signed digest"):
        ElasticModel.load(path, public_key=key)


@pytest.mark.parametrize("name", ["tied", "tiny"])
def test_a_pulled_int4_copy_runs_its_own_file_at_every_level(registry, tmp_path, name):
    """Pulled with precision int4 (only that weights file), the model runs the file's blocks as stored, the head
    at Q8_0: the same numbers as the full package quantised to int4 at load, and it generates at every level."""
    key = public_bytes(KEY)
    path = pull(name, "1.0.0", registry=registry, public_key=key, cache_dir=tmp_path, precision="int4")
    assert not (path / WEIGHTS).exists()
    model = ElasticModel.load(path, public_key=key)
    at_load = ElasticModel.load(registry / "packages" / name / "1.0.0", public_key=key, quantize="int4")
    head = model.transformer.lm_head
    assert model.weight_format == "int4" and head.block_format == "int8"
    assert at_load.transformer.lm_head.block_format == "int8"
    assert isinstance(model.transformer.embed_tokens, Packed) == (name == "tied")
    blocks = {layer.block_format for block in model.transformer.layers for layer in block.modules()
              if hasattr(layer, "block_format")}
    assert blocks == {"int4"}
    ids = token_ids(256, length=9, batch=1)
    for level in model.available_levels():
        model.set_level(level)
        at_load.set_level(level)
        assert torch.equal(model.logits(ids), at_load.logits(ids)), level
        out = model.generate("abc", max_new_tokens=4, level=level)
        assert out.level == level and len(out.tokens) >= 1
        assert out.tokens == at_load.generate("abc", max_new_tokens=4, level=level).tokens
    with pytest.raises(PackageError, match="cannot be quantised again to int8"):
        ElasticModel.load(path, public_key=key, quantize="int8")


def test_a_package_from_before_the_format_map_still_loads(tmp_path, monkeypatch):
    """An int4 file written before the map: its head kept as stored, no `formats` in the manifest. It loads
    (every quantised tensor at int4, the head quantised to Q8_0 at load) and computes what int4 at load does."""
    package = random_package("llama_mha", tmp_path / "package", None)
    monkeypatch.setattr(package_module, "head_tensor", lambda architecture: None)  # the writer before the map
    manifest = add_precision(package, "int4")
    entry = manifest.precisions["int4"]
    assert TIED_HEAD in entry["unquantised"]
    raw = json.loads((package / MANIFEST).read_bytes())
    del raw["precisions"]["int4"]["formats"]
    atomic_write_bytes(package / MANIFEST, canonical_json(raw))
    old = read_manifest(package)
    assert "formats" not in old.precisions["int4"] and set(precision_formats(old, "int4").values()) == {"int4"}
    model = ElasticModel.load(package, allow_unsigned=True, precision="int4")
    at_load = ElasticModel.load(package, allow_unsigned=True, quantize="int4")
    assert model.transformer.lm_head.block_format == "int8"
    ids = token_ids(256, length=7, batch=1)
    for level in ("0.5", "1.0"):
        model.set_level(level)
        at_load.set_level(level)
        assert torch.equal(model.logits(ids), at_load.logits(ids))
    raw["precisions"]["int4"]["formats"] = {TIED_HEAD: "int2"}
    atomic_write_bytes(package / MANIFEST, canonical_json(raw))
    with pytest.raises(PackageError, match="formats must map quantised tensors"):
        read_manifest(package)
