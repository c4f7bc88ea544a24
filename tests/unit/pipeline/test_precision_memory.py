"""bf16 end to end and elastify in bounded memory: a bf16 source loads, profiles and packages in bf16, an
fp32 one stays fp32, the streamed package is the in-memory one byte for byte, and elastify's peak memory
is a fraction of the model's bytes (measured in a fresh process)."""

from __future__ import annotations

import copy

import pytest
import torch

from device_sdk.format import WEIGHTS, read_manifest, safetensors_layout
from device_sdk.package import write_package
from device_sdk.runtime import ElasticModel
from pipeline.elastilm import elastify as elastify_stage
from pipeline.elastilm.elastify import build_elastic
from pipeline.elastilm.profile import ProfileSettings, profile
from pipeline.models import precision
from pipeline.models.loading import describe_architecture, load_model, open_weights
from pipeline.settings import ElastifySettings
from pipeline.stage import quiet_context
from tests.support.pipeline_packages import random_importance
from tests.support.stage_memory import measure, write_random_llama
from tests.support.tiny import byte_tokenizer, tiny_model

SETTINGS = dict(levels=[0.5, 1.0], anchor_fraction=0.25, align=8)


def save_source(kind: str, dtype: torch.dtype, out_dir):
    model = tiny_model(kind).to(dtype)
    model.save_pretrained(str(out_dir))
    byte_tokenizer().save_pretrained(str(out_dir))
    return out_dir


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_auto_loads_half_sources_as_stored_and_the_rest_in_fp32(dtype, tmp_path):
    source = save_source("llama_gqa", dtype, tmp_path / "source")
    assert next(load_model(source).model.parameters()).dtype == dtype
    assert next(load_model(source, dtype=torch.float32).model.parameters()).dtype == torch.float32


def test_upcast_linears_computes_in_fp32_over_bf16_weights(monkeypatch):
    monkeypatch.setattr(precision, "UPCAST_CHUNK_ELEMENTS", 1000)  # chunk even the tiny model's weights
    stored = tiny_model("qwen2_bias").to(torch.bfloat16)
    reference = copy.deepcopy(stored).float()  # the same (bf16-rounded) values, in fp32
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for param in stored.parameters():
        param.requires_grad_(True)
    with precision.upcast_linears(stored):
        logits = stored(ids).logits
        logits.logsumexp(-1).sum().backward()
    expected = reference(ids).logits
    expected.logsumexp(-1).sum().backward()
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max().item() <= 1e-5
    for name in ("mlp.up_proj.weight", "self_attn.q_proj.bias", "self_attn.o_proj.weight"):
        got, want = (dict(m.model.layers[0].named_parameters())[name].grad for m in (stored, reference))
        assert got.dtype == torch.bfloat16  # the gradient comes back in the weight's dtype
        assert ((got.float() - want).abs().max() / want.abs().max()).item() <= 1e-2
    assert all(p.dtype == torch.bfloat16 for p in stored.parameters())  # nothing was converted in place
    assert "forward" not in vars(stored.model.layers[0].mlp.up_proj)  # the class's forward is back


def test_profile_of_a_bf16_model_matches_its_fp32_copy(calib_text):
    stored = tiny_model("llama_gqa").to(torch.bfloat16)
    reference = copy.deepcopy(stored).float()
    settings = ProfileSettings(calibration=[str(calib_text)], windows=4, window_length=32, layer_windows=2)
    arch = describe_architecture(reference.config)
    got = profile(stored, byte_tokenizer(), arch, settings, quiet_context())
    want = profile(reference, byte_tokenizer(), arch, settings, quiet_context())
    # Leave-one-out passes compute in fp32 over the same values; Taylor folds bf16 gradients.
    assert torch.allclose(got.layers, want.layers, rtol=1e-4, atol=1e-6)
    for a, b in zip(got.attn, want.attn, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(got.mlp, want.mlp, strict=True):
        assert a.dtype == torch.float32 and ((a - b).abs().max() / b.abs().max()).item() <= 2e-2


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_bias"])
def test_the_streamed_package_is_the_in_memory_one_byte_for_byte(kind, source_dtype, tmp_path):
    source = save_source(kind, source_dtype, tmp_path / "source")
    loaded = load_model(source)
    importance = random_importance(loaded.architecture)
    importance.save(tmp_path / "importance.safetensors")
    settings = ElastifySettings(**SETTINGS)
    ctx = quiet_context(tmp_path / "work")
    ctx.work_dir.mkdir()
    with open_weights(source) as weights:
        assert weights is not None  # the stage takes the streaming path for this source
    streamed = elastify_stage.run({"model": source, "importance": tmp_path / "importance.safetensors"}, settings,
                                  ctx)["package"]
    tensors, elastic = build_elastic(loaded.model, loaded.architecture, importance, settings)
    in_memory = tmp_path / "in-memory"
    write_package(in_memory, manifest_fields={"name": "model", "version": "0.0.0", "created_at": "now",
                                                    "build_id": None, "source": {}},
                  architecture=loaded.architecture, elastic=elastic, weights=tensors)  # safetensors' save_file
    assert (streamed / WEIGHTS).read_bytes() == (in_memory / WEIGHTS).read_bytes()
    assert read_manifest(streamed).byte_ranges == read_manifest(in_memory).byte_ranges


@pytest.mark.parametrize("source_dtype, stored", [(torch.bfloat16, "BF16"), (torch.float32, "F32")])
def test_the_default_package_keeps_a_bf16_source_in_bf16_and_the_sdk_runs_it(source_dtype, stored, tmp_path):
    source = save_source("llama_gqa", source_dtype, tmp_path / "source")
    arch = load_model(source).architecture
    random_importance(arch).save(tmp_path / "importance.safetensors")
    ctx = quiet_context(tmp_path / "work")
    ctx.work_dir.mkdir()
    package = elastify_stage.run({"model": source, "importance": tmp_path / "importance.safetensors"},
                                 ElastifySettings(**SETTINGS), ctx)["package"]
    assert {info["dtype"] for info in safetensors_layout(package / WEIGHTS)[1].values()} == {stored}
    model = ElasticModel.load(package, allow_unsigned=True, verify=False)
    for level in model.available_levels():
        result = model.generate("hello", level=level, max_new_tokens=4)
        assert result.tokens and result.level == level
    logits = model.logits(torch.tensor([[1, 2, 3, 4]]))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_elastify_peak_memory_is_under_half_the_model_plus_a_layer(dtype, tmp_path):
    # ~97M random parameters (195 MB in bf16): big enough that allocator and import noise is small beside it.
    source = write_random_llama(tmp_path / "source", dtype=dtype)
    arch = load_model_arch(source)
    random_importance(arch).save(tmp_path / "importance.safetensors")
    (tmp_path / "work").mkdir()
    result = measure("elastify", source, tmp_path / "work", tmp_path / "importance.safetensors")
    element = 2 if dtype == "bfloat16" else 4
    per_layer = arch.hidden * arch.head_dim * (arch.heads * 2 + arch.kv_heads * 2) + 3 * arch.hidden * arch.intermediate
    layer_mb = per_layer * element / 2**20
    assert result["above_baseline_mb"] <= 0.5 * result["model_mb"] + layer_mb, result
    package = result["outputs"]["package"]
    assert {info["dtype"] for info in safetensors_layout(f"{package}/{WEIGHTS}")[1].values()} == \
        {"BF16" if dtype == "bfloat16" else "F32"}


def load_model_arch(source):
    with open_weights(source) as weights:
        return weights.architecture
