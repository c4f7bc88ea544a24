"""`generate` obeys the package's TLM (a random one with fixed heads): its (prompt ratio, level) decision,
judged by the device's profile, and its compression of all but `keep` (by default the prompt's question). Against the pipeline's own TLM:
test_roundtrip_sdk_tlm.py."""

from __future__ import annotations

import pytest
import torch

from device_sdk.format import Level
from device_sdk.latency import SLO, LatencyProfile, LevelLatency, TLMLatency
from device_sdk.runtime import ElasticModel
from device_sdk.tlm import TLM, TLMError
from tests.support.sdk_packages import LEVELS, TLM_HIDDEN, TLM_RATIOS, random_package, random_tlm, signing_key


def test_missing_tlm_files_are_a_clear_error(tmp_path):
    with pytest.raises(TLMError, match="missing"):
        TLM.load(tmp_path)


def _package_with_tlm(tmp_path, favourite_level: str, favourite_ratio: float):
    """A tiny signed package whose TLM always prefers (favourite_ratio, favourite_level)."""
    levels = [Level(ratio).name for ratio in LEVELS]
    heads = {
        "level_head.weight": torch.zeros(len(levels), TLM_HIDDEN),
        "level_head.bias": torch.tensor([5.0 if m == favourite_level else float(i) for i, m in enumerate(levels)]),
        "ratio_head.weight": torch.zeros(len(TLM_RATIOS), TLM_HIDDEN),
        "ratio_head.bias": torch.tensor([5.0 if r == favourite_ratio else 0.0 for r in TLM_RATIOS]),
    }
    tlm = random_tlm(tmp_path / "tlm", levels, heads=heads)
    return random_package("llama_gqa", tmp_path / "pkg", signing_key(), tlm=tlm), levels


def _profile(levels: list[str]) -> LatencyProfile:
    """Latency proportional to the level: level m costs m × the full model."""
    return LatencyProfile("fp32", 1, {level.name: LevelLatency(1.0 * level.ratio, 0.5 * level.ratio, 10.0 * level.ratio)
                                       for level in map(Level, levels)})


def test_generate_follows_the_tlm_decision_and_compresses_the_prompt(tmp_path):
    package, levels = _package_with_tlm(tmp_path, favourite_level="0.5", favourite_ratio=0.5)
    model = ElasticModel.load(package, allow_unsigned=True)
    assert model.tlm is not None
    model.latency_profile = _profile(levels)
    prompt = "one two three four five six seven eight nine ten eleven twelve?"  # keep="": all of it compresses
    full = model.generate(prompt, max_new_tokens=2)
    loose = model.generate(prompt, slo=SLO.fraction(ttft=1.0, tpot=1.0), max_new_tokens=2, keep="")
    assert (loose.level, loose.decision.prompt_ratio, loose.decision.feasible) == ("0.5", 0.5, True)
    assert loose.prompt_tokens < full.prompt_tokens  # the TLM's ratio compressed the prompt

    # The favourite level is too slow for this SLO: the TLM's best feasible pair is chosen instead.
    tight = model.generate(prompt, slo=SLO.fraction(ttft=1.0, tpot=0.3), max_new_tokens=2, keep="")
    assert Level(tight.level) <= Level(0.3) and tight.decision.feasible

    # The full model meets (1, 1) by itself: it is served as is, and the TLM (whose time would break the
    # SLO) is not asked at all.
    model.latency_profile.tlm = TLMLatency(5.0, 0.01, 5.0, 0.01)
    asked = []
    model.tlm.utility = model.tlm.decision_log_probs = lambda *a, **k: asked.append(a)
    exact = model.generate(prompt, slo=SLO.fraction(ttft=1.0, tpot=1.0), max_new_tokens=2, keep="")
    assert (exact.level, exact.decision.prompt_ratio, exact.decision.feasible, asked) == (levels[-1], 1.0, True, [])
    del model.tlm.utility, model.tlm.decision_log_probs
    model.latency_profile.tlm = None

    # Nothing meets it: best effort at the smallest level, reported as not met.
    hopeless = model.generate(prompt, slo=SLO(ttft_ms=1e-6, tpot_ms=1e-6), max_new_tokens=2, keep="")
    assert hopeless.level == levels[0] and not hopeless.decision.feasible and not hopeless.slo_met



def test_keep_is_served_whole_and_only_the_rest_compresses(tmp_path):
    """A few-shot block or passage compresses; the question after it (`keep`, by default found by
    `question_tail`) reaches the model as written; `keep=""` compresses it all."""
    package, levels = _package_with_tlm(tmp_path, favourite_level="0.5", favourite_ratio=0.5)
    model = ElasticModel.load(package, allow_unsigned=True)
    model.latency_profile = _profile(levels)
    context = "one two three four five six seven eight nine ten eleven twelve"
    question = "\n\nQuestion: which number comes after twelve?\nAnswer:"
    compressed_texts = []
    compress = model.compress
    model.compress = lambda text, ratio: compressed_texts.append(text) or compress(text, ratio)
    slo = SLO.fraction(ttft=1.0, tpot=1.0)
    kept = model.generate(context + question, slo=slo, max_new_tokens=2, keep=question)
    found = model.generate(context + question, slo=slo, max_new_tokens=2)  # the question found, not told
    whole = model.generate(context + question, slo=slo, max_new_tokens=2, keep="")
    assert compressed_texts == [context, context, context + question]
    assert found.served_prompt == kept.served_prompt == compress(context, 0.5) + question
    assert kept.decision.prompt_ratio == 0.5
    assert kept.prompt_tokens == len(model.tokenizer.encode(compress(context, 0.5) + question).ids)
    assert kept.prompt_tokens > whole.prompt_tokens
    assert model.generate(question, slo=slo, max_new_tokens=2, keep=question).prompt_tokens == len(
        model.tokenizer.encode(question).ids)  # nothing before it: nothing to compress
    with pytest.raises(ValueError, match="end of the prompt"):
        model.generate(context, slo=slo, max_new_tokens=2, keep="not its end")
