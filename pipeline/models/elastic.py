"""The pipeline's two views of an elastic package: serving (the device's model) and training (HF).

`serving_model` is the device SDK's `ElasticModel` itself, so every stage that only runs the
model (evaluate, latency, label, clone-collect/search) measures exactly what a device runs.

`ElasticCausalLM` is the training view, for stages that need autograd through HF modules and
peft (recover, experts, the TLM's LLM-derived labels): an HF skeleton whose projections are
`device_sdk.ElasticLinear`s sharing the package's tensors; `set_widths` / `set_level` only move
views. Width 0 skips a sub-layer: the attention or MLP adds nothing to the residual stream.
The LoRA both views carry is defined once, in `device_sdk.lora`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from device_sdk.elastic import ElasticLinear, LevelCursor
from device_sdk.format import WEIGHTS, Architecture, Elastic, Manifest, read_manifest
from device_sdk.lora import ATTN_PROJECTIONS as ATTN_PROJ
from device_sdk.lora import MLP_PROJECTIONS as MLP_PROJ
from device_sdk.runtime import ElasticModel


def serving_model(package_dir: Path) -> ElasticModel:
    """The device SDK's model of a package, with every level's LoRA, on the native kernels and decoder
    where they build. Pipeline packages are unsigned work in progress that this build just wrote, so
    they are loaded with the explicit opt-in for unsigned packages and without hashing."""
    return ElasticModel.load(Path(package_dir), verify=False, allow_unsigned=True)


class ElasticAttention(nn.Module):
    """Wraps an HF attention module; with zero KV groups it contributes nothing."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        # The q projection's width says whether attention runs at all. Held outside the module
        # registry: `inner` owns it, and a LoRA wrapper may later take its place there.
        self.__dict__["width_source"] = inner.q_proj

    def forward(self, hidden_states, *args, **kwargs):
        if self.__dict__["width_source"].units == 0:
            return torch.zeros_like(hidden_states), None
        return self.inner(hidden_states, *args, **kwargs)


class ElasticCausalLM(nn.Module):
    """An HF causal LM whose layers can each run at any prefix width."""

    def __init__(self, model: nn.Module, arch: Architecture, elastic: Elastic, tensors: Mapping[str, torch.Tensor]):
        super().__init__()
        self.hf = model
        self.arch = arch
        self.elastic = elastic
        self.__dict__["level"] = None  # name of the current level; None after set_widths
        # Every layer prepares its views for every level up front, so set_level is one write.
        self.cursor = LevelCursor()
        self.level_index = {level.name: i for i, level in enumerate(elastic.levels)}
        q_rows = arch.n_rep * arch.head_dim
        unit_rows = {"q_proj": q_rows, "k_proj": arch.head_dim, "v_proj": arch.head_dim, "o_proj": q_rows}
        for index, layer in enumerate(model.model.layers):
            groups = [level.attn_units[index] for level in elastic.levels]
            neurons = [level.mlp_units[index] for level in elastic.levels]
            attn = layer.self_attn
            for proj in ATTN_PROJ:
                linear = _elastic(tensors, f"model.layers.{index}.self_attn.{proj}", unit_rows[proj])
                linear.bind_levels(self.cursor, groups)
                setattr(attn, proj, linear)
            layer.self_attn = ElasticAttention(attn)
            for proj in MLP_PROJ:
                linear = _elastic(tensors, f"model.layers.{index}.mlp.{proj}", 1)
                linear.bind_levels(self.cursor, neurons)
                setattr(layer.mlp, proj, linear)

    # -- construction ------------------------------------------------------------------

    @classmethod
    def from_package(cls, package_dir: Path, manifest: Manifest | None = None,
                     device: str | torch.device = "cpu") -> ElasticCausalLM:
        """Build an HF skeleton on the meta device and fill it with the package's tensors (loaded onto `device`)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        package_dir = Path(package_dir)
        manifest = manifest or read_manifest(package_dir)
        config = AutoConfig.from_pretrained(str(package_dir / "model"))
        tensors = load_file(str(package_dir / WEIGHTS), device=str(device))
        dtype = next(iter(tensors.values())).dtype
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        plain = {k: v for k, v in tensors.items() if k not in manifest.elastic.tensors and "_proj." not in k}
        model.load_state_dict(plain, strict=False, assign=True)
        if manifest.architecture.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        # Rotary frequencies are buffers computed at init, so rebuild them off the meta device.
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(device)
        model.eval()
        elastic = cls(model, manifest.architecture, manifest.elastic, tensors)
        _check_materialised(elastic)
        return elastic

    # -- switching ---------------------------------------------------------------------

    def set_widths(self, attn_units: list[int], mlp_units: list[int]) -> None:
        """Per-layer widths in units; O(layers), no weight data is copied."""
        if len(attn_units) != self.arch.layers or len(mlp_units) != self.arch.layers:
            raise ValueError(f"need one width per layer ({self.arch.layers})")
        self.cursor.index = -1
        for layer, groups, neurons in zip(self.hf.model.layers, attn_units, mlp_units, strict=True):
            for proj in ATTN_PROJ:
                getattr(layer.self_attn.inner, proj).set_width(groups)
            for proj in MLP_PROJ:
                getattr(layer.mlp, proj).set_width(neurons)
        self.__dict__["level"] = None

    def set_level(self, level: str | float) -> None:
        """Switch every layer to a level of the manifest: one write, O(1)."""
        name = level if level in self.level_index else self.elastic.level(level).name
        self.cursor.index = self.level_index[name]
        self.__dict__["level"] = name  # skips nn.Module.__setattr__'s checks on this hot path

    def elastic_linears(self) -> list[ElasticLinear]:
        return [m for m in self.hf.modules() if isinstance(m, ElasticLinear)]

    # -- running -----------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, **kwargs):
        return self.hf(input_ids=input_ids, **kwargs)

    # The base model and LM head, so LM-loss helpers treat this like any HF causal LM.
    @property
    def model(self) -> nn.Module:
        return self.hf.model

    @property
    def lm_head(self) -> nn.Module:
        return self.hf.lm_head

    @property
    def config(self):
        return self.hf.config


def _elastic(tensors: Mapping[str, torch.Tensor], base: str, rows_per_unit: int) -> ElasticLinear:
    if f"{base}.weight_t" in tensors:
        return ElasticLinear(tensors[f"{base}.weight_t"], tensors.get(f"{base}.bias"), unit_axis="in", unit_size=rows_per_unit)
    return ElasticLinear(tensors[f"{base}.weight"], tensors.get(f"{base}.bias"), unit_axis="out", unit_size=rows_per_unit)


def _check_materialised(model: nn.Module) -> None:
    meta = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise ValueError(f"package is missing tensors for: {meta[:5]}{' …' if len(meta) > 5 else ''}")
