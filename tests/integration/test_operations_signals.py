"""`elastify up` and `elastify serve` as systemd and Kubernetes stop them (SIGTERM): exit 0, the stage that was
running goes back to the queue uncharged for the stop, the Ray processes `up` started stop with it, and a restart
finishes the build. `up` joined to a Ray cluster of two nodes with a local-directory store says it will not work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cluster.db import make_engine, session_factory
from cluster.service import build_summary
from pipeline.chain import ELASTILM_STAGES
from tests.support import services
from tests.support.tiny import save_tiny

pytestmark = pytest.mark.integration
ELASTIFY = str(services.VENV_BIN / "elastify")
ROOT = Path(__file__).resolve().parents[2]


def _embedded_env(tmp_path: Path) -> dict[str, str]:
    """`elastify up` on its own: SQLite, local store and a Ray it starts itself (not the tests' Ray head)."""
    env = {key: value for key, value in os.environ.items() if key != "ELASTIFY_RAY_ADDRESS"}
    return {**env, "ELASTIFY_HOME": str(tmp_path / "home"), "ELASTIFY_SOURCE_ROOTS": str(tmp_path),
            "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1",
            "COLUMNS": "1000"}  # rich wraps log lines at 80 columns off a terminal


def _spec(model: Path, calib: Path) -> dict:
    # A profile stage of several seconds on the tiny model (leave-one-out over many windows), so that it is
    # still running when the signal comes; the rest of the chain is off.
    spec = {
        "source": {"model": str(model)}, "calibration": [str(calib)], "levels": [1.0],
        "stages": {"profile": {"settings": {"windows": 64, "window_length": 128, "layer_windows": 64,
                                            "batch_size": 1}},
                   "elastify": {"settings": {"align": 8}}, "evaluate": {"enabled": False}},
        "publish": {"name": "tiny-sigterm", "version": "1"},
    }
    spec["stages"].update({name: {"enabled": False} for name in ELASTILM_STAGES})
    return spec


def _wait(predicate, timeout: float, process: subprocess.Popen, log: Path, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := predicate()) is not None:
            return value
        assert process.poll() is None, f"exited with {process.returncode} before {what}: {log.read_text()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} after {timeout} s: {log.read_text()[-3000:]}")


def _stage(summary: dict, key: str) -> dict:
    return next(stage for stage in summary["stages"] if stage["key"] == key)


@pytest.mark.parametrize("to", ["process", "group"])
def test_sigterm_requeues_the_running_stage_stops_ray_and_a_restart_finishes_the_build(tmp_path, calib_text, to):
    model = save_tiny("llama_gqa", tmp_path / "tiny")
    env = _embedded_env(tmp_path)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(model, calib_text)))
    build_id = subprocess.run([ELASTIFY, "admin", "build", "submit", str(spec)], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()
    sessions = session_factory(make_engine(f"sqlite:///{tmp_path / 'home' / 'elastify.db'}"))

    def running_profile():
        profile = _stage(build_summary(sessions, build_id), "profile")
        return profile if profile["status"] == "running" else None

    log = tmp_path / "up-1.log"
    started = time.monotonic()
    process = subprocess.Popen([ELASTIFY, "up", "--port", str(services.free_port())], env=env,
                               stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(running_profile, 180, process, log, "running profile stage")
        ray_processes = psutil.Process(process.pid).children(recursive=True)
        assert any(p.name() in ("gcs_server", "raylet") for p in ray_processes), [p.name() for p in ray_processes]
        if to == "process":  # the main process alone, as Kubernetes does (and systemd with KillMode=mixed)
            process.send_signal(signal.SIGTERM)
        else:  # every process of the group at once, Ray's too, as systemd's default KillMode=control-group does
            os.killpg(process.pid, signal.SIGTERM)
        assert process.wait(90) == 0, log.read_text()[-3000:]
        lived = time.monotonic() - started
    finally:
        services.stop_group(process)
    output = log.read_text()
    assert "SIGTERM: stopping" in output, output[-3000:]
    _, alive = psutil.wait_procs(ray_processes, timeout=30)
    assert alive == [], f"Ray processes left behind: {alive}"

    stopped = build_summary(sessions, build_id)
    profile = _stage(stopped, "profile")
    if to == "process":
        assert stopped["status"] == "running" and profile["status"] == "queued", stopped
        [interrupted] = profile["attempts"]
        assert interrupted["exit"] == "interrupted" and interrupted["status"] == "failed", interrupted
        assert 0 < interrupted["wall_seconds"] <= lived  # charged for the time it ran, nothing after the stop
    else:
        # Ray stopped under the scheduler: the stage went back through the database, unless the stuck loop held
        # the database's lock; then its lease is left for the restart below to take back.
        assert profile["status"] in ("queued", "running"), stopped

    log = tmp_path / "up-2.log"
    process = subprocess.Popen([ELASTIFY, "up", "--port", "0"], env=env, stdout=open(log, "wb"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def finished():
            summary = build_summary(sessions, build_id)
            return summary if summary["status"] in ("succeeded", "failed", "cancelled") else None

        done = _wait(finished, 240, process, log, "finished build")
        process.send_signal(signal.SIGTERM)
        assert process.wait(90) == 0, log.read_text()[-3000:]
    finally:
        services.stop_group(process)
    assert done["status"] == "succeeded" and done["package"]["name"] == "tiny-sigterm", done
    attempts = _stage(done, "profile")["attempts"]
    if to == "process":
        assert [(a["number"], a["exit"]) for a in attempts] == [(1, "interrupted"), (2, "ok")]
    else:  # an attempt row, if the stop came after it was written, charged no later than the process lived
        assert attempts[-1]["exit"] == "ok" and len(attempts) <= 2, attempts
        assert all(a["exit"] in ("interrupted", "lease_expired") and a["wall_seconds"] <= lived for a in attempts[:-1])


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_stops_elastify_serve_with_status_0(tmp_path, workers):
    env = _embedded_env(tmp_path)
    port = services.free_port()
    log = tmp_path / "serve.log"
    process = subprocess.Popen([ELASTIFY, "serve", "--port", str(port), "--workers", str(workers)], env=env,
                               stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        services.wait_for_port(port, 120, process, log)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log.read_text()[-3000:]
    finally:
        services.stop_group(process)


TWO_NODES = """
import sys
from cluster.embedded import keep_ray_on_loopback
keep_ray_on_loopback()  # both nodes on 127.0.0.1: nothing reachable from the network
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
print(cluster.address, flush=True)
sys.stdin.read()  # until the test closes stdin
cluster.shutdown()
"""


def test_elastify_up_on_two_ray_nodes_warns_that_a_local_store_needs_s3(tmp_path):
    env = {**_embedded_env(tmp_path)}
    nodes = subprocess.Popen([sys.executable, "-c", TWO_NODES], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        address = nodes.stdout.readline().strip()
        assert address, "the two-node cluster did not start"
        log = tmp_path / "up.log"
        process = subprocess.Popen([ELASTIFY, "up", "--port", "0"], env={**env, "ELASTIFY_RAY_ADDRESS": address},
                                   stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait(lambda: True if "cannot read what this one wrote" in log.read_text() else None, 120, process, log,
                  "multi-node warning")
            assert "2 nodes" in log.read_text() and "ELASTIFY_STORE_URL=s3://" in log.read_text()
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 0, log.read_text()[-3000:]
        finally:
            services.stop_group(process)
    finally:
        nodes.stdin.close()
        try:
            nodes.wait(60)
        finally:
            services.stop_group(nodes)
