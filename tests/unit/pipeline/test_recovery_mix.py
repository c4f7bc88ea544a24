"""Recovery windows drawn per kind of corpus text in set proportions (pipeline.data.calibration.mixed_windows)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from pipeline.data.calibration import CalibrationError, mixed_windows
from pipeline.data.recovery_text import CorpusError, corpus_kind
from pipeline.settings import RecoverSettings
from tests.support.tiny import byte_tokenizer

LENGTH = 16


def _kinds() -> dict[str, list[str]]:
    # Each kind is made of one letter, so every window tells which kind it came from.
    return {"generated": ["g" * 40], "passages": ["p" * 2000], "ptb": ["t" * 2000]}


def _kind_of(window: torch.Tensor, tokenizer) -> str:
    letters = set(tokenizer.decode(window.tolist()))
    assert len(letters) == 1, f"a window mixes kinds: {letters}"
    return {"g": "generated", "p": "passages", "t": "ptb"}[letters.pop()]


def test_windows_follow_the_shares_and_repeat_a_small_kind():
    tokenizer = byte_tokenizer()
    windows, stats = mixed_windows(tokenizer, _kinds(), {"generated": 0.5, "passages": 0.3, "ptb": 0.2}, 20, LENGTH)
    assert windows.shape == (20, LENGTH)
    drawn = [_kind_of(w, tokenizer) for w in windows]
    assert {k: drawn.count(k) for k in set(drawn)} == {"generated": 10, "passages": 6, "ptb": 4}
    assert {k: s["windows"] for k, s in stats.items()} == {"generated": 10, "passages": 6, "ptb": 4}
    # 40 letters hold 2 windows of 16 tokens: 10 windows are 5 passes over them.
    assert stats["generated"]["available"] == 2 and stats["generated"]["passes"] == 5.0
    assert stats["passages"]["passes"] < 1
    # shuffled across kinds, not one block per kind
    assert drawn != sorted(drawn)


def test_counts_add_up_by_largest_remainder_and_are_seeded():
    tokenizer = byte_tokenizer()
    shares = {"generated": 1.0, "passages": 1.0, "ptb": 1.0}
    windows, stats = mixed_windows(tokenizer, _kinds(), shares, 7, LENGTH, seed=3)
    assert sum(s["windows"] for s in stats.values()) == 7
    assert sorted(s["windows"] for s in stats.values()) == [2, 2, 3]
    again, _ = mixed_windows(tokenizer, _kinds(), shares, 7, LENGTH, seed=3)
    other, _ = mixed_windows(tokenizer, {k: [v[0] + "x" * 64] for k, v in _kinds().items()}, shares, 7, LENGTH, seed=4)
    assert torch.equal(windows, again)
    assert not torch.equal(windows, other)


def test_absent_kinds_are_renormalised_away_but_not_all_of_them():
    tokenizer = byte_tokenizer()
    only_ptb = {"ptb": ["t" * 400]}
    windows, stats = mixed_windows(tokenizer, only_ptb, {"generated": 0.5, "ptb": 0.5}, 6, LENGTH)
    assert set(stats) == {"ptb"} and len(windows) == 6
    with pytest.raises(CalibrationError, match="none of the kinds"):
        mixed_windows(tokenizer, only_ptb, {"generated": 1.0, "ptb": 0.0}, 6, LENGTH)
    with pytest.raises(CalibrationError, match="fewer than one"):
        mixed_windows(tokenizer, {"ptb": ["t" * 5]}, {"ptb": 1.0}, 2, LENGTH)


def test_record_sources_map_to_kinds():
    assert corpus_kind("generated:squad") == "generated"
    assert corpus_kind("squad-passages") == "passages"
    assert corpus_kind("ptb-train") == "ptb"
    with pytest.raises(CorpusError, match="no known kind"):
        corpus_kind("wikipedia")


@pytest.mark.parametrize("mix", [{"generated": 0.0, "ptb": 0.0}, {"wiki": 1.0}, {"ptb": -0.5}])
def test_a_mix_without_weight_or_with_unknown_kinds_is_refused(mix):
    with pytest.raises(ValidationError, match="mix"):
        RecoverSettings(level="0.5", mix=mix)


def test_the_token_stream_is_made_once_per_tokenizer_and_text():
    """Each level's recovery tokenizes the same corpus: the second time, from a tokenizer loaded anew,
    comes from memory, and only an identical tokenizer and text are served it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pipeline.data.calibration import token_stream

    text = "the recovery corpus, " * 50
    first = token_stream(byte_tokenizer(), text)
    again = token_stream(byte_tokenizer(), text)  # another object, the same tokenizer
    assert again is first and first.tolist() == byte_tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert token_stream(byte_tokenizer(), text + "!").tolist() == first.tolist() + [ord("!")]
    # another vocabulary over the same text: its own ids, not the cached ones
    vocab = {bytes([i]).decode("latin-1"): 255 - i for i in range(256)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="\xff"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    reversed_ids = token_stream(PreTrainedTokenizerFast(tokenizer_object=core), text)
    assert reversed_ids.tolist() == [255 - i for i in first.tolist()]
