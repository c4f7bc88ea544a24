"""Which llama.cpp kernels our llama-cpp-python runs use. Stdlib only: it is imported in llama.cpp's own venv."""

from __future__ import annotations

from pathlib import Path


def cpu_has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def plain_kernels_where_amx_crashes() -> bool:
    """llama-cpp-python 0.3.36's AMX int8 kernels (an "extra buffer type") crash with SIGSEGV on SmolLM2's
    Q8_0 and Q4_1 weights, exported or packaged. Where the CPU has AMX, every model this process loads
    afterwards uses the plain CPU kernels (`use_extra_bufts` off, AVX-512 still on). Returns whether it
    switched, for the results."""
    if not cpu_has_amx():
        return False
    import llama_cpp.llama_cpp as low

    defaults = low.llama_model_default_params

    def plain_kernels():
        params = defaults()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = plain_kernels
    return True
