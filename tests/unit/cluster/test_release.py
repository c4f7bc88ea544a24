"""Releasing: the scheduler's stop paths that need no Ray (handing its stages back through the database when Ray
went down with it; a SQLite scheduler taking back, at start, the stages a dead one still holds), and publishing a
package release (alias objects repaired by a retry, signed sequences that only go up)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
from sqlalchemy import select

import cluster.packages
from cluster.models import Attempt, Build, Package, Stage, Tenant, utcnow
from cluster.packages import PublishRefused, alias_key, next_sequence, register_package
from device_sdk.format import canonical_json, read_manifest
from device_sdk.trust import verify_package
from pipeline.publish import publish_package
from tests.support.sdk_packages import public_bytes, random_package, signing_key
from workers.store import LocalStore


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


def _publishing(sessions, tmp_path, versions: dict[str, str]):
    """A store, and one build with a publish stage per build id -> version, publishing `pkg` with alias latest."""
    with sessions.begin() as session:
        session.add(Tenant(id="acme"))
        session.flush()
        for build_id, version in versions.items():
            spec = {"publish": {"name": "pkg", "version": version, "aliases": ["latest"]}}
            session.add(Build(id=build_id, tenant_id="acme", spec=spec, spec_hash="h", status="running"))
            session.flush()
            session.add(Stage(build_id=build_id, key="publish", type="publish", settings={}, resources={}))
    return LocalStore(tmp_path / "store")


def _context(sessions, store, build_id: str, package):
    with sessions() as session:
        build = session.get(Build, build_id)
        stage = session.scalar(select(Stage).where(Stage.build_id == build_id))
    return SimpleNamespace(sessions=sessions, store=store, build=build, stage=stage, package=package)


def _artifact(store, tmp_path, key: str, manifest: dict):
    folder = tmp_path / key
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "weights.safetensors").write_bytes(b"w" * 64)
    (folder / "manifest.json").write_bytes(canonical_json(manifest))
    return store.put_artifact(key, folder)


def test_a_crash_between_the_package_row_and_the_alias_objects_is_repaired_by_the_retry(sessions, tmp_path, monkeypatch):
    store = _publishing(sessions, tmp_path, {"b1": "1.0"})
    package = _artifact(store, tmp_path, "a/1", {"sequence": 1})
    write_aliases = cluster.packages.write_alias_objects

    def crash(*args):
        raise RuntimeError("scheduler killed after the package row committed")

    monkeypatch.setattr(cluster.packages, "write_alias_objects", crash)
    with pytest.raises(RuntimeError, match="killed"):
        register_package(_context(sessions, store, "b1", package))
    with sessions() as session:
        assert session.scalar(select(Package.version)) == "1.0"  # the row is in, the alias object is not
    assert not store.exists(alias_key("pkg", "latest"))

    monkeypatch.setattr(cluster.packages, "write_alias_objects", write_aliases)
    register_package(_context(sessions, store, "b1", package))  # the retry: "already published", yet repairs
    assert store.get_bytes(alias_key("pkg", "latest")) == b"1.0"


def test_sequences_are_assigned_one_above_the_highest_and_a_stale_one_is_refused(sessions, tmp_path):
    store = _publishing(sessions, tmp_path, {"b1": "1.0", "b2": "2.0", "b3": "3.0"})
    with sessions() as session:
        assert next_sequence(session, store, "pkg") == 1
    register_package(_context(sessions, store, "b1", _artifact(store, tmp_path, "a/1", {"sequence": 1})))
    with sessions() as session:
        assert next_sequence(session, store, "pkg") == 2
    # b2 was handed sequence 2 too, but b3 registered first: b2's signed manifest would roll devices back
    register_package(_context(sessions, store, "b3", _artifact(store, tmp_path, "a/3", {"sequence": 2})))
    with pytest.raises(PublishRefused, match="sequence 2, not above sequence 2 already published"):
        register_package(_context(sessions, store, "b2", _artifact(store, tmp_path, "a/2", {"sequence": 2})))
    assert store.get_bytes(alias_key("pkg", "latest")) == b"3.0"
    with sessions() as session:
        assert next_sequence(session, store, "pkg") == 3


def test_publish_signs_the_sequence_and_expiry_it_is_handed(tmp_path):
    key = signing_key()
    built = random_package("llama_mha", tmp_path / "built", None, layers=2)
    out = publish_package(built, tmp_path / "published", key, sequence=4, expires_at="2030-01-01T00:00:00+00:00")
    manifest = verify_package(out, public_bytes(key))
    assert (manifest.sequence, manifest.expires_at) == (4, "2030-01-01T00:00:00+00:00")
    assert read_manifest(publish_package(built, tmp_path / "unsequenced", key)).sequence == 0
