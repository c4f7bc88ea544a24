"""REST API, auth and tenancy: tokens stored hashed, 401 for bad tokens, 404 for other tenants'
objects, admin tokens see everything, usage per tenant, and quotas that refuse with 429."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select

from api.auth import token_hash
from cluster.models import ApiToken, Build, utcnow
from cluster.service import month_start, set_quota
from tests.support.api import finish_build, make_api, publish_files, spec


def test_tokens_are_stored_only_as_their_hash(api):
    headers = api.token("acme")
    token = headers["Authorization"].split()[1]
    with api.sessions() as session:
        rows = session.scalars(select(ApiToken)).all()
    assert len(rows) == 1 and rows[0].token_sha256 == token_hash(token)
    assert all(token not in str(value) for value in vars(rows[0]).values())


@pytest.mark.parametrize("authorization", [None, "Bearer", "Bearer elst_wrong", "Basic YTpi", "bearer  "])
def test_missing_or_bad_tokens_are_401_problems(client, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, url in [("GET", "/v1/builds"), ("POST", "/v1/builds"), ("GET", "/v1/packages"), ("GET", "/v1/usage")]:
        response = client.request(method, url, headers=headers, json=spec() if method == "POST" else None)
        assert response.status_code == 401, (authorization, url)
        assert response.headers["content-type"] == "application/problem+json"
        assert response.headers["www-authenticate"] == "Bearer"


def test_revoked_tokens_are_refused(api, client):
    headers = api.token("acme")
    with api.sessions.begin() as session:
        session.scalar(select(ApiToken)).revoked_at = utcnow()
    assert client.get("/v1/builds", headers=headers).status_code == 401


def test_another_tenants_builds_and_packages_are_not_found(api, client, tmp_path):
    acme, beta = api.token("acme"), api.token("beta")
    build_id = client.post("/v1/builds", json=spec(name="secret"), headers=acme).json()["id"]
    failed_id = client.post("/v1/builds", json=spec(name="secret", version="2"), headers=acme).json()["id"]
    finish_build(api, build_id)
    finish_build(api, failed_id, status="failed")
    publish_files(api, build_id, "secret", "1", {"model/config.json": b"{}"}, tmp_path)
    client.put("/v1/packages/secret/aliases/latest", json={"version": "1"}, headers=acme)

    for method, url, body in [
        ("GET", f"/v1/builds/{build_id}", None),
        ("POST", f"/v1/builds/{build_id}/cancel", None),
        ("POST", f"/v1/builds/{failed_id}/retry", None),
        ("GET", f"/v1/builds/{build_id}/logs", None),
        ("GET", "/v1/packages/secret/versions", None),
        ("GET", "/v1/packages/secret/1/manifest", None),
        ("GET", "/v1/packages/secret/latest/files/model/config.json", None),
        ("GET", "/v1/packages/secret/1/files/model/config.json", None),
        ("PUT", "/v1/packages/secret/aliases/latest", {"version": "1"}),
    ]:
        response = client.request(method, url, headers=beta, json=body)
        assert response.status_code == 404, (url, response.text)
        assert response.headers["content-type"] == "application/problem+json"
        assert client.request(method, url, headers=acme, json=body).status_code == 200, url
    assert client.get("/v1/builds", headers=beta).json()["items"] == []
    assert client.get("/v1/builds", params={"owner": "acme"}, headers=beta).json()["items"] == []
    assert client.get("/v1/packages", headers=beta).json()["items"] == []
    # Nothing beta did changed acme's build.
    assert client.get(f"/v1/builds/{failed_id}", headers=acme).json()["status"] == "queued"  # acme's own retry


def test_admin_tokens_see_every_tenant(api, client):
    acme, beta, admin = api.token("acme"), api.token("beta"), api.token("ops", admin=True)
    a = client.post("/v1/builds", json=spec(), headers=acme).json()["id"]
    b = client.post("/v1/builds", json=spec(), headers=beta).json()["id"]
    finish_build(api, a, gpu_seconds=3600.0)
    finish_build(api, b, gpu_seconds=1800.0)
    assert {x["id"] for x in client.get("/v1/builds", headers=admin).json()["items"]} == {a, b}
    assert [x["id"] for x in client.get("/v1/builds", params={"owner": "beta"}, headers=admin).json()["items"]] == [b]
    assert client.get(f"/v1/builds/{a}", headers=admin).status_code == 200
    usage = client.get("/v1/usage", params={"group_by": "tenant"}, headers=admin).json()
    assert {r["tenant"]: r["gpu_hours"] for r in usage["rows"]} == {"acme": 3.0, "beta": 1.5}
    assert usage["total_gpu_hours"] == 4.5
    # A tenant sees only its own usage, whatever it asks for.
    own = client.get("/v1/usage", params={"group_by": "tenant"}, headers=beta).json()
    assert [(r["tenant"], r["gpu_hours"]) for r in own["rows"]] == [("beta", 1.5)]
    assert client.get("/v1/usage", params={"tenant": "acme"}, headers=beta).json()["rows"] == []


def test_usage_groups_by_day_and_stage_type_with_filters(api, client):
    acme = api.token("acme")
    today = utcnow().replace(hour=12, minute=0, second=0, microsecond=0)
    old = client.post("/v1/builds", json=spec(version="1"), headers=acme).json()["id"]
    new = client.post("/v1/builds", json=spec(version="2"), headers=acme).json()["id"]
    finish_build(api, old, gpu_seconds=360.0, cpu_seconds=7200.0, started=today - timedelta(days=3))
    finish_build(api, new, gpu_seconds=720.0, cpu_seconds=3600.0, started=today)
    report = client.get("/v1/usage", params={"group_by": ["day", "stage_type"]}, headers=acme).json()
    assert report["group_by"] == ["day", "stage_type"]
    cells = {(r["day"], r["stage_type"]): r["gpu_hours"] for r in report["rows"]}
    assert cells[(f"{today:%Y-%m-%d}", "first")] == pytest.approx(0.2)
    assert cells[(f"{today - timedelta(days=3):%Y-%m-%d}", "second")] == pytest.approx(0.1)
    assert len(cells) == 6
    recent = client.get("/v1/usage", params={"group_by": "build", "since": f"{today - timedelta(days=1):%Y-%m-%d}"},
                        headers=acme).json()
    assert [(r["build"], r["cpu_hours"]) for r in recent["rows"]] == [(new, 3.0)]
    one_type = client.get("/v1/usage", params={"group_by": "build", "stage_type": "third", "build": old},
                          headers=acme).json()["rows"]
    assert [(r["build"], r["attempts"], r["gpu_seconds"]) for r in one_type] == [(old, 1, 360.0)]
    assert client.get("/v1/usage", params={"group_by": "colour"}, headers=acme).status_code == 422


def _builds(api) -> int:
    with api.sessions() as session:
        return session.scalar(select(func.count()).select_from(Build))


def test_concurrency_quota_refuses_with_429_and_queues_nothing(api, client):
    acme = api.token("acme")
    set_quota(api.sessions, "acme", max_concurrent_builds=2)
    first = [client.post("/v1/builds", json=spec(version=str(i)), headers={**acme, "Idempotency-Key": f"k{i}"})
             for i in range(2)]
    assert [r.status_code for r in first] == [201, 201]
    refused = client.post("/v1/builds", json=spec(version="3"), headers={**acme, "Idempotency-Key": "k"})
    assert refused.status_code == 429
    assert refused.headers["content-type"] == "application/problem+json"
    assert "2 builds queued or running; its limit is 2" in refused.json()["detail"]
    assert _builds(api) == 2
    # Replaying an accepted submission queues nothing new, so the quota does not refuse it.
    replay = client.post("/v1/builds", json=spec(version="0"), headers={**acme, "Idempotency-Key": "k0"})
    assert replay.status_code == 200 and replay.json()["id"] == first[0].json()["id"]
    client.post(f"/v1/builds/{first[0].json()['id']}/cancel", headers=acme)
    assert client.post("/v1/builds", json=spec(version="3"), headers=acme).status_code == 201
    assert client.post("/v1/builds", json=spec(version="4"), headers=api.token("beta")).status_code == 201  # per tenant


def test_gpu_hour_budget_refuses_with_429_and_counts_only_this_month(api, client):
    acme = api.token("acme")
    set_quota(api.sessions, "acme", gpu_hours_per_month=1.0)
    last_month = client.post("/v1/builds", json=spec(version="0"), headers=acme).json()["id"]
    finish_build(api, last_month, gpu_seconds=7200.0, started=month_start() - timedelta(days=2))
    spent = client.post("/v1/builds", json=spec(version="1"), headers=acme).json()["id"]
    assert client.post("/v1/builds", json=spec(version="2"), headers=acme).status_code == 201
    finish_build(api, spent, gpu_seconds=1200.0, started=max(month_start(), utcnow() - timedelta(minutes=10)))
    before = _builds(api)
    refused = client.post("/v1/builds", json=spec(version="3"), headers=acme)
    assert refused.status_code == 429, refused.text
    assert "used 1.000 of its 1 GPU-hours" in refused.json()["detail"]
    assert _builds(api) == before
    set_quota(api.sessions, "acme", gpu_hours_per_month=2.0)
    assert client.post("/v1/builds", json=spec(version="3"), headers=acme).status_code == 201


def test_gpu_builds_reserve_the_configured_estimate_at_submit_and_the_429_says_so(tmp_path):
    from fastapi.testclient import TestClient

    api = make_api(tmp_path, gpu_stage_seconds=5.0)  # ELASTIFY_GPU_STAGE_SECONDS=5
    client, acme = TestClient(api.app), api.token("acme")
    set_quota(api.sessions, "acme", gpu_hours_per_month=12 / 3600)  # room for two 5 GPU-second reservations
    on_a_gpu = {"first": {"resources": {"num_gpus": 1}}}
    responses = [client.post("/v1/builds", json=spec(version=str(i), stages=on_a_gpu), headers=acme) for i in range(3)]
    assert [r.status_code for r in responses] == [201, 201, 429]
    detail = responses[2].json()["detail"]
    assert "its queued and running builds reserve 10.0 more, of 12 GPU-seconds in all" in detail
    assert ("this build reserves 5 GPU-seconds (1 GPU stage, 1 GPU × 5 s, the estimate per GPU stage set by "
            "ELASTIFY_GPU_STAGE_SECONDS)") in detail
    assert client.post("/v1/builds", json=spec(version="3"), headers=acme).status_code == 201  # no GPU: fits


def test_a_retry_counts_against_the_concurrency_quota(api, client):
    acme = api.token("acme")
    failed = client.post("/v1/builds", json=spec(version="1"), headers=acme).json()["id"]
    finish_build(api, failed, status="failed")
    client.post("/v1/builds", json=spec(version="2"), headers=acme)
    set_quota(api.sessions, "acme", max_concurrent_builds=1)
    refused = client.post(f"/v1/builds/{failed}/retry", headers=acme)
    assert refused.status_code == 429 and refused.headers["content-type"] == "application/problem+json"
    assert client.get(f"/v1/builds/{failed}", headers=acme).json()["status"] == "failed"  # left as it was


def test_a_package_name_belongs_to_the_tenant_that_published_it(api, client, tmp_path):
    from types import SimpleNamespace

    from cluster.models import Stage
    from cluster.packages import PublishRefused, alias_key, register_package
    from device_sdk.format import canonical_json

    acme, beta = api.token("acme"), api.token("beta")
    mine = client.post("/v1/builds", json=spec(name="shared", version="1"), headers=acme).json()["id"]
    early = client.post("/v1/builds", json=spec(name="shared", version="2"), headers=beta).json()["id"]  # not yet taken
    finish_build(api, mine)
    publish_files(api, mine, "shared", "1", {"model/config.json": b"{}"}, tmp_path)
    client.put("/v1/packages/shared/aliases/latest", json={"version": "1"}, headers=acme)

    refused = client.post("/v1/builds", json=spec(name="shared", version="3"), headers=beta)
    assert refused.status_code == 409 and "belongs to another tenant" in refused.json()["detail"]
    # A build accepted before the name was taken cannot publish under it, nor move acme's alias.
    source = tmp_path / "artifact"
    source.mkdir()
    (source / "manifest.json").write_bytes(canonical_json({"name": "shared", "version": "2"}))
    artifact = api.store.put_artifact("builds/x/publish", source)
    with api.sessions() as session:
        build = session.get(Build, early)
        stage = session.scalar(select(Stage).where(Stage.build_id == early, Stage.key == "third"))
    with pytest.raises(PublishRefused, match="belongs to another tenant"):
        register_package(SimpleNamespace(sessions=api.sessions, store=api.store, build=build, stage=stage,
                                         package=artifact))
    assert api.store.get_bytes(alias_key("shared", "latest")) == b"1"
    assert not api.store.exists("packages/shared/2/manifest.json")
