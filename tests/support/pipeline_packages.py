"""Signed packages built by the pipeline's elastify from HF models (tests/support/tiny.py's, or SmolLM2): for
tests of the pipeline, and of the round trip from a pipeline build to the device SDK. The SDK's own
tests write random packages with device_sdk alone (tests/support/sdk_packages.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pipeline.elastilm.elastify import elastify
from pipeline.elastilm.profile import Importance
from pipeline.models.loading import describe_architecture
from pipeline.settings import ElastifySettings
from tests.support.sdk_packages import LEVELS, sign_package
from tests.support.tiny import byte_tokenizer, tiny_model

SMOLLM2_LEVELS = [0.25, 0.5, 1.0]


def random_importance(arch, seed: int = 0) -> Importance:
    """Shuffled unit scores: the tests need a real reorder, not a good one."""
    generator = torch.Generator().manual_seed(seed)
    return Importance(
        attn=[torch.rand(arch.kv_heads, generator=generator) for _ in range(arch.layers)],
        mlp=[torch.rand(arch.intermediate, generator=generator) for _ in range(arch.layers)],
        layers=torch.rand(arch.layers, generator=generator),
        meta={"method": "random"},
    )


def build_package(model, tokenizer, out_dir: Path, key: Ed25519PrivateKey, *, name: str = "tiny",
                  version: str = "1.0.0", levels=LEVELS, dtype: str = "float32", align: int = 8,
                  importance=None) -> Path:
    """Elastify `model` (with shuffled importance unless given one) and sign the package."""
    arch = describe_architecture(model.config)
    settings = ElastifySettings(levels=list(levels), align=align, anchor_fraction=0.25, dtype=dtype)
    importance = importance or random_importance(arch)
    elastify(model, tokenizer, arch, importance, settings, out_dir, name=name, version=version)
    sign_package(out_dir, key)
    return out_dir


def tiny_package(kind: str, out_dir: Path, key: Ed25519PrivateKey, **config_overrides):
    """(the HF model, its signed package); `config_overrides` e.g. rope_parameters."""
    model = tiny_model(kind)
    for field, value in config_overrides.items():
        setattr(model.config, field, value)
    if config_overrides:  # rotary frequencies are computed at init: rebuild them from the new config
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return model, build_package(model, byte_tokenizer(), out_dir, key)
