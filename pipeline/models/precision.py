"""Training precision: bf16 autocast where the hardware multiplies bf16 natively, fp32 elsewhere.

Recovery and the TLM's heads train under the same rule. Weights and optimiser state stay fp32
(autocast casts per op), and evaluation and serving always run in fp32.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from pipeline.settings import Precision


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
