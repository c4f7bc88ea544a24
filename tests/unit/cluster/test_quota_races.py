"""Quotas under concurrency on SQLite: many threads submitting or uploading at once for one tenant never
overshoot its limits (the write lock is taken before the check; SQLite ignores SELECT … FOR UPDATE)."""

from __future__ import annotations

import pytest

from cluster.db import lock_for_write
from cluster.models import Tenant
from cluster.service import set_quota
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
