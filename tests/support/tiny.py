"""Tiny random Llama-family models for fast tests: one per supported family and shape."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_CONFIGS = {
    "llama_mha": ("LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama_gqa": ("LlamaForCausalLM", dict(num_attention_heads=8, num_key_value_heads=4)),
    "mistral": ("MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "qwen2_bias": ("Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
}


def tiny_model(kind: str, seed: int = 0, layers: int = 4):
    import transformers

    arch, extra = TINY_CONFIGS[kind]
    extra = dict(extra)
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        max_position_embeddings=256,
        tie_word_embeddings=extra.pop("tie_word_embeddings", True),
        **extra,
    )
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    if kind == "qwen2_bias":  # random init zeroes biases; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def byte_level_tokenizer():
    """A `tokenizers` tokenizer with one token per byte (256 symbols); needs no transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {bytes([i]).decode("latin-1"): i for i in range(256)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="\x00"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    return core


def byte_tokenizer():
    """`byte_level_tokenizer` as an HF tokenizer, saved like HF's."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(), eos_token="\x00")


def save_tiny(kind: str, directory: Path, seed: int = 0) -> Path:
    model = tiny_model(kind, seed)
    model.save_pretrained(str(directory))
    byte_tokenizer().save_pretrained(str(directory))
    return directory
