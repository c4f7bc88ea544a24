"""Several scheduler processes on one PostgreSQL: exclusivity, and resuming after a scheduler is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from sqlalchemy import func, select

from cluster.db import make_engine, session_factory
from cluster.models import Attempt, Build
from cluster.service import build_summary, submit_build
from tests.support.control_plane import chain_registry, journal_lines, spec_for
from workers import testing

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _scheduler(env, url: str, store: Path, registry: str, *flags: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.support.scheduler_process", url, str(store), registry, *flags], env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)


def _wait(condition, timeout: float, what: str, processes=()) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for process in processes:
            if process.poll() not in (None, 0):
                raise AssertionError(f"scheduler process exited with {process.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_two_schedulers_run_every_stage_of_200_builds_exactly_once(tmp_path, pg_url, cluster_env):
    sessions = session_factory(make_engine(pg_url))
    registry = chain_registry(testing.noop)
    journal = tmp_path / "journal"
    for index in range(200):  # distinct settings: no build is a cache hit of another
        own = {"journal": str(journal)}
        spec = spec_for({"first": {**own, "tag": f"{index}a"}, "second": {**own, "tag": f"{index}b"},
                         "third": {**own, "tag": f"{index}c"}})
        submit_build(sessions, spec, registry)
    go = tmp_path / "go"
    processes = [
        _scheduler(cluster_env, pg_url, tmp_path / "store", "chain-noop", "--idle-exit", "--wait-for", str(go),
                   "--ready", str(tmp_path / f"ready{i}"), "--lease-seconds", "15", log=tmp_path / f"scheduler{i}.log")
        for i in range(2)
    ]
    try:
        _wait(lambda: all((tmp_path / f"ready{i}").exists() for i in range(2)), 90, "schedulers ready", processes)
        go.touch()  # both start leasing at the same moment
        for process in processes:
            assert process.wait(timeout=300) == 0, (tmp_path / "scheduler0.log").read_text()[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)

    runs = Counter(line["key"] for line in journal_lines(journal))
    assert len(runs) == 600 and set(runs.values()) == {1}, runs.most_common(3)
    with sessions() as session:
        assert set(session.scalars(select(Build.status))) == {"succeeded"}
        per_stage = session.execute(select(Attempt.stage_id, func.count()).group_by(Attempt.stage_id)).all()
        assert len(per_stage) == 600 and {count for _, count in per_stage} == {1}
        workers = session.execute(select(Attempt.worker, func.count()).group_by(Attempt.worker)).all()
    assert len(workers) == 2, f"both schedulers should have dispatched work: {workers}"


def test_killed_scheduler_is_replaced_and_no_stage_ever_runs_twice_at_once(tmp_path, pg_url, cluster_env):
    sessions = session_factory(make_engine(pg_url))
    registry = chain_registry(testing.sleep, fan_out=True)
    journal = tmp_path / "journal"
    own = {"journal": str(journal), "seconds": 1.5, "tick": 0.05}
    spec = spec_for({"first": {**own, "tag": "first"}, "second": {**own, "tag": "second"},
                     "third": {**own, "tag": "third"}}, levels=(0.5, 1.0))
    build_id = submit_build(sessions, spec, registry)
    store = tmp_path / "store"

    doomed = _scheduler(cluster_env, pg_url, store, "chain-sleep-fanout", log=tmp_path / "doomed.log")
    try:
        _wait(lambda: any(line["key"].startswith("second") for line in journal_lines(journal)), 120,
              "the build to reach its fanned-out stage", [doomed])
    finally:
        os.killpg(doomed.pid, signal.SIGKILL)  # mid-stage, no goodbye: its leases must expire
        doomed.wait()

    successor = _scheduler(cluster_env, pg_url, store, "chain-sleep-fanout", "--idle-exit", log=tmp_path / "next.log")
    try:
        assert successor.wait(timeout=180) == 0, (tmp_path / "next.log").read_text()[-3000:]
    finally:
        if successor.poll() is None:
            os.killpg(successor.pid, signal.SIGKILL)

    summary = build_summary(sessions, build_id)
    assert summary["status"] == "succeeded", summary
    interrupted = [a for s in summary["stages"] for a in s["attempts"] if a["exit"] == "lease_expired"]
    assert interrupted, "the killed scheduler's stage should show an expired-lease attempt"
    # For each stage, the tick intervals of different worker processes never overlap.
    spans: dict[str, dict[int, list[float]]] = defaultdict(dict)
    for line in journal_lines(journal):
        first, last = spans[line["key"]].get(line["pid"], [line["t"], line["t"]])
        spans[line["key"]][line["pid"]] = [min(first, line["t"]), max(last, line["t"])]
    for key, by_pid in spans.items():
        intervals = sorted(by_pid.values())
        for (_, end), (start, _) in zip(intervals, intervals[1:], strict=False):
            assert start > end, f"stage {key} ran in two processes at once: {intervals}"
    assert any(len(by_pid) > 1 for by_pid in spans.values())  # a stage really was re-run after the kill
