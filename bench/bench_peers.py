"""Ours against real peers on SmolLM2-135M at equal active parameters (issue 44 item 1): unrecovered rows.

Methods, each at the active-parameter fraction of our levels 0.9, 0.7 and 0.5 (`level_table` of the
repo's elastify settings; embeddings and the LM head counted as `active_params` counts them for everyone):

  ours         the package's importance order (its weights are stored in that order, so a level is a
               prefix of every layer's units), served by the device SDK through `set_widths`
  ShortGPT     whole layers removed in order of least block influence (the package's `layer_scores`)
               until the fraction is reached; the last layer removed is thinned instead, so the
               fraction matches within 1%
  torch-pruning  LLM-Pruner's recipe in its own library: Taylor importance over a calibration batch,
               hidden size untouched, the first 3 and last 2 layers kept (LLM-Pruner prunes blocks 4..30
               of 32); MLP channels only, because torch-pruning 1.6.1 fails on SmolLM2's GQA head groups
               (see prune_llm_pruner), so it cuts more MLP than a heads-and-channels run would

Unrecovered, separately pruned ours is ours by construction (the same order, no recovery to nest), so it
is not a separate row here. Recovery, MC accuracy, repeat-4 and LAMBADA of the recovered rows are not
run by this version (see the report of the run in bench/results/peers.json's `not_run`).

  nice -n 19 .venv/bin/python -m bench.bench_peers --package ~/.cache/elastify/bench/smollm2-device
"""

from __future__ import annotations

import argparse
import math
import os
import time
from functools import partial
from importlib.metadata import version
from pathlib import Path

import torch

from bench.common import RESULTS, print_table, write_file, write_results
from bench.trace import paired_difference_ci

LLM_PRUNER_KEEP_FIRST, LLM_PRUNER_KEEP_LAST = 3, 2  # LLM-Pruner prunes blocks 4..30 of LLaMA-7B's 32
FRACTION_TOLERANCE = 0.01


def ours_widths(arch, anchors: list[int], ratios: list[float]) -> dict[float, tuple[list[int], list[int]]]:
    """Per level ratio, our level's per-layer (attn groups, MLP neurons), as elastify lays them out."""
    from pipeline.elastilm.elastify import level_table
    from pipeline.settings import ElastifySettings

    shapes = level_table(arch, anchors, ElastifySettings(levels=sorted(set(ratios) | {1.0})))
    return {ratio: (list(shape.attn_units), list(shape.mlp_units))
            for ratio in ratios for shape in shapes if math.isclose(shape.ratio, ratio)}


def fraction_of(arch, attn_units: list[int], mlp_units: list[int]) -> float:
    """Active parameters of these widths over the full model's, counted as the package counts them."""
    from pipeline.elastilm.elastify import active_params

    full = active_params(arch, [arch.kv_heads] * arch.layers, [arch.intermediate] * arch.layers)
    return active_params(arch, attn_units, mlp_units) / full


def shortgpt_widths(arch, layer_scores: list[float], target: float) -> tuple[list[int], list[int]]:
    """ShortGPT at `target`: drop whole layers of least block influence while the fraction stays above
    `target`; the next layer's MLP is then thinned so the fraction lands on `target` (within one neuron)."""
    attn, mlp = [arch.kv_heads] * arch.layers, [arch.intermediate] * arch.layers
    for layer in sorted(range(arch.layers), key=lambda i: layer_scores[i]):
        trial_attn, trial_mlp = attn.copy(), mlp.copy()
        trial_attn[layer], trial_mlp[layer] = 0, 0
        if fraction_of(arch, trial_attn, trial_mlp) >= target:
            attn, mlp = trial_attn, trial_mlp
            continue
        # Thin this layer's MLP to the remainder rather than overshoot by a whole layer's worth.
        low, high = 0, arch.intermediate
        while low < high:
            mid = (low + high) // 2
            mlp[layer] = mid
            if fraction_of(arch, attn, mlp) >= target:
                high = mid
            else:
                low = mid + 1
        mlp[layer] = low
        break
    return attn, mlp


def pruned_layers(layers: int) -> list[int]:
    """The layers LLM-Pruner's recipe prunes: all but the first three and the last two."""
    return list(range(LLM_PRUNER_KEEP_FIRST, layers - LLM_PRUNER_KEEP_LAST))


def llm_pruner_widths(arch, target: float, heads: bool = True) -> tuple[list[int], list[int]]:
    """Uniform widths over `pruned_layers` at `target`: KV groups cut in proportion (at least one kept,
    GQA legal) unless `heads` is False, then the MLP width that lands the fraction on `target` (the
    closest neuron count). Groups too coarse to land within 1% fall back to the MLP alone."""
    layers = pruned_layers(arch.layers)
    attn, mlp = [arch.kv_heads] * arch.layers, [arch.intermediate] * arch.layers
    if heads:  # the share of the cut each pruned layer takes, applied to its groups (rounded, at least 1)
        full = fraction_of(arch, attn, mlp)
        kept_share = 1 - (full - target) / (len(layers) / arch.layers)
        groups = max(1, min(arch.kv_heads, round(arch.kv_heads * kept_share)))
        for layer in layers:
            attn[layer] = groups

    def at(neurons: int) -> float:
        return fraction_of(arch, attn, [neurons if i in layers else m for i, m in enumerate(mlp)])

    neurons = min(range(arch.intermediate + 1), key=lambda n: abs(at(n) - target))
    if abs(at(neurons) - target) > FRACTION_TOLERANCE:
        attn = [arch.kv_heads] * arch.layers
        neurons = min(range(arch.intermediate + 1), key=lambda n: abs(at(n) - target))
    return attn, [neurons if i in layers else m for i, m in enumerate(mlp)]


def matched(fraction: float, target: float) -> bool:
    return abs(fraction - target) <= FRACTION_TOLERANCE


def paired_token_ci(a_nll: torch.Tensor, b_nll: torch.Tensor, windows: torch.Tensor) -> tuple[float, float, float]:
    """Mean per-window NLL difference a − b with its 95% bootstrap interval (windows are the units)."""
    return paired_difference_ci(a_nll.tolist(), b_nll.tolist(), list(range(windows.shape[0])))


# --------------------------------------------------------------------------- measurement


def hf_window_predictions(hf, windows: torch.Tensor, batch_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-token NLL per window [N], argmax next token [N, T − 1]) of a transformers model."""
    nll, argmax = [], []
    with torch.inference_mode():
        for start in range(0, windows.shape[0], batch_size):
            batch = windows[start : start + batch_size]
            logits = hf(input_ids=batch).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
            nll.append(loss.mean(1))
            argmax.append(logits.argmax(-1))
    return torch.cat(nll), torch.cat(argmax)


def sdk_window_predictions(model, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from the device SDK's model at its current widths (`window_predictions` per window)."""
    from pipeline.elastilm.evaluate import window_predictions

    nll, argmax = [], []
    for window in windows:
        mean, top = window_predictions(model, window[None])
        nll.append(mean)
        argmax.append(top[0])
    return torch.tensor(nll), torch.stack(argmax)


def prune_llm_pruner(model_dir: Path, arch, target: float, calibration: torch.Tensor):
    """torch-pruning at LLM-Pruner's recipe; (model, widths asked, seconds)."""
    import torch_pruning as tp
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.config.use_cache = False
    # Heads stay whole: torch-pruning 1.6.1 groups SmolLM2's q_proj (9 heads) with k_proj (3 KV heads) and
    # fails reshaping their importance (RuntimeError: shape '[9, -1]' is invalid for input of size 192), so
    # this row is LLM-Pruner's Taylor channel pruning of the MLP only, at the same fraction.
    attn, mlp = llm_pruner_widths(arch, target, heads=False)
    layers = pruned_layers(arch.layers)
    blocks = hf.model.layers
    ratio_dict = {blocks[i].mlp.gate_proj: 1 - mlp[i] / arch.intermediate for i in layers}
    # The hidden size stays whole (LLM-Pruner's block-wise mode): every module whose output is the
    # residual stream, attention, and the kept layers' MLPs are ignored; only MLP channels are cut.
    ignored = [hf.lm_head, hf.model.embed_tokens]
    for index, block in enumerate(blocks):
        ignored += [block.self_attn.o_proj, block.mlp.down_proj, block.self_attn.q_proj, block.self_attn.k_proj,
                    block.self_attn.v_proj]
        if index not in layers:
            ignored += [block.mlp.gate_proj, block.mlp.up_proj]
    hf.zero_grad()
    for window in calibration:
        hf(input_ids=window[None], labels=window[None]).loss.backward()
    pruner = tp.pruner.MetaPruner(
        hf, example_inputs=calibration[:1], importance=tp.importance.TaylorImportance(),
        pruning_ratio=0.0, pruning_ratio_dict=ratio_dict, ignored_layers=ignored,
    )
    pruner.step()
    hf.zero_grad(set_to_none=True)
    got_attn = [b.self_attn.k_proj.out_features // arch.head_dim for b in blocks]
    got_mlp = [b.mlp.gate_proj.out_features for b in blocks]
    return hf.eval(), (got_attn, got_mlp), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", type=Path, default=Path.home() / ".cache/elastify/bench/smollm2-device",
                        help="elastified SmolLM2-135M package (its importance order and block influence)")
    parser.add_argument("--levels", default="0.9,0.7,0.5", help="our level ratios whose fractions all match")
    parser.add_argument("--windows", type=int, default=16, help="held-out windows per corpus")
    parser.add_argument("--window-length", type=int, default=256)
    parser.add_argument("--calibration-windows", type=int, default=8,
                        help="torch-pruning's Taylor batch, from the packaged passages (not an evaluation set)")
    parser.add_argument("--corpora", default="lambada,ptb:test")
    parser.add_argument("--results", type=Path, default=RESULTS / "peers.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("PEERS_THREADS", "1")))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from device_sdk.runtime import ElasticModel
    from pipeline.data.calibration import make_windows

    model = ElasticModel.load(args.package, allow_unsigned=True)
    arch, elastic = model.manifest.architecture, model.manifest.elastic
    model_dir = Path(model.manifest.source["model"])
    tokenizer = AutoTokenizer.from_pretrained(str(args.package / "model"))
    windows = {c: make_windows(tokenizer, c, args.windows, args.window_length, seed=1) for c in args.corpora.split(",")}
    calibration = make_windows(tokenizer, "passages", args.calibration_windows, args.window_length, seed=2)
    ratios = [float(r) for r in args.levels.split(",")]
    ours = ours_widths(arch, list(elastic.anchor_layers), ratios)

    full_hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    reference = {c: hf_window_predictions(full_hf, w) for c, w in windows.items()}
    del full_hf

    rows, per_window = [], {}

    def measure(method: str, ratio: float, widths, predict, seconds: float) -> None:
        fraction = fraction_of(arch, *widths)
        row = {"method": method, "level": ratio, "recovered": False, "active_fraction": round(fraction, 5),
               "target_fraction": round(fraction_of(arch, *ours[ratio]), 5), "prune_seconds": round(seconds, 2)}
        row["matched"] = matched(row["active_fraction"], row["target_fraction"])
        for corpus, corpus_windows in windows.items():
            nll, top = predict(corpus_windows)
            ref_nll, ref_top = reference[corpus]
            per_window[(method, ratio, corpus)] = nll
            row[f"ppl_ratio:{corpus}"] = round(math.exp(nll.mean().item() - ref_nll.mean().item()), 4)
            row[f"top1_agreement:{corpus}"] = round((top == ref_top).float().mean().item(), 4)
        rows.append(row)

    for ratio in ratios:
        started = time.perf_counter()
        model.set_widths(*ours[ratio])
        measure("ours", ratio, ours[ratio], lambda w: sdk_window_predictions(model, w), time.perf_counter() - started)
        target = fraction_of(arch, *ours[ratio])
        started = time.perf_counter()
        short = shortgpt_widths(arch, elastic.importance["layer_scores"], target)
        model.set_widths(*short)
        measure("ShortGPT", ratio, short, lambda w: sdk_window_predictions(model, w), time.perf_counter() - started)
        pruned, widths, seconds = prune_llm_pruner(model_dir, arch, target, calibration)
        measure("torch-pruning (LLM-Pruner, MLP)", ratio, widths, partial(hf_window_predictions, pruned), seconds)

    # Paired differences ours − peer in per-window NLL (negative: ours better), per corpus and level.
    paired = []
    for ratio in ratios:
        for peer in ("ShortGPT", "torch-pruning (LLM-Pruner, MLP)"):
            for corpus, corpus_windows in windows.items():
                mean, low, high = paired_token_ci(per_window[("ours", ratio, corpus)],
                                                  per_window[(peer, ratio, corpus)], corpus_windows)
                paired.append({"level": ratio, "peer": peer, "corpus": corpus, "nll_difference": round(mean, 4),
                               "ci95": [round(low, 4), round(high, 4)]})
    corpora = list(windows)
    print_table("unrecovered, ppl ratio to the full model", ["method", "level", "fraction", *corpora, "top-1"],
                [[r["method"], r["level"], r["active_fraction"], *[r[f"ppl_ratio:{c}"] for c in corpora],
                  r[f"top1_agreement:{corpora[0]}"]] for r in rows])
    write_results("peers", args, rows, paired=paired,
                  versions={p: version(p) for p in ("torch-pruning", "llmlingua", "torch", "transformers")},
                  modelopt="nvidia-modelopt 0.47.0: Minitron pruning is its mcore_minitron mode, which imports "
                           "megatron.core and transformer_engine and prunes Megatron-Core GPT/Mamba models only; "
                           "it does not apply to a transformers Llama on CPU, so no Minitron row",
                  not_run=["recovered rows (LoRA at an equal budget)", "MC accuracy", "greedy repeat-4",
                           "separately pruned ours after recovery"],
                  package=str(args.package))
    plot(rows, corpora[0], args.results.with_suffix(".png"))


def plot(rows: list[dict], corpus: str, path: Path) -> None:
    """Perplexity ratio against active fraction, one line per method."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = sorted((r["active_fraction"], r[f"ppl_ratio:{corpus}"]) for r in rows if r["method"] == method)
        axis.plot(*zip(*points, strict=True), marker="o", label=method)
    axis.set(xlabel="active parameter fraction", ylabel=f"{corpus} perplexity ÷ full model", yscale="log",
             title="SmolLM2-135M, unrecovered")
    axis.legend()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    write_file(path, buffer.getvalue())


if __name__ == "__main__":
    main()
