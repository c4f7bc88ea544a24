"""Stage `elastify`: anchors, importance reorder, the level table, and the package (format v1).

After this stage every elastic tensor is stored unit-major (o_proj and down_proj transposed),
units sorted by descending importance, so every level is a contiguous prefix of every tensor.

A level is a target fraction m of the decoder's elastic parameters. Anchor layers never
shrink, so the other layers keep `(m·L − A) / (L − A)` of their parameters (A anchors out of
L layers), as in ElastiLM: a level's size stays honest whether anchors are on or off.
"""

from __future__ import annotations

import json
import math
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch

from device_sdk.format import Architecture, Elastic, ElasticTensor, LevelShape, parse_levels
from device_sdk.package import write_package
from pipeline.elastilm.profile import Importance
from pipeline.errors import PipelineError
from pipeline.models.loading import load_model
from pipeline.settings import ElastifySettings
from pipeline.stage import StageContext

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ElastifyError(PipelineError):
    """Settings that cannot produce a valid elastic package."""


# --------------------------------------------------------------------------- decisions


def choose_anchors(layer_scores: torch.Tensor, fraction: float) -> list[int]:
    count = math.floor(fraction * len(layer_scores) + 0.5)
    ranked = torch.argsort(layer_scores, descending=True, stable=True)
    return sorted(ranked[:count].tolist())


def unit_orders(importance: Importance, order: str, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the permutation that puts units in descending importance (or a seeded shuffle)."""
    if order == "random":
        generator = torch.Generator().manual_seed(seed)
        return (
            [torch.randperm(len(s), generator=generator) for s in importance.attn],
            [torch.randperm(len(s), generator=generator) for s in importance.mlp],
        )
    return (
        [torch.argsort(s, descending=True, stable=True) for s in importance.attn],
        [torch.argsort(s, descending=True, stable=True) for s in importance.mlp],
    )


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def kept_units(total: int, keep_ratio: float, min_units: int, align: int = 1) -> int:
    if keep_ratio >= 1.0:
        return total
    step = min(align, total)
    kept = _round_half_up(keep_ratio * total / step) * step
    return min(total, max(kept, min_units, step))


def unit_params(arch: Architecture) -> tuple[int, int]:
    """Parameters in one KV group (q/k/v rows, o columns, biases) and in one MLP neuron."""
    h, hd, n_rep = arch.hidden, arch.head_dim, arch.n_rep
    per_group = h * hd * (2 * n_rep + 2) + (hd * (n_rep + 2) if arch.attention_bias else 0)
    per_neuron = 3 * h + (2 if arch.mlp_bias else 0)
    return per_group, per_neuron


def active_params(arch: Architecture, attn_units: list[int], mlp_units: list[int]) -> int:
    """Parameters multiplied per token: kept decoder weights, norms and the LM head."""
    per_group, per_neuron = unit_params(arch)
    total = arch.vocab * arch.hidden + arch.hidden  # LM head + final norm
    for groups, neurons in zip(attn_units, mlp_units, strict=True):
        total += groups * per_group + neurons * per_neuron + 2 * arch.hidden
    return total


def layer_widths(arch: Architecture, keep: float, settings: ElastifySettings) -> tuple[int, int]:
    """(KV groups, neurons) holding `keep` of one layer's elastic parameters.

    Attention moves in whole KV groups (SmolLM2 has only 3), so it is rounded first (up by
    default) and the MLP, which moves in `align`-neuron steps, takes up the rest of the layer's
    budget. Up, because removing a group costs the loss more than its parameters' worth of
    neurons (bench/bench_recovery.py compares the two at equal size).
    """
    if keep >= 1.0:
        return arch.kv_heads, arch.intermediate
    per_group, per_neuron = unit_params(arch)
    if settings.attn_rounding == "whole":
        groups = arch.kv_heads
    elif settings.attn_rounding == "up":
        groups = min(arch.kv_heads, max(math.ceil(keep * arch.kv_heads - 1e-9), settings.min_units))
    else:
        groups = kept_units(arch.kv_heads, keep, settings.min_units)
    budget = keep * (arch.kv_heads * per_group + arch.intermediate * per_neuron) - groups * per_group
    neuron_ratio = max(0.0, budget) / (per_neuron * arch.intermediate)
    return groups, kept_units(arch.intermediate, min(neuron_ratio, 1.0), settings.min_units, settings.align)


def level_table(arch: Architecture, anchors: list[int], settings: ElastifySettings) -> list[LevelShape]:
    """Per-level kept units. Level m targets m of the decoder's elastic parameters; anchors
    stay whole, so the other layers keep (m·L − A)/(L − A) each. A layer never keeps fewer
    units at a higher level, so every level's units are a prefix of the next level's."""
    n_layers, n_anchor = arch.layers, len(anchors)
    full = active_params(arch, [arch.kv_heads] * n_layers, [arch.intermediate] * n_layers)
    levels: list[LevelShape] = []
    for level in parse_levels(settings.levels):
        ratio = level.ratio
        keep = 1.0 if ratio >= 1.0 else max(0.0, (ratio * n_layers - n_anchor) / (n_layers - n_anchor))
        attn, mlp = [], []
        for layer in range(n_layers):
            groups, neurons = layer_widths(arch, 1.0 if layer in anchors else keep, settings)
            if levels:  # nest: at least what the level below keeps
                groups = max(groups, levels[-1].attn_units[layer])
                neurons = max(neurons, levels[-1].mlp_units[layer])
            attn.append(groups)
            mlp.append(neurons)
        count = active_params(arch, attn, mlp)
        levels.append(
            LevelShape(
                name=level.name,
                ratio=level.ratio,
                attn_units=attn,
                mlp_units=mlp,
                active_params=count,
                active_fraction=round(count / full, 6),
            )
        )
    return levels


# --------------------------------------------------------------------------- reorder


def _prefix(layer: int, proj: str) -> str:
    kind = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{kind}.{proj}"


def reorder_state(
    state: dict[str, torch.Tensor], arch: Architecture, attn_orders: list[torch.Tensor], mlp_orders: list[torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, ElasticTensor]]:
    """Permute every layer's units and lay the elastic tensors out unit-major.

    Returns the new tensor dict (o/down renamed `weight_t`, stored [in, out]) and, for each
    elastic tensor, how its first axis is cut into units.
    """
    q_rows, hd = arch.n_rep * arch.head_dim, arch.head_dim
    out = {k: v for k, v in state.items() if ".layers." not in k}
    layout: dict[str, ElasticTensor] = {}
    for layer in range(arch.layers):
        a_order, m_order = attn_orders[layer], mlp_orders[layer]

        def by_group(t: torch.Tensor, rows: int, order: torch.Tensor = a_order) -> torch.Tensor:
            return t.reshape(arch.kv_heads, rows, *t.shape[1:])[order].reshape(t.shape)

        plan = {
            "q_proj": ("attn", q_rows, False),
            "k_proj": ("attn", hd, False),
            "v_proj": ("attn", hd, False),
            "o_proj": ("attn", q_rows, True),
            "gate_proj": ("mlp", 1, False),
            "up_proj": ("mlp", 1, False),
            "down_proj": ("mlp", 1, True),
        }
        for proj, (unit, rows, transposed) in plan.items():
            base = _prefix(layer, proj)
            weight = state[f"{base}.weight"]
            weight = weight.t() if transposed else weight
            weight = by_group(weight, rows) if unit == "attn" else weight[m_order]
            name = f"{base}.weight_t" if transposed else f"{base}.weight"
            out[name] = weight.contiguous()
            layout[name] = ElasticTensor(layer=layer, unit=unit, rows_per_unit=rows, transposed=transposed)
            bias = state.get(f"{base}.bias")
            if bias is None:
                continue
            if transposed:  # an output bias of o/down is not per-unit; it stays whole
                out[f"{base}.bias"] = bias
            else:
                out[f"{base}.bias"] = (by_group(bias, rows) if unit == "attn" else bias[m_order]).contiguous()
                layout[f"{base}.bias"] = ElasticTensor(layer=layer, unit=unit, rows_per_unit=rows, transposed=False)
        for key, value in state.items():
            if key.startswith(f"model.layers.{layer}.") and "_proj." not in key:
                out[key] = value  # norms
    return out, layout


# --------------------------------------------------------------------------- the stage


def build_elastic(model, arch: Architecture, importance: Importance, settings: ElastifySettings):
    """The package's tensors (unit-major, in the package dtype) and its `elastic` manifest section."""
    if len(importance.attn) != arch.layers:
        raise ElastifyError(f"importance covers {len(importance.attn)} layers, the model has {arch.layers}")
    anchors = choose_anchors(importance.layers, settings.anchor_fraction)
    attn_orders, mlp_orders = unit_orders(importance, settings.order, settings.seed)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if arch.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors, layout = reorder_state(state, arch, attn_orders, mlp_orders)
    dtype = DTYPES[settings.dtype]
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    elastic = Elastic(
        anchor_layers=anchors,
        attn_units=[arch.kv_heads] * arch.layers,
        mlp_units=[arch.intermediate] * arch.layers,
        levels=level_table(arch, anchors, settings),
        tensors=layout,
        importance={**importance.meta, "order": settings.order, "anchor_fraction": settings.anchor_fraction},
    )
    return tensors, elastic


def elastify(
    model,
    tokenizer,
    arch: Architecture,
    importance: Importance,
    settings: ElastifySettings,
    out_dir: Path,
    *,
    name: str = "model",
    version: str = "0.0.0",
    source: dict | None = None,
    build_id: str | None = None,
    ctx: StageContext | None = None,
    overwrite: bool = False,
):
    """Reorder `model`'s weights and write the v1 package to `out_dir` atomically."""
    tensors, elastic = build_elastic(model, arch, importance, settings)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    if ctx is not None:
        ctx.report("write package", 0, 1)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        tokenizer.save_pretrained(tokenizer_dir)
        model_files: dict[str, Path | bytes] = {"config.json": json.dumps(config, indent=2).encode()}
        for filename in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / filename).is_file():
                model_files[filename] = Path(tokenizer_dir) / filename
        manifest = write_package(
            out_dir,
            manifest_fields={
                "name": name,
                "version": version,
                "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "build_id": build_id,
                "source": source or {},
            },
            architecture=arch,
            elastic=elastic,
            weights=tensors,
            model_files=model_files,
            overwrite=overwrite,
        )
    if ctx is not None:
        ctx.report("write package", 1, 1)
    return manifest


def run(inputs: dict[str, Path], settings: ElastifySettings, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"model", "importance"} -> outputs {"package": dir}; ctx.runtime may give the build_id."""
    loaded = load_model(inputs["model"])
    out = ctx.work_dir / "package"
    elastify(
        loaded.model,
        loaded.tokenizer,
        loaded.architecture,
        Importance.load(Path(inputs["importance"])),
        settings,
        out,
        name=settings.name,
        version=settings.version,
        build_id=ctx.runtime.get("build_id"),
        source=loaded.source,
        ctx=ctx,
        overwrite=True,
    )
    return {"package": out}

