"""Quotas under concurrency on SQLite: many threads submitting or uploading at once for one tenant never
overshoot its limits (the write lock is taken before the check; SQLite ignores SELECT … FOR UPDATE), GPU
builds reserve their need at submit and give back what they did not use when they end; concurrent deletes
of one upload and cancels of one build each act once."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from cluster.capacity import Capacity
from cluster.db import lock_for_write
from cluster.models import Build, Event, Tenant
from cluster.service import (
    GpuNeed,
    QuotaExceeded,
    assumed_cluster_gpus,
    cancel_build,
    delete_upload,
    gpu_need,
    record_upload,
    reserved_gpu_seconds,
    retry_build,
    set_quota,
    submit,
)
from cluster.spec import parse_spec
from tests.support.api import finish_build, spec
from tests.support.control_plane import chain_registry
from tests.support.quota_races import (
    ON_A_GPU,
    builds_of,
    concurrent_gpu_submissions,
    concurrent_submissions,
    concurrent_uploads,
    uploaded_of,
)


def test_thirty_concurrent_submissions_under_a_limit_of_three_queue_exactly_three(sessions):
    set_quota(sessions, "acme", max_concurrent_builds=3)
    assert sorted(concurrent_submissions(sessions, "acme", 30)) == ["ok"] * 3 + ["quota"] * 27
    assert builds_of(sessions, "acme") == 3


def test_ten_concurrent_uploads_never_exceed_the_upload_quota(sessions):
    outcomes = concurrent_uploads(sessions, "acme", 10, size=300_000, quota=1_000_000)  # room for 3
    assert sorted(outcomes) == ["ok"] * 3 + ["quota"] * 7
    assert uploaded_of(sessions, "acme") == 900_000


def test_eight_concurrent_gpu_builds_queue_only_as_many_as_the_gpu_hour_quota_fits(sessions):
    # Each build reserves 3 GPU stages × 1 GPU × 1 s = 3 GPU-seconds: a 10 GPU-second month fits three.
    # (Checked at submit against use alone, all eight were accepted: nothing had run yet.)
    set_quota(sessions, "acme", gpu_hours_per_month=10 / 3600)
    outcomes = concurrent_gpu_submissions(sessions, "acme", 8, stage_seconds=1.0)
    assert sorted(outcomes) == ["ok"] * 3 + ["quota"] * 5
    assert builds_of(sessions, "acme") == 3
    with sessions() as session:
        assert reserved_gpu_seconds(session, "acme") == 9.0


def test_an_ended_build_gives_back_what_it_reserved_beyond_its_charge_and_a_retry_reserves_again(sessions):
    registry = chain_registry()
    ends = SimpleNamespace(sessions=sessions)  # what finish_build needs of an Api

    def gpu_build(version: str):
        return submit(sessions, parse_spec(spec(version=version, stages=ON_A_GPU), registry), registry,
                      tenant="acme", gpu_stage_seconds=1.0).build_id

    set_quota(sessions, "acme", gpu_hours_per_month=10 / 3600)  # 10 GPU-seconds; a build reserves 3
    a, b, c = (gpu_build(str(i)) for i in range(3))
    with pytest.raises(QuotaExceeded, match=r"reserve 9\.0 more, of 10 GPU-seconds in all\); this build reserves 3 GPU-seconds "
                                            r"\(3 GPU stages, 3 GPUs × 1 s, the estimate per GPU stage set by "
                                            r"ELASTIFY_GPU_STAGE_SECONDS\)"):
        gpu_build("3")
    finish_build(ends, a, gpu_seconds=0.5)  # charged 3 × 0.5: 1.5 used + 6 reserved, 3 more do not fit
    with pytest.raises(QuotaExceeded, match=r"used 0\.000 of its 0\.00277778 GPU-hours .*\(1\.5 GPU-seconds"):
        gpu_build("3")
    finish_build(ends, b, status="failed", gpu_seconds=0.5)  # first and second ran: 1.0 charged, 2 stages to retry
    d = gpu_build("3")  # 2.5 used + 3 (c) + 3 fit in 10
    with pytest.raises(QuotaExceeded):
        retry_build(sessions, b, gpu_stage_seconds=1.0)  # 2.5 + 6 + 2 > 10
    finish_build(ends, c, gpu_seconds=0.5)
    assert retry_build(sessions, b, gpu_stage_seconds=1.0) == 2  # 4.0 used + 3 (d) + 2 fit
    with sessions() as session:
        assert session.get(Build, b).reserved_gpu_seconds == 1.0 + 2.0  # its charge so far + the re-queued need
        assert session.get(Build, d).reserved_gpu_seconds == 3.0
        assert reserved_gpu_seconds(session, "acme") == 2.0 + 3.0


def test_a_build_without_gpus_fits_a_reserved_budget_but_not_a_spent_one(sessions):
    registry = chain_registry()
    ends = SimpleNamespace(sessions=sessions)
    set_quota(sessions, "acme", gpu_hours_per_month=3 / 3600)

    def build(version: str, stages=None):
        return submit(sessions, parse_spec(spec(version=version, stages=stages or {}), registry), registry,
                      tenant="acme", gpu_stage_seconds=1.0).build_id

    gpu = build("0", ON_A_GPU)  # reserves all 3 GPU-seconds
    with pytest.raises(QuotaExceeded, match=r"reserve 3\.0 more"):
        build("1", ON_A_GPU)
    build("2")  # reserves nothing: the budget is held, not spent
    finish_build(ends, gpu, gpu_seconds=1.0)  # and now spent: 3 × 1 s
    with pytest.raises(QuotaExceeded, match=r"\(3\.0 GPU-seconds; .*this build gets no GPU and reserves nothing"):
        build("3")


def test_a_builds_gpu_need_is_what_its_stages_will_be_granted():
    accelerated, two = {"num_cpus": 1, "accelerated": True}, {"num_gpus": 2, "gpus_set": True}
    assert gpu_need([accelerated, two, {"num_cpus": 4}], "auto", 1.0, 10.0) == GpuNeed(3.0, 2, 10.0)
    assert gpu_need([accelerated, two], "cpu", 1.0, 10.0).seconds == 20.0  # the spec's num_gpus wins
    assert gpu_need([accelerated], "auto", 0.0, 10.0).seconds == 0.0  # a cluster without GPUs runs it on CPUs
    assert gpu_need([accelerated], "cuda", 0.0, 10.0).seconds == 10.0
    # Unknown to the submitting process (not joined to Ray, no num_gpus configured): counted as one GPU.
    assert assumed_cluster_gpus(None) == assumed_cluster_gpus(Capacity({"num_cpus": 4.0})) == 1.0
    assert assumed_cluster_gpus(Capacity({"num_cpus": 4.0}, complete=True)) == 0.0
    assert assumed_cluster_gpus(Capacity({"num_gpus": 8.0})) == 8.0


def test_the_write_lock_must_come_before_the_transactions_first_statement(sessions):
    with sessions.begin() as session:
        lock_for_write(session)
        lock_for_write(session)  # again in the same transaction: nothing more to do
    with pytest.warns(Warning, match="already established"), pytest.raises(RuntimeError, match="first statement"):
        with sessions.begin() as session:
            session.get(Tenant, "acme")
            lock_for_write(session)


def race_outcomes(count: int, attempt) -> list[str]:
    """`attempt(i)` in `count` threads released together: 'ok', 'missing' (KeyError) or the error's name."""
    start = threading.Barrier(count)

    def one(index: int) -> str:
        start.wait()
        try:
            attempt(index)
            return "ok"
        except KeyError:
            return "missing"
        except Exception as err:  # what the race used to raise: "database is locked", IntegrityError
            return type(err).__name__

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def test_concurrent_deletes_of_one_upload_delete_it_once(sessions):
    record_upload(sessions, "acme", "ab" * 32, "file", "u", 10, 1_000_000)
    deleted = []
    store = type("ListStore", (), {"delete_prefix": lambda self, prefix: deleted.append(prefix)})()
    outcomes = race_outcomes(8, lambda i: delete_upload(sessions, store, "acme", "ab" * 32))
    assert sorted(outcomes) == ["missing"] * 7 + ["ok"]
    assert len(deleted) == 1


def test_concurrent_cancels_of_one_build_request_it_once(sessions):
    registry = chain_registry()
    build_id = submit(sessions, parse_spec(spec(version="1"), registry), registry, tenant="acme").build_id
    outcomes = race_outcomes(8, lambda i: cancel_build(sessions, build_id, "acme"))
    assert outcomes == ["ok"] * 8
    with sessions() as session:
        requests = session.scalars(select(Event).where(Event.build_id == build_id,
                                                       Event.message == "cancellation requested")).all()
        assert len(requests) == 1
        assert session.get(Build, build_id).status == "cancelled"
