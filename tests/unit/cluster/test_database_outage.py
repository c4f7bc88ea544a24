"""A database that cannot be reached does not end the scheduler's loop: it backs off (doubling, to a cap),
reconnects, logs both and counts them for /metrics, and hands back to the queue the stages the outage left
leased with no Ray task. Errors that are not lost connections still end it. (The real outage, PostgreSQL
stopped and started under a running build, is tests/integration/test_database_outage.py.)"""

from __future__ import annotations

import logging
import sqlite3
import time
from datetime import timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from api.metrics import JobStoreCollector
from cluster.db import DATABASE_OUTAGES, is_connection_error
from cluster.models import Attempt, Stage, utcnow
from cluster.service import submit_build
from tests.support.control_plane import spec_for


class ConnectionRefused(Exception):
    """A driver error without an SQLSTATE, as psycopg raises when no server listens."""


def refused() -> OperationalError:
    return OperationalError("SELECT 1", {}, ConnectionRefused("connection failed: Connection refused"))


def with_sqlstate(message: str, sqlstate: str) -> Exception:
    error = Exception(message)
    error.sqlstate = sqlstate
    return error


def raising(error: Exception):
    def call(*args, **kwargs):
        raise error

    return call


def test_lost_connections_are_told_from_failed_statements():
    assert is_connection_error(refused())
    assert is_connection_error(OperationalError("x", {}, with_sqlstate("terminating connection due to "
                                                                       "administrator command", "57P01")))
    assert is_connection_error(OperationalError("x", {}, with_sqlstate("connection failure", "08006")))
    assert is_connection_error(DBAPIError("x", {}, Exception("server closed the connection unexpectedly"),
                                          connection_invalidated=True))
    assert is_connection_error(OperationalError("x", {}, sqlite3.OperationalError("unable to open database file")))
    assert not is_connection_error(OperationalError("x", {}, with_sqlstate("canceling statement due to lock "
                                                                           "timeout", "55P03")))
    assert not is_connection_error(OperationalError("x", {}, sqlite3.OperationalError("database is locked")))
    assert not is_connection_error(IntegrityError("x", {}, with_sqlstate("duplicate key", "23505")))
    assert not is_connection_error(RuntimeError("connection refused"))


def _orphan(scheduler) -> int:
    """A build whose first stage is leased to `scheduler` with a running attempt and no Ray task: what an
    outage in the middle of a dispatch leaves. Returns the stage id."""
    build_id = submit_build(scheduler.sessions, spec_for(), scheduler.registry)
    with scheduler.sessions.begin() as session:
        stage = session.scalar(select(Stage).where(Stage.build_id == build_id, Stage.key == "first"))
        stage.status, stage.lease_owner, stage.attempts = "running", scheduler.owner, 1
        stage.lease_expires_at = utcnow() + timedelta(seconds=60)
        session.add(Attempt(stage_id=stage.id, number=1, worker=scheduler.owner, num_gpus=1.0,
                            started_at=utcnow() - timedelta(seconds=2)))
        return stage.id


def test_a_lost_database_is_waited_out_with_backoff_then_orphaned_leases_go_back_to_the_queue(
        scheduler, monkeypatch, caplog):
    scheduler.settings.db_retry_base_seconds, scheduler.settings.db_retry_max_seconds = 0.02, 0.05
    stage_id = _orphan(scheduler)
    ticks, connects = [], []

    def tick() -> bool:
        ticks.append(time.monotonic())
        if len(ticks) == 1:
            raise refused()
        return False

    real_connect = scheduler.engine.connect

    def connect(*args, **kwargs):  # the server is back on the fourth try
        connects.append(time.monotonic())
        if len(connects) <= 3:
            raise refused()
        return real_connect(*args, **kwargs)

    monkeypatch.setattr(scheduler, "tick", tick)
    monkeypatch.setattr(scheduler.engine, "connect", connect)
    errors, reconnects = DATABASE_OUTAGES.errors, DATABASE_OUTAGES.reconnects
    with caplog.at_level(logging.WARNING, logger="elastify.scheduler"):
        scheduler.run(until=lambda: len(ticks) >= 2, timeout=10)  # returns: the loop went on after the outage

    assert DATABASE_OUTAGES.errors - errors == 4  # the tick's, and three failed reconnections
    assert DATABASE_OUTAGES.reconnects - reconnects == 1
    messages = [record.getMessage() for record in caplog.records]
    unreachable = [m for m in messages if m.startswith("database unreachable")]
    assert "Connection refused" in unreachable[0]
    waits = [float(m.split(" retries in ")[1].split()[0]) for m in unreachable]
    assert waits == [0.02, 0.04, 0.05, 0.05]  # doubling from the base, capped
    gaps = [later - earlier for earlier, later in zip([ticks[0], *connects[:3]], connects[:4], strict=True)]
    assert all(gap >= wait - 0.005 for gap, wait in zip(gaps, waits, strict=True)), gaps  # and it waited so
    assert any(m.startswith("database reachable again after") for m in messages)
    with scheduler.sessions() as session:
        stage = session.get(Stage, stage_id)
        assert (stage.status, stage.lease_owner, stage.attempts) == ("queued", None, 0)  # no retry spent
        attempt = session.scalar(select(Attempt).where(Attempt.stage_id == stage_id))
        assert (attempt.status, attempt.exit) == ("failed", "interrupted")
        assert attempt.gpu_seconds >= 2.0  # charged up to the recovery


def test_a_stop_during_an_outage_ends_the_loop_and_other_database_errors_are_not_waited_out(scheduler, monkeypatch):
    scheduler.settings.db_retry_base_seconds = scheduler.settings.db_retry_max_seconds = 0.05
    monkeypatch.setattr(scheduler, "tick", raising(refused()))
    monkeypatch.setattr(scheduler.engine, "connect", raising(refused()))
    stop_at = time.monotonic() + 0.3
    scheduler.run(until=lambda: time.monotonic() > stop_at, timeout=10)  # the stop is seen while it waits
    assert time.monotonic() - stop_at < 0.5
    with pytest.raises(TimeoutError, match="still unreachable"):
        scheduler.run(timeout=0.2)
    monkeypatch.setattr(scheduler, "tick", raising(IntegrityError("INSERT", {}, with_sqlstate("duplicate key", "23505"))))
    with pytest.raises(IntegrityError):
        scheduler.run(timeout=10)


def test_metrics_serve_the_outage_counters_and_only_them_while_the_database_is_down(api, monkeypatch):
    from fastapi.testclient import TestClient

    monkeypatch.setattr(DATABASE_OUTAGES, "errors", 7)
    monkeypatch.setattr(DATABASE_OUTAGES, "reconnects", 2)
    families = {f.name: f for f in text_string_to_metric_families(TestClient(api.app).get("/metrics").text)}
    assert families["elastify_database_errors"].samples[0].value == 7
    assert families["elastify_database_reconnects"].samples[0].value == 2
    assert "elastify_builds" in families

    assert list(JobStoreCollector(raising(refused())).collect()) == []  # no 500 for the scrape: nothing to read now
    with pytest.raises(IntegrityError):
        list(JobStoreCollector(raising(IntegrityError("x", {}, Exception("a bug")))).collect())
