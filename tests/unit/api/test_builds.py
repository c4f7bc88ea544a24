"""REST API, builds: idempotent submission, validation, listing with filters and cursors, cancel,
retry and logs (plain text and SSE), on SQLite and a local store (no scheduler: rows stand in)."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from cluster.models import Build, Event, Stage
from tests.support.api import finish_build, spec, sse_events


@pytest.fixture
def acme(api):
    return api.token("acme")


def _count_builds(api) -> int:
    with api.sessions() as session:
        return session.scalar(select(func.count()).select_from(Build))


def test_submit_returns_the_queued_build_with_its_stages(client, acme):
    response = client.post("/v1/builds", json=spec(), headers=acme)
    assert response.status_code == 201, response.text
    build = response.json()
    assert response.headers["location"] == f"/v1/builds/{build['id']}"
    assert build["status"] == "queued" and build["tenant"] == "acme" and build["name"] == "test"
    assert [s["key"] for s in build["stages"]] == ["first", "second", "third"]
    assert build["stages_total"] == 3 and build["progress"] == 0.0 and build["gpu_seconds"] == 0.0


def test_idempotency_key_replays_the_same_build_and_refuses_another_spec(api, client, acme):
    first = client.post("/v1/builds", json=spec(), headers={**acme, "Idempotency-Key": "nightly-1"})
    again = client.post("/v1/builds", json=spec(), headers={**acme, "Idempotency-Key": "nightly-1"})
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    other = client.post("/v1/builds", json=spec(version="2"), headers={**acme, "Idempotency-Key": "nightly-1"})
    assert other.status_code == 409
    assert other.headers["content-type"] == "application/problem+json"
    assert first.json()["id"] in other.json()["detail"]
    # The key is per tenant: another tenant's identical key is a new build.
    beta = client.post("/v1/builds", json=spec(), headers={**api.token("beta"), "Idempotency-Key": "nightly-1"})
    assert beta.status_code == 201 and beta.json()["id"] != first.json()["id"]
    assert _count_builds(api) == 2


def test_concurrent_submissions_with_one_key_make_one_build(api, acme):
    results = []

    def post():
        with TestClient(api.app) as c:
            results.append(c.post("/v1/builds", json=spec(), headers={**acme, "Idempotency-Key": "race"}))

    threads = [threading.Thread(target=post) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in results) == [200] * 5 + [201]
    assert len({r.json()["id"] for r in results}) == 1 and _count_builds(api) == 1


def test_invalid_specs_are_422_problems_naming_every_field(api, client, acme):
    structural = client.post("/v1/builds", json={"source": {}, "levels": [2.0], "publish": {"name": "Bad!", "version": "1"},
                                                "colour": "red"}, headers=acme)
    assert structural.status_code == 422
    assert structural.headers["content-type"] == "application/problem+json"
    fields = {e["field"] for e in structural.json()["errors"]}
    assert {"body.source.model", "body.levels", "body.publish.name", "body.colour"} <= fields
    registry = client.post("/v1/builds", json=spec(stages={"nope": {}, "first": {"settings": {"x": 1}}}), headers=acme)
    assert registry.status_code == 422, registry.text
    errors = {e["field"]: e["message"] for e in registry.json()["errors"]}
    assert set(errors) == {"body.stages.nope", "body.stages.first.settings.x"}
    assert "registered stages: ['first', 'second', 'third']" in errors["body.stages.nope"]
    assert "unknown setting; allowed:" in errors["body.stages.first.settings.x"]
    not_json = client.post("/v1/builds", content=b"{not json", headers={**acme, "Content-Type": "application/json"})
    assert not_json.status_code == 422 and not_json.json()["status"] == 422
    bad_key = client.post("/v1/builds", json=spec(), headers={**acme, "Idempotency-Key": "x" * 129})
    assert bad_key.status_code == 422
    assert _count_builds(api) == 0


@pytest.mark.parametrize(("levels", "message"), [
    ([0.1234561, 0.1234562, 1.0], "are both level 0.123456"),
    ([True], "valid number"),
    ([1e-9, 1.0], "rounds to 0.0"),
])
def test_levels_without_a_name_of_their_own_are_422_naming_the_field_at_once(api, client, acme, levels, message):
    started = time.monotonic()
    response = client.post("/v1/builds", json=spec(levels=levels), headers=acme)
    assert response.status_code == 422, response.text
    assert [(e["field"].split(".")[:2], message in e["message"]) for e in response.json()["errors"]] == [
        (["body", "levels"], True)]
    assert time.monotonic() - started < 5 and _count_builds(api) == 0


def test_list_filters_and_pages_through_every_build_once(api, client, acme):
    ids = [client.post("/v1/builds", json=spec(name=f"pkg-{i % 2}", version=str(i)), headers=acme).json()["id"]
           for i in range(7)]
    finish_build(api, ids[0])
    seen, cursor = [], None
    while True:
        page = client.get("/v1/builds", params={"limit": 3, **({"cursor": cursor} if cursor else {})}, headers=acme).json()
        seen += [b["id"] for b in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(ids) and len(seen) == 7
    assert seen == sorted(seen, key=lambda i: ids.index(i), reverse=True)  # newest first
    named = client.get("/v1/builds", params={"name": "pkg-1"}, headers=acme).json()["items"]
    assert {b["id"] for b in named} == {ids[i] for i in (1, 3, 5)}
    done = client.get("/v1/builds", params={"status": ["succeeded"]}, headers=acme).json()["items"]
    assert [b["id"] for b in done] == [ids[0]] and done[0]["progress"] == 1.0
    queued = client.get("/v1/builds", params={"status": ["queued", "running"]}, headers=acme).json()["items"]
    assert len(queued) == 6
    assert client.get("/v1/builds", params={"cursor": "garbage"}, headers=acme).status_code == 400
    assert client.get("/v1/builds", params={"status": "sleeping"}, headers=acme).status_code == 422


def test_show_reports_stages_attempts_progress_and_compute(api, client, acme):
    build_id = client.post("/v1/builds", json=spec(), headers=acme).json()["id"]
    finish_build(api, build_id, gpu_seconds=5.0, cpu_seconds=2.0)
    build = client.get(f"/v1/builds/{build_id}", headers=acme).json()
    assert build["status"] == "succeeded" and build["stages_done"] == 3 and build["progress"] == 1.0
    assert build["gpu_seconds"] == 15.0 and build["cpu_seconds"] == 6.0
    assert all(len(s["attempts"]) == 1 and s["attempts"][0]["gpu_seconds"] == 5.0 for s in build["stages"])
    # A running stage shows its latest progress report.
    running_id = client.post("/v1/builds", json=spec(version="2"), headers=acme).json()["id"]
    with api.sessions.begin() as session:
        stage = session.scalar(select(Stage).where(Stage.build_id == running_id, Stage.key == "first"))
        stage.status = "running"
        for done in (1, 4):
            session.add(Event(build_id=running_id, stage_id=stage.id, kind="progress", message="windows",
                              data={"done": done, "total": 8}))
    first = client.get(f"/v1/builds/{running_id}", headers=acme).json()["stages"][0]
    assert first["progress"] == {"done": 4, "total": 8, "message": "windows"}


def test_cancel_then_retry_requeues_only_what_did_not_finish(api, client, acme):
    build_id = client.post("/v1/builds", json=spec(), headers=acme).json()["id"]
    cancelled = client.post(f"/v1/builds/{build_id}/cancel", headers=acme).json()
    assert cancelled["status"] == "cancelled" and {s["status"] for s in cancelled["stages"]} == {"cancelled"}
    assert client.post(f"/v1/builds/{build_id}/cancel", headers=acme).json()["status"] == "cancelled"  # idempotent

    failed_id = client.post("/v1/builds", json=spec(version="2"), headers=acme).json()["id"]
    finish_build(api, failed_id, status="failed")
    retried = client.post(f"/v1/builds/{failed_id}/retry", headers=acme)
    assert retried.status_code == 200, retried.text
    body = retried.json()
    assert body["status"] == "queued" and body["error"] is None
    assert {s["key"]: s["status"] for s in body["stages"]} == {"first": "succeeded", "second": "queued", "third": "queued"}
    second = body["stages"][1]
    assert second["attempts"][0]["status"] == "failed"  # history kept; the retry budget starts over
    with api.sessions() as session:
        assert session.scalar(select(Stage.attempts).where(Stage.build_id == failed_id, Stage.key == "second")) == 0
    conflict = client.post(f"/v1/builds/{failed_id}/retry", headers=acme)
    assert conflict.status_code == 409 and "only failed or cancelled" in conflict.json()["detail"]


def test_logs_as_plain_text_and_as_an_sse_stream_that_follows_to_the_end(api, client, acme):
    build_id = client.post("/v1/builds", json=spec(), headers=acme).json()["id"]
    text = client.get(f"/v1/builds/{build_id}/logs", headers=acme)
    assert text.headers["content-type"].startswith("text/plain") and "submitted with 3 stages" in text.text

    def scheduler_writes_then_finishes():
        time.sleep(0.8)
        with api.sessions.begin() as session:
            session.add(Event(build_id=build_id, kind="log", message="working"))
        time.sleep(0.8)
        finish_build(api, build_id)
        with api.sessions.begin() as session:
            session.add(Event(build_id=build_id, kind="state", message="build succeeded"))

    writer = threading.Thread(target=scheduler_writes_then_finishes)
    writer.start()
    started = time.monotonic()
    with client.stream("GET", f"/v1/builds/{build_id}/logs", headers={**acme, "Accept": "text/event-stream"}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = sse_events(stream.iter_lines())
    writer.join()
    assert time.monotonic() - started >= 1.5  # it waited for the build rather than returning what it had
    messages = [data.get("message") for kind, data in events if kind != "end"]
    assert messages == ["submitted with 3 stages", "working", "build succeeded"]
    assert events[-1] == ("end", {"status": "succeeded"})
    # Resuming after the second event sends only what came later.
    resumed = client.get(f"/v1/builds/{build_id}/logs",
                         headers={**acme, "Accept": "text/event-stream", "Last-Event-ID": str(events[1][1]["id"])})
    assert [d.get("message") for _, d in sse_events(resumed.text.splitlines())] == ["build succeeded", None]


def test_the_plain_text_log_holds_every_event_of_a_long_build(api, client, acme):
    build_id = client.post("/v1/builds", json=spec(), headers=acme).json()["id"]
    with api.sessions.begin() as session:
        session.add_all(Event(build_id=build_id, kind="log", message=f"line {i}") for i in range(1200))
    text = client.get(f"/v1/builds/{build_id}/logs", headers=acme).text.splitlines()
    assert len(text) == 1201 and text[-1].endswith("line 1199")
    tail = client.get(f"/v1/builds/{build_id}/logs", params={"after": 1100}, headers=acme).text.splitlines()
    assert len(tail) == 101 and tail[0].endswith("line 1099")
