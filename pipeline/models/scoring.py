"""Language-model loss over token windows, computed in chunks so the logits never fill memory.

The model is an HF causal LM (training, profiling) or the device SDK's `ElasticModel`
(evaluation: its own forward pass at its current level or widths, with the level's LoRA).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from device_sdk.runtime import ElasticModel

LOGIT_CHUNK = 512  # tokens per LM-head chunk: 512 x 49k vocab x 4 B = 100 MB at most


def _chunk_nll(lm_head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = lm_head(hidden).float()
    return F.cross_entropy(logits, targets, reduction="sum")


def nll_sum(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL of a batch [B, T] and the number of predicted tokens.

    Differentiable when grad is enabled; the LM head is recomputed per chunk in backward
    (checkpointing), so peak memory holds one chunk of logits, not B·T·vocab.
    """
    if isinstance(model, ElasticModel):  # the device's forward pass: inference only
        with torch.inference_mode():
            return nll_from_hidden(model.transformer.lm_head, model.transformer.hidden_states(input_ids), input_ids)
    hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    return nll_from_hidden(model.lm_head, hidden, input_ids)


def nll_from_hidden(lm_head, hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed NLL given the final (normed) hidden states [B, T, H] of `input_ids`."""
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = input_ids[:, 1:].reshape(-1)
    total = hidden.new_zeros(())
    for start in range(0, targets.numel(), LOGIT_CHUNK):
        h, y = hidden[start : start + LOGIT_CHUNK], targets[start : start + LOGIT_CHUNK]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_nll, lm_head, h, y, use_reentrant=False)
        else:
            total = total + _chunk_nll(lm_head, h, y)
    return total, targets.numel()


@torch.no_grad()
def window_nlls(model, windows: torch.Tensor, batch_size: int = 4, progress=None) -> list[float]:
    """Mean next-token NLL of each window of `windows` [N, T], run `batch_size` windows at a time."""
    nlls: list[float] = []
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]
        nlls += [total / (batch.shape[1] - 1) for total in _row_nll_sums(model, batch)]
        if progress is not None:
            progress(min(start + batch_size, windows.shape[0]), windows.shape[0])
    return nlls


def _row_nll_sums(model, batch: torch.Tensor) -> list[float]:
    """Summed NLL of each row of a batch, from one forward pass over the batch."""
    if isinstance(model, ElasticModel):
        with torch.inference_mode():
            hidden, head = model.transformer.hidden_states(batch), model.transformer.lm_head
    else:
        hidden, head = model.model(input_ids=batch, use_cache=False).last_hidden_state, model.lm_head
    return [nll_from_hidden(head, hidden[row : row + 1], batch[row : row + 1])[0].item() for row in range(len(batch))]


def mean_nll(model, windows: torch.Tensor, batch_size: int = 4, progress=None) -> float:
    """Mean next-token NLL over all windows (they have equal length, so the mean of the windows' means)."""
    nlls = window_nlls(model, windows, batch_size, progress)
    return sum(nlls) / len(nlls)


def perplexity(model, windows: torch.Tensor, batch_size: int = 4, progress=None) -> float:
    return math.exp(mean_nll(model, windows, batch_size, progress))


def paired_ratio(nlls: list[float], reference_nlls: list[float], z: float = 1.96) -> dict:
    """Perplexity ratio exp(mean(nll - reference)) over the same windows, with its normal-approximation interval.

    Pairing by window takes out how hard each window is, which dominates the spread of either
    side alone; `se` is the standard error of the mean per-window NLL difference (nats).
    """
    if len(nlls) != len(reference_nlls) or len(nlls) < 2:
        raise ValueError(f"need two equal lists of at least 2 windows, got {len(nlls)} and {len(reference_nlls)}")
    diffs = [a - b for a, b in zip(nlls, reference_nlls, strict=True)]
    mean = sum(diffs) / len(diffs)
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
    return {"ratio": math.exp(mean), "low": math.exp(mean - z * se), "high": math.exp(mean + z * se),
            "se_nats": se, "windows": len(diffs)}
