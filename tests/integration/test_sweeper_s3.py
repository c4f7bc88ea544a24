"""The store sweeper (cluster/sweeper.py) on SeaweedFS (S3) and PostgreSQL: the unit tests' cases run
here again against the real backends, and a case only a key-prefix store has (attempt a1 is not a11)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from cluster.models import Artifact, Attempt, utcnow
from cluster.scheduler import Scheduler
from cluster.sweeper import attempt_prefix, sweep_dead_outputs
from tests.support.control_plane import chain_registry, make_settings

# The local-store tests, collected here with this module's `scheduler` (PostgreSQL + S3).
from tests.unit.cluster.test_crash_cache import (  # noqa: F401
    _stage,
    _upload,
    test_an_attempt_referenced_by_a_cache_hit_is_never_swept,
    test_the_sweeper_deletes_dead_attempts_partial_outputs_and_keeps_referenced_ones,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def scheduler(tmp_path, pg_url, s3_store):
    scheduler = Scheduler(make_settings(tmp_path, pg_url, s3_store, lease_seconds=30.0), chain_registry(), owner="me")
    yield scheduler
    scheduler.engine.dispose()


def test_sweeping_dead_attempt_a1_keeps_live_attempts_a11_and_a2(scheduler, tmp_path):
    """S3 lists by key prefix, so `builds/b1/first/a1` also matches `…/a11`: only a1's objects may go."""
    ended = utcnow() - timedelta(minutes=10)
    with scheduler.sessions.begin() as session:
        stage = _stage(session, "b1", "acme", status="running", attempts=11)
        session.add(Attempt(stage_id=stage.id, number=1, worker="me", status="failed", ended_at=ended))
        session.add(Attempt(stage_id=stage.id, number=2, worker="me", status="running", started_at=ended))
        session.add(Attempt(stage_id=stage.id, number=11, worker="me", status="succeeded", ended_at=ended))
        session.add(Artifact(stage_id=stage.id, name="out", uri=attempt_prefix("b1", "first", 11) + "/out",
                             digest="d" * 64, size=4096))
    for number in (1, 2, 11):
        _upload(scheduler, tmp_path, attempt_prefix("b1", "first", number))
    store = scheduler.store
    before = {number: store.list(attempt_prefix("b1", "first", number) + "/") for number in (1, 2, 11)}
    assert all(before.values())

    deleted = sweep_dead_outputs(scheduler.sessions, store, ended_before=utcnow() - timedelta(minutes=1))

    assert deleted == {"builds/b1/first/a1": 1}
    assert store.list("builds/b1/first/a1/") == []
    assert store.list("builds/b1/first/a11/") == before[11], "a succeeded attempt's artifact is kept"
    assert store.list("builds/b1/first/a2/") == before[2], "a running attempt's partial output is kept"
