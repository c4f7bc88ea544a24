"""`elastify up` serves the REST API next to the scheduler: ready on database, store and Ray; a
token from `elastify tokens create` submits a build that the scheduler in the same process runs."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import tarfile
import time

import httpx
import pytest

from pipeline.chain import ELASTILM_STAGES
from tests.support import services
from tests.support.tiny import save_tiny

pytestmark = pytest.mark.integration


def test_elastify_up_serves_the_api_and_runs_what_it_accepts(tmp_path, cluster_env, calib_text):
    model = save_tiny("llama_gqa", tmp_path / "tiny")
    # The calibration text is read from a source root; the model is uploaded, as a remote user would.
    env = {**cluster_env, "ELASTIFY_HOME": str(tmp_path / "home"), "ELASTIFY_SOURCE_ROOTS": str(calib_text.parent)}
    elastify = str(services.VENV_BIN / "elastify")
    port = services.free_port()
    log = tmp_path / "up.log"
    process = subprocess.Popen([elastify, "up", "--host", "127.0.0.1", "--port", str(port)], env=env,
                               stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        services.wait_for_port(port, 120, process, log)
        created = subprocess.run([elastify, "tokens", "create", "--tenant", "acme"], env=env, capture_output=True,
                                 text=True, check=True)
        token = created.stdout.strip()
        assert token.startswith("elst_") and token not in created.stderr
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            ready = client.get("/readyz").json()
            assert ready["status"] == "ready" and all(c["ok"] for c in ready["checks"].values()), ready
            archive = io.BytesIO()
            with tarfile.open(fileobj=archive, mode="w:gz") as tar:
                tar.add(model, arcname="tiny")
            uploaded = client.post("/v1/sources", content=archive.getvalue(),
                                   headers={**auth, "Content-Type": "application/gzip"})
            assert uploaded.status_code == 201, uploaded.text
            refused = client.post("/v1/builds", headers=auth, json={
                "source": {"model": uploaded.json()["source"]}, "calibration": ["/etc/passwd"],
                "publish": {"name": "tiny-up", "version": "1"}})
            assert refused.status_code == 403 and refused.json()["errors"][0]["field"] == "calibration.0"
            spec = {
                "source": {"model": uploaded.json()["source"]}, "calibration": [str(calib_text)], "levels": [1.0],
                "stages": {"profile": {"settings": {"windows": 1, "window_length": 16, "layer_method": "block_influence"}},
                           "elastify": {"settings": {"align": 8}}, "evaluate": {"enabled": False}},
                "publish": {"name": "tiny-up", "version": "1"},
            }
            spec["stages"].update({name: {"enabled": False} for name in ELASTILM_STAGES})
            submitted = client.post("/v1/builds", json=spec, headers=auth)
            assert submitted.status_code == 201, submitted.text
            build_id = submitted.json()["id"]
            deadline = time.monotonic() + 240
            while (status := client.get(f"/v1/builds/{build_id}", headers=auth).json()["status"]) not in (
                    "succeeded", "failed", "cancelled"):
                assert time.monotonic() < deadline, "the build did not finish"
                time.sleep(0.5)
            assert status == "succeeded", client.get(f"/v1/builds/{build_id}/logs", headers=auth).text
            assert [p["name"] for p in client.get("/v1/packages", headers=auth).json()["items"]] == ["tiny-up"]
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(60) == 0, log.read_text()[-2000:]
        assert token not in log.read_text()  # tokens are never logged
    finally:
        services.stop_group(process)


def test_elastify_serve_runs_the_api_alone_in_several_workers(tmp_path, postgres_server):
    import uuid

    database_url = services.create_database(postgres_server, f"t_{uuid.uuid4().hex[:10]}")
    env = {**os.environ, "ELASTIFY_HOME": str(tmp_path / "home"), "ELASTIFY_DATABASE_URL": database_url}
    elastify = str(services.VENV_BIN / "elastify")
    port = services.free_port()
    log = tmp_path / "serve.log"
    process = subprocess.Popen([elastify, "serve", "--port", str(port), "--workers", "2"], env=env,
                               stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        services.wait_for_port(port, 120, process, log)
        token = subprocess.run([elastify, "tokens", "create", "--tenant", "acme"], env=env, capture_output=True,
                               text=True, check=True).stdout.strip()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            model = str(tmp_path / "home" / "models" / "m")  # under the default source roots
            ids = {client.post("/v1/builds", json={"source": {"model": model}, "publish": {"name": "p", "version": str(i)}},
                               headers={"Authorization": f"Bearer {token}"}).json()["id"] for i in range(6)}
            listed = client.get("/v1/builds", headers={"Authorization": f"Bearer {token}"}).json()["items"]
            assert {b["id"] for b in listed} == ids and len(ids) == 6
            assert client.get("/readyz").json()["checks"]["database"]["ok"]
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)
    finally:
        services.stop_group(process)
