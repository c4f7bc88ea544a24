"""Quotas under concurrency on PostgreSQL (the tenant row locked FOR UPDATE): the same races as
tests/unit/cluster/test_quota_races.py on SQLite, with the same answers."""

from __future__ import annotations

import pytest

from cluster.db import make_engine, session_factory
from cluster.service import set_quota
from tests.support.quota_races import builds_of, concurrent_submissions, concurrent_uploads, uploaded_of

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
