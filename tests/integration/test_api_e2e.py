"""The issue's acceptance, through the REST API only: a SmolLM2 build on PostgreSQL, SeaweedFS (S3)
and Ray, followed over SSE to the end; the package listed, downloaded from a presigned URL with a
Range resume in the middle and verified; an alias moved; the usage that recorded its seconds."""

from __future__ import annotations

import threading

import httpx
import pytest

from api.app import ServerThread, create_app, default_registry
from api.auth import create_token
from cluster.packages import alias_key
from device_sdk.format import MANIFEST
from device_sdk.trust import verify_package
from tests.support import services
from tests.support.api import sse_events
from tests.support.control_plane import make_settings, small_elastic_spec, started

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _download(client: httpx.Client, url: str, dest, headers: dict, cut: int | None = None) -> None:
    """GET a package file through its presigned URL; with `cut`, stop after `cut` bytes and resume."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if cut is None:
        response = client.get(url, headers=headers, follow_redirects=True)
        assert response.status_code == 200, response.text
        dest.write_bytes(response.content)
        return
    first = client.get(url, headers={**headers, "Range": f"bytes=0-{cut - 1}"}, follow_redirects=True)
    assert first.status_code == 206 and len(first.content) == cut
    rest = client.get(url, headers={**headers, "Range": f"bytes={cut}-"}, follow_redirects=True)
    assert rest.status_code == 206, rest.text
    total = int(rest.headers["content-range"].rsplit("/", 1)[1])
    assert rest.headers["content-range"] == f"bytes {cut}-{total - 1}/{total}"
    dest.write_bytes(first.content + rest.content)


def test_smollm2_build_end_to_end_through_the_api(tmp_path, smollm2_dir, pg_url, s3_store, ray_cluster):
    settings = make_settings(tmp_path, pg_url, s3_store, lease_seconds=30.0)
    registry = default_registry()
    scheduler = started(settings, registry)
    stop = threading.Event()
    loop = threading.Thread(target=scheduler.run, kwargs={"until": stop.is_set}, daemon=True)
    loop.start()
    app = create_app(settings, registry)
    token = create_token(app.state.sessions, "acme")
    auth = {"Authorization": f"Bearer {token}"}
    spec = small_elastic_spec(smollm2_dir, "smollm2-api", ["latest"])
    try:
        with ServerThread(app, port=services.free_port()) as server, \
                httpx.Client(base_url=server.url, timeout=httpx.Timeout(30, read=600)) as client:
            ready = client.get("/readyz").json()
            assert ready["status"] == "ready" and ready["checks"]["ray"]["ok"], ready

            submitted = client.post("/v1/builds", json=spec, headers={**auth, "Idempotency-Key": "e2e"})
            assert submitted.status_code == 201, submitted.text
            build_id = submitted.json()["id"]

            # Follow the logs over SSE until the build ends.
            with client.stream("GET", f"/v1/builds/{build_id}/logs",
                               headers={**auth, "Accept": "text/event-stream"}) as stream:
                events = sse_events(stream.iter_lines())
            assert events[-1] == ("end", {"status": "succeeded"}), events[-5:]
            kinds = {kind for kind, _ in events}
            assert {"state", "progress"} <= kinds
            assert any(d.get("stage") == "publish" for _, d in events)

            build = client.get(f"/v1/builds/{build_id}", headers=auth).json()
            assert build["status"] == "succeeded" and build["progress"] == 1.0
            assert [s["key"] for s in build["stages"]] == ["profile", "elastify", "evaluate", "publish"]
            assert build["package"] == {"name": "smollm2-api", "version": "0.0.1"}

            packages = client.get("/v1/packages", headers=auth).json()["items"]
            assert [(p["name"], p["latest_version"], p["aliases"]) for p in packages] == \
                [("smollm2-api", "0.0.1", {"latest": "0.0.1"})]

            # Download every file (S3: presigned URLs); the weights with a Range resume in the middle.
            manifest = client.get("/v1/packages/smollm2-api/latest/manifest", headers=auth).json()
            local = tmp_path / "pulled"
            presign = client.get(f"/v1/packages/smollm2-api/0.0.1/files/{MANIFEST}", params={"presign": True},
                                 headers=auth).json()
            assert presign["expires_in"] > 0 and presign["url"].startswith(s3_store.endpoint_url)
            for entry in [*manifest["files"], {"path": MANIFEST, "size": None}]:
                url = f"/v1/packages/smollm2-api/0.0.1/files/{entry['path']}"
                redirect = client.get(url, headers=auth)
                assert redirect.status_code == 307 and redirect.headers["location"].startswith(s3_store.endpoint_url)
                big = entry["path"] == "model/weights.safetensors"
                _download(client, url, local / entry["path"], auth, cut=entry["size"] // 2 if big else None)
            key = client.get("/v1/keys/signing").json()["public_key"]
            verified = verify_package(local, key)
            assert verified.build_id == build_id and [lv.name for lv in verified.elastic.levels] == ["0.5", "1.0"]

            # Move an alias.
            moved = client.put("/v1/packages/smollm2-api/aliases/stable", json={"version": "0.0.1"}, headers=auth)
            assert moved.status_code == 200
            versions = client.get("/v1/packages/smollm2-api/versions", headers=auth).json()["items"]
            assert versions[0]["aliases"] == ["latest", "stable"]
            assert scheduler.store.get_bytes(alias_key("smollm2-api", "stable")) == b"0.0.1"

            # The usage recorded the build's seconds, per stage type.
            usage = client.get("/v1/usage", params={"build": build_id, "group_by": ["build", "stage_type"]},
                               headers=auth).json()
            by_type = {r["stage_type"]: r for r in usage["rows"]}
            assert set(by_type) == {"profile", "elastify", "evaluate", "publish"}
            assert all(r["build"] == build_id and r["wall_seconds"] > 0 and r["attempts"] == 1 for r in by_type.values())
            assert by_type["profile"]["cpu_seconds"] > 0 and usage["total_cpu_hours"] > 0
            # The Ray head has two (fake) GPUs, so under `accelerator: auto` profile and elastify were granted
            # one each and are charged for it; evaluate and publish run on CPUs.
            assert all(by_type[name]["gpu_seconds"] > 0 for name in ("profile", "elastify"))
            assert all(by_type[name]["gpu_seconds"] == 0 for name in ("evaluate", "publish"))

            # Another tenant sees none of it.
            other = {"Authorization": f"Bearer {create_token(app.state.sessions, 'beta')}"}
            assert client.get(f"/v1/builds/{build_id}", headers=other).status_code == 404
            assert client.get(f"/v1/packages/smollm2-api/0.0.1/files/{MANIFEST}", headers=other).status_code == 404
            metrics = client.get("/metrics").text
            assert 'elastify_builds{state="succeeded"} 1.0' in metrics
            assert "published smollm2-api 0.0.1" in client.get(f"/v1/builds/{build_id}/logs", headers=auth).text
    finally:
        stop.set()
        loop.join(timeout=60)
        scheduler.close()
