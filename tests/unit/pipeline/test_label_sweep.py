"""Label stage: one worker sweeps the grid zero-copy; labels per SLO; the decision head trains on them."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch

from device_sdk.format import Level
from tests.support.elastilm_fixtures import (
    latency_report,
    recovered_package,
    score_tlm_dir,
    scratch,
    single_thread,  # noqa: F401  (fixture)
)

RATIOS = [0.5, 1.0]

pytestmark = pytest.mark.usefixtures("single_thread")


@cache
def labelled_shards() -> list[dict[str, Path]]:
    from pipeline.elastilm import label
    from pipeline.stage import quiet_context

    shards = []
    for index, (start, stop) in enumerate(((0, 3), (3, 5))):
        settings = label.LabelSettings(tasks=["arc_easy"], per_task=5, start=start, stop=stop, ratios=RATIOS)
        inputs = {"package": recovered_package(), "tlm": score_tlm_dir()}
        shards.append(label.run(inputs, settings, quiet_context(scratch(f"label-{index}"))))
    return shards


@cache
def derived_labels() -> Path:
    from pipeline.elastilm import slo_labels
    from pipeline.settings import DeriveSettings
    from pipeline.stage import quiet_context

    inputs = {"package": recovered_package(), "latency": latency_report()}
    for index, shard in enumerate(labelled_shards()):
        inputs[f"correctness.{index}"] = shard["correctness"]
        inputs[f"meta.{index}"] = shard["meta"]
    return slo_labels.run_derive(inputs, DeriveSettings(), quiet_context(scratch("derive")))["labels"]


def test_label_worker_sweeps_every_grid_point_without_reloading(monkeypatch):
    from device_sdk.elastic import ElasticLinear
    from device_sdk.runtime import ElasticModel
    from pipeline.data.tasks import load_items
    from pipeline.elastilm import label
    from pipeline.stage import quiet_context

    package, tlm_dir = recovered_package(), score_tlm_dir()  # build the shared inputs before counting loads
    loads = []
    original = label.serving_model
    monkeypatch.setattr(label, "serving_model", lambda *a: loads.append(a) or original(*a))
    worker = label.LabelWorker(package, tlm_dir)
    assert isinstance(worker.model, ElasticModel)  # the device's own model

    def elastic_linears():
        return [m for m in worker.model.transformer.modules() if isinstance(m, ElasticLinear)]

    storages = {id(m): (m.storage.data_ptr(), m.storage.untyped_storage().data_ptr()) for m in elastic_linears()}
    visited = []
    real_set_level = worker.set_level

    def tracking_set_level(level):
        real_set_level(level)
        visited.append(level)
        # every active weight is a view into the one storage the worker loaded
        for module in elastic_linears():
            assert module.active_weight.untyped_storage().data_ptr() == storages[id(module)][1]

    worker.set_level = tracking_set_level
    items = load_items(["arc_easy"], 0, 3)
    correct = worker.sweep(items, RATIOS, worker.levels, ["?"], quiet_context())
    assert correct.shape == (3, len(RATIOS), len(worker.levels))
    assert len(visited) == len(worker.levels)  # one switch per level: every item and ratio runs at it
    assert set(visited) == set(worker.levels)
    assert len(loads) == 1  # the weights were read once, at construction
    assert {id(m): (m.storage.data_ptr(), m.storage.untyped_storage().data_ptr()) for m in elastic_linears()} == storages
    assert set(worker.adapted_levels) == {"0.5", "0.7"}


def test_label_choice_scores_share_the_prompt_cache_exactly():
    """The batched scorer (prompts of different lengths, one KV cache shared by their choices,
    LM head only at choice tokens) equals one plain forward per (prompt, choice) row."""
    from pipeline.data.tasks import load_items
    from pipeline.elastilm import label

    worker = label.LabelWorker(recovered_package(), None)
    tokenizer = worker.tokenizer
    item = load_items(["arc_easy"], 0, 1)[0]
    prompts = [item.prompt(), item.prompt("Which is a renewable resource?"), "Answer:"]
    choices = item.choices + ["a much longer choice of several words than the others"]
    for level in ("0.5", "1.0"):  # 0.5 runs its recovery LoRA
        worker.set_level(level)
        batched = label.choice_scores(worker.model, tokenizer, prompts, choices)
        expected = torch.zeros(len(prompts), len(choices))
        with torch.no_grad():
            for p, prompt in enumerate(prompts):
                context = tokenizer(prompt, add_special_tokens=False)["input_ids"]
                for c, choice in enumerate(choices):
                    tokens = tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
                    logits = worker.model.logits(torch.tensor([context + tokens]))[0].log_softmax(-1)
                    positions = torch.arange(len(context) - 1, len(context) - 1 + len(tokens))
                    expected[p, c] = logits[positions, torch.tensor(tokens)].mean()
        assert (batched - expected).abs().max().item() < 1e-4, level
    right = label.answers_correct(worker.model, tokenizer, item, [None, None, "x"])
    assert right.shape == (3,) and right[0] == right[1]


def test_label_level_adapter_changes_the_output_of_its_level_only():
    from device_sdk.llama import Projection
    from pipeline.elastilm import label

    worker = label.LabelWorker(recovered_package(), None)
    ids = torch.tensor([[1, 2, 3, 4]])
    worker.set_level("0.5")
    with_lora = worker.model.logits(ids)
    projections = [m for m in worker.model.transformer.modules() if isinstance(m, Projection)]
    adapter = worker.model.adapters["0.5"]
    assert any(p.lora is not None for p in projections)
    assert all(p.lora is None or any(p.lora is pair for pair in adapter.values()) for p in projections)
    for p in projections:
        p.lora = None
    without = worker.model.logits(ids)
    assert not torch.allclose(with_lora, without)
    worker.set_level("1.0")
    assert all(p.lora is None for p in projections)


def test_label_shards_store_the_correctness_tensor():
    from pipeline.elastilm.slo_labels import load_shards

    shards = labelled_shards()
    correct, tokens, meta = load_shards([(s["correctness"], s["meta"]) for s in shards])
    assert correct.shape == (5, len(RATIOS), 3) and correct.dtype == torch.bool
    assert tokens.shape == (5,) and int(tokens.min()) > 3
    ids = [it["id"] for it in meta["items"]]
    assert len(set(ids)) == 5 and all(i.startswith("arc_easy/") for i in ids)
    assert meta["ratios"] == RATIOS and meta["levels"] == ["0.5", "0.7", "1.0"]


def test_label_rules_pick_most_capable_or_lightest_feasible_pair():
    from pipeline.elastilm.slo_labels import choose_pair

    correct = torch.tensor([[True, False, True], [True, True, False]])  # [ratio, level]
    pairs = [(0, 0), (0, 1), (1, 0), (1, 1)]  # (ratio index, level index); level 2 infeasible
    cost = lambda r, m: r + 2 * m  # noqa: E731
    assert choose_pair(correct, pairs, "capable", cost) == (1, 1)
    assert choose_pair(correct, pairs, "lightest", cost) == (0, 0)
    wrong = torch.zeros(2, 3, dtype=torch.bool)
    assert choose_pair(wrong, pairs, "capable", cost) == (1, 1)  # none correct: most capable feasible
    assert choose_pair(wrong, [], "capable", cost) is None


def test_label_derive_picks_hand_computed_labels():
    """Two items, two levels, two ratios, three SLO classes; every expected label worked out by hand."""
    from device_sdk.latency import LatencyProfile, LevelLatency
    from pipeline.elastilm.slo_labels import derive_labels

    # TTFT(n) = base + per_token * n. At n = 100: level 1.0 110 ms (60 at ratio 0.5), tpot 10;
    # level 0.5 55 ms (30 at ratio 0.5), tpot 6.
    profile = LatencyProfile("fp32", 1, {"0.5": LevelLatency(5.0, 0.5, 6.0), "1.0": LevelLatency(10.0, 1.0, 10.0)})
    meta = {"ratios": [0.5, 1.0], "levels": ["0.5", "1.0"],
            "items": [{"id": "a", "prompt": "A?"}, {"id": "b", "prompt": "B?"}]}
    correct = torch.tensor([[[False, True], [True, False]],  # a: right at (0.5, level 1.0) and (1.0, level 0.5)
                            [[False, False], [False, False]]])  # b: never right
    # (0.6, 0.7): TTFT <= 66, TPOT <= 7: level 0.5 only. (0.6, 1.0): TTFT <= 66, TPOT <= 10: level 0.5 at
    # both ratios, level 1.0 at ratio 0.5. (0.2, 0.5): TTFT <= 22, TPOT <= 5: nothing.
    labels = derive_labels(correct, torch.tensor([100, 100]), meta, profile, slos=[(0.6, 0.7), (0.6, 1.0), (0.2, 0.5)])

    def rows(rule):
        return [(r["item"], r["ttft"], r["tpot"], r["ratio"], r["level"], r["correct"]) for r in labels["rules"][rule]]

    assert rows("capable") == [("a", 0.6, 0.7, 1.0, "0.5", True), ("a", 0.6, 1.0, 0.5, "1.0", True),
                               ("b", 0.6, 0.7, 1.0, "0.5", False), ("b", 0.6, 1.0, 0.5, "1.0", False)]
    # lightest correct under (0.6, 1.0): (1.0, level 0.5) costs 55 + 6 = 61 ms, (0.5, level 1.0) 60 + 10 = 70 ms
    assert rows("lightest") == [("a", 0.6, 0.7, 1.0, "0.5", True), ("a", 0.6, 1.0, 1.0, "0.5", True),
                                ("b", 0.6, 0.7, 1.0, "0.5", False), ("b", 0.6, 1.0, 0.5, "1.0", False)]
    assert labels["infeasible_slos"] == 2
    # Item a's last 40 tokens (its question) are served whole: at ratio 0.5 that is 40 + 30 = 70 tokens, so
    # level 1.0 takes 80 ms and leaves (0.6, 1.0); level 0.5 at ratio 0.5 takes 40 ms.
    meta["items"][0]["kept_tokens"] = 40
    labels = derive_labels(correct, torch.tensor([100, 100]), meta, profile, slos=[(0.6, 1.0)])
    assert [(r["item"], r["ratio"], r["level"]) for r in labels["rules"]["capable"]] == [("a", 1.0, "0.5"),
                                                                                        ("b", 0.5, "1.0")]


def test_label_derived_labels_match_a_brute_force_over_the_grid():
    """The stage's labels from the real shards equal a search over every pair written here from the
    latency report's raw numbers and the rules' definitions (no pipeline cost-model or rule code)."""
    from pipeline.elastilm.slo_labels import load_shards, slo_grid

    labels = json.loads(Path(derived_labels()).read_text())
    profile = json.loads(Path(latency_report()).read_text())["latency_profile"]
    levels_latency, overhead = profile["levels"], profile.get("tlm")  # the TLM's own time, where measured
    correct, tokens, meta = load_shards([(s["correctness"], s["meta"]) for s in labelled_shards()])
    ratios, levels = meta["ratios"], meta["levels"]
    full = levels_latency[max(levels, key=float)]

    def prefill(level, ratio, n, kept):  # the question (kept) is served whole, the rest at the ratio
        own = levels_latency[level]
        return own["ttft_base_ms"] + own["ttft_per_token_ms"] * max(1, kept + round(ratio * (n - kept)))

    def ttft_of(level, ratio, n, kept):  # what feasibility judges: the TLM's time (if measured), then prefill
        first = prefill(level, ratio, n, kept)
        if overhead:
            first += overhead["decide_base_ms"] + overhead["decide_per_token_ms"] * n
            if ratio < 1.0:
                first += overhead["compress_base_ms"] + overhead["compress_per_token_ms"] * (n - kept)
        return first

    expected = {"capable": [], "lightest": []}
    infeasible = 0
    for i, item in enumerate(meta["items"]):
        n, kept = int(tokens[i]), item["kept_tokens"]
        for slo_ttft, slo_tpot in slo_grid():
            ttft_limit = slo_ttft * (full["ttft_base_ms"] + full["ttft_per_token_ms"] * n)
            tpot_limit = slo_tpot * full["tpot_ms"]
            # "lightest" ranks by the TTFT feasibility judges plus one TPOT
            grid = [(ratio, level, ttft_of(level, ratio, n, kept) + levels_latency[level]["tpot_ms"],
                     bool(correct[i, r, m]))
                    for r, ratio in enumerate(ratios) for m, level in enumerate(levels)
                    if ttft_of(level, ratio, n, kept) <= ttft_limit and levels_latency[level]["tpot_ms"] <= tpot_limit]
            if not grid:
                infeasible += 1
                continue
            right = [g for g in grid if g[3]]
            most_capable = max(right or grid, key=lambda g: (float(g[1]), g[0]))
            lightest = min(right, key=lambda g: g[2]) if right else most_capable
            for rule, (ratio, level, _, ok) in (("capable", most_capable), ("lightest", lightest)):
                expected[rule].append((item["id"], slo_ttft, slo_tpot, ratio, level, ok))
    for rule in ("capable", "lightest"):
        got = [(r["item"], r["ttft"], r["tpot"], r["ratio"], r["level"], r["correct"]) for r in labels["rules"][rule]]
        assert got == expected[rule], rule
    assert labels["infeasible_slos"] == infeasible
    assert expected["capable"]  # the grid leaves some SLO classes feasible, so rows were compared


def test_tlm_decision_head_trains_saves_and_picks_feasible_pairs():
    from pipeline.elastilm import tlm
    from pipeline.stage import quiet_context

    out = tlm.run_decision({"tlm": score_tlm_dir(), "labels": derived_labels()},
                           tlm.DecisionSettings(steps=8, batch_size=8), quiet_context(scratch("decision")))
    trained, tokenizer = tlm.load_tlm(out["tlm"])
    before, _ = tlm.load_tlm(score_tlm_dir())
    base = trained.config.base_vocab
    # SLO rows trained; pretrained rows and the frozen trunk identical, so one trunk serves both heads
    emb_after, emb_before = trained.embeddings.word_embeddings.weight, before.embeddings.word_embeddings.weight
    assert not torch.equal(emb_after[base:], emb_before[base:])
    assert torch.equal(emb_after[:base], emb_before[:base])
    for a, b in zip(trained.trunk.state_dict().values(), before.trunk.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(trained.score_layers.state_dict().values(), before.score_layers.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert tokenizer.convert_tokens_to_ids("[TTFT_0.2]") >= base
    ratio, level, ok = tlm.decide(trained, tokenizer, "Question: why?", 0.4, 0.7,
                                  lambda r, m: Level(m) <= Level(0.5) and r <= 0.5)
    assert ok and Level(level) <= Level(0.5) and ratio <= 0.5
    _, _, ok = tlm.decide(trained, tokenizer, "Question: why?", 0.4, 0.7, lambda r, m: False)
    assert not ok
