"""Stage `label-derive`: merged label shards and the cost model -> per-SLO labels (docs/design.md, 'label-derive').

The label stage's shards (pipeline.elastilm.label) hold a boolean correctness tensor
[items, ratios, levels] and the confidence margin of every cell. Merged in shard order, they
become labels per SLO: among feasible pairs that answer correctly, the most capable (largest m,
then largest p); if none is correct, the most capable feasible pair. The "lightest correct" rule
(cheapest correct feasible pair) is stored beside it for the ablation. `cell_labels` keeps the
SLO-free correctness and margin per cell, which the TLM's utility head learns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from device_sdk.format import atomic_write_bytes, read_manifest
from device_sdk.latency import SLO, LatencyProfile, feasible
from pipeline.elastilm.label import LabelError
from pipeline.elastilm.latency import cost_rank, profile_from_dict, profile_from_manifest
from pipeline.elastilm.tlm import TPOT_BINS, TTFT_BINS
from pipeline.settings import DeriveSettings
from pipeline.stage import StageContext


def load_shards(pairs: list[tuple[Path, Path]]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Concatenate shards (in the order given) into one correctness tensor, token counts and meta."""
    if not pairs:
        raise LabelError("no correctness shards given")
    corrects, tokens, meta = [], [], None
    for tensors_path, meta_path in pairs:
        tensors, shard_meta = load_file(str(tensors_path)), json.loads(Path(meta_path).read_text())
        if meta is None:
            meta = {**shard_meta, "items": []}
        elif (shard_meta["ratios"], shard_meta["levels"]) != (meta["ratios"], meta["levels"]):
            raise LabelError(f"{meta_path} was labelled on a different grid")
        corrects.append(tensors["correct"].bool())
        tokens.append(tensors["prompt_tokens"])
        meta["items"] += shard_meta["items"]
    return torch.cat(corrects), torch.cat(tokens), meta


def load_margins(tensors_paths: list[Path]) -> torch.Tensor | None:
    """The shards' margin tensors concatenated in the order given, or None when any shard predates them."""
    margins = [load_file(str(path)).get("margin") for path in tensors_paths]
    return None if any(m is None for m in margins) else torch.cat(margins)


def cell_labels(correct: torch.Tensor, margins: torch.Tensor | None, meta: dict) -> list[dict]:
    """Per item, SLO-free: {item, prompt, correct [ratio][level], margin [ratio][level] or None}: what the
    utility head learns, for every grid cell, whether and how surely the answer is right."""
    return [{"item": item["id"], "prompt": item["prompt"], "correct": correct[i].tolist(),
             "margin": None if margins is None else margins[i].tolist()}
            for i, item in enumerate(meta["items"])]


# --------------------------------------------------------------------------- labels per SLO


def slo_grid() -> list[tuple[float, float]]:
    return [(t, d) for t in TTFT_BINS for d in TPOT_BINS]


def feasible_pairs(profile: LatencyProfile, ratios: list[float], levels: list[str], prompt_tokens: int,
                   slo: tuple[float, float], kept_tokens: int = 0) -> list[tuple[int, int]]:
    target = SLO.fraction(*slo)
    return [(r, m) for r, ratio in enumerate(ratios) for m, level in enumerate(levels)
            if feasible(profile, level, ratio, prompt_tokens, target, kept_tokens)]


def choose_pair(correct: torch.Tensor, pairs: list[tuple[int, int]], rule: str,
                cost: Callable[[int, int], float]) -> tuple[int, int] | None:
    """One item's label among feasible `pairs` (indices into ratios × levels) under `rule`."""
    if not pairs:
        return None
    capable = max(pairs, key=lambda p: (p[1], p[0]))
    right = [p for p in pairs if correct[p[0], p[1]]]
    if not right:
        return capable
    if rule == "capable":
        return max(right, key=lambda p: (p[1], p[0]))
    if rule == "lightest":
        return min(right, key=lambda p: cost(*p))
    raise LabelError(f"unknown rule {rule!r}")


def derive_labels(correct: torch.Tensor, prompt_tokens: torch.Tensor, meta: dict, profile: LatencyProfile,
                  slos: list[tuple[float, float]] | None = None, rules=("capable", "lightest")) -> dict:
    """Per rule: rows {item, prompt, ttft, tpot, ratio, level}; an SLO with no feasible pair is skipped. The
    cost model serves an item's kept end (its question) whole at every ratio, as the SDK does; shards
    labelled before items carried `kept_tokens` count as compressing all of the prompt."""
    ratios, levels = meta["ratios"], meta["levels"]
    slos = slos or slo_grid()
    result = {rule: [] for rule in rules}
    infeasible = 0
    for i, item in enumerate(meta["items"]):
        tokens, kept = int(prompt_tokens[i]), item.get("kept_tokens", 0)
        for slo in slos:
            pairs = feasible_pairs(profile, ratios, levels, tokens, slo, kept)
            if not pairs:
                infeasible += 1
                continue
            for rule in rules:
                chosen = choose_pair(correct[i], pairs, rule,
                                     lambda r, m, t=tokens, k=kept: cost_rank(profile, levels[m], ratios[r], t, k))
                result[rule].append({"item": item["id"], "prompt": item["prompt"], "ttft": slo[0], "tpot": slo[1],
                                     "ratio": ratios[chosen[0]], "level": levels[chosen[1]],
                                     "correct": bool(correct[i, chosen[0], chosen[1]])})
    return {"rules": result, "ratios": ratios, "levels": levels, "infeasible_slos": infeasible}


def load_profile(inputs: dict[str, Path]) -> LatencyProfile:
    """The cost model from a `latency` stage report when given, else from the package's manifest."""
    if "latency" in inputs:
        return profile_from_dict(json.loads(Path(inputs["latency"]).read_text())["latency_profile"])
    return profile_from_manifest(read_manifest(inputs["package"]))


# --------------------------------------------------------------------------- stage entry


def run_derive(inputs: dict[str, Path], options: DeriveSettings, ctx: StageContext) -> dict[str, Path]:
    """Fan-in: inputs {"package" or "latency", "correctness.<k>", "meta.<k>", …} -> {"labels": labels.json}."""
    keys = sorted((k.split(".", 1)[1] for k in inputs if k.startswith("correctness.")), key=_shard_order)
    pairs = [(Path(inputs[f"correctness.{k}"]), Path(inputs[f"meta.{k}"])) for k in keys]
    correct, tokens, meta = load_shards(pairs)
    slos = [tuple(s) for s in options.slos] if options.slos else None
    labels = derive_labels(correct, tokens, meta, load_profile(inputs), slos)
    labels["accuracy"] = correct.float().mean(0).tolist()  # [ratio][level], for the report
    labels["cells"] = cell_labels(correct, load_margins([p for p, _ in pairs]), meta)
    out = ctx.work_dir / "labels.json"
    atomic_write_bytes(out, json.dumps(labels).encode())
    return {"labels": out}


def _shard_order(key: str):
    return (0, int(key)) if key.isdigit() else (1, key)
