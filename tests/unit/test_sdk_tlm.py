"""The SDK runs the TLM without transformers, exactly as the pipeline trained it, and `generate` obeys it."""

from __future__ import annotations

import pytest
import torch

from device_sdk.format import Level
from device_sdk.latency import SLO, LatencyProfile, LevelLatency, TLMLatency
from device_sdk.runtime import ElasticModel
from device_sdk.tlm import TLM, TLMError

LONG_TEXT = " ".join(f"word{i} is followed by another, isn't it?" for i in range(60))  # > max_length tokens


@pytest.fixture(scope="module")
def tlm_pair(tmp_path_factory):
    """A fresh MiniLM TLM (random heads, distinct branches) saved, and its SDK twin loaded from disk."""
    from pipeline.elastilm.tlm import new_tlm, save_tlm

    torch.manual_seed(0)
    model, tokenizer = new_tlm(None, ["0.25", "0.5", "1.0"], frozen_layers=3, max_length=64)
    with torch.no_grad():  # make the branches differ from each other and from the backbone
        for param in [*model.decision_layers.parameters(), *model.score_layers.parameters()]:
            param.add_(0.02 * torch.randn_like(param))
    out = save_tlm(model, tokenizer, tmp_path_factory.mktemp("tlm") / "tlm")
    return model, tokenizer, TLM.load(out)


def test_sdk_word_scores_match_the_pipeline(tlm_pair):
    from pipeline.elastilm.tlm import word_scores

    model, tokenizer, sdk = tlm_pair
    for text in ("Which gas do plants take in from the air?", LONG_TEXT):
        ours, reference = sdk.word_scores(text), word_scores(model, tokenizer, text)
        assert len(ours) == len(reference) == len(text.split())
        assert max(abs(a - b) for a, b in zip(ours, reference, strict=True)) < 1e-5


def test_sdk_decision_matches_the_pipeline(tlm_pair):
    from pipeline.elastilm.tlm import decide, decision_log_probs

    model, tokenizer, sdk = tlm_pair
    for prompt, ttft, tpot in (("What is the capital of France?", 0.6, 0.8), (LONG_TEXT, 0.23, 0.5)):
        ratio_ref, level_ref = decision_log_probs(model, tokenizer, prompt, ttft, tpot)
        ratio, level = sdk.decision_log_probs(prompt, ttft, tpot)
        assert torch.allclose(ratio, ratio_ref, atol=1e-5) and torch.allclose(level, level_ref, atol=1e-5)

        def no_full_model(r, m):
            return m != "1.0"

        assert sdk.decide(prompt, ttft, tpot, no_full_model) == decide(model, tokenizer, prompt, ttft, tpot,
                                                                        no_full_model)


def test_long_prompts_keep_the_slo_tokens_and_their_end(tlm_pair):
    """A few-shot block fills the decision window, so the cut drops the middle: two prompts that share
    a long block but end in different questions must look different to the head (pipeline and SDK)."""
    from device_sdk.tlm import head_and_tail
    from pipeline.elastilm.tlm import decision_log_probs

    assert head_and_tail(list(range(10)), 3, 6) == [0, 1, 2, 7, 8, 9]
    assert head_and_tail(list(range(5)), 3, 6) == [0, 1, 2, 3, 4]
    model, tokenizer, sdk = tlm_pair
    first, second = LONG_TEXT + " Is the sky blue?", LONG_TEXT + " Which metal rusts in water?"
    for ttft, tpot in ((0.6, 0.8), (1.0, 1.0)):
        ids = sdk._decision_ids("[TTFT_0.6] [TPOT_0.8] ", first)
        assert len(ids) == sdk.max_length and tokenizer.decode(ids[1:3]) == "[TTFT_0.6] [TPOT_0.8]"
        assert "blue" in tokenizer.decode(ids[-6:])
        differ = [not torch.allclose(sdk.decision_log_probs(first, ttft, tpot)[1],
                                     sdk.decision_log_probs(second, ttft, tpot)[1])]
        reference = decision_log_probs(model, tokenizer, second, ttft, tpot)[1]
        assert all(differ) and torch.allclose(sdk.decision_log_probs(second, ttft, tpot)[1], reference, atol=1e-5)


def test_a_prompt_longer_than_the_window_is_cut_without_a_tokenizer_warning(tlm_pair):
    """The trace's passages run past MiniLM's 512 tokens; the cut is deliberate, so HF must not warn."""
    import copy

    from pipeline.elastilm.tlm import _decision_ids

    model, tokenizer, _ = tlm_pair
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.model_max_length = model.config.max_length  # as MiniLM's 512: the prompt is longer
    assert len(tokenizer(LONG_TEXT, verbose=False)["input_ids"]) > tokenizer.model_max_length
    ids = _decision_ids(model, tokenizer, LONG_TEXT, "[TTFT_0.6] [TPOT_0.8] ")
    assert len(ids) == model.config.max_length
    assert not tokenizer.deprecation_warnings.get("sequence-length-is-longer-than-the-specified-maximum")


def test_missing_tlm_files_are_a_clear_error(tmp_path):
    with pytest.raises(TLMError, match="missing"):
        TLM.load(tmp_path)


def _package_with_tlm(tmp_path, favourite_level: str, favourite_ratio: float):
    """A tiny signed package whose TLM always prefers (favourite_ratio, favourite_level)."""
    from pipeline.elastilm.tlm import install_tlm, new_tlm, save_tlm
    from tests.unit.sdk_packages import sign_package, signing_key, tiny_package

    key = signing_key()
    _, package = tiny_package("llama_gqa", tmp_path / "pkg", key)
    levels = [level.name for level in ElasticModel.load(package, allow_unsigned=True).manifest.elastic.levels]
    model, tokenizer = new_tlm(None, levels, frozen_layers=3, max_length=64)
    with torch.no_grad():
        model.level_head.weight.zero_()
        model.level_head.bias.copy_(torch.tensor([5.0 if m == favourite_level else float(i) for i, m in enumerate(levels)]))
        model.ratio_head.weight.zero_()
        model.ratio_head.bias.copy_(torch.tensor([5.0 if r == favourite_ratio else 0.0 for r in model.config.ratio_grid]))
    install_tlm(package, save_tlm(model, tokenizer, tmp_path / "tlm"))
    sign_package(package, key)
    return package, levels


def _profile(levels: list[str]) -> LatencyProfile:
    """Latency proportional to the level: level m costs m × the full model."""
    return LatencyProfile("fp32", 1, {level.name: LevelLatency(1.0 * level.ratio, 0.5 * level.ratio, 10.0 * level.ratio)
                                       for level in map(Level, levels)})


def test_generate_follows_the_tlm_decision_and_compresses_the_prompt(tmp_path):
    package, levels = _package_with_tlm(tmp_path, favourite_level="0.5", favourite_ratio=0.5)
    model = ElasticModel.load(package, allow_unsigned=True)
    assert model.tlm is not None
    model.latency_profile = _profile(levels)
    prompt = "one two three four five six seven eight nine ten eleven twelve?"
    full = model.generate(prompt, max_new_tokens=2)
    loose = model.generate(prompt, slo=SLO.fraction(ttft=1.0, tpot=1.0), max_new_tokens=2)
    assert (loose.level, loose.decision.prompt_ratio, loose.decision.feasible) == ("0.5", 0.5, True)
    assert loose.prompt_tokens < full.prompt_tokens  # the TLM's ratio compressed the prompt

    # The favourite level is too slow for this SLO: the TLM's best feasible pair is chosen instead.
    tight = model.generate(prompt, slo=SLO.fraction(ttft=1.0, tpot=0.3), max_new_tokens=2)
    assert Level(tight.level) <= Level(0.3) and tight.decision.feasible

    # The full model meets (1, 1) by itself: it is served as is, and the TLM (whose time would break the
    # SLO) is not asked at all.
    model.latency_profile.tlm = TLMLatency(5.0, 0.01, 5.0, 0.01)
    asked = []
    model.tlm.utility = model.tlm.decision_log_probs = lambda *a, **k: asked.append(a)
    exact = model.generate(prompt, slo=SLO.fraction(ttft=1.0, tpot=1.0), max_new_tokens=2)
    assert (exact.level, exact.decision.prompt_ratio, exact.decision.feasible, asked) == (levels[-1], 1.0, True, [])
    del model.tlm.utility, model.tlm.decision_log_probs
    model.latency_profile.tlm = None

    # Nothing meets it: best effort at the smallest level, reported as not met.
    hopeless = model.generate(prompt, slo=SLO(ttft_ms=1e-6, tpot_ms=1e-6), max_new_tokens=2)
    assert hopeless.level == levels[0] and not hopeless.decision.feasible and not hopeless.slo_met



def test_keep_is_served_whole_and_only_the_rest_compresses(tmp_path):
    """A few-shot block or passage compresses; the question after it (`keep`) reaches the model as written."""
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
    whole = model.generate(context + question, slo=slo, max_new_tokens=2)
    assert compressed_texts == [context, context + question]
    assert kept.decision.prompt_ratio == 0.5
    assert kept.prompt_tokens == len(model.tokenizer.encode(compress(context, 0.5) + question).ids)
    assert kept.prompt_tokens > whole.prompt_tokens
    assert model.generate(question, slo=slo, max_new_tokens=2, keep=question).prompt_tokens == len(
        model.tokenizer.encode(question).ids)  # nothing before it: nothing to compress
    with pytest.raises(ValueError, match="end of the prompt"):
        model.generate(context, slo=slo, max_new_tokens=2, keep="not its end")
