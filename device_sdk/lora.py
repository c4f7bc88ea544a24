"""A package's LoRA adapters, defined once: which projections, tensor names, layout and scale.

A recovery adapter (`adapters/recovery/<level>.safetensors`) or a CLONE expert holds, for each
adapted projection `model.layers.<i>.self_attn.{q,k,v,o}_proj` / `model.layers.<i>.mlp.{gate,up,down}_proj`,
the tensors `<projection>.lora_A` [r, in_active] and `<projection>.lora_B` [out_active, r], cut
unit-major like the weights, and the metadata `rank`, `alpha` and `scale` (= alpha / rank). The
adapted projection computes `y = W·x + scale · B·(A·x)`.

The recover stage trains these through peft on the pipeline's HF view and saves them with
`adapter_metadata` and `projection_key`; the device (and every pipeline stage that evaluates)
reads them with `read_adapter`. An adapter without a readable scale is an error, never a guess.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from device_sdk.format import PackageError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # of each block
ATTN_PROJECTIONS = PROJECTIONS[:4]
MLP_PROJECTIONS = PROJECTIONS[4:]
LoRA = tuple[torch.Tensor, torch.Tensor, float]  # (A [r, in_active], B [out_active, r], scale)


class AdapterError(PackageError):
    """An adapter file whose tensors or metadata do not follow the package's LoRA format."""


def projection_key(layer: int, projection: str) -> str:
    """`model.layers.<layer>.self_attn.q_proj` …: the name an adapter's tensors are stored under."""
    if projection not in PROJECTIONS:
        raise ValueError(f"{projection!r} is not one of {PROJECTIONS}")
    kind = "self_attn" if projection in ATTN_PROJECTIONS else "mlp"
    return f"model.layers.{layer}.{kind}.{projection}"


def canonical_key(module_name: str) -> str:
    """The projection key of a module name from any wrapper (peft's `base_model.model.…`,
    the pipeline's `self_attn.inner.`): everything from `model.layers.` on, wrappers removed."""
    start = module_name.find("model.layers.")
    if start < 0:
        raise AdapterError(f"{module_name!r} names no decoder layer")
    return module_name[start:].replace(".self_attn.inner.", ".self_attn.")


def tensor_names(key: str) -> tuple[str, str]:
    """The stored names of a projection's A and B."""
    return f"{key}.lora_A", f"{key}.lora_B"


def lora_scale(rank: int, alpha: float) -> float:
    return float(alpha) / int(rank)


def adapter_metadata(rank: int, alpha: float, **extra: str) -> dict[str, str]:
    """The safetensors metadata every adapter carries (plus e.g. its level or expert name)."""
    return {"rank": str(int(rank)), "alpha": str(float(alpha)), "scale": str(lora_scale(rank, alpha)), **extra}


def adapter_scale(meta: Mapping[str, str], where: str) -> float:
    """The scale of an adapter from its metadata: `scale`, else `alpha / rank`; anything else is an error."""
    try:
        if "scale" in meta:
            scale = float(meta["scale"])
        elif "alpha" in meta and "rank" in meta:
            scale = lora_scale(int(meta["rank"]), float(meta["alpha"]))
        else:
            raise AdapterError(f"{where} has neither `scale` nor `alpha` and `rank` in its metadata")
    except (TypeError, ValueError, ZeroDivisionError) as err:
        if isinstance(err, AdapterError):
            raise
        raise AdapterError(f"{where}: unreadable LoRA scale in metadata {dict(meta)} ({err})") from None
    if not math.isfinite(scale):
        raise AdapterError(f"{where}: LoRA scale {scale} is not finite")
    return scale


def read_adapter(path: Path) -> dict[str, LoRA]:
    """Projection key -> (A, B, scale) of an adapter file, in fp32."""
    path = Path(path)
    with safe_open(str(path), framework="pt") as handle:
        scale = adapter_scale(handle.metadata() or {}, path.name)
        names = set(handle.keys())
        pairs = {}
        for name in sorted(names):
            if not name.endswith(".lora_A"):
                continue
            key = name.removesuffix(".lora_A")
            a_name, b_name = tensor_names(key)
            if b_name not in names:
                raise AdapterError(f"{path.name}: {a_name} has no {b_name}")
            a, b = handle.get_tensor(a_name).float(), handle.get_tensor(b_name).float()
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise AdapterError(f"{path.name}: {key} has A {tuple(a.shape)} and B {tuple(b.shape)}, not [r, in], [out, r]")
            pairs[key] = (a, b, scale)
    if not pairs:
        raise AdapterError(f"{path.name} holds no lora_A/lora_B pairs")
    return pairs


def lora_delta(x: torch.Tensor, lora: LoRA) -> torch.Tensor:
    """What the adapter adds to a projection's output: scale · B·(A·x)."""
    a, b, scale = lora
    return (x @ a.T) @ b.T * scale
