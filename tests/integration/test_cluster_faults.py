"""Control plane on real PostgreSQL + SeaweedFS + Ray: crashes, cancellation, cache, ledger, bad input."""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime

import psutil
import pytest
from sqlalchemy import func, select

from api.app import default_registry
from cluster.ledger import usage
from cluster.models import Attempt, Event, Package, Stage
from cluster.registry import Registry
from cluster.service import build_summary, cancel_build, submit_build
from cluster.spec import parse_spec
from pipeline.contract import Resources
from tests.support.control_plane import chain_registry, journal_lines, make_settings, spec_for, started
from tests.support.services import free_port
from workers import testing
from workers.store import ArtifactRef, StoreConfig

pytestmark = pytest.mark.integration


@pytest.fixture
def scheduler_for(tmp_path, pg_url, s3_store, ray_cluster):
    """Start a scheduler on this test's PostgreSQL database and bucket; closed after the test."""
    made = []

    def make(registry, store=s3_store, **overrides):
        scheduler = started(make_settings(tmp_path, pg_url, store, **overrides), registry)
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.close()


def _wait_for_file(scheduler, path, timeout=60):
    scheduler.run(until=path.exists, timeout=timeout)


def test_worker_killed_mid_stage_is_retried_and_leaves_no_partial_artifact(tmp_path, scheduler_for):
    pid_file = tmp_path / "pid"
    registry = Registry([testing.tiny_stage("first", testing.sleep)])
    scheduler = scheduler_for(registry)
    spec = spec_for({"first": {"seconds": 30, "pid_file": str(pid_file), "only_first_time": True, "tag": "k"}})
    build_id = submit_build(scheduler.sessions, spec, registry)
    _wait_for_file(scheduler, pid_file)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    scheduler.run_until_done([build_id], timeout=90)

    summary = build_summary(scheduler.sessions, build_id)
    assert summary["status"] == "succeeded"
    first, second = summary["stages"][0]["attempts"]
    assert (first["status"], first["exit"]) == ("failed", "crashed")
    assert (second["status"], second["exit"]) == ("succeeded", "ok")
    assert first["wall_seconds"] > 0  # the crashed attempt's time is on the ledger too
    # Nothing of the killed attempt is in the store; the artifact is the retry's and verifies.
    assert scheduler.store.list(f"builds/{build_id}/first/a1") == []
    artifact = summary["stages"][0]["artifacts"]["out"]
    assert artifact["uri"].endswith("/a2/out")
    assert scheduler.store.artifact_exists(ArtifactRef(artifact["uri"], artifact["digest"], artifact["size"]))
    with scheduler.sessions() as session:  # the worker's progress reached the database while it ran
        progress = session.scalars(select(Event.data).where(Event.build_id == build_id, Event.kind == "progress")).all()
    # each report says how far the stage is and the usage its process has measured so far
    assert progress and all({"done", "total", "wall_seconds", "cpu_seconds"} <= set(data) for data in progress)
    assert all(0 <= data["done"] <= data["total"] and data["wall_seconds"] >= 0 for data in progress)


def test_cancellation_stops_ray_tasks_and_marks_everything_cancelled(tmp_path, scheduler_for):
    pid_file = tmp_path / "pid"
    registry = chain_registry(testing.sleep)
    scheduler = scheduler_for(registry)
    spec = spec_for({"first": {"seconds": 120, "pid_file": str(pid_file), "tag": "c"}})
    build_id = submit_build(scheduler.sessions, spec, registry)
    _wait_for_file(scheduler, pid_file)
    pid = int(pid_file.read_text())
    assert psutil.pid_exists(pid)

    cancel_build(scheduler.sessions, build_id)
    scheduler.run_until_done([build_id], timeout=30)
    deadline = time.monotonic() + 15
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, "Ray task still running"

    summary = build_summary(scheduler.sessions, build_id)
    assert summary["status"] == "cancelled"
    assert [s["status"] for s in summary["stages"]] == ["cancelled"] * 3
    assert summary["stages"][0]["attempts"][0]["status"] == "cancelled"
    assert summary["package"] is None


def test_identical_resubmission_comes_from_cache_with_zero_compute(tmp_path, scheduler_for):
    journal = tmp_path / "journal"
    registry = chain_registry(fan_out=True)
    scheduler = scheduler_for(registry)
    own = {"journal": str(journal)}
    spec = spec_for({"first": {**own, "tag": "a"}, "second": {**own, "tag": "b"}, "third": {**own, "tag": "c"}},
                    levels=(0.5, 1.0))
    first_build = submit_build(scheduler.sessions, spec, registry)
    scheduler.run_until_done([first_build], timeout=60)
    runs = len(journal_lines(journal))
    assert runs == 4  # first, second[0.5], second[1.0], third

    again = submit_build(scheduler.sessions, spec, registry)
    scheduler.run_until_done([again], timeout=60)
    summary = build_summary(scheduler.sessions, again)
    assert summary["status"] == "succeeded"
    assert summary["cache_hits"] == 4 and all(s["cache_hit"] for s in summary["stages"])
    assert all(s["attempts"] == [] for s in summary["stages"])
    assert len(journal_lines(journal)) == runs  # nothing ran again
    with scheduler.sessions() as session:
        assert usage(session, "build", build_id=again) == {}
        hits = session.scalar(select(func.count()).where(Event.build_id == again, Event.message == "cache hit"))
    assert hits == 4

    changed = spec_for({"first": {**own, "tag": "a"}, "second": {**own, "tag": "B"}, "third": {**own, "tag": "c"}},
                       levels=(0.5, 1.0))
    third = submit_build(scheduler.sessions, changed, registry)
    scheduler.run_until_done([third], timeout=60)
    hits = [s["key"] for s in build_summary(scheduler.sessions, third)["stages"] if s["cache_hit"]]
    assert hits == ["first"]  # a changed setting invalidates that stage and everything downstream


def test_ledger_rolls_up_fractional_gpu_seconds(tmp_path, scheduler_for):
    half = Resources(num_cpus=0.5, num_gpus=0.5)
    registry = Registry([
        testing.tiny_stage("train", testing.sleep, resources=half),
        testing.tiny_stage("score", testing.sleep, inputs={"x": "train.out"},
                           resources=Resources(num_cpus=0.5, num_gpus=0.25)),
        testing.tiny_stage("broken", testing.fail, resources=half, max_attempts=2, enabled_by_default=False),
    ])
    scheduler = scheduler_for(registry)
    builds = {}
    for tenant in ("acme", "globex"):
        spec = spec_for({"train": {"seconds": 0.3, "tag": tenant}, "score": {"seconds": 0.2, "tag": tenant}})
        builds[tenant] = submit_build(scheduler.sessions, spec, registry, tenant=tenant)
    failing = parse_spec({"source": {"model": "unused"}, "publish": {"name": "f", "version": "1"}, "stages": {
        "broken": {"enabled": True}, "train": {"enabled": False}, "score": {"enabled": False}}})
    builds["initech"] = submit_build(scheduler.sessions, failing, registry, tenant="initech")
    scheduler.run_until_done(list(builds.values()), timeout=90)

    with scheduler.sessions() as session:
        rows = session.execute(
            select(Attempt.num_gpus, Attempt.wall_seconds, Attempt.gpu_seconds, Attempt.status, Stage.type, Stage.build_id)
            .join(Stage, Stage.id == Attempt.stage_id)
        ).all()
        by = {group: usage(session, group) for group in ("build", "stage_type", "tenant", "day")}
    assert [r.status for r in rows if r.type == "broken"] == ["failed", "failed"]
    for row in rows:
        assert row.gpu_seconds == pytest.approx(row.wall_seconds * row.num_gpus)
    assert {r.num_gpus for r in rows} == {0.5, 0.25}
    expected_type = {t: sum(r.gpu_seconds for r in rows if r.type == t) for t in ("train", "score", "broken")}
    assert {k: v["gpu_seconds"] for k, v in by["stage_type"].items()} == pytest.approx(expected_type)
    assert by["stage_type"]["train"]["gpu_seconds"] >= 2 * 0.3 * 0.5  # two builds × 0.3 s × half a GPU
    assert by["stage_type"]["broken"]["attempts"] == 2  # failed attempts are on the ledger
    for tenant, build_id in builds.items():
        expected = sum(r.gpu_seconds for r in rows if r.build_id == build_id)
        assert by["build"][build_id]["gpu_seconds"] == pytest.approx(expected)
        assert by["tenant"][tenant]["gpu_seconds"] == pytest.approx(expected)
    total = sum(r.gpu_seconds for r in rows)
    today = datetime.now(UTC).date().isoformat()
    assert list(by["day"]) == [today]
    assert by["day"][today]["gpu_seconds"] == pytest.approx(total)


def test_missing_source_model_fails_first_stage_clearly_and_publishes_nothing(tmp_path, scheduler_for):
    registry = default_registry()
    scheduler = scheduler_for(registry)
    spec = parse_spec({"source": {"model": str(tmp_path / "no-such-model")}, "levels": [0.5, 1.0],
                       "publish": {"name": "ghost", "version": "1.0"}})
    build_id = submit_build(scheduler.sessions, spec, registry)
    scheduler.run_until_done([build_id], timeout=120)

    summary = build_summary(scheduler.sessions, build_id)
    assert summary["status"] == "failed"
    profile, *rest = summary["stages"]
    assert profile["status"] == "failed" and len(profile["attempts"]) == 1  # permanent: not retried
    assert "no-such-model" in profile["error"] and "does not exist" in profile["error"]
    assert summary["error"].startswith("profile: ")
    assert all(s["status"] == "cancelled" and s["attempts"] == [] for s in rest)
    with scheduler.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Package)) == 0
    assert scheduler.store.list("packages") == []


def test_store_down_is_retried_then_fails_clearly_without_losing_rows(tmp_path, scheduler_for):
    down = StoreConfig("s3://gone/x", f"http://127.0.0.1:{free_port()}", "test", "test")
    registry = chain_registry(max_attempts=3)
    scheduler = scheduler_for(registry, store=down)
    build_id = submit_build(scheduler.sessions, spec_for(), registry)
    scheduler.run_until_done([build_id], timeout=120)

    summary = build_summary(scheduler.sessions, build_id)
    assert summary["status"] == "failed"
    first = summary["stages"][0]
    assert [a["status"] for a in first["attempts"]] == ["failed"] * 3
    assert all("unreachable" in a["error"] for a in first["attempts"])
    assert "artifact store unreachable at http://127.0.0.1" in summary["error"]
    with scheduler.sessions() as session:
        retries = session.scalar(select(func.count()).where(Event.build_id == build_id, Event.message.like("retrying in%")))
        attempts = session.scalar(select(func.count()).select_from(Attempt))
    assert retries == 2 and attempts == 3


def test_a_stage_that_reports_progress_keeps_its_cpus_to_itself(tmp_path, scheduler_for):
    """Two shards that each need both CPUs of the head run one after the other, never together.

    A worker that blocked on Ray while sending an event would lend its CPUs to the next shard.
    """
    registry = chain_registry(testing.sleep, resources=Resources(num_cpus=2), fan_out=True)
    scheduler = scheduler_for(registry)
    journal = tmp_path / "journal"
    own = {"journal": str(journal), "seconds": 3.0, "tick": 0.01, "chatty": True}
    spec = spec_for({"first": {"seconds": 0}, "second": own}, levels=(0.5, 1.0))
    build_id = submit_build(scheduler.sessions, spec, registry)
    scheduler.run_until_done([build_id], timeout=120)
    assert scheduler.status(build_id) == "succeeded"
    spans = {}
    for line in journal_lines(journal):
        first, last = spans.get(line["key"], (line["t"], line["t"]))
        spans[line["key"]] = (min(first, line["t"]), max(last, line["t"]))
    (a_start, a_end), (b_start, b_end) = sorted(spans[key] for key in ("|0.5", "|1.0"))
    assert b_start >= a_end, f"shards overlapped: {spans}"


def test_each_stage_computes_on_as_many_threads_as_cpus_it_was_granted(tmp_path, scheduler_for):
    """1, 2, 1, 2 CPUs in a chain on a 2-CPU head: Ray reuses idle worker processes, and torch's thread
    pool, once made, would otherwise keep the first grant's size (one thread for the 2-CPU stages, two
    for a 1-CPU shard beside another)."""
    grants = {"a": 1, "b": 2, "c": 1, "d": 2}
    journal = tmp_path / "journal"
    names = list(grants)
    registry = Registry([
        testing.tiny_stage(name, testing.threads, resources=Resources(num_cpus=cpus),
                           inputs={"x": f"{names[k - 1]}.out"} if k else {})
        for k, (name, cpus) in enumerate(grants.items())
    ])
    scheduler = scheduler_for(registry)
    spec = spec_for({name: {"tag": name, "journal": str(journal)} for name in grants}, cache=False)
    build_id = submit_build(scheduler.sessions, spec, registry)
    scheduler.run_until_done([build_id], timeout=120)
    assert scheduler.status(build_id) == "succeeded"
    ran = {line["key"].split("|")[0]: line for line in journal_lines(journal)}
    assert {name: ran[name]["threads"] for name in grants} == grants, ran
