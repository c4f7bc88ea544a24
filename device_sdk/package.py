"""The weights side of the elastic package: writing a package's tensors, reading a tensor's prefix.

The format itself (manifest schema, hashing, byte ranges, signing) is `device_sdk.format`,
which needs no torch; this module adds what does.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from device_sdk.format import (
    FORMAT_VERSION,
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
    safetensors_layout,
    staged_directory,
)


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


def write_package(
    out_dir: Path,
    *,
    manifest_fields: Mapping[str, Any],
    architecture: Architecture,
    elastic: Elastic,
    weights: Mapping[str, torch.Tensor],
    model_files: Mapping[str, Path | bytes] = {},
    extra_files: Mapping[str, Path | bytes] = {},
    overwrite: bool = False,
) -> Manifest:
    """Write a complete package to a temp dir beside `out_dir`, then rename it into place.

    `model_files` land under model/ (config.json, tokenizer files); `extra_files` keep their
    relative path (adapters/…, tlm/…). A reader never sees a half-written package.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise PackageError(f"{out_dir} already exists")
    with staged_directory(out_dir) as stage:
        (stage / "model").mkdir()
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


def _place(root: Path, relative: str, content: Path | bytes) -> None:
    target = root / relative
    if ".." in Path(relative).parts or Path(relative).is_absolute():
        raise PackageError(f"refusing file path {relative!r} outside the package")
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        target.write_bytes(content)
    else:
        shutil.copyfile(content, target)

