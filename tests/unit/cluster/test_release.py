"""The scheduler's stop paths that need no Ray: handing its stages back through the database (when Ray went down
with it), and a SQLite scheduler taking back, at start, the stages a dead one still holds."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from cluster.models import Attempt, Build, Stage, Tenant, utcnow


def _running(scheduler, owner: str, started, heartbeat) -> int:
    with scheduler.sessions.begin() as session:
        session.add(Tenant(id="acme"))
        session.flush()
        session.add(Build(id="b1", tenant_id="acme", spec={}, spec_hash="0" * 64, status="running"))
        session.flush()
        stage = Stage(build_id="b1", key="first", type="first", settings={}, resources={"num_gpus": 1},
                      status="running", attempts=1, max_attempts=3, lease_owner=owner,
                      lease_expires_at=utcnow() + timedelta(seconds=30))
        session.add(stage)
        session.flush()
        session.add(Attempt(stage_id=stage.id, number=1, worker=owner, num_gpus=1.0, started_at=started,
                            heartbeat_at=heartbeat))
        return stage.id


def test_release_leases_requeues_my_stages_charges_up_to_now_and_spends_no_attempt(scheduler):
    started = utcnow() - timedelta(seconds=40)
    stage_id = _running(scheduler, "me", started, started + timedelta(seconds=30))
    assert scheduler.release_leases() == 1
    with scheduler.sessions() as session:
        stage, attempt = session.get(Stage, stage_id), session.scalar(select(Attempt))
        assert (stage.status, stage.lease_owner, stage.attempts) == ("queued", None, 0)
        assert (attempt.status, attempt.exit) == ("failed", "interrupted")
        assert 40 <= attempt.wall_seconds < 45 and attempt.gpu_seconds == pytest.approx(attempt.wall_seconds)
    assert scheduler.release_leases() == 0  # nothing held any more


def test_a_sqlite_scheduler_takes_back_a_dead_ones_unexpired_leases_charged_to_its_last_heartbeat(scheduler):
    started = utcnow() - timedelta(seconds=40)
    stage_id = _running(scheduler, "dead-scheduler", started, started + timedelta(seconds=20))
    scheduler._requeue_expired()
    with scheduler.sessions() as session:
        assert session.get(Stage, stage_id).status == "running"  # its lease has 30 s left
    scheduler._requeue_expired(unexpired_too=True)  # what start() does once it holds the SQLite writer lock
    with scheduler.sessions() as session:
        stage, attempt = session.get(Stage, stage_id), session.scalar(select(Attempt))
        assert (stage.status, stage.lease_owner) == ("queued", None)
        assert (attempt.exit, attempt.wall_seconds) == ("lease_expired", pytest.approx(20.0))
