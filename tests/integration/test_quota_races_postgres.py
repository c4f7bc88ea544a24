"""Quotas under concurrency on PostgreSQL (the tenant row locked FOR UPDATE): the same races as
tests/unit/cluster/test_quota_races.py on SQLite, with the same answers; and GPU builds accepted under a
GPU-hour quota, then run on Ray (fake GPUs), charged within it."""

from __future__ import annotations

import pytest

from cluster.db import make_engine, session_factory
from cluster.ledger import charged_gpu_seconds
from cluster.models import Build
from cluster.service import QuotaExceeded, set_quota, submit
from cluster.spec import parse_spec
from tests.support.api import spec
from tests.support.control_plane import chain_registry, make_settings, started
from tests.support.quota_races import (
    builds_of,
    concurrent_gpu_submissions,
    concurrent_submissions,
    concurrent_uploads,
    submitted_of,
    uploaded_of,
)
from workers.store import StoreConfig

pytestmark = pytest.mark.integration


@pytest.fixture
def sessions(pg_url):
    engine = make_engine(pg_url)
    yield session_factory(engine)
    engine.dispose()


def test_thirty_concurrent_submissions_under_a_limit_of_three_queue_exactly_three(sessions):
    set_quota(sessions, "acme", max_concurrent_builds=3)
    assert sorted(concurrent_submissions(sessions, "acme", 30)) == ["ok"] * 3 + ["quota"] * 27
    assert builds_of(sessions, "acme") == 3


def test_ten_concurrent_uploads_never_exceed_the_upload_quota(sessions):
    outcomes = concurrent_uploads(sessions, "acme", 10, size=300_000, quota=1_000_000)
    assert sorted(outcomes) == ["ok"] * 3 + ["quota"] * 7
    assert uploaded_of(sessions, "acme") == 900_000


def test_eight_concurrent_gpu_builds_queue_what_the_gpu_hour_quota_fits_and_run_within_it(sessions, pg_url, tmp_path,
                                                                                       ray_cluster):
    # The first stage of each build asks for one GPU and reserves 1 GPU × 2 s: a 7 GPU-second month fits three.
    # (Checked at submit against use alone, all eight were accepted, and each charged what it ran.)
    budget, stage_seconds = 7.0, 2.0
    set_quota(sessions, "acme", gpu_hours_per_month=budget / 3600)
    first_on_a_gpu = {"first": {"resources": {"num_gpus": 1}}}
    outcomes = concurrent_gpu_submissions(sessions, "acme", 8, stage_seconds, stages=first_on_a_gpu)
    assert sorted(outcomes) == ["ok"] * 3 + ["quota"] * 5
    accepted = submitted_of(sessions, "acme")

    registry = chain_registry()
    scheduler = started(make_settings(tmp_path, pg_url, StoreConfig(str(tmp_path / "store"))), registry)
    try:
        scheduler.run_until_done(accepted, timeout=60)
    finally:
        scheduler.close()
    with sessions() as session:
        assert {session.get(Build, b).status for b in accepted} == {"succeeded"}
        charged = charged_gpu_seconds(session, accepted)
        reserved = {b: session.get(Build, b).reserved_gpu_seconds for b in accepted}
    # What the month was charged is the quota at most, plus what builds ran past their reservations (the
    # estimate can be short: then each such build overshoots by its excess, never more, and the next
    # submission sees the charge). Here every GPU stage ran well under its 2 s.
    overshoot = sum(max(0.0, charged[b] - reserved[b]) for b in accepted)
    assert sum(reserved.values()) == 3 * stage_seconds <= budget
    assert 0 < sum(charged.values()) <= budget + overshoot, (charged, reserved)
    # Ended, they hold their charge only: one more build fits exactly when charge + its 2 s fit the budget.
    try:
        submit(sessions, parse_spec(spec(version="8", stages=first_on_a_gpu, cache=False), registry), registry,
               tenant="acme", gpu_stage_seconds=stage_seconds)
        fitted = True
    except QuotaExceeded:
        fitted = False
    assert fitted == (sum(charged.values()) + stage_seconds <= budget), charged
