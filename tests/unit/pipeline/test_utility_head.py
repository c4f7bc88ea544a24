"""Issue 14: margin labels, the utility decision head (pipeline ↔ SDK), its SLO mask, and the TLM's time in TTFT."""

from __future__ import annotations

import itertools
import json
import random
import time

import pytest
import torch

from device_sdk.format import Level, LevelShape
from device_sdk.latency import SLO, LatencyProfile, LevelLatency, TLMLatency, feasible, predicted_ttft_ms
from device_sdk.runtime import ElasticModel
from device_sdk.tlm import TLM, best_utility_cell, tlm_decider

LEVELS = ["0.25", "0.5", "1.0"]
PROMPTS = ["Question: Which gas do plants take in from the air?\nAnswer:",
           "Question: " + " ".join(f"word{i} follows, doesn't it?" for i in range(50)) + "\nAnswer:"]


# --------------------------------------------------------------------------- labels


def test_margin_is_gold_minus_the_best_wrong_choice():
    from pipeline.elastilm.label import choice_margins

    scores = torch.tensor([[-1.0, -2.0, -0.5, -3.0],  # gold 2 leads the best wrong (0) by 0.5
                           [-1.0, -0.9, -1.2, -3.0]])  # gold 2 trails the best wrong (1) by 0.3
    margins = choice_margins(scores, gold=2)
    assert torch.allclose(margins, torch.tensor([0.5, -0.3]))
    assert ((margins > 0) == (scores.argmax(1) == 2)).all()  # the sign is correctness


def test_cell_labels_carry_margins_and_targets_soften_lucky_answers():
    from pipeline.elastilm.slo_labels import cell_labels
    from pipeline.elastilm.tlm import utility_targets

    meta = {"items": [{"id": "a", "prompt": "A?"}]}
    correct = torch.tensor([[[True, False]]])
    margins = torch.tensor([[[0.01, -2.0]]])  # right by a hair, wrong by a lot
    cells = cell_labels(correct, margins, meta)
    assert cells[0]["margin"][0] == pytest.approx([0.01, -2.0]) and cells[0]["correct"] == [[True, False]]
    soft = utility_targets(cells, margin_temperature=0.5)[0, 0]
    assert 0.5 < soft[0] < 0.52 and soft[1] < 0.02  # a lucky right answer is ~0.5, not a sure 1
    assert utility_targets(cells, margin_temperature=0.0)[0, 0].tolist() == [1.0, 0.0]
    assert utility_targets(cell_labels(correct, None, meta), 0.5)[0, 0].tolist() == [1.0, 0.0]  # old shards


# --------------------------------------------------------------------------- pipeline ↔ SDK


@pytest.fixture(scope="module")
def utility_pair(tmp_path_factory):
    """A MiniLM TLM with a utility head (random, branches perturbed) saved, and its SDK twin."""
    from pipeline.elastilm.tlm import new_tlm, save_tlm

    torch.manual_seed(0)
    model, tokenizer = new_tlm(None, LEVELS, frozen_layers=3, max_length=64)
    model.use_utility_head()
    with torch.no_grad():
        for param in [*model.decision_layers.parameters(), *model.utility_head.parameters()]:
            param.add_(0.05 * torch.randn_like(param))
    out = save_tlm(model.eval(), tokenizer, tmp_path_factory.mktemp("tlm") / "tlm")
    return model, tokenizer, out


def test_sdk_utility_matches_the_pipeline_within_1e_5(utility_pair):
    from pipeline.elastilm.tlm import utility

    model, tokenizer, out = utility_pair
    sdk = TLM.load(out)
    assert sdk.decision_head == "utility" and json.loads((out / "tlm_config.json").read_text())["decision_head"] == "utility"
    for prompt in PROMPTS:  # the second is longer than max_length: both truncate alike
        ours, reference = sdk.utility(prompt), utility(model, tokenizer, prompt)
        assert ours.shape == (len(model.config.ratio_grid), len(LEVELS))
        assert (ours - reference).abs().max().item() < 1e-5
    assert (sdk.utility(PROMPTS[0]) - sdk.utility(PROMPTS[1])).abs().max() > 1e-4  # depends on the prompt


def test_a_package_without_the_field_reads_as_the_slo_token_head(tmp_path):
    from pipeline.elastilm.tlm import load_tlm, new_tlm, save_tlm

    model, tokenizer = new_tlm(None, LEVELS, frozen_layers=3, max_length=64)
    out = save_tlm(model, tokenizer, tmp_path / "tlm")
    config = json.loads((out / "tlm_config.json").read_text())
    del config["decision_head"]  # as written before the field existed
    (out / "tlm_config.json").write_text(json.dumps(config))
    sdk = TLM.load(out)
    assert sdk.decision_head == "slo_token" and load_tlm(out)[0].config.decision_head == "slo_token"
    ratio, level, ok = sdk.decide("Why?", 0.5, 0.5, lambda r, m: True)
    assert ok and level in LEVELS
    with pytest.raises(ValueError, match="slo_token"):
        sdk.utility("Why?")


def test_utility_head_learns_cell_targets_over_cached_trunk_features(tmp_path, monkeypatch):
    """The stage trains on cached trunk features: the trunk runs once per prompt, the score branch and
    trunk stay bit-identical, and the head ranks held-in cells as the labels do."""
    from pipeline.elastilm import tlm
    from pipeline.stage import quiet_context

    base, tokenizer = tlm.new_tlm(None, LEVELS, frozen_layers=3, max_length=64)
    score_dir = tlm.save_tlm(base, tokenizer, tmp_path / "score")
    ratios = [0.5, 1.0]  # labelled on part of the TLM's ratio grid: that part becomes the head's grid

    # Level 1.0 is right everywhere, 0.25 nowhere, 0.5 only on the full prompt: every prompt alike.
    def cell_margin(r, m):
        return {"1.0": 1.0, "0.25": -1.0, "0.5": 1.0 if ratios[r] == 1.0 else -1.0}[LEVELS[m]]

    margins = [[cell_margin(r, m) for m in range(len(LEVELS))] for r in range(len(ratios))]
    cells = [{"item": f"i{k}", "prompt": f"Question: what is item {k}?\nAnswer:", "margin": margins,
              "correct": [[v > 0 for v in row] for row in margins]} for k in range(6)]
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({"rules": {}, "cells": cells, "ratios": ratios, "levels": LEVELS}))
    calls = []
    original = tlm.DualHeadTLM.trunk_states

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(tlm.DualHeadTLM, "trunk_states", counting)
    out = tlm.run_decision({"tlm": score_dir, "labels": labels},
                           tlm.DecisionSettings(head="utility", steps=40, batch_size=4, lr=1e-3),
                           quiet_context(tmp_path / "decision"))
    assert len(calls) == len(cells)  # once per training prompt, not per step
    trained, tok = tlm.load_tlm(out["tlm"])
    before, _ = tlm.load_tlm(score_dir)
    assert trained.config.ratio_grid == ratios and trained.config.level_grid == LEVELS
    assert TLM.load(out["tlm"]).utility("Why?").shape == (len(ratios), len(LEVELS))
    for module in ("trunk", "score_layers", "score_head", "embeddings"):
        for a, b in zip(getattr(trained, module).state_dict().values(), getattr(before, module).state_dict().values(),
                        strict=True):
            assert torch.equal(a, b), module
    predicted = tlm.utility(trained, tok, "Question: what is item 99?\nAnswer:")
    full = ratios.index(1.0)
    assert predicted[full, LEVELS.index("1.0")] > 0.7 and predicted[0, LEVELS.index("0.25")] < 0.3
    assert predicted[full, LEVELS.index("0.5")] > predicted[0, LEVELS.index("0.5")]
    assert json.loads(out["metrics"].read_text())["head"] == "utility"
    (tmp_path / "old.json").write_text(json.dumps({"rules": {"capable": []}}))
    with pytest.raises(ValueError, match="cells"):
        tlm.run_decision({"tlm": score_dir, "labels": tmp_path / "old.json"}, tlm.DecisionSettings(head="utility"),
                         quiet_context(tmp_path / "old"))


def test_a_prior_initialised_head_starts_at_each_cells_base_rate_and_keeps_its_order(tmp_path):
    """At the prior every prompt reads each cell's held-in mean target; after the demo's small lr the
    order of the base rates still holds on an unseen prompt, where a random start ranks cells by noise."""
    from pipeline.elastilm import tlm

    model, tokenizer = tlm.new_tlm(None, LEVELS, frozen_layers=3, max_length=64)
    ratios = [0.5, 1.0]
    base_rate = torch.tensor([[0.2, 0.5, 0.7], [0.3, 0.6, 0.9]])  # [ratios, levels]: more is righter
    items = 24
    generator = torch.Generator().manual_seed(0)
    # 0/1 correctness at exactly the base rates, the right items of each cell a seeded draw of its own:
    # the labels hold no signal but the cell
    right = torch.zeros(items, *base_rate.shape, dtype=torch.bool)
    for r, m in itertools.product(range(len(ratios)), range(len(LEVELS))):
        right[torch.randperm(items, generator=generator)[: round(items * base_rate[r, m].item())], r, m] = True
    cells = [{"item": f"i{k}", "prompt": f"Question: what is item {k}?\nAnswer:", "correct": right[k].tolist()}
             for k in range(items)]
    targets = tlm.utility_targets(cells, margin_temperature=0.0)
    model.use_utility_head(ratios, LEVELS)
    tlm.init_at_prior(model.utility_head, targets)
    for prompt in PROMPTS:
        assert torch.allclose(tlm.utility(model, tokenizer, prompt), targets.mean(0), atol=1e-6)

    tlm.train_utility_head(model, tokenizer, cells, steps=20, batch_size=8, lr=1e-4, margin_temperature=0.0,
                           ratios=ratios, levels=LEVELS, init="prior", validation_fraction=0.0)
    order = targets.mean(0).flatten().argsort()
    predicted = tlm.utility(model, tokenizer, "Question: which planet is largest?\nAnswer:").flatten()
    assert torch.equal(predicted.argsort(), order)
    assert (predicted - targets.mean(0).flatten()).abs().max() < 0.1
    with pytest.raises(ValueError, match="init"):
        tlm.train_utility_head(model, tokenizer, cells, steps=1, ratios=ratios, levels=LEVELS, init="zeros")
    assert tlm.DecisionSettings().utility_init == "prior"


def test_held_in_validation_keeps_the_best_read_weights_and_a_fit_only_where_the_prompt_explains():
    """Training that ruins the head (an absurd lr) is not kept: the head comes back exactly at its
    prior. Labels the prompt explains (hard questions are wrong at the small level): training goes
    on, and the head tells the two kinds apart on prompts it never saw."""
    from pipeline.elastilm import tlm

    model, tokenizer = tlm.new_tlm(None, LEVELS, frozen_layers=3, max_length=64)
    ratios = [1.0]
    generator = torch.Generator().manual_seed(1)
    noise = [{"item": f"n{k}", "prompt": f"Question: what is item {k}?\nAnswer:",
              "correct": (torch.rand(1, len(LEVELS), generator=generator) < 0.5).tolist()} for k in range(30)]
    fit = tlm.train_utility_head(model, tokenizer, noise, steps=20, batch_size=8, lr=1.0, margin_temperature=0.0,
                                 ratios=ratios, levels=LEVELS)
    assert fit.kept_step == 0 and len(fit.validation) == 11
    assert all(loss > fit.validation[0][1] for _, loss in fit.validation[1:])
    assert torch.count_nonzero(model.utility_head.weight) == 0  # the prior's weights, restored

    def item(k, hard):
        kind = "Hard question: prove the theorem" if hard else "Easy question: say hello"
        return {"item": f"s{k}", "prompt": f"{kind} number {k}.\nAnswer:", "correct": [[not hard, True, True]]}

    signal = [item(k, hard=k % 2 == 0) for k in range(30)]
    fit = tlm.train_utility_head(model, tokenizer, signal, steps=60, batch_size=8, lr=1e-3, margin_temperature=0.0,
                                 ratios=ratios, levels=LEVELS)
    assert fit.kept_step > 0 and dict(fit.validation)[fit.kept_step] == min(loss for _, loss in fit.validation)
    easy = tlm.utility(model, tokenizer, "Easy question: say goodbye number 77.\nAnswer:")[0, 0]
    hard = tlm.utility(model, tokenizer, "Hard question: prove the lemma number 78.\nAnswer:")[0, 0]
    assert easy > 0.7 and hard < 0.3


def test_the_frozen_trunk_runs_without_dropout_while_the_branches_train():
    """In training mode the trunk gives the same states twice (as served, and as the utility head's
    cache holds them); the trained decision branch still has its dropout."""
    from pipeline.elastilm import tlm

    model, tokenizer = tlm.new_tlm(None, LEVELS, frozen_layers=3, max_length=64)
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
    mask = torch.ones_like(ids)
    model.train()
    assert not model.trunk.training and not model.embeddings.training and model.decision_layers.training
    trunk = model.trunk_states(ids, mask)
    assert torch.equal(trunk, model.trunk_states(ids, mask))
    assert torch.equal(trunk, model.eval().trunk_states(ids, mask))
    model.train()
    assert not torch.equal(*(model.decision_logits(ids, mask, trunk)[1] for _ in range(2)))


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_each_tlm_head_trains_in_the_precision_its_setting_names_and_keeps_fp32_weights(precision):
    """bf16 autocast (the setting's "auto" on a CPU with native bf16, as recovery) for the score head,
    ElastiLM's SLO-token head and the utility head; the weights saved and served stay fp32."""
    from pipeline.elastilm import tlm

    model, tokenizer = tlm.new_tlm(None, LEVELS, frozen_layers=3, max_length=64)
    seen: list[torch.dtype] = []
    for layers in (model.score_layers, model.decision_layers):  # a matmul's output (LayerNorm's stays fp32)
        layers[0].intermediate.dense.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    text = "Plants take in carbon dioxide and give off oxygen."
    tlm.train_score_head(model, tokenizer, [(text, [1, 0, 1, 1, 0, 1, 0, 1, 1])], steps=1, batch_size=1,
                         precision=precision)
    rows = [{"prompt": PROMPTS[0], "ttft": 0.6, "tpot": 0.8, "ratio": 0.5, "level": "0.5"}]
    tlm.train_decision_head(model, tokenizer, rows, steps=1, batch_size=1, precision=precision)
    cells = [{"item": f"i{k}", "prompt": f"Question {k}?", "correct": [[True, k % 2 == 0, False]]} for k in range(5)]
    tlm.train_utility_head(model, tokenizer, cells, steps=1, batch_size=2, ratios=[1.0], levels=LEVELS,
                           precision=precision)
    assert seen.count(getattr(torch, precision)) >= 3  # one training forward per head at least
    if precision == "bfloat16":
        assert torch.float32 in seen  # validation and the cached trunk stay fp32
    else:
        assert set(seen) == {torch.float32}
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_head_kept_at_its_prior_is_served_without_running_the_encoder(tmp_path, utility_pair, monkeypatch):
    from pipeline.elastilm import tlm

    model, tokenizer = tlm.new_tlm(None, LEVELS, frozen_layers=3, max_length=64)
    model.use_utility_head([0.5, 1.0], LEVELS)
    targets = torch.tensor([[[0.1, 0.4, 0.6], [0.2, 0.5, 0.9]]])
    tlm.init_at_prior(model.utility_head, targets)
    sdk = TLM.load(tlm.save_tlm(model, tokenizer, tmp_path / "tlm"))
    assert sdk.prompt_blind and not TLM.load(utility_pair[2]).prompt_blind

    def no_encoder(*args, **kwargs):
        raise AssertionError("the encoder ran")

    monkeypatch.setattr(TLM, "_branch", no_encoder)
    for prompt in PROMPTS:
        assert torch.allclose(sdk.utility(prompt), targets[0], atol=1e-5)
        assert torch.allclose(sdk.utility(prompt), tlm.utility(model, tokenizer, prompt), atol=1e-5)


# --------------------------------------------------------------------------- the mask and the choice


def _profile(scale: float = 1.0, tlm: TLMLatency | None = None, jitter: random.Random | None = None) -> LatencyProfile:
    """Level m costs about m × the full model; `jitter` makes each level's slowdown different."""
    def k():
        return scale * (1.0 + (jitter.random() if jitter else 0.0))

    return LatencyProfile("fp32", 1, {name: LevelLatency(20.0 * Level(name).ratio * k(), 1.0 * Level(name).ratio * k(),
                                                         10.0 * Level(name).ratio * k()) for name in LEVELS}, tlm=tlm)


RATIOS = [0.3, 0.5, 0.7, 1.0]


def _choose(utility, profile, slo, tokens=100, held=tuple(LEVELS)):
    def ok(r, m):
        return m in held and feasible(profile, m, r, tokens, slo)

    return best_utility_cell(utility, RATIOS, LEVELS, ok,
                             lambda r, m: predicted_ttft_ms(profile, m, r, tokens) + profile.tpot_ms(m))


def _latency(profile, ratio, level, tokens=100):
    return predicted_ttft_ms(profile, level, ratio, tokens), profile.tpot_ms(level)


def _never_costlier(before, after, profile, target, tokens=100):
    """`after` equals `before`, or `before` misses `target` on `profile` in a dimension where `after` is cheaper."""
    if before[:2] == after[:2]:
        return True
    (ttft_b, tpot_b), (ttft_a, tpot_a) = _latency(profile, *before[:2], tokens), _latency(profile, *after[:2], tokens)
    missed_ttft = target.ttft_ms is not None and ttft_b > target.ttft_ms
    missed_tpot = target.tpot_ms is not None and tpot_b > target.tpot_ms
    return (missed_ttft and ttft_a < ttft_b) or (missed_tpot and tpot_a < tpot_b)


def test_a_slower_profile_never_yields_a_costlier_cell():
    rng = random.Random(0)
    changed = 0
    for _ in range(300):
        utility = torch.rand(len(RATIOS), len(LEVELS), generator=torch.Generator().manual_seed(rng.randrange(10**6)))
        target = SLO(ttft_ms=rng.uniform(4, 25), tpot_ms=rng.choice([None, rng.uniform(2, 11)]))
        fast = _profile()
        slow = _profile(jitter=rng)  # every level slower, each by its own factor in [1, 2)
        before, after = _choose(utility, fast, target), _choose(utility, slow, target)
        assert not after[2] or feasible(slow, after[1], after[0], 100, target)
        if after[2]:
            assert before[2]  # what the slow device meets, the fast one meets too
            assert _never_costlier(before, after, slow, target)
            changed += before[:2] != after[:2]
    assert changed > 10  # the profile did move decisions


def test_a_tighter_slo_never_yields_a_costlier_cell():
    rng = random.Random(1)
    profile = _profile(tlm=TLMLatency(1.0, 0.01, 0.5, 0.02))
    changed = 0
    for _ in range(300):
        utility = torch.rand(len(RATIOS), len(LEVELS), generator=torch.Generator().manual_seed(rng.randrange(10**6)))
        loose = SLO(ttft_ms=rng.uniform(6, 30), tpot_ms=rng.uniform(3, 11))
        tight = SLO(ttft_ms=loose.ttft_ms * rng.uniform(0.3, 1.0), tpot_ms=loose.tpot_ms * rng.uniform(0.3, 1.0))
        before, after = _choose(utility, profile, loose), _choose(utility, profile, tight)
        if after[2]:
            assert before[2] and _never_costlier(before, after, profile, tight)
            changed += before[:2] != after[:2]
    assert changed > 10


def test_ties_go_to_the_cheaper_cell_and_no_feasible_cell_is_flagged():
    profile = _profile()
    flat = torch.full((len(RATIOS), len(LEVELS)), 0.5)
    assert _choose(flat, profile, SLO(ttft_ms=1e9)) == (0.3, "0.25", True)  # every cell ties: the cheapest
    best_full = flat.clone()
    best_full[-1, -1] = 0.9
    assert _choose(best_full, profile, SLO(ttft_ms=1e9)) == (1.0, "1.0", True)
    assert _choose(best_full, profile, SLO(ttft_ms=1e-6)) == (0.3, "0.25", False)


class _FakeUtilityTLM:
    """What `tlm_decider` reads of a utility TLM, with fixed utilities."""

    decision_head = "utility"
    ratios, levels = RATIOS, LEVELS

    def __init__(self, utility):
        self._utility = utility

    def utility(self, prompt):
        return self._utility


def _shapes(usable: dict[str, bool]) -> list[LevelShape]:
    return [LevelShape(name, Level(name).ratio, [], [], 0, Level(name).ratio, usable=usable[name]) for name in LEVELS]


def test_unusable_levels_are_never_chosen_and_the_tlm_time_masks_cells():
    utility = torch.zeros(len(RATIOS), len(LEVELS))
    utility[:, LEVELS.index("0.5")] = 0.9  # the head loves level 0.5 ...
    decide = tlm_decider(_FakeUtilityTLM(utility))
    profile = _profile()
    usable = {"0.25": True, "0.5": False, "1.0": True}  # ... which the report card marked unusable
    for slo in (SLO(ttft_ms=1e9), SLO.fraction(0.6, 0.6), SLO(ttft_ms=1e-6)):
        assert decide("Why?", 100, slo, profile, _shapes(usable)).level != "0.5"
    everything = {name: True for name in LEVELS}
    assert decide("Why?", 100, SLO(ttft_ms=1e9), profile, _shapes(everything)).level == "0.5"
    # A TTFT budget level 0.5 meets at every ratio without the TLM; a TLM that takes 40 ms before prefill
    # leaves level 0.5 none of them, and the choice moves to a cell that still fits.
    slo = SLO(ttft_ms=_latency(profile, 1.0, "0.5")[0] + 1.0)
    assert decide("Why?", 100, slo, profile, _shapes(everything)).level == "0.5"
    slow_tlm = _profile(tlm=TLMLatency(40.0, 0.0, 0.0, 0.0))
    chosen = decide("Why?", 100, slo, slow_tlm, _shapes(everything))
    assert chosen.feasible and chosen.level != "0.5"
    assert predicted_ttft_ms(slow_tlm, chosen.level, chosen.prompt_ratio, 100) <= slo.ttft_ms


class _CountingUtilityTLM(_FakeUtilityTLM):
    asked = 0

    def utility(self, prompt):
        self.asked += 1
        return self._utility


def test_the_tlm_is_skipped_where_its_own_time_is_all_that_misses_the_slo():
    utility = torch.rand(len(RATIOS), len(LEVELS), generator=torch.Generator().manual_seed(0))
    tlm = _CountingUtilityTLM(utility)
    decide = tlm_decider(tlm)
    everything = _shapes({name: True for name in LEVELS})
    # Level 0.5 meets this TTFT on the whole prompt by 1 ms; a TLM taking 55 ms leaves no cell that meets it.
    no_tlm = _profile()
    slo = SLO(ttft_ms=_latency(no_tlm, 1.0, "0.5")[0] + 1.0)
    slow_tlm = _profile(tlm=TLMLatency(55.0, 0.0, 0.0, 0.0))
    assert not any(feasible(slow_tlm, m, r, 100, slo) for r in RATIOS for m in LEVELS)
    chosen = decide("Why?", 100, slo, slow_tlm, everything)
    assert (chosen.level, chosen.prompt_ratio, chosen.feasible) == ("0.5", 1.0, True) and tlm.asked == 0
    assert not chosen.tlm_ran  # its time is not in this request's TTFT
    # With a TLM cheap enough to leave cells, it is asked.
    cheap_tlm = _profile(tlm=TLMLatency(0.1, 0.0, 0.1, 0.0))
    chosen = decide("Why?", 100, slo, cheap_tlm, everything)
    assert tlm.asked == 1 and chosen.feasible and chosen.tlm_ran
    # With no cell meeting the SLO either way, the best effort is the lightest level served soonest: on the
    # whole prompt where the TLM's time outweighs what compressing saves, else compressed to the smallest ratio.
    chosen = decide("Why?", 100, SLO(ttft_ms=1e-6), slow_tlm, everything)
    assert (chosen.level, chosen.prompt_ratio, chosen.feasible, chosen.tlm_ran) == ("0.25", 1.0, False, False)
    assert tlm.asked == 1
    assert slow_tlm.ttft_ms("0.25", 100) < predicted_ttft_ms(slow_tlm, "0.25", min(RATIOS), 100)
    chosen = decide("Why?", 100, SLO(ttft_ms=1e-6), cheap_tlm, everything)
    assert (chosen.level, chosen.feasible, chosen.tlm_ran) == ("0.25", False, True) and tlm.asked == 2
    assert predicted_ttft_ms(cheap_tlm, "0.25", chosen.prompt_ratio, 100) < cheap_tlm.ttft_ms("0.25", 100)


def test_the_kept_end_is_served_whole_and_never_scored():
    profile = _profile(tlm=TLMLatency(2.0, 0.0, 1.0, 0.5))
    # 100 tokens, the last 20 kept: at ratio 0.5, 40 + 20 = 60 served; compression scores 80.
    assert predicted_ttft_ms(profile, "1.0", 0.5, 100, kept_tokens=20) == pytest.approx(
        2.0 + 1.0 + 0.5 * 80 + profile.ttft_ms("1.0", 60))
    assert predicted_ttft_ms(profile, "1.0", 0.5, 100) == pytest.approx(2.0 + 1.0 + 0.5 * 100 + profile.ttft_ms("1.0", 50))
    assert predicted_ttft_ms(profile, "1.0", 1.0, 100, kept_tokens=20) == 2.0 + profile.ttft_ms("1.0", 100)
    with pytest.raises(ValueError, match="kept_tokens"):
        predicted_ttft_ms(profile, "1.0", 0.5, 100, kept_tokens=101)


def test_profile_keeps_the_tlm_time_through_json(tmp_path):
    profile = _profile(tlm=TLMLatency(3.0, 0.1, 2.0, 0.2))
    profile.save(tmp_path / "p.json")
    loaded = LatencyProfile.load(tmp_path / "p.json")
    assert loaded.tlm == profile.tlm
    assert loaded.tlm_ms(100, 1.0) == pytest.approx(13.0) and loaded.tlm_ms(100, 0.5) == pytest.approx(35.0)
    assert _profile().tlm_ms(100, 0.5) == 0.0  # a profile without it (older, or no TLM) adds nothing
    assert predicted_ttft_ms(loaded, "1.0", 0.5, 100) == pytest.approx(35.0 + 20.0 + 50.0)


# --------------------------------------------------------------------------- on the device: generate


def _package_with_utility_tlm(tmp_path, favourite: tuple[float, str]):
    from pipeline.elastilm.tlm import install_tlm, new_tlm, save_tlm
    from tests.support.pipeline_packages import tiny_package
    from tests.support.sdk_packages import sign_package, signing_key

    key = signing_key()
    _, package = tiny_package("llama_gqa", tmp_path / "pkg", key)
    levels = [level.name for level in ElasticModel.load(package, allow_unsigned=True).manifest.elastic.levels]
    model, tokenizer = new_tlm(None, levels, frozen_layers=3, max_length=64)
    model.use_utility_head()
    ratios = model.config.ratio_grid
    with torch.no_grad():
        model.utility_head.weight.zero_()
        bias = torch.full((len(ratios), len(levels)), -2.0)
        bias[ratios.index(favourite[0]), levels.index(favourite[1])] = 3.0
        model.utility_head.bias.copy_(bias.flatten())
    install_tlm(package, save_tlm(model, tokenizer, tmp_path / "tlm"))
    sign_package(package, key)
    return package, levels


def test_generate_with_a_utility_package_counts_the_tlm_in_ttft(tmp_path):
    from device_sdk.format import read_manifest

    package, levels = _package_with_utility_tlm(tmp_path, (0.5, "0.5"))
    assert read_manifest(package).tlm["decision_head"] == "utility"
    model = ElasticModel.load(package, allow_unsigned=True)
    assert model.tlm.decision_head == "utility"
    model.latency_profile = LatencyProfile("fp32", 1, {m: LevelLatency(1.0 * Level(m).ratio, 0.5 * Level(m).ratio,
                                                                       10.0 * Level(m).ratio) for m in levels})
    prompt = "one two three four five six seven eight nine ten eleven twelve?"
    loose = model.generate(prompt, slo=SLO(ttft_ms=1e6, tpot_ms=1e6), max_new_tokens=2)
    assert (loose.level, loose.decision.prompt_ratio, loose.decision.feasible) == ("0.5", 0.5, True)
    # The measured TTFT starts before the TLM runs: a decision that takes 300 ms shows in it.
    real = model.decide

    def slow_decide(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    model.decide = slow_decide
    slowed = model.generate(prompt, slo=SLO(ttft_ms=1e6, tpot_ms=1e6), max_new_tokens=2)
    assert slowed.ttft_ms >= 300.0 and slowed.level == "0.5"


def test_a_loaded_or_estimated_profile_gets_the_tlm_time_measured_on_the_device(tmp_path):
    package, _ = _package_with_utility_tlm(tmp_path, (1.0, "1.0"))
    model = ElasticModel.load(package, allow_unsigned=True)
    profile = model.latency_profile  # none beside the package: estimated here, and the TLM timed
    assert profile.tlm is not None and profile.tlm.decide_base_ms + profile.tlm.decide_per_token_ms > 0
    assert profile.tlm_ms(64, 0.5) > profile.tlm_ms(64, 1.0) > 0  # compressing adds the score branch
    assert model.generate("Why is the sky blue?", slo=SLO(ttft_ms=1e6), max_new_tokens=1).level == "1.0"
