"""Quotas under concurrency on SQLite: many threads submitting or uploading at once for one tenant never
overshoot its limits (the write lock is taken before the check; SQLite ignores SELECT … FOR UPDATE);
concurrent deletes of one upload and cancels of one build each act once."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import select

from cluster.db import lock_for_write
from cluster.models import Build, Event, Tenant
from cluster.service import cancel_build, delete_upload, record_upload, set_quota, submit
from cluster.spec import parse_spec
from tests.support.api import spec
from tests.support.control_plane import chain_registry
from tests.support.quota_races import builds_of, concurrent_submissions, concurrent_uploads, uploaded_of


def test_thirty_concurrent_submissions_under_a_limit_of_three_queue_exactly_three(sessions):
    set_quota(sessions, "acme", max_concurrent_builds=3)
    assert sorted(concurrent_submissions(sessions, "acme", 30)) == ["ok"] * 3 + ["quota"] * 27
    assert builds_of(sessions, "acme") == 3


def test_ten_concurrent_uploads_never_exceed_the_upload_quota(sessions):
    outcomes = concurrent_uploads(sessions, "acme", 10, size=300_000, quota=1_000_000)  # room for 3
    assert sorted(outcomes) == ["ok"] * 3 + ["quota"] * 7
    assert uploaded_of(sessions, "acme") == 900_000


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
