"""A package the pipeline builds, run by the device SDK: equal to HF at level 1.0 and to the pipeline's
wrapper at every level, its LoRA as the wrapper applies it, and the real SmolLM2 package served."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from device_sdk import kernels
from device_sdk.chat import ChatTemplate
from device_sdk.elastic import ElasticLinear
from device_sdk.format import read_manifest
from device_sdk.runtime import ElasticModel
from pipeline.models.elastic import ElasticCausalLM
from tests.support.pipeline_packages import build_package, tiny_package
from tests.support.reference import relative_logit_error
from tests.support.sdk_packages import (
    add_recovery_adapters,
    decode_both_ways,
    public_bytes,
    serving,
    signing_key,
    token_ids,
)
from tests.support.tiny import TINY_CONFIGS, byte_tokenizer, tiny_model

KEY = signing_key()
ROPE_VARIANTS = {
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
}
needs_native = pytest.mark.skipif(kernels.native_module() is None, reason="no C++ compiler on this machine")


def check_against_reference(hf_model, package, ids, native: bool = True, tolerance: float = 1e-4):
    """HF at 1.0, then the wrapper at every level: max |Δlogit| in fp32, relative to the logits' scale
    (tests.support.reference.relative_logit_error), within `tolerance`."""
    model = ElasticModel.load(package, public_key=public_bytes(KEY), native=native)
    with torch.no_grad():
        expected = hf_model(ids).logits
    assert model.level == model.available_levels()[-1]
    assert relative_logit_error(model.logits(ids), expected) <= tolerance
    wrapper = ElasticCausalLM.from_package(package)
    for level in model.available_levels():
        model.set_level(level)
        wrapper.set_level(level)
        with torch.no_grad():
            expected = wrapper(ids).logits
        assert relative_logit_error(model.logits(ids), expected) <= tolerance, level


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_sdk_matches_hf_and_wrapper_tiny(kind, tmp_path):
    hf_model, package = tiny_package(kind, tmp_path / "pkg", KEY)
    check_against_reference(hf_model, package, token_ids(hf_model.config.vocab_size))


@pytest.mark.parametrize("rope", sorted(ROPE_VARIANTS))
def test_sdk_rope_scaling_matches_hf(rope, tmp_path):
    # 40 positions > original_max_position_embeddings, so the llama3 bands all matter.
    hf_model, package = tiny_package("llama_gqa", tmp_path / "pkg", KEY, rope_parameters=dict(ROPE_VARIANTS[rope]))
    assert read_manifest(package).architecture.rope["rope_type"] == rope
    check_against_reference(hf_model, package, token_ids(256, length=40, batch=1))


def test_sdk_level_lora_switches_with_level(tmp_path):
    hf_model, package = tiny_package("qwen2_bias", tmp_path / "pkg", KEY)
    add_recovery_adapters(package, KEY)
    model = ElasticModel.load(package, public_key=public_bytes(KEY))
    wrapper = ElasticCausalLM.from_package(package)
    ids = token_ids(256)
    for level in model.available_levels():
        model.set_level(level)
        wrapper.set_level(level)
        lora = model.adapters[level]
        # Reference: the wrapper with every projection's LoRA added by a forward hook.
        hooks = []
        for name, module in wrapper.hf.named_modules():
            key = name.replace("self_attn.inner.", "self_attn.")
            if isinstance(module, ElasticLinear) and key in lora:
                a, b, scale = lora[key]
                hooks.append(module.register_forward_hook(
                    lambda mod, args, out, a=a, b=b, s=scale: out + (args[0] @ a.T) @ b.T * s))
        assert len(hooks) == 7 * model.manifest.architecture.layers
        with torch.no_grad():
            expected = wrapper(ids).logits
            for hook in hooks:
                hook.remove()
            plain = wrapper(ids).logits
        got = model.logits(ids)
        assert (got - expected).abs().max().item() <= 1e-4, level
        assert (got - plain).abs().max().item() > 1e-3  # the adapter really changed the output
        assert lora["model.layers.0.mlp.up_proj"][1].shape[0] == model.transformer.layers[0].mlp.neurons


def test_sdk_fp16_storage_runs_in_fp32(tmp_path):
    """A package stored in fp16, and an fp32 one converted at load, both compute in fp32."""
    hf_model = tiny_model("qwen2_bias")
    stored = build_package(hf_model, byte_tokenizer(), tmp_path / "fp16", KEY, dtype="float16")
    ids = token_ids(256)
    with torch.no_grad():
        expected = hf_model(ids).logits
    fp32 = tiny_package("qwen2_bias", tmp_path / "fp32", KEY)[1]
    for model in (ElasticModel.load(stored, allow_unsigned=True),
                  ElasticModel.load(fp32, quantize="fp16", allow_unsigned=True)):
        assert model.weight_format == "fp16"
        assert model.transformer.layers[0].mlp.up_proj.linear.storage.dtype == torch.float16
        logits = model.logits(ids)
        assert logits.dtype == torch.float32
        assert (logits - expected).abs().max().item() <= 0.05  # fp16 rounding of the weights only



@pytest.mark.slow
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_sdk_matches_hf_and_wrapper_smollm2(native, smollm2_package, smollm2):
    # The native kernel sums in a different order than oneDNN, so it gets twice the torch path's tolerance.
    ids = token_ids(smollm2.model.config.vocab_size, length=32, batch=1)
    check_against_reference(smollm2.model, smollm2_package, ids, native=native, tolerance=2e-5 if native else 1e-5)


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize("weight_format", ["fp32", "int8"])
def test_sdk_native_decode_matches_reference_smollm2(weight_format, smollm2_package):
    model = ElasticModel.load(smollm2_package, quantize=weight_format, allow_unsigned=True)
    arch = model.manifest.architecture
    ids = token_ids(arch.vocab, length=24, batch=1)
    generator = torch.Generator().manual_seed(1)
    for level in model.available_levels():
        model.set_level(level)
        # A LoRA assigned straight to some projections, as an expert mix does.
        for name in ("q_proj", "o_proj", "up_proj", "down_proj"):
            linear = model.transformer.layers[3].projection(name).linear
            a = torch.randn(4, linear.in_features, generator=generator) * 0.05
            b = torch.randn(linear.out_features, 4, generator=generator) * 0.05
            model.transformer.layers[3].projection(name).lora = (a, b, 2.0)
        steps, reference = decode_both_ways(model, ids, prefill=16)
        # int8 decode quantises each token's activations to 8 bits (as llama.cpp's Q8_0 does) while the
        # reference's many-row path multiplies fp32 activations: they agree to quantisation scale
        # (mean 0.1–0.2 on logits of about ±15, at most 0.9 at level 0.25), fp32 to rounding.
        gap = (steps - reference).abs()
        if weight_format == "fp32":
            assert gap.max().item() <= 5e-4, level
        else:
            assert gap.mean().item() <= 0.02 * reference.abs().mean().item(), level
            assert gap.max().item() <= 0.06 * reference.abs().max().item(), level
        assert (steps.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9, level


INT8_PPL_TOLERANCE = 0.02  # relative perplexity change on PTB, the bound (measured ≤ 1.4%)
INT8_MEAN_LOGIT_TOLERANCE = 0.35  # mean |Δlogit| vs fp32 (logits span about ±30); measured ≤ 0.25


@pytest.mark.slow
def test_sdk_int8_close_to_fp32_per_level(smollm2_package):
    import treebank

    fp32 = ElasticModel.load(smollm2_package, allow_unsigned=True)
    int8 = ElasticModel.load(smollm2_package, quantize="int8", allow_unsigned=True)
    ids = torch.tensor([fp32.tokenizer.encode(treebank.penn["valid"][:3000]).ids[:192]])
    for level in fp32.available_levels():
        fp32.set_level(level)
        int8.set_level(level)
        reference, quantized = fp32.logits(ids)[0], int8.logits(ids)[0]
        assert (quantized - reference).abs().mean().item() <= INT8_MEAN_LOGIT_TOLERANCE, level
        ppl = [math.exp(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]).item()) for logits in (reference, quantized)]
        assert abs(ppl[1] / ppl[0] - 1) <= INT8_PPL_TOLERANCE, (level, ppl)


def test_smollm2_chat_matches_transformers_template_and_answers(smollm2, smollm2_package):
    """The real SmolLM2 package: our rendering is transformers' own, and a chat answer is sensible."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    template = ChatTemplate.load(smollm2_package / "model")
    assert template.render(messages) == smollm2.tokenizer.apply_chat_template(messages, tokenize=False,
                                                                              add_generation_prompt=True)
    with serving(ElasticModel.load(smollm2_package, allow_unsigned=True)) as free_port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{free_port}/v1", api_key="-", max_retries=0)
        reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24)
        assert "Paris" in reply.choices[0].message.content
        assert "<|im_end|>" not in reply.choices[0].message.content
