"""Fixtures of the control-plane unit tests."""

from __future__ import annotations

import pytest

from cluster.db import make_engine, migrate, session_factory


@pytest.fixture
def sessions(tmp_path):
    """Sessions on a migrated SQLite job store in this test's directory."""
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    migrate(url)
    return session_factory(make_engine(url))
