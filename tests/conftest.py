"""Shared fixtures: the real SmolLM2 (prepared once per machine) and tiny random models."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# An empty trust store of this run's own (subprocesses inherit it), so keys a developer pinned
# (~/.config/elastify/trust.json) never change what a test sees.
_TRUST_DIR = tempfile.mkdtemp(prefix="elastify-trust-")
atexit.register(shutil.rmtree, _TRUST_DIR, True)
os.environ["ELASTIFY_TRUST_STORE"] = str(Path(_TRUST_DIR) / "trust.json")

ARTIFACTS = Path(__file__).parent / "artifacts"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M as a cached fp32 HF safetensors directory."""
    # lazy: the device SDK's tests load this conftest where only the SDK is installed
    from pipeline.assets import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """The loaded SmolLM2 (model, tokenizer, architecture); treat as read-only."""
    # lazy: as smollm2_dir
    from pipeline.models.loading import load_model

    return load_model(smollm2_dir)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """Where tests keep files worth looking at after a run (screenshots, tables)."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def calib_text(tmp_path) -> Path:
    """A small English text file for calibration of tiny models."""
    import treebank

    path = tmp_path / "calib.txt"
    path.write_text(treebank.penn["valid"][:40000])
    return path
