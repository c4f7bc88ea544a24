"""ElasticLinear kernels: the native C++/OpenMP one and its torch reference; the native decoder.

The native code is one translation unit (csrc/elastic_linear.cpp and the headers beside it),
JIT-compiled on first use (~45 s) into ~/.cache/elastify/kernels and loaded from there
afterwards. Where it cannot be built (no compiler, ELASTIFY_NATIVE=0) the torch reference
runs instead, with a warning.

`NativeDecoder` runs a whole decode step (one token, batch 1) of a llama.Transformer in one
C++ call (csrc/decoder.h) over the same storage; the Python forward stays the reference and
does prefill.

Weight formats: "fp32", "fp16" (storage only; compute is fp32), and "int8" / "int4": blocks of 32
along the reduction dimension with one fp16 scale (llama.cpp's Q8_0 / Q4_0 blocks), laid out so
that every width is a prefix of the packed tensor (device_sdk/quant.py). Their native kernels
quantise each input row to int8 blocks and use integer dot products (csrc/quant.h: AVX2,
AVX-VNNI / AVX-512 VNNI where the build has them, and a scalar path). ELASTIFY_KERNEL_ISA
(scalar, avx2, vnni; default: the best this machine has) or `set_kernel_isa` picks one.
Many rows at once (prefill) dequantise the active prefix to fp32 and run torch's GEMM.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import math
import operator
import os
import platform
import threading
import warnings
from pathlib import Path

import torch

from device_sdk import quant
from device_sdk.elastic import ElasticLinear, UnitAxis
from device_sdk.llama import PROJECTIONS  # in decoder.h's slot order

WEIGHT_FORMATS = ("fp32", "fp16") + quant.QUANTIZED_FORMATS
SOURCE = Path(__file__).parent / "csrc" / "elastic_linear.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]

_build_lock = threading.Lock()
_native_module = None
_native_tried = False


def cache_home() -> Path:
    return Path(os.environ.get("ELASTIFY_HOME", Path.home() / ".cache" / "elastify"))


def _build_signature() -> str:
    """Built with -march=native, so a cached build is only valid on the same kind of CPU (and
    for the same sources: torch's own check does not see the headers)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    digest = hashlib.sha256(f"{platform.machine()} {flags} {torch.__version__} {CFLAGS}".encode())
    for source in sorted(SOURCE.parent.iterdir()):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:10]


def native_module():
    """The compiled extension, or None (with one warning) when it cannot be built."""
    global _native_module, _native_tried
    with _build_lock:
        if _native_tried:
            return _native_module
        _native_tried = True
        if os.environ.get("ELASTIFY_NATIVE", "1") == "0":
            warnings.warn("ELASTIFY_NATIVE=0: ElasticLinear runs on the torch fallback", stacklevel=2)
            return None
        try:
            name = f"elastify_elastic_linear_{_build_signature()}"
            build_dir = cache_home() / "kernels" / name
            built = build_dir / f"{name}.so"
            if built.is_file() and not (build_dir / "lock").exists():
                # The name already pins sources, flags, CPU and torch: import the build directly
                # (torch's load() would re-run ninja, seconds per process on a busy machine).
                loader = importlib.machinery.ExtensionFileLoader(name, str(built))
                spec = importlib.util.spec_from_file_location(name, str(built), loader=loader)
                _native_module = importlib.util.module_from_spec(spec)
                loader.exec_module(_native_module)
                _choose_isa(_native_module)
                return _native_module
            from torch.utils.cpp_extension import load

            build_dir.mkdir(parents=True, exist_ok=True)
            _native_module = load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
            _choose_isa(_native_module)
        except Exception as err:  # no compiler, no headers, a failed build: run on torch instead
            warnings.warn(f"native ElasticLinear kernel unavailable ({err}); using the torch fallback", stacklevel=2)
            _native_module = None
        return _native_module


def _choose_isa(module) -> None:
    module.set_quant_isa(os.environ.get("ELASTIFY_KERNEL_ISA", "auto"))


def kernel_isas() -> list[str]:
    """Instruction sets the native quantised kernels can use on this machine, best last ([] without them)."""
    module = native_module()
    return [] if module is None else list(module.quant_isas())


def set_kernel_isa(name: str = "auto") -> str:
    """Run every quantised native kernel on `name` ("scalar", "avx2", "vnni", "auto"); returns the one chosen."""
    return native_module().set_quant_isa(name)


# --------------------------------------------------------------------------- weight formats


def convert_storage(storage: torch.Tensor, unit_axis: UnitAxis, weight_format: str) -> torch.Tensor:
    """Storage in `weight_format` (int8/int4: packed blocks); fp32 storage in fp32 is returned as is (still memory-mapped)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}, not {weight_format!r}")
    if weight_format in quant.QUANTIZED_FORMATS:
        return quant.quantize(storage, unit_axis, weight_format)
    dtype = torch.float16 if weight_format == "fp16" else torch.float32
    return storage if storage.dtype == dtype else storage.to(dtype).contiguous()


# --------------------------------------------------------------------------- the two kernels


def reference_linear(x: torch.Tensor, layer: ElasticLinear) -> torch.Tensor:
    """Torch over the same prefix, dequantizing the active rows per call: the oracle, and the many-row path.

    (For block-quantised storage the native single-row kernel also quantises the activations, so
    this is its reference only up to that; quant.reference_gemv is the exact one.)"""
    if layer.block_format is not None:
        weight = quant.dequantize(layer.storage, layer.unit_axis, layer.block_format, layer.active_rows, layer.shape[1])
    else:
        weight = layer.active_weight.float()
    bias = None if layer.active_bias is None else layer.active_bias.float()
    if layer.unit_axis == "out":
        return torch.nn.functional.linear(x, weight, bias)
    if x.shape[-1] != layer.active_rows:
        raise ValueError(f"input has {x.shape[-1]} features, the active width needs {layer.active_rows}")
    y = x @ weight
    return y if bias is None else y + bias


# From this many input rows on (prefill, batched scoring) torch's GEMM beats the native kernel,
# which is shaped for decode's single row. Measured on SmolLM2's MLP shapes at one thread:
# 128 rows fp32 3.5 ms torch vs 7.8 ms native; fp16 (dequantized per call) 2.8-4.8 vs 3.7-7.9.
# Block-quantised storage (uint8): one integer GEMV per row; from 16 rows on the active prefix is
# dequantised once (in C++) for torch's GEMM (not yet measured on this machine: a guess from
# the fp32 crossover).
GEMM_ROWS = {torch.float32: 16, torch.float16: 64, torch.uint8: 16}


def _quantized_linear(flat: torch.Tensor, layer: ElasticLinear) -> torch.Tensor:
    module, fmt = native_module(), quant.FORMAT_CODES[layer.block_format]
    rows_active, cols, row_units = layer.active_rows, layer.shape[1], layer.unit_axis == "out"
    if flat.shape[0] >= GEMM_ROWS[torch.uint8]:
        weight = module.dequantize(layer.storage, fmt, rows_active, cols, row_units)  # [out, in]
        bias = layer.active_bias
        return torch.nn.functional.linear(flat, weight, None if bias is None else bias.float())
    return module.quant_linear(flat, layer.storage, fmt, rows_active, cols, row_units, layer.bias)


def native_linear(x: torch.Tensor, layer: ElasticLinear) -> torch.Tensor:
    """The C++ kernel on the whole storage plus the active row count: nothing is sliced or copied.

    Many rows at once go to torch's GEMM over the same prefix instead (see GEMM_ROWS).
    """
    flat = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if layer.block_format is not None:
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        y = _quantized_linear(flat, layer)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if flat.shape[0] >= GEMM_ROWS[layer.storage.dtype]:
        return reference_linear(x, layer)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.float().contiguous()
    y = native_module().elastic_linear(flat, layer.storage, layer.active_rows, layer.unit_axis == "out", layer.bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def make_linear(
    storage: torch.Tensor | quant.Packed,
    bias: torch.Tensor | None,
    *,
    unit_axis: UnitAxis,
    unit_size: int,
    weight_format: str = "fp32",
    native: bool = True,
) -> ElasticLinear:
    """An ElasticLinear in `weight_format`, on the native kernel when it builds (else torch). Storage already
    in blocks (`quant.Packed`, packed for `unit_axis`) keeps its own block format, whatever `weight_format` is."""
    if isinstance(storage, quant.Packed):
        weights, block_format, shape = storage.blocks, storage.format, storage.shape
    else:
        weights = convert_storage(storage, unit_axis, weight_format)
        block_format = weight_format if weight_format in quant.QUANTIZED_FORMATS else None
        shape = tuple(storage.shape)
    bias = None if bias is None else bias.float()
    layer = ElasticLinear(weights, bias, unit_axis=unit_axis, unit_size=unit_size, block_format=block_format,
                          shape=shape)
    use_native = native and native_module() is not None
    if use_native or block_format is not None or weight_format != "fp32":
        layer.use_kernel(native_linear if use_native else reference_linear)
    return layer


# --------------------------------------------------------------------------- the native decoder


def _spec(linear: ElasticLinear) -> tuple:
    """(storage, bias, block format code, unpacked columns): decoder.h's ProjectionSpec."""
    return linear.storage, linear.bias, quant.FORMAT_CODES.get(linear.block_format, 0), linear.shape[1]


class NativeDecoder:
    """One C++ call per decoded token for a llama.Transformer whose projections all run native.

    Widths and LoRA are pushed to the C++ side only when they changed: widths by the model's
    LevelCursor version, LoRA by the identity of each projection's adapter (a level switch
    or an expert mix assigns new ones), so a token costs no per-layer Python calls.
    """

    def __init__(self, transformer):
        arch = transformer.arch
        self.transformer = transformer
        embed = transformer.embed_tokens
        packed = isinstance(embed, quant.Packed)  # the tied LM head's blocks: the lookup dequantises one row
        table, table_format = (embed.blocks, quant.FORMAT_CODES[embed.format]) if packed else (embed, 0)
        self.native = native_module().Decoder(
            arch.head_dim, arch.n_rep, arch.norm_eps, arch.sliding_window or 0, transformer.inv_freq,
            table, table_format, transformer.norm.weight, _spec(transformer.lm_head),
        )
        self.projections = [[block.projection(name) for name in PROJECTIONS] for block in transformer.layers]
        for block, projections in zip(transformer.layers, self.projections, strict=True):
            self.native.add_layer(block.input_layernorm.weight, block.post_attention_layernorm.weight,
                                  [_spec(projection.linear) for projection in projections])
        self._attributes = [projection.__dict__ for layer in self.projections for projection in layer]
        self._widths: tuple[int, int] | None = None  # (cursor index, version) last pushed
        self._loras = [None] * len(self._attributes)  # each projection's adapter last pushed

    @classmethod
    def build(cls, transformer) -> NativeDecoder | None:
        """The decoder, or None where some projection does not run the native kernel."""
        linears = [m for m in transformer.modules() if isinstance(m, ElasticLinear)]
        if native_module() is None or any(linear.kernel is not native_linear for linear in linears):
            return None
        return cls(transformer)

    def sync(self) -> None:
        """Push the current widths and LoRA where they changed since the last step."""
        cursor = self.transformer.cursor
        if self._widths != (cursor.index, cursor.version):
            groups, neurons = [], []
            for index, projections in enumerate(self.projections):
                units = [projection.linear.units for projection in projections]
                if len(set(units[:4])) > 1 or len(set(units[4:])) > 1:
                    raise ValueError(f"layer {index}: q/k/v/o (or gate/up/down) widths differ: {units}")
                groups.append(units[0])
                neurons.append(units[4])
            self.native.set_widths(groups, neurons)
            self._widths = (cursor.index, cursor.version)
        loras = [attributes["lora"] for attributes in self._attributes]
        if any(map(operator.is_not, loras, self._loras)):
            for index, (adapter, previous) in enumerate(zip(loras, self._loras, strict=True)):
                if adapter is not previous:
                    layer, slot = divmod(index, len(PROJECTIONS))
                    self.native.set_lora(layer, slot, *(adapter if adapter is not None else (None, None, 0.0)))
            self._loras = loras

    def step(self, token: int, cache) -> torch.Tensor:
        """Logits [vocab] of `token` at position cache.length; its keys and values join the cache."""
        if cache.length >= cache.max_len:
            raise ValueError(f"sequence of {cache.length + 1} tokens exceeds the cache ({cache.max_len})")
        self.sync()
        keys, values = cache.buffers(batch=1)
        logits = self.native.step(token, cache.length, keys, values)
        cache.length += 1
        return logits
