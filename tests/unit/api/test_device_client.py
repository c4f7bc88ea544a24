"""ElastifyClient against the live app, and the device SDK's pull through the REST API."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import pytest

from device_sdk.client import ElastifyAPIError, ElastifyClient
from device_sdk.format import WEIGHTS, PackageError
from device_sdk.registry import pull, read_local_state, verify_local
from tests.support.api import finish_build, spec
from tests.support.live_api import KEY_SEED, api_with_packages
from tests.support.sdk_packages import public_bytes, signing_key

KEY = signing_key(KEY_SEED)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with api_with_packages(tmp_path_factory.mktemp("client")) as live:
        yield live


@pytest.fixture
def packages(api) -> dict[str, Path]:
    return api.packages


@pytest.fixture
def acme(api) -> ElastifyClient:
    return ElastifyClient(api.url, token=api.acme)


def cached_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []


# --------------------------------------------------------------------------- builds


def test_client_submit_is_idempotent_and_conflicts_are_errors(acme):
    first = acme.submit(spec("idem"), idempotency_key="nightly-1")
    again = acme.submit(spec("idem"), idempotency_key="nightly-1")
    assert again.id == first.id and first.status == "queued" and len(first.stages) == 3
    with pytest.raises(ElastifyAPIError) as conflict:
        acme.submit(spec("idem", version="9"), idempotency_key="nightly-1")
    assert conflict.value.status == 409 and first.id in conflict.value.detail
    with pytest.raises(ElastifyAPIError) as invalid:
        acme.submit({"source": {"model": "x"}, "levels": [1.0]})  # no publish target
    assert invalid.value.status == 422 and invalid.value.problem["errors"]
    assert acme.submit(json.dumps(spec("fromtext"))).name == "fromtext"
    with pytest.raises(ValueError, match="not JSON"):
        acme.submit("source: {model: unused}")


def test_client_lists_every_build_across_cursor_pages(api):
    client = ElastifyClient(api.url, token=api.token("pager"))
    ids = [client.submit(spec(f"page{i}")).id for i in range(5)]
    first_page = client.builds(limit=2)
    assert len(first_page.items) == 2 and first_page.next_cursor
    seen = [b.id for b in client.iter_builds(limit=2)]
    assert seen == ids[::-1]  # newest first, each once
    assert [b.id for b in client.iter_builds(name="page3")] == [ids[3]]
    assert list(client.iter_builds(status="succeeded")) == []


def test_client_cancel_logs_and_retry(acme):
    build = acme.submit(spec("logs"))
    cancelled = acme.cancel(build.id)
    assert cancelled.status == "cancelled"
    events = list(acme.logs(build.id))
    assert events[-1].event == "end" and events[-1].json() == {"status": "cancelled"}
    messages = [e.json()["message"] for e in events[:-1]]
    assert messages[0] == "submitted with 3 stages" and "cancellation requested" in messages
    assert [int(e.id) for e in events[:-1]] == sorted(int(e.id) for e in events[:-1])
    resumed = list(acme.logs(build.id, after=int(events[0].id)))  # Last-Event-ID: only what came after
    assert [e.id for e in resumed] == [e.id for e in events[1:]]
    assert "cancellation requested" in acme.logs_text(build.id)
    retried = acme.retry(build.id)
    assert retried.status == "queued" and all(s.status == "queued" for s in retried.stages)
    with pytest.raises(ElastifyAPIError) as twice:
        acme.retry(build.id)
    assert twice.value.status == 409


def test_client_errors_are_problems_and_never_show_the_token(api, acme):
    secret = api.acme
    assert secret not in repr(acme)
    with pytest.raises(ElastifyAPIError) as bad:
        ElastifyClient(api.url, token="elst_not-a-token").builds()
    assert bad.value.status == 401 and bad.value.title
    build = acme.submit(spec("private"))
    beta = ElastifyClient(api.url, token=api.beta)
    with pytest.raises(ElastifyAPIError) as hidden:
        beta.build(build.id)
    assert hidden.value.status == 404 and secret not in str(hidden.value)
    with pytest.raises(ElastifyAPIError) as missing:
        acme.versions("no-such-package")
    assert missing.value.status == 404
    with pytest.raises(ValueError, match="invalid name"):
        acme.build("../../etc")
    with pytest.raises(ElastifyAPIError) as down:
        ElastifyClient("http://127.0.0.1:9", token=secret).health()
    assert down.value.status == 0 and secret not in str(down.value)
    assert str(down.value) == "cannot reach the server at http://127.0.0.1:9: Connection refused"


def test_client_usage_reports_the_ledger(api):
    client = ElastifyClient(api.url, token=api.token("metered"))
    build = client.submit(spec("metered"))
    finish_build(api.api, build.id, status="failed", gpu_seconds=1800)  # first ran, second failed, third never ran
    report = client.usage(group_by=["stage_type"])
    assert {r.stage_type: r.gpu_hours for r in report.rows} == {"first": 0.5, "second": 0.5}
    assert report.total_gpu_hours == 1.0  # the failed attempt's time counts too
    assert client.usage(group_by=["build"], stage_type="second").rows[0].gpu_hours == 0.5
    assert client.build(build.id).gpu_seconds == 3600


def test_client_token_and_server_from_the_environment(api, monkeypatch):
    monkeypatch.setenv("ELASTIFY_SERVER", api.url + "/v1")
    monkeypatch.setenv("ELASTIFY_TOKEN", api.acme)
    client = ElastifyClient()
    assert client.base_url == api.url
    assert [p.name for p in client.packages()] == ["tiny"]
    assert client.health() == {"status": "ok"}
    assert client.signing_key() == api.api.settings.public_key_b64()


# --------------------------------------------------------------------------- packages


def test_client_packages_versions_manifest_and_alias(acme, packages):
    listed = acme.packages()
    assert [(p.name, p.versions, p.aliases) for p in listed] == [("tiny", 2, {"latest": "1.0.0"})]
    versions = acme.versions("tiny")
    assert [(v.version, v.aliases) for v in versions] == [("1.0.0", ("latest",)), ("2.0.0", ())]
    assert acme.manifest("tiny", "latest")["version"] == "1.0.0"
    assert acme.manifest_bytes("tiny", "1.0.0") == (packages["1.0.0"] / "manifest.json").read_bytes()
    moved = acme.set_alias("tiny", "stable", "2.0.0")
    assert moved.version == "2.0.0" and acme.manifest("tiny", "stable")["version"] == "2.0.0"
    with pytest.raises(ElastifyAPIError) as unknown:
        acme.set_alias("tiny", "stable", "7.7.7")
    assert unknown.value.status == 404


def test_client_download_resumes_a_partial_file_with_range(acme, packages, tmp_path):
    whole = (packages["1.0.0"] / WEIGHTS).read_bytes()
    target = tmp_path / "weights.safetensors"
    part = target.with_name(target.name + ".part")
    part.write_bytes(whole[:10_000])  # an earlier, interrupted download
    seen = []
    acme.download("tiny", "1.0.0", WEIGHTS, target, on_progress=lambda done, total: seen.append((done, total)))
    assert target.read_bytes() == whole and not part.exists()
    assert seen[0][0] > 10_000 and seen[-1] == (len(whole), len(whole))  # resumed, not restarted
    part.write_bytes(whole)  # a whole part file: the server answers 416 and it is kept as is
    target.unlink()
    acme.download("tiny", "1.0.0", WEIGHTS, target)
    assert target.read_bytes() == whole


# --------------------------------------------------------------------------- pull through the API


def test_pull_through_the_api_resolves_aliases_and_verifies(api, tmp_path):
    cache = tmp_path / "cache"
    progress = []
    path = pull("tiny", "latest", registry=f"{api.url}/v1", token=api.acme, public_key=public_bytes(KEY),
                cache_dir=cache, on_progress=lambda done, total: progress.append((done, total)))
    state = read_local_state(path)
    assert path == cache / "tiny" / "1.0.0" and state["max_level"] is None and state["registry"] == f"{api.url}/v1"
    assert progress[-1] == (state["bytes"], state["bytes"])
    verify_local(path, public_bytes(KEY))
    client = ElastifyClient(api.url, token=api.acme)
    assert pull("tiny", "2.0.0", registry=client, public_key=public_bytes(KEY), cache_dir=cache) == cache / "tiny" / "2.0.0"


def test_pull_through_the_api_resumes_an_interrupted_download(api, tmp_path, monkeypatch):
    from device_sdk import registry as registry_module

    monkeypatch.setattr(registry_module, "CHUNK", 4096)  # small blocks, so progress is recorded often
    requested = []
    real_open = ElastifyClient.open_file

    @contextlib.contextmanager
    def recording(self, name, version, path, byte_range=None):
        with real_open(self, name, version, path, byte_range) as response:
            requested.append((path, byte_range, response.status_code))
            yield response

    monkeypatch.setattr(ElastifyClient, "open_file", recording)

    class Interrupted(Exception):
        pass

    def stop_half_way(done, total):
        if done > total // 2:
            raise Interrupted  # the device lost power, or the user pressed Ctrl-C

    cache = tmp_path / "cache"
    with pytest.raises(Interrupted):
        pull("tiny", "1.0.0", registry=f"{api.url}/v1", token=api.acme, public_key=public_bytes(KEY),
             cache_dir=cache, workers=1, on_progress=stop_half_way)
    assert not (cache / "tiny" / "1.0.0").exists()  # nothing half-downloaded is loadable
    requested.clear()
    path = pull("tiny", "1.0.0", registry=f"{api.url}/v1", token=api.acme, public_key=public_bytes(KEY),
                cache_dir=cache, workers=1)
    weights = [(r, status) for p, r, status in requested if p == WEIGHTS]
    size = (path / WEIGHTS).stat().st_size
    assert weights, requested
    resumed = [(r, status) for r, status in weights if r is not None and r[0] > 0]
    assert resumed and all(status == 206 for _, status in resumed)  # the server honoured Range
    fetched = sum(r[1] - r[0] for r, _ in weights if r is not None)
    assert fetched < size  # the second pull did not start over
    verify_local(path, public_bytes(KEY))


def test_pull_through_the_api_fetches_only_the_levels_asked_for(api, tmp_path):
    partial = pull("tiny", "1.0.0", registry=f"{api.url}/v1", token=api.acme, public_key=public_bytes(KEY),
                   max_level=0.5, cache_dir=tmp_path / "a")
    full = pull("tiny", "1.0.0", registry=f"{api.url}/v1", token=api.acme, public_key=public_bytes(KEY),
                cache_dir=tmp_path / "b")
    state = read_local_state(partial)
    assert state["max_level"] == "0.5" and state["bytes"] < 0.8 * read_local_state(full)["bytes"]
    assert not (partial / "adapters/recovery/1.0.safetensors").exists()
    verify_local(partial, public_bytes(KEY))  # every fetched range against its signed digest


def test_pull_through_the_api_refuses_a_tampered_file_and_installs_nothing(api, packages, tmp_path):
    stored = api.api.store.local_path(f"packages/tiny/2.0.0/{WEIGHTS}")
    original = stored.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    stored.write_bytes(bytes(damaged))
    cache = tmp_path / "cache"
    try:
        with pytest.raises(PackageError, match="does not match its sha256"):
            pull("tiny", "2.0.0", registry=f"{api.url}/v1", token=api.acme, public_key=public_bytes(KEY),
                 cache_dir=cache)
    finally:
        stored.write_bytes(original)
    assert cached_files(cache) == []


def test_pull_through_the_api_is_scoped_to_the_tenant(api, tmp_path, monkeypatch):
    with pytest.raises(PackageError, match="no package 'tiny'"):
        pull("tiny", "latest", registry=f"{api.url}/v1", token=api.beta, public_key=public_bytes(KEY),
             cache_dir=tmp_path)
    with pytest.raises(PackageError, match="no version or alias 'nope'"):
        pull("tiny", "nope", registry=f"{api.url}/v1", token=api.acme, public_key=public_bytes(KEY),
             cache_dir=tmp_path)
    assert cached_files(tmp_path) == []
    monkeypatch.delenv("ELASTIFY_TOKEN", raising=False)
    with pytest.raises(PackageError, match="401"):
        pull("tiny", "latest", registry=f"{api.url}/v1", public_key=public_bytes(KEY), cache_dir=tmp_path)


def test_device_cli_pulls_through_the_api_with_the_token_from_the_environment(api, tmp_path, monkeypatch, capsys):
    import base64

    from device_sdk.cli import main

    key = base64.b64encode(public_bytes(KEY)).decode()
    args = ["pull", "tiny", "latest", "--registry", f"{api.url}/v1", "--public-key", key, "--cache-dir", str(tmp_path)]
    monkeypatch.setenv("ELASTIFY_TOKEN", api.beta)  # another tenant: the package does not exist for it
    assert main(args) == 1 and "no package 'tiny'" in capsys.readouterr().err
    monkeypatch.setenv("ELASTIFY_TOKEN", api.acme)
    assert main(args) == 0
    assert "ok: tiny 1.0.0 (every level" in capsys.readouterr().out
    verify_local(tmp_path / "tiny" / "1.0.0", public_bytes(KEY))


# --------------------------------------------------------------------------- typed answers, pages, wait


def test_client_answers_are_typed_and_keep_the_servers_json(api, acme):
    import dataclasses
    from datetime import timedelta

    import httpx

    from device_sdk.client import Build, BuildSummary, Package, Page, Stage, Version

    build = acme.submit(spec("typed"))
    assert isinstance(build, Build) and build.status == "queued" and not build.ended
    assert build.created_at.utcoffset() == timedelta(0)
    assert all(isinstance(stage, Stage) and stage.attempts == () for stage in build.stages)
    assert [stage.key for stage in build.stages] == ["first", "second", "third"] and build.package is None
    assert build.spec["publish"]["name"] == "typed" and build.cancel_requested is False
    served = httpx.get(f"{api.url}/v1/builds/{build.id}", headers={"Authorization": f"Bearer {api.acme}"}).json()
    assert acme.build(build.id).raw == served  # --json prints what the server sent
    assert "raw" not in repr(build) and build.id in repr(build)
    with pytest.raises(dataclasses.FrozenInstanceError):
        build.status = "succeeded"
    summary = next(acme.iter_builds(name="typed"))
    assert type(summary) is BuildSummary and summary.id == build.id and summary.created_at == build.created_at
    finish_build(api.api, build.id)
    ended = acme.build(build.id)
    assert ended.ended and ended.finished_at > ended.started_at
    assert {a.status for s in ended.stages for a in s.attempts} == {"succeeded"}
    packages = acme.packages()
    assert isinstance(packages, Page) and packages.next_cursor is None and isinstance(packages.items[0], Package)
    assert packages.items[0].updated_at.tzinfo is not None
    versions = acme.versions("tiny")
    assert all(isinstance(v, Version) and len(v.manifest_sha256) == 64 for v in versions)
    assert versions.items[0].created_at <= versions.items[1].created_at


def test_client_every_list_is_a_page_and_its_iter_walks_them_all(api):
    client = ElastifyClient(api.url, token=api.token("walker"))
    ids = [client.submit(spec(f"walk{i}")).id for i in range(5)]
    pages, cursor = [], None
    while True:
        page = client.builds(limit=2, cursor=cursor)
        pages.append([b.id for b in page])
        cursor = page.next_cursor
        if cursor is None:
            break
    assert pages == [ids[4:2:-1], ids[2:0:-1], ids[:1]]  # newest first, two a page, the last one short
    assert [b.id for b in client.iter_builds(limit=2)] == ids[::-1] == [b.id for b in client.iter_builds()]
    acme = ElastifyClient(api.url, token=api.acme)
    assert [p.name for p in acme.iter_packages()] == [p.name for p in acme.packages()] == ["tiny"]
    assert [v.version for v in acme.iter_versions("tiny")] == ["1.0.0", "2.0.0"]
    assert list(client.iter_packages()) == [] and len(client.packages()) == 0


def _report_progress_then_finish(api, build_id: str, delay: float = 0.3) -> threading.Thread:
    """A scheduler's stand-in: two progress reports on the first stage, then the build succeeds."""
    from sqlalchemy import select

    from cluster.models import Event, Stage

    def run():
        time.sleep(delay)
        with api.api.sessions.begin() as session:
            stage = session.scalar(select(Stage).where(Stage.build_id == build_id, Stage.key == "first"))
            for done in (1, 2):
                session.add(Event(build_id=build_id, stage_id=stage.id, kind="progress", message="windows",
                                  data={"done": done, "total": 2}))
        time.sleep(0.2)
        finish_build(api.api, build_id)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_wait_follows_the_build_until_it_ends_and_returns_it(api, acme):
    from device_sdk.client import LogEvent

    build = acme.submit(spec("waited"))
    seen: list[LogEvent] = []
    helper = _report_progress_then_finish(api, build.id)
    ended = acme.wait(build.id, timeout=30, on_progress=seen.append)
    helper.join()
    assert ended.status == "succeeded" and ended.ended and ended.stages_done == 3
    assert all(isinstance(e, LogEvent) for e in seen) and seen[0].message == "submitted with 3 stages"
    progress = [(e.stage, e.data["done"], e.data["total"]) for e in seen if e.kind == "progress"]
    assert progress == [("first", 1, 2), ("first", 2, 2)]
    assert [e.id for e in seen] == sorted({e.id for e in seen})  # each event once, in order
    again = acme.wait(build.id, timeout=5)  # an ended build: at once
    assert again.status == "succeeded"


@pytest.mark.parametrize("keepalive", [None, 0.05])
def test_wait_raises_a_clear_timeout_and_leaves_the_build_running(api, acme, monkeypatch, keepalive):
    """A silent stream times out at the deadline; one kept alive by the server's comments is stopped too."""
    from api.routes import builds as builds_route
    from device_sdk.client import BuildTimeout

    if keepalive is not None:
        monkeypatch.setattr(builds_route, "SSE_KEEPALIVE_SECONDS", keepalive)
    build = acme.submit(spec("stuck"))  # no scheduler here: it stays queued
    started = time.monotonic()
    with pytest.raises(BuildTimeout) as late:
        acme.wait(build.id, timeout=0.8)
    took = time.monotonic() - started
    assert 0.8 <= took < 3.0, took
    assert late.value.build.status == "queued" and isinstance(late.value, TimeoutError)
    assert str(late.value).startswith(f"build {build.id} has not ended after 0.8 s: queued, 0/3 stages done")
    assert acme.build(build.id).status == "queued"
    with pytest.raises(ValueError, match="timeout"):
        acme.wait(build.id, timeout=-1)


def test_the_token_is_never_logged_even_at_debug(api, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="httpx")  # the CLI quiets httpx to WARNING (api/progress.py)
    client = ElastifyClient(api.url, token=api.acme)
    client.build(client.submit(spec("logged")).id)
    list(client.iter_versions("tiny"))
    with pytest.raises(ElastifyAPIError):
        client.build("0123456789abcdef")
    assert "HTTP Request" in caplog.text and api.acme not in caplog.text  # httpx did log each request
    assert api.acme not in repr(client) and api.acme not in repr(client.http.headers)


def test_redirects_carry_the_token_to_the_api_only_and_errors_show_no_presigned_query():
    import httpx

    sent = []

    def server(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.host, request.headers.get("Authorization")))
        if request.url.host == "api.test" and request.url.path.endswith("/files/moved"):
            return httpx.Response(307, headers={"Location": "/v1/packages/p/1/files/here"})
        if request.url.host == "api.test" and request.url.path.endswith("/files/here"):
            return httpx.Response(307, headers={"Location": "http://store.test/bucket/obj?X-Amz-Signature=secret"})
        if request.url.path.endswith("/files/gone"):
            return httpx.Response(307, headers={"Location": "http://store.test/bucket/gone?X-Amz-Signature=secret"})
        if request.url.path == "/bucket/obj":
            return httpx.Response(200, content=b"weights")
        return httpx.Response(403, text="expired")

    client = ElastifyClient("http://api.test/v1", token="elst_secret", transport=httpx.MockTransport(server))
    with client.open_file("p", "1", "moved") as response:
        assert response.read() == b"weights"
    assert sent == [("api.test", "Bearer elst_secret"), ("api.test", "Bearer elst_secret"), ("store.test", None)]
    with pytest.raises(ElastifyAPIError) as refused, client.open_file("p", "1", "gone"):
        pass
    assert refused.value.status == 403 and "secret" not in str(refused.value)


def test_an_answer_that_is_not_what_the_api_documents_is_a_clear_error():
    import httpx

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/builds":
            return httpx.Response(200, json={"items": [{"id": "x"}]})  # a summary without its fields
        return httpx.Response(200, text="<html>a proxy's page</html>")

    client = ElastifyClient("http://api.test", transport=httpx.MockTransport(server))
    with pytest.raises(ElastifyAPIError, match="the server's answer is not a page of builds: KeyError"):
        client.builds()
    with pytest.raises(ElastifyAPIError, match="did not answer with JSON"):
        client.build("0123456789abcdef")
