"""Job store on SQLite: migrations match the models, races on status, the ledger, publishing."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from cluster.db import alembic_config, make_engine, migrate
from cluster.ledger import usage
from cluster.models import Alias, Attempt, Base, Build, Package, Stage, Tenant
from cluster.packages import PublishRefused, alias_key, register_package
from cluster.states import IllegalTransition, Status, advance
from device_sdk.format import canonical_json
from workers.store import LocalStore


def test_migrations_create_exactly_the_models_schema(tmp_path):
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    url = f"sqlite:///{tmp_path / 'm.db'}"
    migrate(url)
    migrate(url)  # idempotent
    engine = make_engine(url)
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    command.downgrade(alembic_config(url), "base")
    with engine.connect() as connection:
        assert [name for (name,) in connection.exec_driver_sql("SELECT name FROM sqlite_master WHERE type='table'")] == ["alembic_version"]


def _build(session, build_id="b1", tenant="t1", status=Status.RUNNING.value, spec=None, key=None):
    if session.get(Tenant, tenant) is None:
        session.add(Tenant(id=tenant))
        session.flush()
    session.add(Build(id=build_id, tenant_id=tenant, spec=spec or {}, spec_hash="h", status=status,
                      idempotency_key=key))
    session.flush()


def test_a_new_demo_cancels_unfinished_demos_of_other_code_only(sessions):
    from api.commands.cluster import cancel_stale_demos

    with sessions.begin() as session:
        _build(session, "old-running", key="demo-old1")
        _build(session, "old-queued", status=Status.QUEUED.value, key="demo-old2")
        _build(session, "old-done", status=Status.SUCCEEDED.value, key="demo-old3")
        _build(session, "current", key="demo-new")  # an interrupted run of this demo resumes
        _build(session, "user-build", key="nightly-1")
    assert sorted(cancel_stale_demos(sessions, "demo-new")) == ["old-queued", "old-running"]
    with sessions() as session:
        status = dict(session.execute(select(Build.id, Build.status)).all())
        requested = dict(session.execute(select(Build.id, Build.cancel_requested)).all())
    assert status["old-queued"] == Status.CANCELLED.value and requested["old-running"]
    assert status["old-done"] == Status.SUCCEEDED.value
    assert not requested["current"] and not requested["user-build"]


def test_conditional_transitions_let_exactly_one_racer_win(sessions):
    with sessions.begin() as session:
        _build(session)
        session.add(Stage(build_id="b1", key="s", type="s", settings={}, resources={}))
    with sessions.begin() as session:
        stage_id = session.scalar(select(Stage.id))
        assert advance(session, Stage, stage_id, Status.QUEUED, Status.RUNNING, lease_owner="A")
        assert not advance(session, Stage, stage_id, Status.QUEUED, Status.RUNNING, lease_owner="B")
        with pytest.raises(IllegalTransition):
            advance(session, Stage, stage_id, Status.SUCCEEDED, Status.RUNNING)
    with sessions() as session:
        assert session.get(Stage, stage_id).lease_owner == "A"


def test_ledger_rolls_up_per_build_stage_type_tenant_and_day(sessions):
    day1, day2 = datetime(2026, 3, 1, 23, 59), datetime(2026, 3, 2, 0, 1)
    with sessions.begin() as session:
        _build(session, "b1", "acme")
        _build(session, "b2", "globex")
        rows = [("b1", "train", day1, 10.0, 0.5, "succeeded"), ("b1", "train", day2, 4.0, 0.5, "failed"),
                ("b1", "label", day2, 2.0, 0.25, "succeeded"), ("b2", "train", day2, 8.0, 1.0, "succeeded")]
        for index, (build_id, kind, started, wall, gpus, status) in enumerate(rows):
            stage = Stage(build_id=build_id, key=f"{kind}{index}", type=kind, settings={}, resources={})
            session.add(stage)
            session.flush()
            session.add(Attempt(stage_id=stage.id, number=1, worker="w", status=status, num_gpus=gpus,
                                wall_seconds=wall, cpu_seconds=wall / 2, gpu_seconds=wall * gpus, started_at=started,
                                ended_at=started + timedelta(seconds=wall)))
    with sessions() as session:
        assert {k: v["gpu_seconds"] for k, v in usage(session, "build").items()} == {"b1": 5.0 + 2.0 + 0.5, "b2": 8.0}
        assert {k: v["gpu_seconds"] for k, v in usage(session, "stage_type").items()} == {"train": 15.0, "label": 0.5}
        assert {k: v["gpu_seconds"] for k, v in usage(session, "tenant").items()} == {"acme": 7.5, "globex": 8.0}
        by_day = usage(session, "day")
        assert {k: v["gpu_seconds"] for k, v in by_day.items()} == {"2026-03-01": 5.0, "2026-03-02": 10.5}
        assert by_day["2026-03-02"]["attempts"] == 3 and by_day["2026-03-02"]["wall_seconds"] == 14.0
        assert usage(session, "tenant", tenant="acme")["acme"]["cpu_seconds"] == 8.0
        with pytest.raises(ValueError, match="group by one of"):
            usage(session, "colour")


def _package_artifact(store, tmp_path, key: str, levels: list[str]):
    src = tmp_path / key
    (src / "model").mkdir(parents=True)
    (src / "model" / "weights.safetensors").write_bytes(b"w" * 100)
    (src / "manifest.json").write_bytes(canonical_json({"levels": levels}))
    return store.put_artifact(key, src)


def _hook(sessions, store, build_id, package):
    with sessions() as session:
        build = session.get(Build, build_id)
        stage = session.scalar(select(Stage).where(Stage.build_id == build_id))
    return SimpleNamespace(sessions=sessions, store=store, build=build, stage=stage, package=package)


def test_publish_is_immutable_idempotent_and_moves_aliases(sessions, tmp_path):
    store = LocalStore(tmp_path / "store")
    publish = {"name": "pkg", "version": "1.0", "aliases": ["latest"]}
    with sessions.begin() as session:
        for build_id in ("b1", "b2", "b3"):
            version = "2.0" if build_id == "b3" else "1.0"
            _build(session, build_id, spec={"publish": {**publish, "version": version}})
            session.add(Stage(build_id=build_id, key="publish", type="publish", settings={}, resources={}))
    first = _package_artifact(store, tmp_path, "a/1", ["0.5", "1.0"])
    register_package(_hook(sessions, store, "b1", first))
    assert store.exists("packages/pkg/1.0/manifest.json") and store.exists("packages/pkg/1.0/model/weights.safetensors")
    assert store.get_bytes(alias_key("pkg", "latest")) == b"1.0"

    register_package(_hook(sessions, store, "b2", first))  # same manifest: a no-op
    different = _package_artifact(store, tmp_path, "a/2", ["1.0"])
    with pytest.raises(PublishRefused, match="already published"):
        register_package(_hook(sessions, store, "b2", different))
    assert json.loads(store.get_bytes("packages/pkg/1.0/manifest.json")) == {"levels": ["0.5", "1.0"]}

    register_package(_hook(sessions, store, "b3", different))
    with sessions() as session:
        packages = {p.version: p for p in session.scalars(select(Package))}
        assert set(packages) == {"1.0", "2.0"}
        assert session.get(Alias, ("pkg", "latest")).package_id == packages["2.0"].id
    assert store.get_bytes(alias_key("pkg", "latest")) == b"2.0"


def test_a_submission_that_breaks_a_constraint_fails_once_and_writes_nothing(sessions, monkeypatch):
    import cluster.service
    from cluster.dag import plan
    from cluster.registry import Registry
    from cluster.service import SubmissionFailed, submit
    from cluster.spec import parse_spec
    from workers.testing import tiny_stage

    registry = Registry([tiny_stage("only")])
    spec = parse_spec({"source": {"model": "/m"}, "publish": {"name": "pkg", "version": "1"}})
    node = plan(spec, registry)[0]
    calls = []

    def two_rows_with_one_key(spec, registry):  # what duplicate level names once produced
        calls.append(1)
        return [node, node]

    monkeypatch.setattr(cluster.service, "plan", two_rows_with_one_key)
    with pytest.raises(SubmissionFailed, match="build could not be stored"):
        submit(sessions, spec, registry, tenant="t1", idempotency_key="k1")
    assert calls == [1]  # not retried
    with sessions() as session:
        assert session.scalar(select(Build.id)) is None and session.scalar(select(Stage.id)) is None
