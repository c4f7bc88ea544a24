"""Usable levels: the report card's verdict reaches the manifest, and the SDK's SLO decision respects it."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from device_sdk.format import MANIFEST, Manifest, read_manifest
from device_sdk.latency import SLO, choose_level, usable_levels
from device_sdk.runtime import ElasticModel
from device_sdk.tlm import best_feasible_pair, tlm_decider
from pipeline.elastilm.evaluate import apply_quality
from tests.support.sdk_packages import fixed_profile_model


@pytest.fixture
def model(gqa_package) -> ElasticModel:
    return fixed_profile_model(gqa_package)


def mark_unusable(model: ElasticModel, *names: str) -> None:
    for name in names:
        model.manifest.elastic.level(name).usable = False


def test_usable_flags_reach_the_manifest_and_old_manifests_read_as_usable(gqa_package, tmp_path):
    import shutil

    copy = tmp_path / "pkg"
    shutil.copytree(gqa_package, copy)
    card = {"levels": {"0.25": {"ppl:lambada": 90.0, "ppl_ratio:lambada": 4.5, "repeat_4gram_rate": 0.8,
                                "usable": False, "unusable_because": ["lambada perplexity is 4.50×"]},
                       "0.5": {"ppl:lambada": 40.0, "ppl_ratio:lambada": 2.0, "top1_agreement": 0.7,
                               "accuracy": 0.5, "accuracy_stderr": 0.05, "usable": True},
                       "1.0": {"ppl:lambada": 20.0, "ppl_ratio:lambada": 1.0, "usable": True}}}
    apply_quality(copy, card)
    manifest = read_manifest(copy)
    assert [(shape.name, shape.usable) for shape in manifest.elastic.levels] == [
        ("0.25", False), ("0.5", True), ("0.75", True), ("1.0", True)]
    assert manifest.elastic.level("0.25").quality == {"ppl:lambada": 90.0, "ppl_ratio:lambada": 4.5,
                                                      "repeat_4gram_rate": 0.8}
    assert manifest.elastic.level("0.5").quality["accuracy_stderr"] == 0.05
    assert json.loads((copy / MANIFEST).read_text())["elastic"]["levels"][0]["usable"] is False

    # A package written before the verdict existed has no `usable` field: every level is usable.
    data = manifest.to_dict()
    for level in data["elastic"]["levels"]:
        del level["usable"]
    assert all(shape.usable for shape in Manifest.from_dict(data).elastic.levels)
    data["elastic"]["levels"][0]["usable"] = "no"
    with pytest.raises(ValueError, match="usable must be true or false"):
        Manifest.from_dict(data).validate()


def test_slo_decision_and_its_fallback_skip_unusable_levels(model):
    mark_unusable(model, "0.5", "0.25")
    # TPOT 2.5 ms fits 0.5 (2 ms) and 0.25 (1 ms): neither is usable, and nothing usable fits.
    out = model.generate("hello", slo=SLO(tpot_ms=2.5), max_new_tokens=2)
    assert out.level == "0.75" and not out.decision.feasible  # best effort: the smallest usable level
    assert model.generate("hello", slo=SLO(tpot_ms=3.5), max_new_tokens=2).level == "0.75"
    impossible = model.generate("hello", slo=SLO(ttft_ms=1e-6, tpot_ms=1e-6), max_new_tokens=2)
    assert impossible.level == "0.75"
    assert model.generate("hello", slo=SLO(ttft_ms=1e6, tpot_ms=1e6), max_new_tokens=2).level == "1.0"


def test_a_forced_unusable_level_still_runs_with_a_warning(model, caplog):
    mark_unusable(model, "0.25")
    model.manifest.elastic.level("0.25").quality["ppl_ratio:lambada"] = 4.5
    with caplog.at_level(logging.WARNING, logger="device_sdk.runtime"):
        out = model.generate("hello", level="0.25", max_new_tokens=2)
    assert out.level == "0.25"
    assert "level 0.25 is marked unusable" in caplog.text and "ppl_ratio:lambada 4.5" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="device_sdk.runtime"):
        model.generate("hello", level="0.5", max_new_tokens=2)
    assert "unusable" not in caplog.text


def test_a_copy_holding_no_usable_level_serves_its_largest(model):
    levels = [model.manifest.elastic.level(name) for name in ("0.25", "0.5")]
    for shape in levels:
        shape.usable = False
    assert [shape.name for shape in usable_levels(levels)] == ["0.5"]
    decision = choose_level("hello", 1, SLO(tpot_ms=1.5), model.latency_profile, levels)
    assert decision.level == "0.5" and not decision.feasible


class PrefersTheSmallestLevel:
    """A TLM stand-in whose level head puts most mass on the smallest level."""

    ratios = [0.5, 1.0]

    def __init__(self, levels: list[str]) -> None:
        self.levels = levels

    def decide(self, prompt, ttft_fraction, tpot_fraction, is_feasible):
        level_log_probs = torch.tensor([-0.1 * (i + 1) for i in range(len(self.levels))])
        return best_feasible_pair(torch.tensor([-0.5, -0.7]), level_log_probs, self.ratios, self.levels, is_feasible)


def test_tlm_decision_and_its_fallback_skip_unusable_levels(model):
    decide = tlm_decider(PrefersTheSmallestLevel(model.available_levels()))
    levels = [model.manifest.elastic.level(name) for name in model.available_levels()]
    profile = model.latency_profile
    assert decide("hello", 1, SLO(ttft_ms=1e6, tpot_ms=1e6), profile, levels).level == "0.25"
    mark_unusable(model, "0.25")
    relaxed = decide("hello", 1, SLO(ttft_ms=1e6, tpot_ms=1e6), profile, levels)
    assert relaxed.level == "0.5" and relaxed.feasible
    impossible = decide("hello", 1, SLO(ttft_ms=1e-6, tpot_ms=1e-6), profile, levels)
    assert impossible.level == "0.5" and not impossible.feasible  # the lightest usable level
