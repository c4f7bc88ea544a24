"""TLM inference on the device: word-level prompt compression and the (prompt ratio, level) decision.

The TLM is one BERT-style encoder: a frozen trunk, then a score branch (keep/drop per token)
and a decision branch, whose head the config names (`decision_head`; absent in older
packages, which read as "slo_token"): ElastiLM's prompt-ratio and level heads over
`[TTFT_x] [TPOT_y] prompt`, or the utility head (P(right) per (ratio, level) cell over the
prompt alone, masked here by this device's profile). The pipeline trains it (pipeline/elastilm/tlm.py)
and uses the word and decision rules defined here, so that what the labels were made with is
exactly what a device runs.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from device_sdk.encoder import Encoder, load_tokenizer
from device_sdk.format import Level, LevelShape
from device_sdk.latency import (
    SLO,
    Decision,
    LatencyProfile,
    choose_level,
    feasible,
    predicted_ttft_ms,
    usable_levels,
)

WORD = re.compile(r"\S+")
CONFIG_FILE = "tlm_config.json"
WEIGHTS_FILE = "tlm.safetensors"
TOKENIZER_FILE = "tokenizer.json"


class TLMError(ValueError):
    """Bad TLM settings, data, or a TLM directory that cannot be loaded."""


# --------------------------------------------------------------------------- words


def word_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of whitespace-separated words: the unit every tokenizer is mapped through."""
    return [m.span() for m in WORD.finditer(text)]


def words_of(text: str) -> list[str]:
    return [text[a:b] for a, b in word_spans(text)]


def encode_words(tokenizer: Tokenizer, words: list[str], max_length: int) -> list[tuple[list[int], list[int | None]]]:
    """Chunks of (input ids, word index per token) that fit `max_length`; words never split across chunks."""
    chunks, start = [], 0
    while start < len(words):
        end = len(words)
        while True:
            encoded = tokenizer.encode(words[start:end], is_pretokenized=True)
            if len(encoded.ids) <= max_length or end - start == 1:
                break
            end = start + max(1, (end - start) * max_length // len(encoded.ids) - 1)
        ids = encoded.ids[:max_length]
        word_ids = [None if w is None else w + start for w in encoded.word_ids][:max_length]
        chunks.append((ids, word_ids))
        start = end
    return chunks


QUESTION_MARKERS = ("Question:", "Q:")  # a line opening with one starts the question (the labelled layout)


def question_tail(prompt: str) -> str:
    """The end of a completion prompt that compression leaves whole unless told otherwise: its question.

    It runs to the end of the prompt from the start of the last line that opens with a question marker
    ("Question:" or "Q:"; the labelled layout "…passage…\\nQuestion: …\\nAnswer:", whose question the label
    stage keeps whole, so a prompt is served as its labels were made), else of the last line of the last
    paragraph that holds a "?", else of the last line with text. Whole lines, never a part of one: a
    question's own context ("Tom has 3 apples. How many…?") stays with it, and a one-line prompt is all
    question, so nothing in it is compressed.
    """
    starts = [0] + [m.end() for m in re.finditer("\n", prompt)]  # where each line starts
    lines = [prompt[start:end] for start, end in zip(starts, [*starts[1:], len(prompt)], strict=True)]
    marked = [i for i, line in enumerate(lines) if line.lstrip().startswith(QUESTION_MARKERS)]
    written = [i for i, line in enumerate(lines) if line.strip()]
    if marked:
        first = marked[-1]
    elif written:
        blank = max((i for i in range(written[-1]) if not lines[i].strip()), default=-1)  # the last paragraph's edge
        first = ([i for i in written if i > blank and "?" in lines[i]] or written)[-1]
    else:
        return prompt
    return prompt[starts[first]:]


@dataclass
class Compressed:
    text: str
    kept: list[int]  # indices of kept words, ascending
    rate: float  # achieved: kept words / words


def compress_by_scores(text: str, scores: Sequence[float], rate: float, force_tokens: Sequence[str] = ()) -> Compressed:
    """Keep round(rate · words) words with the highest scores, in order; forced words always stay.

    A word is forced when it equals a force token or contains one (e.g. "?" keeps "Paris?").
    Kept words are joined by a newline where the original gap held one, else a space.
    """
    if not 0.0 < rate <= 1.0:
        raise TLMError(f"rate must be in (0, 1], got {rate}")
    spans = word_spans(text)
    if len(scores) != len(spans):
        raise TLMError(f"{len(scores)} scores for {len(spans)} words")
    if not spans:
        return Compressed(text, [], 1.0)
    forced = {i for i, (a, b) in enumerate(spans) if any(tok and tok in text[a:b] for tok in force_tokens)}
    target = max(len(forced), round(rate * len(spans)))
    rest = sorted((i for i in range(len(spans)) if i not in forced), key=lambda i: (-scores[i], i))
    kept = sorted(forced | set(rest[: target - len(forced)]))
    pieces = []
    for position, index in enumerate(kept):
        if position:
            gap = text[spans[kept[position - 1]][1] : spans[index][0]]
            pieces.append("\n" if "\n" in gap else " ")
        pieces.append(text[spans[index][0] : spans[index][1]])
    return Compressed("".join(pieces), kept, len(kept) / len(spans))


# --------------------------------------------------------------------------- SLO tokens and the decision rule


def slo_token_names(ttft_bins: Sequence[float], tpot_bins: Sequence[float]) -> list[str]:
    return [f"[TTFT_{b:.1f}]" for b in ttft_bins] + [f"[TPOT_{b:.1f}]" for b in tpot_bins]


def slo_prefix(ttft_bins: Sequence[float], tpot_bins: Sequence[float], ttft_fraction: float, tpot_fraction: float) -> str:
    """The SLO tokens for a pair of fractions, snapped down to the nearest bin (never looser)."""

    def snap(value, bins):
        fitting = [b for b in bins if b <= value + 1e-9]
        return max(fitting) if fitting else min(bins)

    return f"[TTFT_{snap(ttft_fraction, ttft_bins):.1f}] [TPOT_{snap(tpot_fraction, tpot_bins):.1f}] "


def head_and_tail(ids: list[int], head: int, max_length: int) -> list[int]:
    """`ids` cut to `max_length` by dropping from the middle: the first `head` ids (the [CLS] and
    SLO tokens) and the last ones. A few-shot block or a passage comes before the question, so
    the end of a long prompt is what tells one request from another."""
    if len(ids) <= max_length:
        return list(ids)
    return list(ids[:head]) + list(ids[len(ids) - (max_length - head):])


def best_feasible_pair(ratio_log_probs: torch.Tensor, level_log_probs: torch.Tensor, ratios: Sequence[float],
                       levels: Sequence[str], is_feasible: Callable[[float, str], bool]) -> tuple[float, str, bool]:
    """(prompt ratio, level, feasible): the feasible pair with the highest joint log-probability.

    When no pair is feasible, the lightest pair (smallest level, smallest ratio) is returned, flagged.
    """
    best, best_score = None, -math.inf
    for i, ratio in enumerate(ratios):
        for j, level in enumerate(levels):
            score = float(ratio_log_probs[i] + level_log_probs[j])
            if score > best_score and is_feasible(ratio, level):
                best, best_score = (ratio, level), score
    if best is None:
        return min(ratios), min(levels, key=Level), False
    return best[0], best[1], True


UTILITY_TIE = 1e-6  # utilities this close are a tie, and the cheaper cell wins


def best_utility_cell(utility: torch.Tensor, ratios: Sequence[float], levels: Sequence[str],
                      is_feasible: Callable[[float, str], bool],
                      cost: Callable[[float, str], float]) -> tuple[float, str, bool]:
    """(prompt ratio, level, feasible): the feasible cell with the highest utility [ratios, levels],
    ties (within UTILITY_TIE) to the cheapest by `cost`. When no cell is feasible, the lightest pair
    (smallest level, smallest ratio) is returned, flagged."""
    cells = [(float(utility[i, j]), ratio, level) for i, ratio in enumerate(ratios) for j, level in enumerate(levels)
             if is_feasible(ratio, level)]
    if not cells:
        return min(ratios), min(levels, key=Level), False
    top = max(u for u, _, _ in cells)
    _, ratio, level = min((c for c in cells if c[0] >= top - UTILITY_TIE), key=lambda c: (cost(c[1], c[2]), c[1]))
    return ratio, level, True


# --------------------------------------------------------------------------- the model


class TLM:
    """A trained TLM directory (`tlm_config.json`, `tlm.safetensors`, `tokenizer.json`), run without transformers."""

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor], tokenizer_file: Path):
        self.config = config
        self.max_length = config["max_length"]
        self.tokenizer = load_tokenizer(tokenizer_file)  # for words: chunked by encode_words
        self.prompt_tokenizer = load_tokenizer(tokenizer_file)  # for decisions: specials kept, cut by head_and_tail
        self.prompt_tokenizer.no_truncation()
        self.encoder = Encoder(tensors, config["backbone"])
        frozen = config["frozen_layers"]
        branch = config["backbone"]["num_hidden_layers"] - frozen
        self.trunk = [f"trunk.{i}." for i in range(frozen)]
        self.score_layers = [f"score_layers.{i}." for i in range(branch)]
        self.decision_layers = [f"decision_layers.{i}." for i in range(branch)]
        self.ratios = [float(r) for r in config["ratio_grid"]]
        self.levels = [Level(m).name for m in config["level_grid"]]
        self.decision_head = config.get("decision_head", "slo_token")
        if self.decision_head not in ("slo_token", "utility"):
            raise TLMError(f"this SDK does not know the decision head {self.decision_head!r}; update elastify-device")
        # A utility head kept at its prior (zero weights: on held-in items no training beat the cells' base
        # rates) says the same for every prompt, so a decision need not run the encoder at all.
        self.prompt_blind = self.decision_head == "utility" and not tensors["utility_head.weight"].any()

    @classmethod
    def load(cls, tlm_dir: Path) -> TLM:
        tlm_dir = Path(tlm_dir)
        missing = [n for n in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE) if not (tlm_dir / n).is_file()]
        if missing:
            raise TLMError(f"{tlm_dir} is not a TLM directory: missing {missing}")
        config = json.loads((tlm_dir / CONFIG_FILE).read_text())
        tensors = {k: v.float() for k, v in load_file(str(tlm_dir / WEIGHTS_FILE)).items()}
        return cls(config, tensors, tlm_dir / TOKENIZER_FILE)

    def _head(self, hidden: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.encoder.tensors[f"{name}.weight"],
                                          self.encoder.tensors[f"{name}.bias"])

    def _branch(self, ids: list[int], layers: list[str]) -> torch.Tensor:
        ids_t = torch.tensor([ids])
        mask = torch.ones_like(ids_t)
        hidden = self.encoder.run(self.encoder.embed(ids_t), self.trunk, mask)
        return self.encoder.run(hidden, layers, mask)[0]

    @torch.inference_mode()
    def word_scores(self, text: str) -> list[float]:
        """Per word: mean keep probability over its sub-tokens (0 for a word the tokenizer drops)."""
        words = words_of(text)
        sums, counts = [0.0] * len(words), [0] * len(words)
        for ids, word_ids in encode_words(self.tokenizer, words, self.max_length):
            keep = self._head(self._branch(ids, self.score_layers), "score_head").softmax(-1)[:, 1]
            for position, word in enumerate(word_ids):
                if word is not None:
                    sums[word] += float(keep[position])
                    counts[word] += 1
        return [s / c if c else 0.0 for s, c in zip(sums, counts, strict=True)]

    def compress(self, text: str, rate: float, force_tokens: Sequence[str] = ()) -> Compressed:
        if rate >= 1.0:
            return Compressed(text, list(range(len(word_spans(text)))), 1.0)
        return compress_by_scores(text, self.word_scores(text), rate, force_tokens)

    def _decision_ids(self, prefix: str, prompt: str) -> list[int]:
        head = 1 + len(self.prompt_tokenizer.encode(prefix, add_special_tokens=False).ids)
        return head_and_tail(self.prompt_tokenizer.encode(prefix + prompt).ids, head, self.max_length)

    @torch.inference_mode()
    def decision_log_probs(self, prompt: str, ttft_fraction: float, tpot_fraction: float):
        """(log p(ratio) over `ratios`, log p(level) over `levels`) for a prompt under an SLO."""
        bins = self.config["ttft_bins"], self.config["tpot_bins"]
        pooled = self._branch(self._decision_ids(slo_prefix(*bins, ttft_fraction, tpot_fraction), prompt),
                              self.decision_layers)[0]
        return self._head(pooled, "ratio_head").log_softmax(-1), self._head(pooled, "level_head").log_softmax(-1)

    def decide(self, prompt: str, ttft_fraction: float, tpot_fraction: float,
               is_feasible: Callable[[float, str], bool]) -> tuple[float, str, bool]:
        ratio_lp, level_lp = self.decision_log_probs(prompt, ttft_fraction, tpot_fraction)
        return best_feasible_pair(ratio_lp, level_lp, self.ratios, self.levels, is_feasible)

    @torch.inference_mode()
    def utility(self, prompt: str) -> torch.Tensor:
        """[ratios, levels]: the utility head's probability that each cell answers `prompt` right."""
        if self.decision_head != "utility":
            raise TLMError("this TLM's decision head is 'slo_token'; it predicts no utilities")
        if self.prompt_blind:
            return self.encoder.tensors["utility_head.bias"].sigmoid().view(len(self.ratios), len(self.levels))
        pooled = self._branch(self._decision_ids("", prompt), self.decision_layers)[0]
        return self._head(pooled, "utility_head").sigmoid().view(len(self.ratios), len(self.levels))


def tlm_decider(tlm: TLM) -> Callable[..., Decision]:
    """A level decision with `choose_level`'s signature that asks the TLM, judged by this device's profile.

    Absolute SLOs become fractions of the full model's predicted latency for this prompt. Only
    levels this copy holds and the package marks usable, and pairs the profile predicts to meet the
    SLO (the TLM's own time in TTFT, where the profile measured it), are eligible. A utility head
    takes the eligible cell most likely to answer right, ties to the one predicted cheapest.

    Where the TLM's own time is all that stands in the way, the TLM is skipped and the request served
    on the whole prompt by the profile rule (`choose_level`): when the largest usable level meets the
    SLO without the TLM but not with it (at (1, 1) it never does: asking could only push the request
    to a worse cell), and when no cell meets it with the TLM's time but some level does without.
    Where nothing meets it either way, the lightest level is served on the whole prompt or compressed
    to the smallest ratio, whichever is predicted to start sooner.
    """

    def decide(prompt: str, prompt_tokens: int, slo: SLO, profile: LatencyProfile, levels: list[LevelShape],
               kept_tokens: int = 0) -> Decision:
        target = slo.absolute(profile, prompt_tokens)
        full = profile.largest_level()
        ttft_fraction = 1.0 if target.ttft_ms is None else target.ttft_ms / profile.ttft_ms(full, prompt_tokens)
        tpot_fraction = 1.0 if target.tpot_ms is None else target.tpot_ms / profile.tpot_ms(full)
        held = {level.name for level in usable_levels(levels)}  # what the decision and its fallback may pick

        def is_feasible(r: float, m: str) -> bool:
            return m in held and feasible(profile, m, r, prompt_tokens, target, kept_tokens)

        without_tlm = choose_level(prompt, prompt_tokens, target, profile, levels)
        any_cell = any(is_feasible(r, m) for r in tlm.ratios for m in tlm.levels)
        if without_tlm.feasible and not is_feasible(1.0, without_tlm.level) and (
                without_tlm.level == max(held, key=Level) or not any_cell):
            return without_tlm
        if not (without_tlm.feasible or any_cell):
            # Nothing meets the SLO: the best effort is the lightest level served soonest. On a short
            # prompt the TLM's own time outweighs what compressing saves, so it is not asked at all.
            lightest = without_tlm.level
            if profile.ttft_ms(lightest, prompt_tokens) <= predicted_ttft_ms(profile, lightest, min(tlm.ratios),
                                                                             prompt_tokens, kept_tokens):
                return without_tlm

        if getattr(tlm, "decision_head", "slo_token") == "utility":  # the SLO masks; the head ranks what remains
            ratio, level, met = best_utility_cell(
                tlm.utility(prompt), tlm.ratios, tlm.levels, is_feasible,
                lambda r, m: predicted_ttft_ms(profile, m, r, prompt_tokens, kept_tokens) + profile.tpot_ms(m))
        else:
            ratio, level, met = tlm.decide(prompt, ttft_fraction, tpot_fraction, is_feasible)
        if not met:  # best effort: the lightest pair this copy holds
            level = min(held, key=Level)
        return Decision(level, ratio, met, tlm_ran=True)

    return decide
