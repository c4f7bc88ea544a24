"""Stage `profile`: how much each unit and each layer matters to the LM loss.

Unit importance is first-order Taylor over a unit's weights: `Σ|w·∂L/∂w|` (param_first) or
`|Σ w·∂L/∂w|` (vectorize), L the mean LM loss over all calibration windows in one backward.
Each weight's gradient is folded into unit scores by a hook the moment it is accumulated and
then freed, and decoder layers are checkpointed, so memory stays close to inference.

Neurons can instead be ranked by activation (`mlp_method="activation"`): Minitron's criterion, the
size of what a neuron feeds down_proj on calibration text, from forward passes alone.

Layer importance is the loss increase when a layer is skipped (leave-one-out), or ShortGPT's
block influence `1 − cos(h_in, h_out)` as the cheap option. KV groups can be ranked the same
leave-one-out way (`attn_method="loo"`): with only a few groups per layer, the first-order
estimate often keeps the wrong one.

The model runs where the stage was placed (`ctx.device`), in its stored dtype and the precision
`pipeline.models.precision.model_precision` picks for it there; scores accumulate in fp64.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from device_sdk.format import Architecture, atomic_write_bytes
from pipeline.data.calibration import make_windows
from pipeline.models.loading import load_model
from pipeline.models.precision import model_precision
from pipeline.models.scoring import nll_from_hidden, nll_sum
from pipeline.settings import ProfileSettings
from pipeline.stage import StageContext

IMPORTANCE_FILE = "importance.safetensors"


@dataclass
class Importance:
    attn: list[torch.Tensor]  # per layer: one score per KV group
    mlp: list[torch.Tensor]  # per layer: one score per neuron
    layers: torch.Tensor  # one score per layer; larger = more important
    meta: dict

    def save(self, path: Path) -> None:
        tensors = {f"attn.{i}": t.contiguous() for i, t in enumerate(self.attn)}
        tensors |= {f"mlp.{i}": t.contiguous() for i, t in enumerate(self.mlp)}
        tensors["layers"] = self.layers.contiguous()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp), metadata={"meta": json.dumps(self.meta)})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Importance:
        from safetensors import safe_open

        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as handle:
            meta = json.loads(handle.metadata()["meta"])
        layers = tensors["layers"]
        return cls(
            attn=[tensors[f"attn.{i}"] for i in range(len(layers))],
            mlp=[tensors[f"mlp.{i}"] for i in range(len(layers))],
            layers=layers,
            meta=meta,
        )


# --------------------------------------------------------------------------- unit importance


def _unit_reducers(layer, arch: Architecture) -> dict[torch.nn.Parameter, tuple[str, callable]]:
    """Map each parameter of a layer to (unit kind, fn from w·g to one value per unit)."""
    n_kv, q_rows = arch.kv_heads, arch.n_rep * arch.head_dim
    attn, mlp = layer.self_attn, layer.mlp

    def rows(group_rows):
        return lambda s: s.reshape(s.shape[0], -1).sum(1).reshape(n_kv, group_rows).sum(1)

    reducers = {
        attn.q_proj.weight: ("attn", rows(q_rows)),
        attn.k_proj.weight: ("attn", rows(arch.head_dim)),
        attn.v_proj.weight: ("attn", rows(arch.head_dim)),
        attn.o_proj.weight: ("attn", lambda s: s.sum(0).reshape(n_kv, q_rows).sum(1)),
        mlp.gate_proj.weight: ("mlp", lambda s: s.sum(1)),
        mlp.up_proj.weight: ("mlp", lambda s: s.sum(1)),
        mlp.down_proj.weight: ("mlp", lambda s: s.sum(0)),
    }
    for proj, group_rows in ((attn.q_proj, q_rows), (attn.k_proj, arch.head_dim), (attn.v_proj, arch.head_dim)):
        if proj.bias is not None:
            reducers[proj.bias] = ("attn", lambda s, g=group_rows: s.reshape(n_kv, g).sum(1))
    return reducers


UNIT_TAYLOR = "unit importance (taylor)"


def unit_importance(model, arch: Architecture, windows: torch.Tensor, taylor: str = "param_first",
                    ctx: StageContext | None = None):
    """Per-layer Taylor scores for KV groups and neurons from one backward over all windows; with `ctx`, the
    backward reports progress as each tracked weight's gradient is folded in (it is one long computation)."""
    layers = list(model.model.layers)
    device = windows.device
    attn_scores = [torch.zeros(arch.kv_heads, dtype=torch.float64, device=device) for _ in layers]
    mlp_scores = [torch.zeros(arch.intermediate, dtype=torch.float64, device=device) for _ in layers]
    handles, tracked, folded = [], [], [0]
    requires = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)

    for index, layer in enumerate(layers):
        for param, (kind, reduce) in _unit_reducers(layer, arch).items():
            target = attn_scores[index] if kind == "attn" else mlp_scores[index]

            def fold(p, target=target, reduce=reduce):
                # in fp32 whatever the weights are stored in: a bf16 product would be summed in bf16
                salience = p.detach().float() * p.grad.float()
                salience = salience.abs() if taylor == "param_first" else salience
                target += reduce(salience).double()
                p.grad = None  # free at once: at most one weight's gradient is alive
                folded[0] += 1
                if ctx is not None:
                    ctx.report(UNIT_TAYLOR, folded[0], len(tracked))

            param.requires_grad_(True)
            tracked.append(param)
            handles.append(param.register_post_accumulate_grad_hook(fold))

    was_training = model.training
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # HF checkpoints only in train mode; Llama-family dropout is 0
    try:
        if ctx is not None:
            ctx.report(UNIT_TAYLOR, 0, len(tracked))
        loss, count = nll_sum(model, windows)
        (loss / count).backward()
    finally:
        for handle in handles:
            handle.remove()
        model.activation_checkpointing_disable()
        model.train(was_training)
        for p, flag in requires.items():
            p.requires_grad_(flag)
            p.grad = None
    if taylor == "vectorize":
        attn_scores = [s.abs() for s in attn_scores]
        mlp_scores = [s.abs() for s in mlp_scores]
    return [s.float().cpu() for s in attn_scores], [s.float().cpu() for s in mlp_scores], loss.item() / count


@torch.no_grad()
def neuron_activation_importance(model, windows: torch.Tensor, batch_size: int) -> tuple[list[torch.Tensor], float]:
    """Per layer, each neuron's SwiGLU output (down_proj's input) as Minitron scores it: the L2 norm over
    a window's tokens, averaged over windows; and the mean NLL of the windows."""
    layers = list(model.model.layers)
    scores = [torch.zeros(layer.mlp.down_proj.in_features, dtype=torch.float64, device=windows.device)
              for layer in layers]

    def accumulate(total: torch.Tensor):
        def hook(module, args) -> None:  # a pre-hook's return value would replace down_proj's input
            total.add_(args[0].float().norm(dim=1).sum(0).double())
        return hook

    handles = [layer.mlp.down_proj.register_forward_pre_hook(accumulate(total))
               for layer, total in zip(layers, scores, strict=True)]
    loss, count = torch.zeros((), dtype=torch.float64, device=windows.device), 0
    try:
        for start in range(0, windows.shape[0], batch_size):
            batch_loss, batch_count = nll_sum(model, windows[start : start + batch_size])
            loss, count = loss + batch_loss.double(), count + batch_count
    finally:
        for handle in handles:
            handle.remove()
    return [(total / windows.shape[0]).float().cpu() for total in scores], (loss / count).item()


# --------------------------------------------------------------------------- layer importance


@torch.no_grad()
def layer_importance_loo(model, windows: torch.Tensor, batch_size: int, ctx: StageContext) -> torch.Tensor:
    """Mean NLL increase per token when each layer is replaced by the identity.

    One full forward records every layer's input; skipping layer l then only re-runs the
    layers after it from that recorded input, which halves the cost of the naive loop.
    """
    layers = list(model.model.layers)
    increase = torch.zeros(len(layers), dtype=torch.float64, device=windows.device)
    batches = range(0, windows.shape[0], batch_size)
    tokens = 0
    ctx.report("layer importance (leave one out)", 0, len(batches) * len(layers))
    for batch_index, start in enumerate(batches):
        batch = windows[start : start + batch_size]
        inputs = _record_layer_inputs(model, batch)
        final = inputs.pop()  # the last layer's output, i.e. the base model's final hidden state
        base, count = nll_from_hidden(model.lm_head, model.model.norm(final[0]), batch)
        for skipped in range(len(layers)):
            loss = _loss_after(model, inputs, skipped, inputs[skipped][0], batch)
            increase[skipped] += (loss - base).double()
            ctx.report("layer importance (leave one out)", batch_index * len(layers) + skipped + 1,
                       len(batches) * len(layers))
        tokens += count
    return (increase / tokens).float().cpu()


@torch.no_grad()
def group_importance_loo(model, arch: Architecture, windows: torch.Tensor, batch_size: int,
                         ctx: StageContext) -> list[torch.Tensor]:
    """Per layer, the mean NLL increase per token when each KV group alone is removed.

    Removing a group zeroes its query heads' slice of o_proj's input, which is exactly what
    pruning the group does. As in `layer_importance_loo`, only the changed layer and the ones
    after it are re-run from recorded inputs.
    """
    layers = list(model.model.layers)
    group_cols = arch.n_rep * arch.head_dim
    increase = [torch.zeros(arch.kv_heads, dtype=torch.float64, device=windows.device) for _ in layers]
    batches = range(0, windows.shape[0], batch_size)
    done, total, tokens = 0, len(batches) * len(layers) * arch.kv_heads, 0
    ctx.report("attention importance (leave one group out)", 0, total)
    for start in batches:
        batch = windows[start : start + batch_size]
        inputs = _record_layer_inputs(model, batch)
        final = inputs.pop()
        base, count = nll_from_hidden(model.lm_head, model.model.norm(final[0]), batch)
        for index, layer in enumerate(layers):
            for group in range(arch.kv_heads):

                def drop_group(module, args, group=group):
                    kept = args[0].clone()
                    kept[..., group * group_cols : (group + 1) * group_cols] = 0
                    return (kept, *args[1:])

                handle = layer.self_attn.o_proj.register_forward_pre_hook(drop_group)
                try:
                    hidden = _hidden(layer(inputs[index][0], **inputs[index][1]))
                finally:
                    handle.remove()
                loss = _loss_after(model, inputs, index, hidden, batch)
                increase[index][group] += (loss - base).double()
                done += 1
                ctx.report("attention importance (leave one group out)", done, total)
        tokens += count
    return [(scores / tokens).float().cpu() for scores in increase]


def _loss_after(model, inputs: list[tuple[torch.Tensor, dict]], layer: int, hidden: torch.Tensor,
                batch: torch.Tensor) -> torch.Tensor:
    """Summed NLL of `batch` when `hidden` stands for layer `layer`'s output: the later layers re-run
    from it with their recorded kwargs."""
    layers = model.model.layers
    for later in range(layer + 1, len(layers)):
        hidden = _hidden(layers[later](hidden, **inputs[later][1]))
    loss, _ = nll_from_hidden(model.lm_head, model.model.norm(hidden), batch)
    return loss


def _record_layer_inputs(model, batch: torch.Tensor) -> list[tuple[torch.Tensor, dict]]:
    """Run the model once; return each decoder layer's (input hidden, kwargs), then (final output, {})."""
    records: list[tuple[torch.Tensor, dict]] = []
    handles = []
    for layer in model.model.layers:

        def pre_hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            records.append((hidden, rest))

        handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))

    last = model.model.layers[-1]
    handles.append(last.register_forward_hook(lambda m, a, out: records.append((_hidden(out), {}))))
    try:
        model.model(input_ids=batch, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return records


def _hidden(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def layer_importance_block_influence(model, windows: torch.Tensor, batch_size: int) -> torch.Tensor:
    layers = list(model.model.layers)
    totals = torch.zeros(len(layers), dtype=torch.float64, device=windows.device)
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for index, layer in enumerate(layers):

        def hook(module, args, kwargs, output, index=index):
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = _hidden(output)
            captured[index] = (1 - F.cosine_similarity(h_in.float(), h_out.float(), dim=-1)).sum()

        handles.append(layer.register_forward_hook(hook, with_kwargs=True))
    tokens = 0
    try:
        for start in range(0, windows.shape[0], batch_size):
            batch = windows[start : start + batch_size]
            model.model(input_ids=batch, use_cache=False)
            tokens += batch.numel()
            for index, value in captured.items():
                totals[index] += value.double()
    finally:
        for handle in handles:
            handle.remove()
    return (totals / tokens).float().cpu()


# --------------------------------------------------------------------------- the stage


LOAD_MODEL = "load model"
CALIBRATION_WINDOWS = "calibration windows"


def profile(model, tokenizer, arch: Architecture, settings: ProfileSettings, ctx: StageContext) -> Importance:
    """Unit and layer importance of `model`, run on the device it is on, in `model_precision`'s dtype."""
    device = next(model.parameters()).device
    ctx.report(CALIBRATION_WINDOWS, 0, 1)
    windows = make_windows(tokenizer, settings.calibration, settings.windows, settings.window_length, settings.seed)
    ctx.report(CALIBRATION_WINDOWS, 1, 1)
    with model_precision(model, device):
        return _profile(model, arch, windows.to(device), settings, ctx)


def _profile(model, arch: Architecture, windows: torch.Tensor, settings: ProfileSettings,
             ctx: StageContext) -> Importance:
    attn = mlp = None
    if settings.attn_method == "taylor" or settings.mlp_method == "taylor":
        attn, mlp, loss = unit_importance(model, arch, windows, settings.taylor, ctx)
    if settings.mlp_method == "activation":
        ctx.report("neuron importance (activation)", 0, 1)
        mlp, loss = neuron_activation_importance(model, windows, settings.batch_size)
        ctx.report("neuron importance (activation)", 1, 1)
    layer_windows = windows[: settings.layer_windows]
    if settings.attn_method == "loo":
        attn = group_importance_loo(model, arch, layer_windows, settings.batch_size, ctx)
    if settings.layer_method == "loo":
        layers = layer_importance_loo(model, layer_windows, settings.batch_size, ctx)
    else:
        layers = layer_importance_block_influence(model, layer_windows, settings.batch_size)
    meta = {"settings": settings.model_dump(mode="json"), "calibration_loss": loss, "layer_scores": layers.tolist()}
    return Importance(attn=attn, mlp=mlp, layers=layers, meta=meta)


def run(inputs: dict[str, Path], settings: ProfileSettings, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"model": dir or .gguf} -> outputs {"importance": file}. The model loads in its
    source's dtype (bf16/fp16, else fp32) and runs on `ctx.device`."""
    # Reported before and after: loading a model is the first long step, and a stage says it is alive at once.
    ctx.report(LOAD_MODEL, 0, 1)
    loaded = load_model(inputs["model"])
    loaded.model.to(torch.device(ctx.device))
    ctx.report(LOAD_MODEL, 1, 1)
    result = profile(loaded.model, loaded.tokenizer, loaded.architecture, settings, ctx)
    out = ctx.work_dir / IMPORTANCE_FILE
    result.save(out)
    atomic_write_bytes(ctx.work_dir / "importance.json", json.dumps(result.meta, indent=2).encode())
    return {"importance": out}
