"""Fixtures of the unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_package(smollm2, tmp_path_factory) -> Path:
    """SmolLM2 as a signed device-SDK test package, its units ordered by a small Taylor profile
    (real importance keeps the smaller levels real language models, as the int8 check needs)."""
    # lazy: the device SDK's tests run where only the SDK is installed; this fixture is for pipeline tests
    from pipeline.elastilm.profile import ProfileSettings, profile
    from pipeline.stage import quiet_context
    from tests.support.pipeline_packages import SMOLLM2_LEVELS, build_package
    from tests.support.sdk_packages import signing_key

    settings = ProfileSettings(windows=4, window_length=64, layer_method="block_influence")
    importance = profile(smollm2.model, smollm2.tokenizer, smollm2.architecture, settings, quiet_context())
    out = tmp_path_factory.mktemp("smollm2") / "pkg"
    return build_package(smollm2.model, smollm2.tokenizer, out, signing_key(), name="smollm2",
                         levels=SMOLLM2_LEVELS, align=32, importance=importance)


@pytest.fixture(scope="module")
def gqa_package(tmp_path_factory) -> Path:
    """A tiny Llama-GQA package of random weights signed with `sdk_packages.signing_key()`, one per test
    module (some tests write beside it)."""
    from tests.support.sdk_packages import random_package, signing_key

    return random_package("llama_gqa", tmp_path_factory.mktemp("gqa") / "pkg", signing_key())


@pytest.fixture
def api(tmp_path):
    """The REST API app over SQLite and a local store, with the cheap test registry (tests/support/api.py)."""
    from tests.support.api import make_api

    return make_api(tmp_path)


@pytest.fixture
def client(api):
    """A TestClient of `api`."""
    from fastapi.testclient import TestClient

    return TestClient(api.app)


@pytest.fixture
def scheduler(tmp_path):
    """A scheduler on SQLite and a local store, owner "me"; no Ray (its database and store logic)."""
    from cluster.db import migrate
    from cluster.scheduler import Scheduler
    from cluster.settings import Settings
    from tests.support.control_plane import chain_registry

    settings = Settings(home=tmp_path / "home", database_url=f"sqlite:///{tmp_path / 'jobs.db'}",
                        store_url=str(tmp_path / "store"), lease_seconds=30.0)
    migrate(settings.database_url)
    scheduler = Scheduler(settings, chain_registry(), owner="me")
    scheduler.store.ensure_ready()
    yield scheduler
    scheduler.engine.dispose()
