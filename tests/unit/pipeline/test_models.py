"""The model adapter accepts Llama, Mistral and Qwen2 (MHA/GQA, tied or not) and nothing else."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.models.loading import ModelLoadError, check_hf_dir, load_model
from tests.support.tiny import TINY_CONFIGS, save_tiny, tiny_model


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_loads_each_supported_family_from_a_directory(tmp_path, kind):
    directory = save_tiny(kind, tmp_path / kind)
    loaded = load_model(directory)
    arch = loaded.architecture
    source = tiny_model(kind)
    assert arch.family == {"llama_mha": "llama", "llama_gqa": "llama", "mistral": "mistral", "qwen2_bias": "qwen2"}[kind]
    assert arch.kv_heads == source.config.num_key_value_heads and arch.heads == source.config.num_attention_heads
    assert arch.attention_bias == (kind == "qwen2_bias")
    assert arch.tie_word_embeddings == (kind != "qwen2_bias")
    assert len(loaded.source["sha256"]) == 64
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        assert torch.allclose(loaded.model(ids).logits, source(ids).logits, atol=1e-6)


def test_refuses_other_architectures_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture GemmaForCausalLM.*LlamaForCausalLM"):
        check_hf_dir(tmp_path)


def test_smollm2_loads_from_its_gguf_like_the_cached_copy(smollm2):
    from pipeline.assets import smollm2_gguf

    arch = smollm2.architecture
    assert (arch.family, arch.layers, arch.hidden, arch.heads, arch.kv_heads, arch.intermediate) == (
        "llama", 30, 576, 9, 3, 1536
    )
    assert arch.tie_word_embeddings
    from_gguf = load_model(smollm2_gguf())
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        cached, direct = smollm2.model(ids).logits, from_gguf.model(ids).logits
    assert torch.equal(cached, direct)
    assert smollm2.tokenizer.decode(int(cached[0, -1].argmax())).strip() == "Paris"
