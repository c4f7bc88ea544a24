"""The TLM the pipeline trains, run by the device SDK without transformers: the same word scores and
decisions as the pipeline's own model."""

from __future__ import annotations

import pytest
import torch

from device_sdk.tlm import TLM, head_and_tail
from pipeline.elastilm.tlm import _decision_ids, decide, decision_log_probs, new_tlm, save_tlm, word_scores

LONG_TEXT = " ".join(f"word{i} is followed by another, isn't it?" for i in range(60))  # > max_length tokens


@pytest.fixture(scope="module")
def tlm_pair(tmp_path_factory):
    """A fresh MiniLM TLM (random heads, distinct branches) saved, and its SDK twin loaded from disk."""
    torch.manual_seed(0)
    model, tokenizer = new_tlm(None, ["0.25", "0.5", "1.0"], frozen_layers=3, max_length=64)
    with torch.no_grad():  # make the branches differ from each other and from the backbone
        for param in [*model.decision_layers.parameters(), *model.score_layers.parameters()]:
            param.add_(0.02 * torch.randn_like(param))
    out = save_tlm(model, tokenizer, tmp_path_factory.mktemp("tlm") / "tlm")
    return model, tokenizer, TLM.load(out)


def test_sdk_word_scores_match_the_pipeline(tlm_pair):
    model, tokenizer, sdk = tlm_pair
    for text in ("Which gas do plants take in from the air?", LONG_TEXT):
        ours, reference = sdk.word_scores(text), word_scores(model, tokenizer, text)
        assert len(ours) == len(reference) == len(text.split())
        assert max(abs(a - b) for a, b in zip(ours, reference, strict=True)) < 1e-5


def test_sdk_decision_matches_the_pipeline(tlm_pair):
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

    model, tokenizer, _ = tlm_pair
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.model_max_length = model.config.max_length  # as MiniLM's 512: the prompt is longer
    assert len(tokenizer(LONG_TEXT, verbose=False)["input_ids"]) > tokenizer.model_max_length
    ids = _decision_ids(model, tokenizer, LONG_TEXT, "[TTFT_0.6] [TPOT_0.8] ")
    assert len(ids) == model.config.max_length
    assert not tokenizer.deprecation_warnings.get("sequence-length-is-longer-than-the-specified-maximum")
