"""TLM score head: word-level compression, forced tokens, and answer accuracy vs random dropping."""

from __future__ import annotations

import pytest

from tests.support.elastilm_fixtures import (
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
    from pipeline.elastilm.tlm import compress, load_tlm, words_of

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
    from pipeline.elastilm.tlm import compress_by_scores

    result = compress_by_scores("a b c d e f", [0.1, 0.9, 0.2, 0.8, 0.3, 0.7], 0.5)
    assert result.text == "b d f" and result.rate == 0.5
    forced = compress_by_scores("a b c? d", [0.9, 0.8, 0.0, 0.1], 0.25, force_tokens=["?"])
    assert forced.text == "c?" and forced.rate == 0.25


def test_tlm_align_compressed_labels_words_in_order():
    from pipeline.elastilm.tlm import align_compressed

    assert align_compressed("the cat sat on the mat", "cat the mat") == [0, 1, 0, 0, 1, 1]


def test_tlm_score_head_beats_random_dropping_on_held_out_items():
    """At half the words, the TLM's choice keeps more of what the full model needs to answer than
    dropping words at random does: strictly more items right, and a gold-answer margin higher by
    more than two paired standard errors, on 120 held-out SciQ items. The random baseline is written
    here (Python's `random`, question marks kept like the TLM's forced tokens), not the TLM's rule."""
    import random
    import statistics

    from transformers import AutoTokenizer

    from pipeline.data.tasks import load_items
    from pipeline.elastilm.label import choice_scores
    from pipeline.elastilm.tlm import compress, load_tlm
    from pipeline.models.elastic import serving_model

    package = smollm2_elastic_package()
    model = serving_model(package)  # labelling scores with the device SDK's model
    model.set_level("1.0")
    tokenizer = AutoTokenizer.from_pretrained(str(package / "model"))
    tlm, tlm_tokenizer = load_tlm(score_tlm_dir())
    items = load_items(["sciq"], start=200, stop=320)  # held out: labelling uses the first items

    def dropped_at_random(question: str, seed: int) -> str:
        words = question.split()
        forced = [i for i, word in enumerate(words) if "?" in word]
        others = [i for i in range(len(words)) if i not in forced]
        kept = forced + random.Random(seed).sample(others, max(0, round(0.5 * len(words)) - len(forced)))
        return " ".join(words[i] for i in sorted(kept))

    seeds = 3  # random dropping's expectation: the mean over seeds, not one lucky or unlucky draw

    def judged(item, questions: list[str]) -> list[tuple[bool, float]]:
        """Per question: (right, gold choice's mean log-probability minus the best wrong choice's)."""
        rows = choice_scores(model, tokenizer, [item.prompt(q) for q in questions], item.choices)
        verdicts = []
        for scores in rows:  # one batch per item: the TLM's question and each seed's
            wrong = max(float(s) for c, s in enumerate(scores) if c != item.gold)
            verdicts.append((int(scores.argmax()) == item.gold, float(scores[item.gold]) - wrong))
        return verdicts

    per_item = [judged(it, [compress(tlm, tlm_tokenizer, it.question, 0.5, ["?"]).text]
                       + [dropped_at_random(it.question, seed * 1000 + i) for seed in range(seeds)])
                for i, it in enumerate(items)]
    by_score = [rows[0] for rows in per_item]
    by_random = [[rows[1 + seed] for rows in per_item] for seed in range(seeds)]
    right_score = sum(right for right, _ in by_score)
    right_random = sum(right for draw in by_random for right, _ in draw) / seeds
    assert right_score > right_random, (right_score, right_random)
    gains = [margin - statistics.fmean(draw[i][1] for draw in by_random) for i, (_, margin) in enumerate(by_score)]
    gain, se = statistics.fmean(gains), statistics.stdev(gains) / len(gains) ** 0.5
    assert gain > 2 * se, (gain, se)


def test_tlm_rejects_a_bad_rate():
    from pipeline.elastilm.tlm import TLMError, compress_by_scores

    with pytest.raises(TLMError, match="rate"):
        compress_by_scores("a b", [0.1, 0.2], 0.0)
