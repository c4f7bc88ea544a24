"""ElastiLM's end-to-end trace, as testable parts: the request trace, the policies' cell choice given a
feasibility mask, and bootstrap intervals. bench/bench_trace.py serves the trace through the device SDK.

A grid is prompt ratios (ascending, the last one 1.0 = the full prompt) × levels (ascending). A mask
`feasible[r][m]` says which cells the cost model predicts to meet a request's SLO; every policy picks one
cell, and when no cell is feasible every policy falls back to the lightest cell (the SDK's best effort).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from device_sdk.latency import SLO, LatencyProfile, feasible, predicted_ttft_ms
from device_sdk.tlm import best_feasible_pair, best_utility_cell

# ElastiLM's six SLO classes, (TTFT, TPOT) as fractions of the full model's, loosest first.
TRACE_CLASSES = [(1.0, 1.0), (0.8, 0.9), (0.6, 0.8), (0.4, 0.7), (0.2, 0.6), (0.2, 0.5)]
# The five that ask for less than the full model: the classes the label and decision-head benches score.
TIGHT_CLASSES = TRACE_CLASSES[1:]


# --------------------------------------------------------------------------- the trace


@dataclass(frozen=True)
class Request:
    slo_class: int  # index into the classes
    item: str  # the held-out item it asks


def class_counts(total: int, classes: int, alpha: float) -> list[int]:
    """Requests per class under skew `alpha`: class k (0 = loosest) gets a share ∝ (1 + alpha)^k, so
    alpha = 0 is uniform, alpha > 0 tilts the trace towards the tight classes and alpha < 0 towards the
    loose ones (alpha = +0.25 over six classes: the tightest class 3.05× the loosest). Shares are rounded
    by largest remainder (ties to the lower class), so the counts sum to `total` exactly."""
    if alpha <= -1:
        raise ValueError(f"skew alpha must be > -1, got {alpha}")
    weights = [(1 + alpha) ** k for k in range(classes)]
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(classes), key=lambda k: (-(exact[k] - counts[k]), k))
    for k in by_remainder[: total - sum(counts)]:
        counts[k] += 1
    return counts


def make_trace(total: int, pools: Sequence[Sequence[str]], alpha: float, seed: int) -> list[Request]:
    """`total` requests over len(pools) classes (counts: `class_counts`); class k asks items of pools[k]
    (its task's held-out items), going through a seeded permutation of the pool so items repeat as
    evenly as the count allows; the whole trace is then shuffled with `seed`."""
    rng = random.Random(seed)
    requests = []
    for k, (count, pool) in enumerate(zip(class_counts(total, len(pools), alpha), pools, strict=True)):
        if count and not pool:
            raise ValueError(f"class {k} has {count} requests and no items")
        order = list(pool)
        rng.shuffle(order)
        requests += [Request(k, order[i % len(order)]) for i in range(count)]
    rng.shuffle(requests)
    return requests


# --------------------------------------------------------------------------- feasibility


def policy_profile(profile: LatencyProfile, decides: bool, compresses: bool) -> LatencyProfile:
    """The device profile as a policy pays it: TLM decision time only where a TLM head decides, compression
    time only where the TLM's score head compresses (the profile adds it for ratios below 1)."""
    if profile.tlm is None or (decides and compresses):
        return profile
    if not compresses:
        return dataclasses.replace(profile, tlm=None)
    return dataclasses.replace(profile, tlm=dataclasses.replace(profile.tlm, decide_base_ms=0.0, decide_per_token_ms=0.0))


def feasible_mask(profile: LatencyProfile, ratios: Sequence[float], levels: Sequence[str], prompt_tokens: int,
                  target: SLO, kept_tokens: int = 0) -> torch.Tensor:
    """[ratios, levels] bool: the cells `profile` predicts to meet `target` on a prompt of `prompt_tokens`
    whose last `kept_tokens` are never compressed."""
    return torch.tensor([[feasible(profile, m, r, prompt_tokens, target, kept_tokens) for m in levels]
                         for r in ratios])


def cell_cost_ms(profile: LatencyProfile, ratios: Sequence[float], levels: Sequence[str], prompt_tokens: int,
                 new_tokens: int, kept_tokens: int = 0) -> torch.Tensor:
    """[ratios, levels] float: each cell's predicted time to answer, TTFT plus `new_tokens` × TPOT, by which
    a policy breaks ties in favour of the cheaper cell."""
    return torch.tensor([[predicted_ttft_ms(profile, m, r, prompt_tokens, kept_tokens) + new_tokens * profile.tpot_ms(m)
                          for m in levels] for r in ratios])


# --------------------------------------------------------------------------- the policies' choice
# Each returns (ratio index, level index, feasible); with no feasible cell, the lightest cell, flagged.


def lightest(mask: torch.Tensor) -> tuple[int, int, bool]:
    return 0, 0, False


def utility_choice(utility: torch.Tensor, mask: torch.Tensor, cost: torch.Tensor) -> tuple[int, int, bool]:
    """Ours, utility head: the feasible cell most likely right, ties to the cheaper by `cost` [ratios, levels]."""
    if not mask.any():  # (the SDK's own fallback reads level names; indices stand in for them here)
        return lightest(mask)
    r, m, _ = best_utility_cell(utility, list(range(mask.shape[0])), [str(c) for c in range(mask.shape[1])],
                                lambda r, m: bool(mask[r, int(m)]), lambda r, m: float(cost[r, int(m)]))
    return r, int(m), True


def slo_token_choice(ratio_log_probs: torch.Tensor, level_log_probs: torch.Tensor,
                     mask: torch.Tensor) -> tuple[int, int, bool]:
    """Ours, ElastiLM's SLO-token head: the feasible pair of highest joint log-probability."""
    if not mask.any():
        return lightest(mask)
    r, m, _ = best_feasible_pair(ratio_log_probs, level_log_probs, list(range(mask.shape[0])),
                                 [str(c) for c in range(mask.shape[1])], lambda r, m: bool(mask[r, int(m)]))
    return r, int(m), True


def largest_level_full_prompt(mask: torch.Tensor) -> tuple[int, int, bool]:
    """LLM-Pruner style, done right (the SDK's own `choose_level`): the largest feasible level on the full
    prompt (the last ratio). ShortGPT uses it too, with depths as the levels and one ratio."""
    full = mask.shape[0] - 1
    fitting = [m for m in range(mask.shape[1]) if mask[full, m]]
    return (full, max(fitting), True) if fitting else (full, 0, False)


def largest_level_most_kept(mask: torch.Tensor) -> tuple[int, int, bool]:
    """LLMLingua-2 style: the largest level with any feasible ratio, then the most-kept ratio feasible there."""
    levels = [m for m in range(mask.shape[1]) if mask[:, m].any()]
    if not levels:
        return lightest(mask)
    m = max(levels)
    return max(r for r in range(mask.shape[0]) if mask[r, m]), m, True


def held_in_rates(correct: torch.Tensor, tasks: Sequence[str]) -> dict[str, torch.Tensor]:
    """Per task, each cell's share of the held-in items labelled right ([items, ratios, levels] → [ratios,
    levels]): the table the task lookup policy serves from (with `utility_choice`)."""
    if correct.shape[0] != len(tasks):
        raise ValueError(f"{correct.shape[0]} labelled items but {len(tasks)} task names")
    return {task: correct[[i for i, t in enumerate(tasks) if t == task]].float().mean(0) for task in dict.fromkeys(tasks)}


def random_feasible_expectation(correct: torch.Tensor, mask: torch.Tensor) -> float:
    """The exact expected accuracy of a uniform draw among the feasible cells (the lightest cell if none)."""
    return float(correct[mask].float().mean()) if mask.any() else float(correct[0, 0])


def oracle(correct: torch.Tensor, mask: torch.Tensor) -> float:
    """The best feasible cell per item: an upper bound on any policy that respects the cost model."""
    return float(correct[mask].float().max()) if mask.any() else float(correct[0, 0])


def layer_drop_depths(attn_units: Sequence[int], mlp_units: Sequence[int], layer_scores: Sequence[float],
                      keeps: Sequence[float]) -> dict[str, tuple[list[int], list[int]]]:
    """ShortGPT: per kept fraction of layers, the widths with the layers of least block influence
    (`layer_scores`) at width 0, the rest whole. Named by the fraction ("0.6") and ordered shallowest
    first, so a depth's index orders it as a level's does (`largest_level_full_prompt` takes the deepest)."""
    layers = len(layer_scores)
    ranked = sorted(range(layers), key=lambda i: layer_scores[i])  # least influence first
    depths = {}
    for keep in sorted(keeps):
        dropped = set(ranked[: layers - round(keep * layers)])
        depths[f"{keep:.1f}"] = ([0 if i in dropped else a for i, a in enumerate(attn_units)],
                                 [0 if i in dropped else m for i, m in enumerate(mlp_units)])
    return depths


# --------------------------------------------------------------------------- intervals


def bootstrap_ci(values: Sequence[float], clusters: Sequence[object] | None = None, resamples: int = 4000,
                 seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` with a percentile bootstrap interval. With `clusters` (e.g.
    the item each request asks) whole clusters are resampled, so requests repeating an item are not
    counted as independent evidence; the estimate is then the request mean of the resampled clusters."""
    x = torch.as_tensor(values, dtype=torch.float64)
    if x.numel() == 0:
        raise ValueError("no values to bootstrap")
    keys = list(range(len(x))) if clusters is None else list(clusters)
    index = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    ids = torch.tensor([index[key] for key in keys])
    sums = torch.zeros(len(index), dtype=torch.float64).index_add_(0, ids, x)
    counts = torch.zeros(len(index), dtype=torch.float64).index_add_(0, ids, torch.ones_like(x))
    draws = torch.randint(len(index), (resamples, len(index)), generator=torch.Generator().manual_seed(seed))
    estimates = (sums[draws].sum(1) / counts[draws].sum(1)).sort().values
    tail = (1 - level) / 2
    low = estimates[int(tail * (resamples - 1))]
    high = estimates[int(round((1 - tail) * (resamples - 1)))]
    return float(x.mean()), float(low), float(high)


def paired_difference_ci(a: Sequence[float], b: Sequence[float], clusters: Sequence[object] | None = None,
                         **options) -> tuple[float, float, float]:
    """(mean of a − b, low, high) over the same requests: the bootstrap of the per-request differences."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} and {len(b)}")
    return bootstrap_ci([x - y for x, y in zip(a, b, strict=True)], clusters, **options)
