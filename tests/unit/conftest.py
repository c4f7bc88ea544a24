"""Fixtures of the unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_package(smollm2, tmp_path_factory) -> Path:
    """SmolLM2 as a signed device-SDK test package (random unit order: the tests check arithmetic)."""
    from tests.unit.sdk_packages import SMOLLM2_LEVELS, build_package, signing_key

    out = tmp_path_factory.mktemp("smollm2") / "pkg"
    return build_package(smollm2.model, smollm2.tokenizer, out, signing_key(), name="smollm2",
                         levels=SMOLLM2_LEVELS, align=32)
