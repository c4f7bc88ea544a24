"""The SDK's own forward pass on random packages: the KV cache, zero-copy level switches, partial
copies, LoRA per level and the native decode step. Against HF and the pipeline: test_roundtrip_sdk_runtime.py."""

from __future__ import annotations

import pytest
import torch

from device_sdk import kernels
from device_sdk.elastic import ElasticLinear
from device_sdk.format import PackageError, read_manifest
from device_sdk.runtime import ElasticModel
from tests.support.sdk_packages import (
    add_recovery_adapters,
    decode_both_ways,
    random_package,
    signing_key,
    token_ids,
)

KEY = signing_key()


def test_sdk_kv_cache_decode_equals_full_forward(tmp_path):
    package = random_package("mistral", tmp_path / "pkg", KEY)
    model = ElasticModel.load(package, allow_unsigned=True)
    model.set_level("0.5")
    ids = token_ids(256, length=12, batch=1)
    with torch.no_grad():
        full = model.logits(ids)
        cache = model.transformer.new_cache(12)
        steps = [model.transformer(ids[:, :8], cache)] + [model.transformer(ids[:, i : i + 1], cache) for i in range(8, 12)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_sdk_switching_is_zero_copy(tmp_path):
    package = random_package("llama_gqa", tmp_path / "pkg", KEY)
    model = ElasticModel.load(package, quantize="int8", allow_unsigned=True)
    linears = [m for m in model.transformer.modules() if isinstance(m, ElasticLinear)]
    pointers = {id(m): m.storage.data_ptr() for m in linears}
    manifest = read_manifest(package)
    for level in model.available_levels():
        model.set_level(level)
        for m in linears:
            assert m.storage.data_ptr() == pointers[id(m)]
            if m.units:  # a view of the start of the storage (an empty view has no address)
                assert m.active_weight.data_ptr() == pointers[id(m)]
        block = model.transformer.layers[1]
        assert block.mlp.neurons == manifest.elastic.level(level).mlp_units[1]
    half = [max(1, n // 2) for n in manifest.elastic.mlp_units]
    model.set_widths(manifest.elastic.attn_units, half)
    assert model.level is None and model.transformer.layers[0].mlp.neurons == half[0]
    assert all(m.storage.data_ptr() == pointers[id(m)] for m in linears)


def test_sdk_partial_copy_refuses_larger_levels(tmp_path):
    from device_sdk.format import atomic_write_bytes, canonical_json
    from device_sdk.registry import LOCAL_STATE

    package = random_package("llama_mha", tmp_path / "pkg", KEY)
    atomic_write_bytes(package / LOCAL_STATE, canonical_json({"max_level": "0.5", "files": []}))
    model = ElasticModel.load(package, allow_unsigned=True)
    assert model.available_levels() == ["0.25", "0.5"] and model.level == "0.5"
    with pytest.raises(PackageError, match="partial"):
        model.set_level(1.0)
    with pytest.raises(PackageError, match="partial"):
        model.set_widths(read_manifest(package).elastic.attn_units, read_manifest(package).elastic.mlp_units)


needs_native = pytest.mark.skipif(kernels.native_module() is None, reason="no C++ compiler on this machine")
DECODE_KINDS = {"llama_mha": {}, "llama_gqa": {}, "qwen2_bias": {}, "mistral_window": {"sliding_window": 5}}


@pytest.fixture(scope="module", params=sorted(DECODE_KINDS))
def lora_package(request, tmp_path_factory):
    """Each tiny family with a LoRA per level (Mistral with a window shorter than the test sequence)."""
    kind = request.param
    base = "mistral" if kind == "mistral_window" else kind
    package = random_package(base, tmp_path_factory.mktemp(kind) / "pkg", KEY, **DECODE_KINDS[kind])
    add_recovery_adapters(package, KEY)
    return package


def assert_decode_close(steps, reference, weight_format, label=None):
    """fp32/fp16: to float rounding. int8/int4 (block-quantised, activations quantised per token too): a
    quantised activation a last-bit away from a rounding boundary may round either way in the native
    step and in the Python forward, moving later logits slightly (test_quant_kernels.py)."""
    if weight_format in ("fp32", "fp16"):
        assert (steps - reference).abs().max().item() <= 1e-4, label
    else:
        assert ((steps - reference).norm() / reference.norm()).item() <= 1e-2, label


@needs_native
@pytest.mark.parametrize("weight_format", ["fp32", "fp16", "int8", "int4"])
def test_sdk_native_decode_matches_reference(lora_package, weight_format):
    model = ElasticModel.load(lora_package, quantize=weight_format, allow_unsigned=True)
    assert model.transformer.decoder is not None
    if "mistral" in str(lora_package):
        assert model.manifest.architecture.sliding_window == 5
    ids = token_ids(256, length=14, batch=1)
    for level in model.available_levels():
        model.set_level(level)
        steps, reference = decode_both_ways(model, ids, prefill=6)
        assert_decode_close(steps, reference, weight_format, level)
    # The LoRA really takes part: without it the reference moves.
    projections = [block.projection(name) for block in model.transformer.layers for name in kernels.PROJECTIONS]
    assert all(p.lora is not None for p in projections)
    for p in projections:
        p.lora = None
    assert (decode_both_ways(model, ids, prefill=6)[1] - reference).abs().max().item() > 1e-3
    # Per-layer widths with whole sub-layers off (CLONE profiles), then back to a level.
    full_attn, full_mlp = model.manifest.elastic.attn_units, model.manifest.elastic.mlp_units
    model.set_widths([full_attn[0], 0, 1, full_attn[3]], [0, full_mlp[1], full_mlp[2] // 2, full_mlp[3]])
    steps, reference = decode_both_ways(model, ids, prefill=6)
    assert_decode_close(steps, reference, weight_format)
    model.set_level("0.5")
    steps, reference = decode_both_ways(model, ids, prefill=6)
    assert_decode_close(steps, reference, weight_format)


@needs_native
def test_sdk_native_decoder_reads_the_model_storage_in_place(tmp_path):
    package = random_package("llama_gqa", tmp_path / "pkg", KEY)
    model = ElasticModel.load(package, allow_unsigned=True)
    ids = token_ids(256, length=10, batch=1)
    before, _ = decode_both_ways(model, ids, prefill=4)
    up = model.transformer.layers[1].mlp.up_proj.linear
    pointer = up.storage.data_ptr()
    with torch.no_grad():
        up.storage.mul_(-2.0)  # in the copy-on-write map: the decoder must see it without a reload
    steps, reference = decode_both_ways(model, ids, prefill=4)
    assert up.storage.data_ptr() == pointer
    assert (steps - reference).abs().max().item() <= 1e-4
    assert (steps - before).abs().max().item() > 1e-3


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_sdk_decode_errors_are_clear(native, tmp_path):
    package = random_package("qwen2_bias", tmp_path / "pkg", KEY)
    model = ElasticModel.load(package, native=native, allow_unsigned=True)
    assert (model.transformer.decoder is not None) == (native and kernels.native_module() is not None)
    transformer, ids = model.transformer, token_ids(256, length=4, batch=1)
    with torch.inference_mode():
        cache = transformer.new_cache(3)
        transformer(ids[:, :3], cache)
        with pytest.raises(ValueError, match="exceeds the cache"):
            transformer(ids[:, 3:4], cache)
        q_proj = transformer.layers[0].self_attn.q_proj
        q_proj.lora = (torch.zeros(2, 5), torch.zeros(q_proj.linear.out_features, 2), 1.0)  # A has the wrong width
        with pytest.raises(RuntimeError, match="LoRA|shape|size"):
            transformer(ids[:, :1], transformer.new_cache(2))


@needs_native
def test_sdk_native_decode_is_the_same_at_any_thread_count(tmp_path):
    """Every output is summed by one thread in one order, so splitting the work changes no bit."""
    package = random_package("qwen2_bias", tmp_path / "pkg", KEY)
    add_recovery_adapters(package, KEY)
    model = ElasticModel.load(package, quantize="int8", allow_unsigned=True)
    model.set_level("0.75")
    ids = token_ids(256, length=10, batch=1)
    threads = torch.get_num_threads()
    try:
        runs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            runs.append(decode_both_ways(model, ids, prefill=4)[0])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


def test_sdk_without_a_compiler_decodes_on_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTIFY_NATIVE", "0")
    monkeypatch.setattr(kernels, "_native_tried", False)
    monkeypatch.setattr(kernels, "_native_module", None)
    package = random_package("llama_gqa", tmp_path / "pkg", KEY)
    with pytest.warns(UserWarning, match="torch fallback"):
        model = ElasticModel.load(package, quantize="int8", allow_unsigned=True)
    assert model.transformer.decoder is None
    steps, reference = decode_both_ways(model, token_ids(256, length=8, batch=1), prefill=3)
    assert (steps - reference).abs().max().item() <= 1e-4
    assert model.generate("abc", max_new_tokens=3, level="0.5").tokens
