"""TLM score head: word-level compression, forced tokens, and answer accuracy vs random dropping."""

from __future__ import annotations

import pytest

from tests.unit.elastilm_fixtures import (
    score_tlm_dir,
    single_thread,  # noqa: F401  (fixture)
    smollm2_elastic_package,
)

TEXT = (
    "The mitochondria is the organelle that produces most of the chemical energy needed to power the "
    "biochemical reactions of the cell, and it stores that energy in a molecule called ATP. Which part "
    "of the cell makes energy? Plants also have chloroplasts that capture light for photosynthesis."
)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_tlm_compress_keeps_half_the_words_and_forced_tokens():
    from pipeline.tlm import compress, load_tlm, words_of

    tlm, tokenizer = load_tlm(score_tlm_dir())
    result = compress(tlm, tokenizer, TEXT, 0.5, force_tokens=["?", "ATP."])
    words = words_of(TEXT)
    assert abs(len(result.kept) / len(words) - 0.5) <= 0.05
    assert result.rate == pytest.approx(len(result.kept) / len(words))
    kept_words = words_of(result.text)
    assert "energy?" in kept_words and "ATP." in kept_words
    assert result.kept == sorted(result.kept)  # original order
    assert kept_words == [words[i] for i in result.kept]


def test_tlm_compress_by_scores_keeps_the_highest_scores_in_order():
    from pipeline.tlm import compress_by_scores

    result = compress_by_scores("a b c d e f", [0.1, 0.9, 0.2, 0.8, 0.3, 0.7], 0.5)
    assert result.text == "b d f" and result.rate == 0.5
    forced = compress_by_scores("a b c? d", [0.9, 0.8, 0.0, 0.1], 0.25, force_tokens=["?"])
    assert forced.text == "c?" and forced.rate == 0.25


def test_tlm_align_compressed_labels_words_in_order():
    from pipeline.tlm import align_compressed

    assert align_compressed("the cat sat on the mat", "cat the mat") == [0, 1, 0, 0, 1, 1]


def test_tlm_score_head_beats_random_dropping_on_held_out_items():
    from transformers import AutoTokenizer

    from pipeline.elastic_model import serving_model
    from pipeline.label import answer_correct, load_items
    from pipeline.tlm import compress, load_tlm, random_compress

    package = smollm2_elastic_package()
    model = serving_model(package)  # labelling scores with the device SDK's model
    model.set_level("1.0")
    tokenizer = AutoTokenizer.from_pretrained(str(package / "model"))
    tlm, tlm_tokenizer = load_tlm(score_tlm_dir())
    items = load_items(["sciq"], start=200, stop=220)  # held out: labelling uses the first items
    by_score = sum(answer_correct(model, tokenizer, it, compress(tlm, tlm_tokenizer, it.question, 0.5, ["?"]).text)
                   for it in items)
    # random dropping's expected accuracy: the mean over a few seeds, not one lucky or unlucky draw
    seeds = 3
    by_random = sum(answer_correct(model, tokenizer, it, random_compress(it.question, 0.5, seed=seed * 1000 + i,
                                                                         force_tokens=["?"]).text)
                    for seed in range(seeds) for i, it in enumerate(items)) / seeds
    assert by_score >= by_random, (by_score, by_random)


def test_tlm_rejects_a_bad_rate():
    from pipeline.tlm import TLMError, compress_by_scores

    with pytest.raises(TLMError, match="rate"):
        compress_by_scores("a b", [0.1, 0.2], 0.0)
