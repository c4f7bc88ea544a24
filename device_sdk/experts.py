"""CLONE's LoRA-MoE on the device: route a prompt to task experts and mix their LoRAs.

Each expert is a LoRA trained at full width on one task; the package stores it unit-major like
a recovery adapter (A [r, in], B [out, r]), so at a smaller width it is cut to the active prefix
exactly as the base weights are. The router embeds the prompt with the packaged MiniLM
(`device_sdk.encoder.MiniLMEncoder`, the same code that computed the task centroids at build
time) and weighs expert i by

    soft:    softmax_i(cos(e, c_i) / τ)           (the default)
    top1:    1 for the nearest centroid, else 0   (ablation)
    uniform: 1/K for every expert                 (ablation)

The mixture Σ wᵢ·Bᵢ·Aᵢ·x is one LoRA of rank Σ rᵢ: A stacked, B stacked with wᵢ·scaleᵢ folded in,
so the forward pass is unchanged. The level's recovery adapter, if any, joins with weight 1.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from device_sdk.encoder import MiniLMEncoder
from device_sdk.format import Manifest, PackageError, expert_entries
from device_sdk.lora import LoRA, read_adapter

MODES = ("soft", "top1", "uniform")


class ExpertRouter:
    """Weights over experts from a prompt embedding and the task centroids."""

    def __init__(self, names: list[str], centroids: torch.Tensor, temperature: float = 0.05):
        if not names:
            raise ValueError("the expert set is empty: a router needs at least one expert (name and centroid)")
        if centroids.dim() != 2 or centroids.shape[0] != len(names):
            raise ValueError(f"need one centroid per expert: {len(names)} names, centroids {tuple(centroids.shape)}")
        if not temperature > 0:
            raise ValueError(f"the temperature must be positive, got {temperature}")
        self.names = list(names)
        self.centroids = F.normalize(centroids.float(), dim=-1)
        self.temperature = temperature

    def weights(self, embeddings: torch.Tensor, mode: str = "soft") -> torch.Tensor:
        """[B, K] (or [K] for one embedding) routing weights that sum to 1."""
        if mode not in MODES:
            raise ValueError(f"routing mode must be one of {MODES}, not {mode!r}")
        single = embeddings.dim() == 1
        cos = F.normalize(embeddings.float().reshape(-1, self.centroids.shape[1]), dim=-1) @ self.centroids.T
        if mode == "soft":
            weights = torch.softmax(cos / self.temperature, dim=-1)
        elif mode == "top1":
            weights = F.one_hot(cos.argmax(-1), len(self.names)).float()
        else:
            weights = torch.full_like(cos, 1.0 / len(self.names))
        return weights[0] if single else weights

    def route(self, embeddings: torch.Tensor) -> list[str]:
        """The nearest expert of each embedding."""
        cos = F.normalize(embeddings.float().reshape(-1, self.centroids.shape[1]), dim=-1) @ self.centroids.T
        return [self.names[i] for i in cos.argmax(-1).tolist()]


def fit_to_width(lora: LoRA, unit_axis: str, active_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-width LoRA cut to a projection's active prefix (outputs of row-unit, inputs of column-unit)."""
    a, b, _ = lora
    return (a, b[:active_rows]) if unit_axis == "out" else (a[:, :active_rows], b)


def mix(loras: list[LoRA], weights: list[float]) -> LoRA | None:
    """Σ wᵢ·scaleᵢ·Bᵢ·Aᵢ as one stacked LoRA with scale 1; None when every weight is zero."""
    kept = [(lora, w) for lora, w in zip(loras, weights, strict=True) if w != 0.0]
    if not kept:
        return None
    a = torch.cat([lora[0] for lora, _ in kept], dim=0)
    b = torch.cat([lora[1] * (w * lora[2]) for lora, w in kept], dim=1)
    return a, b, 1.0


class ExpertSet:
    """A package's experts, router and encoder, loaded once; `apply` sets a prompt's mixture on a model."""

    def __init__(self, router: ExpertRouter, adapters: dict[str, dict[str, LoRA]], encoder=None):
        self.router = router
        self.adapters = adapters  # expert name -> projection name -> LoRA
        self.encoder = encoder

    @classmethod
    def load(cls, package_dir: Path, manifest: Manifest) -> ExpertSet:
        entries = expert_entries(manifest)
        if not entries:
            raise PackageError("this package has no experts")
        router = ExpertRouter([e.name for e in entries], torch.tensor([e.centroid for e in entries]),
                              float(manifest.experts.get("temperature", 0.05)))
        adapters = {e.name: read_adapter(Path(package_dir) / e.adapter) for e in entries}
        encoder = MiniLMEncoder.load(Path(package_dir) / manifest.experts["encoder"])
        return cls(router, adapters, encoder)

    def weights_for(self, prompt: str, mode: str = "soft") -> dict[str, float]:
        embedding = self.encoder.embed([prompt])[0]
        return dict(zip(self.router.names, self.router.weights(embedding, mode).tolist(), strict=True))

    def apply(self, switch_plan, weights: dict[str, float], base: dict[str, LoRA]) -> None:
        """Give every projection the weighted mixture (plus `base`, the level's adapter) at its current width."""
        for projections in switch_plan:
            for name, proj, _ in projections:
                linear = proj.linear
                parts, part_weights = [], []
                if name in base:
                    parts.append(base[name])
                    part_weights.append(1.0)
                for expert, weight in weights.items():
                    lora = self.adapters[expert].get(name)
                    if lora is not None and weight:
                        a, b = fit_to_width(lora, linear.unit_axis, linear.active_rows)
                        parts.append((a, b, lora[2]))
                        part_weights.append(weight)
                proj.__dict__["lora"] = mix(parts, part_weights) if parts else None
