"""A Ray started for 127.0.0.1 (the tests' head, `elastify up`'s embedded one) listens on loopback only:
GCS, raylet, agents and workers are unreachable from the network."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def listeners(session_marker: str) -> list[list]:
    """[process name, address, port, on loopback] of each TCP listener of the processes whose command line names
    `session_marker` (the Ray session directory every Ray process of one cluster is started with)."""
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid is None:
            continue
        try:
            process = psutil.Process(conn.pid)
            if session_marker not in " ".join(process.cmdline()):
                continue
            name = process.name()
        except psutil.Error:
            continue
        address = ipaddress.ip_address(conn.laddr.ip.split("%")[0])
        mapped = getattr(address, "ipv4_mapped", None)
        found.append([name, conn.laddr.ip, conn.laddr.port, (mapped or address).is_loopback])
    return found


def assert_loopback_only(found: list[list]) -> None:
    assert {"gcs_server", "raylet"} <= {name for name, *_ in found}, found  # the check saw the cluster
    assert [listener for listener in found if not listener[3]] == []


def _session_of_gcs(port: int) -> str:
    for process in psutil.process_iter(["cmdline"]):
        args = process.info["cmdline"] or []
        if any(arg == f"--gcs_server_port={port}" for arg in args):
            log_dir = next(arg.split("=", 1)[1] for arg in args if arg.startswith("--log_dir="))
            return Path(log_dir).parent.name  # session_<date>_<pid>
    raise AssertionError(f"no gcs_server on port {port}")


def test_the_test_ray_head_listens_on_loopback_only(ray_cluster):
    session = _session_of_gcs(int(ray_cluster.rpartition(":")[2]))
    assert_loopback_only(listeners(session))


EMBEDDED = """
import json, sys, time
import ray
from cluster.embedded import connect_ray
from cluster.settings import Settings
from tests.integration.test_ray_loopback import listeners

assert connect_ray(Settings(home=sys.argv[1]), num_cpus=1) is True  # started here
assert connect_ray(Settings(home=sys.argv[1])) is False  # already joined: nothing to leave later
ray.get(ray.remote(lambda: 1).remote())  # a worker is up too
time.sleep(3)  # the agents bind a moment after start
session = ray._private.worker.global_worker.node.session_name
print(json.dumps({"node_ip": ray.util.get_node_ip_address(), "listeners": listeners(session)}))
ray.shutdown()
"""


def test_the_embedded_ray_of_elastify_up_listens_on_loopback_only(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "ELASTIFY_RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "disabled"
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # as `elastify up` starts: nothing set beforehand
    done = subprocess.run([sys.executable, "-c", EMBEDDED, str(tmp_path / "home")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["node_ip"] == "127.0.0.1"
    assert_loopback_only(report["listeners"])
