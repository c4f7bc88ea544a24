"""The weights side of the elastic package: writing a package's tensors, reading a tensor's prefix.

The format itself (manifest schema, hashing, byte ranges, signing) is `device_sdk.format`,
which needs no torch; this module adds what does.

Weights given as a dict of tensors are written by safetensors' `save_file`, which needs them all in
memory. Weights given as `StreamedWeights` are written one tensor at a time in safetensors' own
documented layout (8-byte little-endian header length, JSON header, data), with the same bytes
`save_file` writes for the same tensors, so a model larger than memory can be packaged.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from device_sdk.format import (
    FORMAT_VERSION,
    HEAD_FORMATS,
    MANIFEST,
    WEIGHTS,
    Architecture,
    Elastic,
    Level,
    Manifest,
    PackageError,
    byte_ranges_for,
    canonical_json,
    file_entries,
    head_tensor,
    precision_byte_ranges,
    precision_file,
    read_manifest,
    rewrite_manifest,
    safetensors_layout,
    staged_directory,
)
from device_sdk.quant import QUANTIZED_FORMATS, quantize


def read_tensor_prefix(package_dir: Path, manifest: Manifest, name: str, level: Level | float | str) -> torch.Tensor:
    """Read only the bytes `level` needs of one tensor, straight from its byte range."""
    _, header = safetensors_layout(Path(package_dir) / WEIGHTS)
    info = header[name]
    start, end = manifest.byte_ranges["tensors"][name][Level(level).name]
    with open(Path(package_dir) / WEIGHTS, "rb") as handle:
        handle.seek(start)
        raw = handle.read(end - start)
    dtype = _SAFETENSORS_DTYPES[info["dtype"]]
    flat = torch.frombuffer(bytearray(raw), dtype=dtype)
    return flat.reshape(-1, *info["shape"][1:])


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class StreamedWeights:
    """A package's tensors, made one at a time: each one's shape is known up front (the file's header,
    offsets included, is written first), then `make(name)` is called once per tensor, in the file's order,
    and its bytes written before the next is made. `progress(done, total)` follows the tensors."""

    dtype: torch.dtype
    shapes: Mapping[str, Sequence[int]]
    make: Callable[[str], torch.Tensor]
    progress: Callable[[int, int], None] | None = None


def write_safetensors_streamed(path: Path, weights: StreamedWeights, metadata: Mapping[str, str]) -> None:
    """Write `weights` to `path` as safetensors, holding one tensor at a time.

    The layout is `save_file`'s for tensors of one dtype: tensors in name order, the header compact JSON
    with `__metadata__` first, padded with spaces to a multiple of 8 bytes.
    """
    if sys.byteorder != "little":  # safetensors is little-endian; tensor bytes are written as they are in memory
        raise PackageError("streamed safetensors writing needs a little-endian machine")
    if weights.dtype not in _SAFETENSORS_NAMES:
        raise PackageError(f"unsupported weight dtype {weights.dtype}")
    element_size = torch.empty((), dtype=weights.dtype).element_size()
    names = sorted(weights.shapes)
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in names:
        shape = [int(d) for d in weights.shapes[name]]
        size = element_size * _numel(shape)
        header[name] = {"dtype": _SAFETENSORS_NAMES[weights.dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for done, name in enumerate(names, 1):
            tensor = weights.make(name)
            if tensor.dtype != weights.dtype or list(tensor.shape) != header[name]["shape"]:
                raise PackageError(f"tensor {name} is {tensor.dtype} {list(tensor.shape)}, "
                                   f"its header says {weights.dtype} {header[name]['shape']}")
            handle.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor
            if weights.progress is not None:
                weights.progress(done, len(names))


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def write_package(
    out_dir: Path,
    *,
    manifest_fields: Mapping[str, Any],
    architecture: Architecture,
    elastic: Elastic,
    weights: Mapping[str, torch.Tensor] | StreamedWeights,
    model_files: Mapping[str, Path | bytes] = {},
    extra_files: Mapping[str, Path | bytes] = {},
    overwrite: bool = False,
) -> Manifest:
    """Write a complete package to a temp dir beside `out_dir`, then rename it into place.

    `model_files` land under model/ (config.json, tokenizer files); `extra_files` keep their
    relative path (adapters/…, tlm/…). A reader never sees a half-written package. `weights` as
    `StreamedWeights` are written one tensor at a time.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise PackageError(f"{out_dir} already exists")
    with staged_directory(out_dir) as stage:
        (stage / "model").mkdir()
        if isinstance(weights, StreamedWeights):
            write_safetensors_streamed(stage / WEIGHTS, weights, metadata={"format": "pt"})
            element_sizes = {torch.empty((), dtype=weights.dtype).element_size()}
        else:
            contiguous = {name: tensor.contiguous() for name, tensor in weights.items()}
            element_sizes = {t.element_size() for t in contiguous.values()}
            if len(element_sizes) != 1:
                raise PackageError("all package weights must share one dtype")
            save_file(contiguous, str(stage / WEIGHTS), metadata={"format": "pt"})
        for relative, content in {**{f"model/{k}": v for k, v in model_files.items()}, **extra_files}.items():
            _place(stage, relative, content)
        byte_ranges = byte_ranges_for(stage / WEIGHTS, elastic, element_sizes.pop())
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            architecture=architecture,
            elastic=elastic,
            files=file_entries(stage),
            byte_ranges=byte_ranges,
            **manifest_fields,
        )
        manifest.validate()
        (stage / MANIFEST).write_bytes(canonical_json(manifest.to_dict()))
    return manifest


def add_precision(package_dir: Path, precision: str) -> Manifest:
    """Write the package's weights again at `precision` ("int8" Q8_0 or "int4" Q4_0 blocks) as a file of their
    own, list it (with its byte ranges, each quantised tensor's block format, and which tensors stay
    unquantised) in the manifest, and rewrite the manifest's file table. Sign after.

    Every 2-D elastic tensor is quantised to `precision` in device_sdk.quant's prefix layout, so each level is
    still a byte-range prefix of every tensor; the LM head (the tied embedding, or lm_head) to
    `HEAD_FORMATS[precision]` (Q8_0 in the int4 file too, as llama.cpp's Q4_0), whole for every level; the
    rest (an untied embedding, norms, biases) is copied as stored, so the file alone holds a whole model.
    """
    if precision not in QUANTIZED_FORMATS:
        raise PackageError(f"precision {precision!r} is not one of {list(QUANTIZED_FORMATS)}")
    package_dir = Path(package_dir)
    manifest = read_manifest(package_dir)
    head = head_tensor(manifest.architecture)
    tensors, formats = {}, {}
    with safe_open(package_dir / WEIGHTS, framework="pt") as stored:
        for name in stored.keys():  # noqa: SIM118 (safe_open is not a mapping)
            tensor, spec = stored.get_tensor(name), manifest.elastic.tensors.get(name)
            if spec is not None and tensor.dim() == 2:
                formats[name] = precision
                tensor = quantize(tensor, "in" if spec.transposed else "out", precision)
            elif name == head:
                formats[name] = HEAD_FORMATS[precision]
                tensor = quantize(tensor, "out", formats[name])
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(package_dir / precision_file(precision)), metadata={"format": "pt", "precision": precision})
    quantised = sorted(formats)
    manifest.precisions = {**(manifest.precisions or {}), precision: {
        "file": precision_file(precision), "quantised": quantised, "formats": dict(sorted(formats.items())),
        "unquantised": sorted(set(tensors) - set(quantised)),
    }}
    manifest.byte_ranges = {**manifest.byte_ranges, "precisions": {
        **manifest.byte_ranges.get("precisions", {}),
        precision: precision_byte_ranges(package_dir, precision, manifest.elastic, quantised),
    }}
    rewrite_manifest(package_dir, manifest)
    return manifest


def _place(root: Path, relative: str, content: Path | bytes) -> None:
    target = root / relative
    if ".." in Path(relative).parts or Path(relative).is_absolute():
        raise PackageError(f"refusing file path {relative!r} outside the package")
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        target.write_bytes(content)
    else:
        shutil.copyfile(content, target)

