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
def mean_nll(model, windows: torch.Tensor, batch_size: int = 4, progress=None) -> float:
    total, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        loss, n = nll_sum(model, windows[start : start + batch_size])
        total += loss.item()
        count += n
        if progress is not None:
            progress(min(start + batch_size, windows.shape[0]), windows.shape[0])
    return total / count


def perplexity(model, windows: torch.Tensor, batch_size: int = 4, progress=None) -> float:
    return math.exp(mean_nll(model, windows, batch_size, progress))
