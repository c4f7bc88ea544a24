"""Signed tiny packages for the device-SDK tests, and a registry directory to pull them from."""

from __future__ import annotations

import contextlib
import shutil
import threading
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from safetensors.torch import save_file

from device_sdk.format import (
    MANIFEST,
    atomic_write_bytes,
    canonical_json,
    read_manifest,
    rewrite_manifest,
    sign_manifest,
)
from tests.tiny import byte_tokenizer, tiny_model

LEVELS = [0.25, 0.5, 0.75, 1.0]
SMOLLM2_LEVELS = [0.25, 0.5, 1.0]


def signing_key(seed: int = 7) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32)


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def sign_package(package_dir: Path, key: Ed25519PrivateKey) -> None:
    manifest = read_manifest(package_dir)
    rewrite_manifest(package_dir, manifest)  # refresh the file table first
    sign_manifest(manifest, key)
    atomic_write_bytes(Path(package_dir) / MANIFEST, canonical_json(manifest.to_dict()))


def random_importance(arch, seed: int = 0):
    """Shuffled unit scores: the tests need a real reorder, not a good one."""
    from pipeline.elastilm.profile import Importance

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
    from pipeline.elastilm.elastify import ElastifySettings, elastify
    from pipeline.models.loading import describe_architecture

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


def fixed_profile_model(package_dir: Path):
    """The package's ElasticModel with a fixed latency profile (level i: TTFT base 10(i+1) ms, 0.1(i+1) ms
    a prompt token, TPOT i+1 ms), so SLO decisions do not depend on how busy the test machine is (nor
    recalibrate from the requests the test serves)."""
    from device_sdk.latency import Drift, LatencyProfile, LevelLatency
    from device_sdk.runtime import ElasticModel

    model = ElasticModel.load(package_dir, allow_unsigned=True)
    model.latency_profile = LatencyProfile(
        "fp32", 1, {name: LevelLatency(10.0 * (i + 1), 0.1 * (i + 1), 1.0 * (i + 1))
                    for i, name in enumerate(model.available_levels())}, drift=Drift(quantile=None))
    return model


def add_recovery_adapters(package_dir: Path, key: Ed25519PrivateKey, rank: int = 2, seed: int = 0) -> None:
    """A random LoRA per level (A [r, in_active], B [out_active, r]) on every projection."""
    manifest = read_manifest(package_dir)
    arch, generator = manifest.architecture, torch.Generator().manual_seed(seed)
    hd, q_rows = arch.head_dim, arch.n_rep * arch.head_dim
    for level in manifest.elastic.levels:
        tensors = {}
        for layer, (groups, neurons) in enumerate(zip(level.attn_units, level.mlp_units, strict=True)):
            shapes = {
                "self_attn.q_proj": (arch.hidden, groups * q_rows),
                "self_attn.k_proj": (arch.hidden, groups * hd),
                "self_attn.v_proj": (arch.hidden, groups * hd),
                "self_attn.o_proj": (groups * q_rows, arch.hidden),
                "mlp.gate_proj": (arch.hidden, neurons),
                "mlp.up_proj": (arch.hidden, neurons),
                "mlp.down_proj": (neurons, arch.hidden),
            }
            for proj, (fan_in, fan_out) in shapes.items():
                base = f"model.layers.{layer}.{proj}"
                tensors[f"{base}.lora_A"] = torch.randn(rank, fan_in, generator=generator) * 0.1
                tensors[f"{base}.lora_B"] = torch.randn(fan_out, rank, generator=generator) * 0.1
        level.adapter = f"adapters/recovery/{level.name}.safetensors"
        path = Path(package_dir) / level.adapter
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"alpha": "4", "rank": str(rank)})
    rewrite_manifest(package_dir, manifest)
    sign_package(package_dir, key)


def publish(package_dir: Path, registry: Path, name: str = "tiny", version: str = "1.0.0", alias: str = "latest") -> Path:
    """Lay a package out in a registry directory as pull expects it."""
    target = Path(registry) / "packages" / name / version
    shutil.copytree(package_dir, target)
    alias_file = Path(registry) / "packages" / name / "aliases" / alias
    alias_file.parent.mkdir(parents=True, exist_ok=True)
    alias_file.write_text(version)
    return target



@contextlib.contextmanager
def serving(model, **options):
    """`elastify-device serve`'s server for `model` on a free port in a thread; yields the port."""
    from device_sdk.serve import make_server

    server = make_server(model, port=0, **options)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
