"""Issue 14 item 5: the trace generator, the trace policies' cell choice, and the bootstrap intervals."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from bench.trace import (
    TRACE_CLASSES,
    bootstrap_ci,
    cell_cost_ms,
    class_counts,
    feasible_mask,
    held_in_rates,
    largest_level_full_prompt,
    largest_level_most_kept,
    layer_drop_depths,
    make_trace,
    oracle,
    paired_difference_ci,
    policy_profile,
    random_feasible_expectation,
    slo_token_choice,
    utility_choice,
)
from device_sdk.format import Level, LevelShape
from device_sdk.latency import SLO, LatencyProfile, LevelLatency, TLMLatency, choose_level, predicted_ttft_ms

RATIOS = [0.5, 0.7, 1.0]
LEVELS = ["0.25", "0.5", "0.75", "1.0"]
TOKENS = 60

# --------------------------------------------------------------------------- the trace


@pytest.mark.parametrize("total", [600, 601, 7])
def test_class_counts_sum_exactly_and_follow_the_skew(total):
    uniform = class_counts(total, 6, 0.0)
    assert sum(uniform) == total and max(uniform) - min(uniform) <= 1
    for alpha in (0.25, -0.25):
        counts = class_counts(total, 6, alpha)
        assert sum(counts) == total
        if total >= 600:
            steps = [b - a for a, b in zip(counts, counts[1:], strict=False)]
            assert all(s > 0 for s in steps) if alpha > 0 else all(s < 0 for s in steps)
    assert class_counts(600, 6, 0.0) == [100] * 6
    assert class_counts(600, 6, 0.25)[-1] == pytest.approx(600 * 1.25**5 / sum(1.25**k for k in range(6)), abs=1)
    with pytest.raises(ValueError):
        class_counts(10, 6, -1.0)


POOLS = [[f"task{k}/item{i}" for i in range(7 + k)] for k in range(6)]


@pytest.mark.parametrize("alpha", [0.0, 0.25, -0.25])
def test_trace_counts_items_and_seeding(alpha):
    trace = make_trace(600, POOLS, alpha, seed=3)
    assert len(trace) == 600
    assert [Counter(r.slo_class for r in trace)[k] for k in range(6)] == class_counts(600, 6, alpha)
    for k, pool in enumerate(POOLS):
        asked = Counter(r.item for r in trace if r.slo_class == k)
        assert set(asked) <= set(pool)
        assert max(asked.values()) - min(asked.values()) <= 1 and len(asked) == len(pool)  # as even as can be
    assert make_trace(600, POOLS, alpha, seed=3) == trace
    other = make_trace(600, POOLS, alpha, seed=4)
    assert other != trace
    assert Counter(r.slo_class for r in other) == Counter(r.slo_class for r in trace)


def test_trace_classes_are_elastilms_six():
    assert TRACE_CLASSES == [(1.0, 1.0), (0.8, 0.9), (0.6, 0.8), (0.4, 0.7), (0.2, 0.6), (0.2, 0.5)]


# --------------------------------------------------------------------------- the policies


def _profile(rng: random.Random, scale: float = 1.0, tlm: TLMLatency | None = None) -> LatencyProfile:
    """Level m costs roughly m × the full model, each level with its own jitter."""
    def k():
        return scale * (1.0 + 0.3 * rng.random())

    return LatencyProfile("fp32", 1, {name: LevelLatency(20.0 * Level(name).ratio * k(), 0.5 * Level(name).ratio * k(),
                                                         10.0 * Level(name).ratio * k()) for name in LEVELS}, tlm=tlm)


def _cost(profile: LatencyProfile) -> torch.Tensor:
    return cell_cost_ms(profile, RATIOS, LEVELS, TOKENS, new_tokens=1)


def test_a_cells_cost_is_its_predicted_ttft_plus_each_new_tokens_tpot():
    tlm = TLMLatency(2.0, 0.1, 3.0, 0.05)  # decide 2 + 0.1/token; compress 3 + 0.05/token
    profile = LatencyProfile("fp32", 1, {"0.5": LevelLatency(10.0, 1.0, 20.0), "1.0": LevelLatency(10.0, 2.0, 40.0)},
                             tlm=tlm)
    cost = cell_cost_ms(profile, [0.5, 1.0], ["0.5", "1.0"], 100, new_tokens=6, kept_tokens=20)
    # Ratio 0.5 serves 20 + 0.5 × 80 = 60 tokens and pays the TLM's decision over the 100 tokens and its
    # compression over the 80 it may drop from; the full prompt pays the decision only.
    decide, compress = 2.0 + 0.1 * 100, 3.0 + 0.05 * 80
    assert cost.shape == (2, 2)
    assert cost[0, 0] == pytest.approx(decide + compress + 10.0 + 1.0 * 60 + 6 * 20.0)
    assert cost[1, 1] == pytest.approx(decide + 10.0 + 2.0 * 100 + 6 * 40.0)
    for r, ratio in enumerate([0.5, 1.0]):
        for m, level in enumerate(["0.5", "1.0"]):
            assert cost[r, m] == pytest.approx(predicted_ttft_ms(profile, level, ratio, 100, 20) + 6 * profile.tpot_ms(level))


def _choices(mask: torch.Tensor, cost: torch.Tensor, utility: torch.Tensor, ratio_lp, level_lp) -> dict:
    return {"utility": utility_choice(utility, mask, cost), "slo_token": slo_token_choice(ratio_lp, level_lp, mask),
            "llm_pruner": largest_level_full_prompt(mask), "llmlingua2": largest_level_most_kept(mask)}


def _random_case(rng: random.Random):
    seed = rng.randrange(10**6)
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(len(RATIOS), len(LEVELS), generator=g), torch.randn(len(RATIOS), generator=g).log_softmax(0),
            torch.randn(len(LEVELS), generator=g).log_softmax(0))


def _target(rng: random.Random) -> SLO:
    return SLO(ttft_ms=rng.uniform(5, 60), tpot_ms=rng.uniform(2, 11))


def _latency(profile, cell):
    r, m = cell[:2]
    return predicted_ttft_ms(profile, LEVELS[m], RATIOS[r], TOKENS), profile.tpot_ms(LEVELS[m])


def _never_costlier(before, after, profile) -> bool:
    """`after` is `before`, or is cheaper than it in TTFT or in TPOT (never dearer in both)."""
    if before[:2] == after[:2]:
        return True
    (ttft_b, tpot_b), (ttft_a, tpot_a) = _latency(profile, before), _latency(profile, after)
    return ttft_a < ttft_b or tpot_a < tpot_b


def test_no_policy_picks_an_infeasible_cell_when_a_feasible_one_exists():
    rng = random.Random(0)
    seen = Counter()
    for _ in range(300):
        profile = _profile(rng, tlm=TLMLatency(2.0, 0.02, 3.0, 0.05))
        target = _target(rng)
        utility, ratio_lp, level_lp = _random_case(rng)
        for name, (decides, compresses) in {"utility": (True, True), "slo_token": (True, True),
                                            "llm_pruner": (False, False), "llmlingua2": (False, True)}.items():
            paid = policy_profile(profile, decides, compresses)
            mask = feasible_mask(paid, RATIOS, LEVELS, TOKENS, target)
            r, m, met = _choices(mask, _cost(paid), utility, ratio_lp, level_lp)[name]
            if name == "llm_pruner":  # it never compresses: its cells are the full-prompt row
                mask = mask[-1:].expand_as(mask) & (torch.arange(len(RATIOS)) == len(RATIOS) - 1)[:, None]
            assert met == bool(mask.any())
            if mask.any():
                assert mask[r, m], name
                seen[name] += 1
            else:
                assert (r, m) == ((len(RATIOS) - 1, 0) if name == "llm_pruner" else (0, 0))
    assert min(seen.values()) > 50 and len(seen) == 4


def test_policy_profile_charges_only_the_tlm_parts_a_policy_runs():
    profile = _profile(random.Random(0), tlm=TLMLatency(5.0, 0.0, 7.0, 0.0))
    assert policy_profile(profile, True, True).tlm_ms(TOKENS, 0.5) == 12.0
    assert policy_profile(profile, False, True).tlm_ms(TOKENS, 0.5) == 7.0
    assert policy_profile(profile, False, True).tlm_ms(TOKENS, 1.0) == 0.0
    assert policy_profile(profile, False, False).tlm_ms(TOKENS, 0.5) == 0.0
    assert profile.tlm_ms(TOKENS, 0.5) == 12.0  # the device's own profile is left as it was


def test_llm_pruner_is_the_sdks_own_fallback():
    rng = random.Random(2)
    shapes = [LevelShape(name, Level(name).ratio, [], [], 0, Level(name).ratio) for name in LEVELS]
    for _ in range(200):
        profile, target = _profile(rng), _target(rng)
        r, m, met = largest_level_full_prompt(feasible_mask(profile, RATIOS, LEVELS, TOKENS, target))
        sdk = choose_level("Why?", TOKENS, target, profile, shapes)
        assert (LEVELS[m], met, RATIOS[r]) == (sdk.level, sdk.feasible, sdk.prompt_ratio)


def test_a_slower_profile_never_yields_a_costlier_cell_for_the_utility_head():
    rng = random.Random(3)
    changed = 0
    for _ in range(300):
        utility, _, _ = _random_case(rng)
        target, tlm = _target(rng), TLMLatency(2.0, 0.02, 3.0, 0.05)
        fast = _profile(rng, tlm=tlm)
        slow = _profile(rng, scale=rng.uniform(1.0, 2.0), tlm=tlm)
        slow.levels = {m: LevelLatency(*(max(getattr(fast.levels[m], f), getattr(slow.levels[m], f))
                                         for f in ("ttft_base_ms", "ttft_per_token_ms", "tpot_ms")))
                       for m in LEVELS}  # every level at least as slow as on the fast device
        before = utility_choice(utility, feasible_mask(fast, RATIOS, LEVELS, TOKENS, target), _cost(fast))
        after = utility_choice(utility, feasible_mask(slow, RATIOS, LEVELS, TOKENS, target), _cost(slow))
        if after[2]:
            assert before[2]  # what the slow device meets, the fast one meets
            assert _never_costlier(before, after, slow) and _never_costlier(before, after, fast)
            changed += before[:2] != after[:2]
    assert changed > 10  # the profile did move decisions


def test_a_tighter_slo_never_yields_a_costlier_cell_for_any_policy():
    rng = random.Random(4)
    changed = Counter()
    for _ in range(300):
        profile = _profile(rng, tlm=TLMLatency(2.0, 0.02, 3.0, 0.05))
        cost = _cost(profile)
        utility, ratio_lp, level_lp = _random_case(rng)
        loose = _target(rng)
        tight = SLO(ttft_ms=loose.ttft_ms * rng.uniform(0.3, 1.0), tpot_ms=loose.tpot_ms * rng.uniform(0.3, 1.0))
        before = _choices(feasible_mask(profile, RATIOS, LEVELS, TOKENS, loose), cost, utility, ratio_lp, level_lp)
        after = _choices(feasible_mask(profile, RATIOS, LEVELS, TOKENS, tight), cost, utility, ratio_lp, level_lp)
        for name in before:
            if after[name][2]:
                assert before[name][2] and _never_costlier(before[name], after[name], profile), name
                changed[name] += before[name][:2] != after[name][:2]
    assert min(changed.values()) > 10 and len(changed) == 4


def test_random_feasible_is_the_exact_expectation_and_the_oracle_bounds_every_policy():
    correct = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 1], [0, 0, 1, 1]], dtype=torch.bool)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert random_feasible_expectation(correct, mask) == pytest.approx(2 / 5)
    assert oracle(correct, mask) == 1.0
    none = torch.zeros_like(mask)
    assert random_feasible_expectation(correct, none) == oracle(correct, none) == 1.0  # the lightest cell's label
    rng = random.Random(5)
    for _ in range(100):
        utility, ratio_lp, level_lp = _random_case(rng)
        mask = torch.rand(len(RATIOS), len(LEVELS), generator=torch.Generator().manual_seed(rng.randrange(99))) > 0.5
        labels = utility > 0.5
        for r, m, _ in _choices(mask, torch.rand(len(RATIOS), len(LEVELS)), utility, ratio_lp, level_lp).values():
            assert float(labels[r, m]) <= oracle(labels, mask)


def test_the_task_lookup_serves_each_task_its_best_feasible_held_in_cell():
    # Two tasks on a 1 × 3 grid: task "a" is right most often at the middle cell, "b" at the largest.
    correct = torch.tensor([[[0, 1, 0]], [[1, 1, 0]], [[0, 0, 1]], [[0, 1, 1]], [[0, 0, 1]]], dtype=torch.bool)
    rates = held_in_rates(correct, ["a", "a", "b", "b", "b"])
    assert torch.allclose(rates["a"], torch.tensor([[0.5, 1.0, 0.0]]))
    assert torch.allclose(rates["b"], torch.tensor([[0.0, 1 / 3, 1.0]]))
    cost = torch.tensor([[1.0, 2.0, 3.0]])
    everything = torch.ones(1, 3, dtype=torch.bool)
    assert utility_choice(rates["a"], everything, cost)[:2] == (0, 1)
    assert utility_choice(rates["b"], everything, cost)[:2] == (0, 2)
    assert utility_choice(rates["b"], torch.tensor([[True, True, False]]), cost)[:2] == (0, 1)  # its best is infeasible
    tied = held_in_rates(torch.tensor([[[1, 0, 1]]], dtype=torch.bool), ["a"])
    assert utility_choice(tied["a"], everything, cost)[:2] == (0, 0)  # equal rates: the cheaper cell
    with pytest.raises(ValueError, match="task names"):
        held_in_rates(correct, ["a"])


def test_shortgpt_drops_the_least_influential_layers_and_its_deepest_feasible_depth_is_taken():
    scores = [0.9, 0.1, 0.5, 0.05, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6]  # layer 3 matters least, then 1, 6, 4, …
    depths = layer_drop_depths([3] * 10, [8] * 10, scores, [1.0, 0.5, 0.8])
    assert list(depths) == ["0.5", "0.8", "1.0"]  # shallowest first, whatever order they were asked in
    assert depths["1.0"] == ([3] * 10, [8] * 10)
    attn, mlp = depths["0.8"]
    assert [i for i, a in enumerate(attn) if a == 0] == [1, 3] and attn == [3 if m else 0 for m in mlp]
    assert sorted(i for i, a in enumerate(depths["0.5"][0]) if a == 0) == [1, 3, 4, 6, 8]
    everything = torch.ones(1, len(depths), dtype=torch.bool)
    assert list(depths)[largest_level_full_prompt(everything)[1]] == "1.0"
    assert list(depths)[largest_level_full_prompt(torch.tensor([[True, True, False]]))[1]] == "0.8"
    assert list(depths)[largest_level_full_prompt(torch.zeros(1, 3, dtype=torch.bool))[1]] == "0.5"  # best effort


# --------------------------------------------------------------------------- intervals


def test_bootstrap_of_constant_data_has_zero_width():
    assert bootstrap_ci([0.7] * 40) == pytest.approx((0.7, 0.7, 0.7))
    assert paired_difference_ci([1.0] * 30, [0.0] * 30, clusters=[i // 3 for i in range(30)]) == pytest.approx((1, 1, 1))


def test_bootstrap_covers_a_known_mean_difference_at_about_95_percent():
    gen = torch.Generator().manual_seed(6)
    covered, trials = 0, 200
    for trial in range(trials):
        b = torch.rand(60, generator=gen)
        a = b + 0.1 + 0.3 * torch.randn(60, generator=gen)  # a − b ~ N(0.1, 0.3²)
        mean, low, high = paired_difference_ci(a.tolist(), b.tolist(), resamples=1000, seed=trial)
        assert low <= mean <= high
        covered += low <= 0.1 <= high
    assert 0.88 <= covered / trials <= 0.99  # a percentile bootstrap at n=60 runs slightly under 95%


def test_cluster_bootstrap_does_not_count_repeats_as_evidence():
    values = torch.rand(40, generator=torch.Generator().manual_seed(7)).tolist()
    repeated = [v for v in values for _ in range(5)]
    clusters = [i for i in range(40) for _ in range(5)]
    _, low, high = bootstrap_ci(values)
    _, low_c, high_c = bootstrap_ci(repeated, clusters)
    _, low_n, high_n = bootstrap_ci(repeated)  # as if the 200 requests were independent
    assert (high_c - low_c) == pytest.approx(high - low, rel=0.15)
    assert (high_n - low_n) < 0.6 * (high - low)


# --------------------------------------------------------------------------- decision quality


def test_the_trained_utility_head_beats_random_feasible_on_a_fixed_labelled_set(tmp_path):
    """Two kinds of items on one grid: plant questions are right only at level 1.0 on the full prompt,
    number questions only at level 0.5 on a compressed one (a small model's lucky cells). The utility
    head, trained on 16 items, must pick the right kind of cell on 16 new ones under SLO masks, above
    random feasible's exact expectation: a head that ignored the prompt would tie or lose."""
    from device_sdk.tlm import TLM
    from pipeline.elastilm import tlm
    from pipeline.stage import quiet_context

    levels = ["0.25", "0.5", "1.0"]
    base, tokenizer = tlm.new_tlm(None, levels, frozen_layers=3, max_length=64)
    score_dir = tlm.save_tlm(base, tokenizer, tmp_path / "score")
    ratios = [0.5, 1.0]
    plants = ["Which gas do plants take in from the air", "What do leaves turn sunlight into",
              "Where in a plant does photosynthesis happen", "What do roots take up from soil"]
    numbers = ["What is seven plus five", "How much is nine times three", "What is twelve minus four",
               "What is the square of six"]

    def cells(kind: str) -> list[list[bool]]:
        right = (1, 2) if kind == "plant" else (0, 1)
        return [[(r, m) == right for m in range(len(levels))] for r in range(len(ratios))]

    def items(suffixes):
        return [(f"Question: {q} {s}?\nAnswer:", kind) for s in suffixes
                for kind, questions in (("plant", plants), ("number", numbers)) for q in questions]

    train, held_out = items(["today", "again"]), items(["please", "now"])
    labels = [{"item": f"i{k}", "prompt": p, "correct": cells(kind),
               "margin": [[1.0 if c else -1.0 for c in row] for row in cells(kind)]} for k, (p, kind) in enumerate(train)]
    (tmp_path / "labels.json").write_text(json.dumps({"rules": {}, "cells": labels, "ratios": ratios, "levels": levels}))
    out = tlm.run_decision({"tlm": score_dir, "labels": tmp_path / "labels.json"},
                           tlm.DecisionSettings(head="utility", steps=20, batch_size=8, lr=2e-3),
                           quiet_context(tmp_path / "decision"))
    head = TLM.load(out["tlm"])
    masks = [torch.ones(2, 3, dtype=torch.bool), torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
             torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)]
    cost = torch.tensor([[1.0, 2.0, 4.0], [1.5, 3.0, 6.0]])
    ours, chance = [], []
    for prompt, kind in held_out:
        correct = torch.tensor(cells(kind))
        for mask in masks:
            r, m, _ = utility_choice(head.utility(prompt), mask, cost)
            ours.append(float(correct[r, m]))
            chance.append(random_feasible_expectation(correct, mask))
    mean, low, _ = paired_difference_ci(ours, chance)
    assert low > 0 and sum(ours) / len(ours) > 0.8, (mean, sum(ours) / len(ours))
