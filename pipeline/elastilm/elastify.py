"""Stage `elastify`: anchors, importance reorder, the level table, and the package (format v1).

After this stage every elastic tensor is stored unit-major (o_proj and down_proj transposed),
units sorted by descending importance, so every level is a contiguous prefix of every tensor.

The package is written one tensor at a time, read from the source's safetensors as it is needed
(`stream_elastic`), so the stage never holds the model, let alone two copies of it. The weights are
stored in `settings.dtype`: by default ("auto") the source's bf16/fp16, else fp32.

A level is a target fraction m of the decoder's elastic parameters. Anchor layers never
shrink, so the other layers keep `(m·L − A) / (L − A)` of their parameters (A anchors out of
L layers), as in ElastiLM: a level's size stays honest whether anchors are on or off.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from device_sdk.format import Architecture, Elastic, ElasticTensor, LevelShape, parse_levels
from device_sdk.package import StreamedWeights, write_package
from pipeline.elastilm.profile import Importance
from pipeline.errors import PipelineError
from pipeline.models.loading import SourceWeights, load_model, open_weights
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

# One decoder projection's weight or bias, by its state-dict name.
_PROJECTION = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.(weight|bias)")


def _unit_plan(arch: Architecture) -> dict[str, tuple[str, int, bool]]:
    """Per projection: (unit kind, stored rows per unit, stored transposed)."""
    q_rows, hd = arch.n_rep * arch.head_dim, arch.head_dim
    return {
        "q_proj": ("attn", q_rows, False),
        "k_proj": ("attn", hd, False),
        "v_proj": ("attn", hd, False),
        "o_proj": ("attn", q_rows, True),
        "gate_proj": ("mlp", 1, False),
        "up_proj": ("mlp", 1, False),
        "down_proj": ("mlp", 1, True),
    }


def package_layout(name: str, shape: list[int], arch: Architecture) -> tuple[str, list[int], ElasticTensor | None]:
    """Where a source tensor goes in the package, from its name and shape alone: (package name, stored shape,
    how its first axis is cut into units, or None for a tensor every level needs whole).

    o/down weights are stored transposed (`weight_t`, [in, out]); their output biases are not per unit.
    """
    match = _PROJECTION.fullmatch(name)
    plan = _unit_plan(arch)
    if match is None or match[2] not in plan:
        return name, list(shape), None  # embeddings, norms, the LM head
    layer, (unit, rows, transposed) = int(match[1]), plan[match[2]]
    if match[3] == "bias":
        return name, list(shape), None if transposed else ElasticTensor(layer=layer, unit=unit, rows_per_unit=rows,
                                                                        transposed=False)
    if transposed:
        return f"{name}_t", [shape[1], shape[0]], ElasticTensor(layer=layer, unit=unit, rows_per_unit=rows, transposed=True)
    return name, list(shape), ElasticTensor(layer=layer, unit=unit, rows_per_unit=rows, transposed=False)


def reorder_tensor(name: str, tensor: torch.Tensor, arch: Architecture, attn_orders: list[torch.Tensor],
                   mlp_orders: list[torch.Tensor], out: torch.Tensor | None = None) -> tuple[str, torch.Tensor]:
    """One source tensor as the package stores it: its layer's units permuted, o/down transposed, unit-major.

    `out`, a flat buffer of the tensor's dtype at least its size, receives the permuted tensor (a gather, so
    the result is the same bytes either way); without it the result is a new tensor.
    """
    package_name, stored_shape, spec = package_layout(name, list(tensor.shape), arch)
    if spec is None:
        return package_name, tensor
    stored = tensor.t() if spec.transposed else tensor
    if spec.unit == "attn":  # whole KV groups of rows move together
        stored, order = stored.reshape(arch.kv_heads, spec.rows_per_unit, *stored.shape[1:]), attn_orders[spec.layer]
    else:
        order = mlp_orders[spec.layer]
    target = None if out is None else out[: stored.numel()].view(stored.shape)
    permuted = torch.index_select(stored, 0, order, out=target) if target is not None else stored[order]
    return package_name, permuted.reshape(stored_shape).contiguous()


def reorder_state(
    state: dict[str, torch.Tensor], arch: Architecture, attn_orders: list[torch.Tensor], mlp_orders: list[torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, ElasticTensor]]:
    """Permute every layer's units and lay the elastic tensors out unit-major, all in memory.

    Returns the new tensor dict (o/down renamed `weight_t`, stored [in, out]) and, for each
    elastic tensor, how its first axis is cut into units.
    """
    out: dict[str, torch.Tensor] = {}
    layout: dict[str, ElasticTensor] = {}
    for name, tensor in state.items():
        package_name, stored = reorder_tensor(name, tensor, arch, attn_orders, mlp_orders)
        out[package_name] = stored
        if (spec := package_layout(name, list(tensor.shape), arch)[2]) is not None:
            layout[package_name] = spec
    return out, layout


# --------------------------------------------------------------------------- the stage


def package_dtype(setting: str, source: torch.dtype) -> torch.dtype:
    """The package's weight dtype: the setting's, or for "auto" the source's when it is bf16/fp16, else fp32."""
    if setting == "auto":
        return source if source in (torch.bfloat16, torch.float16) else torch.float32
    return DTYPES[setting]


def _elastic_section(arch: Architecture, importance: Importance, settings: ElastifySettings,
                     layout: dict[str, ElasticTensor]) -> Elastic:
    if len(importance.attn) != arch.layers:
        raise ElastifyError(f"importance covers {len(importance.attn)} layers, the model has {arch.layers}")
    anchors = choose_anchors(importance.layers, settings.anchor_fraction)
    return Elastic(
        anchor_layers=anchors,
        attn_units=[arch.kv_heads] * arch.layers,
        mlp_units=[arch.intermediate] * arch.layers,
        levels=level_table(arch, anchors, settings),
        tensors=layout,
        importance={**importance.meta, "order": settings.order, "anchor_fraction": settings.anchor_fraction},
    )


def _source_shapes(shapes: dict[str, list[int]], arch: Architecture) -> dict[str, list[int]]:
    """The source tensors the package keeps: a tied LM head is the embedding, stored once."""
    return {k: v for k, v in shapes.items() if not (arch.tie_word_embeddings and k == "lm_head.weight")}


def build_elastic(model, arch: Architecture, importance: Importance, settings: ElastifySettings):
    """The package's tensors (unit-major, in the package dtype) and its `elastic` manifest section, in memory:
    for tests and benches that run the reordered model. The stage streams instead (`stream_elastic`)."""
    if len(importance.attn) != arch.layers:
        raise ElastifyError(f"importance covers {len(importance.attn)} layers, the model has {arch.layers}")
    attn_orders, mlp_orders = unit_orders(importance, settings.order, settings.seed)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    state = {k: state[k] for k in _source_shapes({k: list(v.shape) for k, v in state.items()}, arch)}
    tensors, layout = reorder_state(state, arch, attn_orders, mlp_orders)
    dtype = package_dtype(settings.dtype, next(model.parameters()).dtype)
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    return tensors, _elastic_section(arch, importance, settings, layout)


def stream_elastic(shapes: dict[str, list[int]], read: Callable[[str], torch.Tensor], source_dtype: torch.dtype,
                   arch: Architecture, importance: Importance, settings: ElastifySettings,
                   ctx: StageContext | None = None) -> tuple[StreamedWeights, Elastic]:
    """`build_elastic`, one tensor at a time: the package's tensors as `StreamedWeights` that read each source
    tensor (`read(name)`) only when the writer asks for it, reorder and convert it, and let it go.

    Memory: two buffers the size of the largest tensor (permuted, converted) and `read`'s own, whatever the
    model's size. A tensor `make` returns is overwritten by the next call: the writer writes it first.
    """
    attn_orders, mlp_orders = unit_orders(importance, settings.order, settings.seed)
    kept = _source_shapes(shapes, arch)
    source_of, package_shapes, layout = {}, {}, {}
    for name, shape in kept.items():
        package_name, stored_shape, spec = package_layout(name, shape, arch)
        source_of[package_name], package_shapes[package_name] = name, stored_shape
        if spec is not None:
            layout[package_name] = spec
    dtype = package_dtype(settings.dtype, source_dtype)
    elastic = _elastic_section(arch, importance, settings, layout)
    largest = max(math.prod(shape) for shape in kept.values())
    buffers: dict[torch.dtype, torch.Tensor] = {}  # by dtype: one for the permuted tensor, one for the converted

    def buffer(of: torch.dtype) -> torch.Tensor:
        if of not in buffers:
            buffers[of] = torch.empty(largest, dtype=of)
        return buffers[of]

    def make(package_name: str) -> torch.Tensor:
        name = source_of[package_name]
        tensor = read(name).detach()
        permuted = reorder_tensor(name, tensor, arch, attn_orders, mlp_orders, out=buffer(tensor.dtype))[1]
        if permuted.dtype == dtype:
            return permuted
        return buffer(dtype)[: permuted.numel()].view(permuted.shape).copy_(permuted)

    def progress(done: int, total: int) -> None:
        if ctx is not None:
            ctx.report("write package", done, total)

    return StreamedWeights(dtype=dtype, shapes=package_shapes, make=make, progress=progress), elastic


def _write(out_dir: Path, weights: StreamedWeights, elastic: Elastic, arch: Architecture, config: dict, tokenizer, *,
           name: str, version: str, source: dict | None, build_id: str | None, overwrite: bool):
    config = dict(config)
    config.pop("quantization_config", None)
    config.pop("torch_dtype", None)
    config["dtype"] = str(weights.dtype).removeprefix("torch.")  # what the package stores, not what the source did
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        tokenizer.save_pretrained(tokenizer_dir)
        model_files: dict[str, Path | bytes] = {"config.json": json.dumps(config, indent=2).encode()}
        for filename in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / filename).is_file():
                model_files[filename] = Path(tokenizer_dir) / filename
        return write_package(
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
            weights=weights,
            model_files=model_files,
            overwrite=overwrite,
        )


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
    """Reorder a loaded `model`'s weights and write the v1 package to `out_dir` atomically.

    Its tensors are reordered and written one at a time, so memory holds the model and one tensor more.
    """
    state = model.state_dict()
    weights, elastic = stream_elastic({k: list(v.shape) for k, v in state.items()}, state.__getitem__,
                                      next(model.parameters()).dtype, arch, importance, settings, ctx)
    return _write(out_dir, weights, elastic, arch, model.config.to_dict(), tokenizer, name=name, version=version,
                  source=source, build_id=build_id, overwrite=overwrite)


def elastify_source(
    source: SourceWeights,
    importance: Importance,
    settings: ElastifySettings,
    out_dir: Path,
    *,
    name: str = "model",
    version: str = "0.0.0",
    build_id: str | None = None,
    ctx: StageContext | None = None,
    overwrite: bool = False,
):
    """`elastify` straight from the source's safetensors, tensor by tensor: the model is never loaded."""
    weights, elastic = stream_elastic(source.shapes, source.tensor, source.dtype, source.architecture, importance,
                                      settings, ctx)
    return _write(out_dir, weights, elastic, source.architecture, source.config.to_dict(), source.tokenizer,
                  name=name, version=version, source=source.source, build_id=build_id, overwrite=overwrite)


def run(inputs: dict[str, Path], settings: ElastifySettings, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"model", "importance"} -> outputs {"package": dir}; ctx.runtime may give the build_id.

    An HF directory with safetensors is read a tensor at a time (peak memory: a few tensors); any other
    source (GGUF, .bin) is loaded whole first. The reorder is a gather with no arithmetic, so it runs on the
    CPU even where the task holds a GPU: the copy there and back would cost more than the gather.
    """
    importance = Importance.load(Path(inputs["importance"]))
    out = ctx.work_dir / "package"
    common = dict(name=settings.name, version=settings.version, build_id=ctx.runtime.get("build_id"), ctx=ctx,
                  overwrite=True)
    with open_weights(inputs["model"]) as source:
        if source is not None:
            elastify_source(source, importance, settings, out, **common)
            return {"package": out}
    loaded = load_model(inputs["model"])
    elastify(loaded.model, loaded.tokenizer, loaded.architecture, importance, settings, out, source=loaded.source,
             **common)
    return {"package": out}
