"""Races on PostgreSQL through the live API: concurrent submissions cannot overshoot a tenant's
concurrency quota, and concurrent submissions with one Idempotency-Key make one build."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import func, select

from api.app import ServerThread
from cluster.models import Build
from cluster.service import set_quota
from tests.support import services
from tests.support.api import make_api, spec

pytestmark = pytest.mark.integration


@pytest.fixture
def live(postgres_server, tmp_path):
    api = make_api(tmp_path, services.create_database(postgres_server, f"t_{uuid.uuid4().hex[:10]}"))
    with ServerThread(api.app, port=services.free_port()) as server:
        yield api, server.url


def _post_all(url: str, bodies_and_headers: list[tuple[dict, dict]]) -> list[httpx.Response]:
    def post(item):
        body, headers = item
        with httpx.Client(base_url=url, timeout=60) as client:
            return client.post("/v1/builds", json=body, headers=headers)

    with ThreadPoolExecutor(len(bodies_and_headers)) as pool:
        return list(pool.map(post, bodies_and_headers))


def _builds(api, tenant: str) -> int:
    with api.sessions() as session:
        return session.scalar(select(func.count()).select_from(Build).where(Build.tenant_id == tenant))


def test_concurrent_submissions_never_overshoot_the_concurrency_quota(live):
    api, url = live
    acme = api.token("acme")
    set_quota(api.sessions, "acme", max_concurrent_builds=3)
    responses = _post_all(url, [(spec(version=str(i)), acme) for i in range(12)])
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201] * 3 + [429] * 9, statuses
    assert all(r.headers["content-type"] == "application/problem+json" for r in responses if r.status_code == 429)
    assert _builds(api, "acme") == 3


def test_concurrent_submissions_with_one_idempotency_key_make_one_build(live):
    api, url = live
    acme = api.token("acme")
    responses = _post_all(url, [(spec(), {**acme, "Idempotency-Key": "once"})] * 10)
    assert sorted(r.status_code for r in responses) == [200] * 9 + [201]
    assert len({r.json()["id"] for r in responses}) == 1 and _builds(api, "acme") == 1


def test_listing_filters_and_pages_on_postgresql(live):
    api, url = live
    acme = api.token("acme")
    with httpx.Client(base_url=url, timeout=60, headers=acme) as client:
        ids = [client.post("/v1/builds", json=spec(name=f"pkg-{i % 3}", version=str(i))).json()["id"] for i in range(8)]
        client.post(f"/v1/builds/{ids[0]}/cancel")
        seen, cursor = [], None
        while True:
            page = client.get("/v1/builds", params={"limit": 3, **({"cursor": cursor} if cursor else {})}).json()
            seen += [b["id"] for b in page["items"]]
            if (cursor := page["next_cursor"]) is None:
                break
        assert seen == ids[::-1]
        named = client.get("/v1/builds", params={"name": "pkg-1"}).json()["items"]
        assert [b["id"] for b in named] == [ids[7], ids[4], ids[1]]
        cancelled = client.get("/v1/builds", params={"status": "cancelled"}).json()["items"]
        assert [b["id"] for b in cancelled] == [ids[0]]


def test_concurrent_first_submissions_of_a_new_tenant_all_succeed(postgres_server, tmp_path):
    # The tenant row is created by whichever submission comes first (insert … on conflict do nothing);
    # the others wait for it instead of failing on its primary key.
    from cluster.db import make_engine, migrate, session_factory
    from cluster.service import submit
    from cluster.spec import parse_spec
    from tests.support.control_plane import chain_registry

    url = services.create_database(postgres_server, f"t_{uuid.uuid4().hex[:10]}")
    migrate(url)
    sessions, registry = session_factory(make_engine(url)), chain_registry()

    def first_submission(i: int) -> str:
        return submit(sessions, parse_spec(spec(version=str(i))), registry, tenant="newcomer").build_id

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(first_submission, range(8)))
    assert len(set(ids)) == 8
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Build).where(Build.tenant_id == "newcomer")) == 8
