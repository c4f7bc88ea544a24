"""Precision: what model stages store and compute in.

Weights stay in the dtype they were loaded in (the source's bf16/fp16, else fp32: see
`pipeline.models.loading`). Computation is bf16 where the hardware multiplies bf16 natively (CUDA, and
CPUs with AVX512-BF16 or AMX), and fp32 elsewhere: on an AVX2-only CPU a bf16 GEMM is emulated, ~6×
slower forward and ~35× slower forward + backward than fp32 at SmolLM2's MLP shapes, so half-precision
weights are kept as they are and upcast one weight (a bounded chunk of it) at a time, per call
(`upcast_linears`): memory stays that of the stored model, speed that of fp32.

fp32 stays where it matters whatever the weights are: importance accumulators (fp64), losses and
log-probs (the LM head's logits are cast to fp32 before any softmax), LoRA weights and optimiser state.
Recovery and the TLM's heads train under the same rule (`training_dtype`, `autocast`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.settings import Precision

HALF = (torch.bfloat16, torch.float16)
# An upcast weight is materialised in fp32 this many elements at a time (16 MB): a 49k-token LM head or a
# 7B model's MLP weight never exists whole in fp32.
UPCAST_CHUNK_ELEMENTS = 1 << 22


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def training_dtype(precision: Precision, device: torch.device) -> torch.dtype:
    """The dtype training computes in: bf16 on CUDA and on CPUs with native bf16, unless `precision` pins one."""
    if precision == "float32":
        return torch.float32
    if precision == "bfloat16" or device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast (CUDA, or a CPU with native bf16: the same code path); fp32 runs as it is."""
    return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()


def compute_dtype(device: torch.device, stored: torch.dtype) -> torch.dtype:
    """What a model whose weights are stored in `stored` multiplies in on `device`.

    CUDA: fp16 weights in fp16, anything else in bf16. A CPU with native bf16: bf16 (fp16 weights, which
    it does not multiply natively, in fp32). Any other CPU: fp32.
    """
    if device.type == "cuda":
        return torch.float16 if stored == torch.float16 else torch.bfloat16
    if cpu_has_native_bf16() and stored != torch.float16:
        return torch.bfloat16
    return torch.float32


@contextmanager
def model_precision(model: nn.Module, device: torch.device) -> Iterator[torch.dtype]:
    """Run `model` (an HF causal LM) in `compute_dtype` for its weights on `device`; yields that dtype.

    Weights already in it run as they are; fp32 weights computing in bf16 run under autocast; half
    weights computing in fp32 run through `upcast_linears`. Nothing is converted in place.
    """
    stored = next(model.parameters()).dtype
    compute = compute_dtype(device, stored)
    if compute == stored:
        yield compute
    elif stored == torch.float32:
        with torch.autocast(device.type, dtype=compute):
            yield compute
    else:
        with upcast_linears(model):
            yield compute


class _UpcastLinear(torch.autograd.Function):
    """`x @ W.T + b` in x's dtype over W stored in a narrower one. Saves the stored W, not an upcast copy,
    and upcasts it again, in chunks of rows, in backward; the weight's gradient comes back in the weight's
    own dtype (autograd casts it to the leaf's)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        chunks = _row_chunks(weight)
        if len(chunks) == 1:
            return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        for rows in chunks:
            out[..., rows] = F.linear(x, weight[rows].to(x.dtype))
        return out if bias is None else out.add_(bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            chunks = _row_chunks(weight)
            if len(chunks) == 1:
                grad_x = grad @ weight.to(grad.dtype)
            else:
                grad_x = x.new_zeros(x.shape)
                for rows in chunks:
                    grad_x.add_(grad[..., rows] @ weight[rows].to(grad.dtype))
        flat_grad = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = flat_grad.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat_grad.sum(0)
        return grad_x, grad_w, grad_b


def _row_chunks(weight: torch.Tensor) -> list[slice]:
    step = max(1, UPCAST_CHUNK_ELEMENTS // max(1, weight.shape[1]))
    return [slice(start, min(start + step, weight.shape[0])) for start in range(0, weight.shape[0], step)]


def _upcast_forward(linear: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _UpcastLinear.apply(x, linear.weight, linear.bias)
    return forward


def _embedding_to_fp32(module, args, output):
    return output.float()


@contextmanager
def upcast_linears(model: nn.Module) -> Iterator[None]:
    """Compute `model` in fp32 while its half-precision weights stay stored as they are.

    Embeddings hand the residual stream on in fp32; every nn.Linear with a half weight multiplies through
    `_UpcastLinear`; RMSNorm and rotary embeddings follow their input's dtype (fp32). At any time at most
    one chunk of one weight exists in fp32.
    """
    patched = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype in HALF]
    hooks = [m.register_forward_hook(_embedding_to_fp32) for m in model.modules() if isinstance(m, nn.Embedding)]
    for linear in patched:
        linear.forward = _upcast_forward(linear)
    try:
        yield
    finally:
        for linear in patched:
            del linear.forward  # back to the class's forward
        for hook in hooks:
            hook.remove()
