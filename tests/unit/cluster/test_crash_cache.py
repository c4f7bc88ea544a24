"""Crash accounting, the store sweeper and the per-tenant stage cache, on SQLite and a local store
(the scheduler's database and store logic; no Ray)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from cluster.models import Artifact, Attempt, Build, Stage, Tenant, utcnow
from cluster.sweeper import attempt_prefix, sweep_dead_outputs
from workers.runner import ExternalInput


def _stage(session, build_id: str, tenant: str, status: str = "running", key: str = "first", **stage) -> Stage:
    if session.get(Tenant, tenant) is None:
        session.add(Tenant(id=tenant))
        session.flush()
    session.add(Build(id=build_id, tenant_id=tenant, spec={"cache": True}, spec_hash="0" * 64, status=status))
    session.flush()
    row = Stage(build_id=build_id, key=key, type=key, settings={}, resources={"num_gpus": 2}, status=status, **stage)
    session.add(row)
    session.flush()
    return row


def test_a_lease_expired_attempt_is_charged_up_to_its_last_heartbeat_not_the_outage(scheduler):
    started = utcnow() - timedelta(hours=1)
    with scheduler.sessions.begin() as session:
        stage = _stage(session, "b1", "acme", attempts=1, lease_owner="dead-scheduler",
                       lease_expires_at=utcnow() - timedelta(seconds=5))
        session.add(Attempt(stage_id=stage.id, number=1, worker="dead-scheduler", num_gpus=2.0, started_at=started,
                            heartbeat_at=started + timedelta(seconds=100)))
    scheduler._requeue_expired()
    with scheduler.sessions() as session:
        attempt = session.scalar(select(Attempt))
    assert (attempt.status, attempt.exit) == ("failed", "lease_expired")
    # It ran 100 s on 2 GPUs before its scheduler died; the hour until the lease was noticed is not billed.
    assert attempt.wall_seconds == pytest.approx(100.0)
    assert attempt.gpu_seconds == pytest.approx(200.0)


def test_the_scheduler_heartbeat_records_the_attempts_last_sign_of_life(scheduler):
    started = utcnow() - timedelta(minutes=5)
    with scheduler.sessions.begin() as session:
        stage = _stage(session, "b1", "acme", lease_owner="me", lease_expires_at=utcnow() + timedelta(seconds=30))
        session.add(Attempt(stage_id=stage.id, number=1, worker="me", num_gpus=1.0, started_at=started,
                            heartbeat_at=started))
    scheduler._heartbeat()
    with scheduler.sessions() as session:
        assert session.scalar(select(Attempt.heartbeat_at)) > utcnow() - timedelta(seconds=5)


def _upload(scheduler, tmp_path, prefix: str, size: int = 4096) -> None:
    payload = tmp_path / "partial.bin"
    payload.write_bytes(b"\x01" * size)
    scheduler.store.put_file(f"{prefix}/out/files/weights.safetensors", payload)  # no index: a partial upload


def test_the_sweeper_deletes_dead_attempts_partial_outputs_and_keeps_referenced_ones(scheduler, tmp_path):
    ended = utcnow() - timedelta(minutes=10)
    with scheduler.sessions.begin() as session:
        stage = _stage(session, "b1", "acme", status="succeeded")
        for number, status in ((1, "failed"), (2, "cancelled"), (3, "succeeded")):
            session.add(Attempt(stage_id=stage.id, number=number, worker="me", status=status, ended_at=ended))
        session.add(Artifact(stage_id=stage.id, name="out", uri=attempt_prefix("b1", "first", 3) + "/out",
                             digest="d" * 64, size=4096))
        recent = _stage(session, "b2", "acme", status="failed")
        session.add(Attempt(stage_id=recent.id, number=1, worker="me", status="failed", ended_at=utcnow()))
    for build, number in (("b1", 1), ("b1", 2), ("b1", 3), ("b2", 1)):
        _upload(scheduler, tmp_path, attempt_prefix(build, "first", number))
    store = scheduler.store

    deleted = sweep_dead_outputs(scheduler.sessions, store, ended_before=utcnow() - timedelta(minutes=1))

    assert set(deleted) == {"builds/b1/first/a1", "builds/b1/first/a2"}
    assert store.list("builds/b1/first/a1") == [] and store.list("builds/b1/first/a2") == []
    assert store.list("builds/b1/first/a3"), "a succeeded attempt's artifact is kept"
    assert store.list("builds/b2/first/a1"), "an attempt that just ended is left its grace period"
    assert sweep_dead_outputs(scheduler.sessions, store, ended_before=utcnow() - timedelta(minutes=1)) == {}
    with scheduler.sessions() as session:
        swept = session.scalars(select(Attempt.number).where(Attempt.outputs_swept_at.is_not(None))).all()
    assert sorted(swept) == [1, 2]


def test_an_attempt_referenced_by_a_cache_hit_is_never_swept(scheduler, tmp_path):
    ended = utcnow() - timedelta(minutes=10)
    prefix = attempt_prefix("b1", "first", 1)
    with scheduler.sessions.begin() as session:
        stage = _stage(session, "b1", "acme", status="failed")
        session.add(Attempt(stage_id=stage.id, number=1, worker="me", status="failed", ended_at=ended))
        reuser = _stage(session, "b2", "acme", status="succeeded")
        session.add(Artifact(stage_id=reuser.id, name="out", uri=prefix + "/out", digest="d" * 64, size=1))
    _upload(scheduler, tmp_path, prefix)
    assert sweep_dead_outputs(scheduler.sessions, scheduler.store, ended_before=utcnow()) == {}
    assert scheduler.store.list(prefix)


def _finished_stage_with_output(scheduler, tmp_path, build_id: str, tenant: str, key: str) -> None:
    output = tmp_path / f"{build_id}.txt"
    output.write_text(f"output of {build_id}")
    ref = scheduler.store.put_artifact(attempt_prefix(build_id, "first", 1) + "/out", output)
    with scheduler.sessions.begin() as session:
        stage = _stage(session, build_id, tenant, status="succeeded", cache_key=key)
        session.add(Artifact(stage_id=stage.id, name="out", uri=ref.key, digest=ref.digest, size=ref.size))


def test_the_stage_cache_is_per_tenant(scheduler, tmp_path):
    registration = scheduler.registry.get("first")
    model = tmp_path / "model.txt"
    model.write_text("the same source model")
    inputs = {"model": ExternalInput(str(model))}

    def key(tenant: str) -> str:
        return scheduler._cache_key(Stage(key="first", type="first", settings={}), registration, inputs, {}, tenant)

    assert key("acme") == key("acme") and key("acme") != key("beta")
    _finished_stage_with_output(scheduler, tmp_path, "a1", "acme", key("acme"))
    with scheduler.sessions.begin() as session:
        acme_again = _stage(session, "a2", "acme", status="running")
        beta = _stage(session, "b1", "beta", status="running")
        acme_again.cache_key, beta.cache_key = key("acme"), key("beta")
        # Beta's identical build misses: it neither gets acme's output nor learns that acme built this model.
        assert scheduler._cached_outputs(session, beta, registration) is None
        hit = scheduler._cached_outputs(session, acme_again, registration)
    assert hit is not None and hit["out"].key == attempt_prefix("a1", "first", 1) + "/out"
