"""Real services on loopback, each in its own temp dir and process group: PostgreSQL, SeaweedFS, Ray.

Context managers shared by the integration fixtures and the benchmarks; teardown stops exactly
the processes started here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout: float, process: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"service exited with {process.returncode}: {log.read_text()[-2000:] if log else ''}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def stop_group(process: subprocess.Popen, timeout: float = 15.0) -> None:
    """Stop a service we started in its own session: SIGTERM, then SIGKILL, to its process group only."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _pg_bindir() -> str:
    if shutil.which("pg_config"):
        return subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True).stdout.strip()
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not candidates:
        raise RuntimeError("PostgreSQL server binaries not found; `make services` installs them")
    return str(candidates[-1].parent)


class PostgresServer:
    """A throwaway PostgreSQL cluster (trust auth, 127.0.0.1, a free port) in its own temp dir, which a
    fault test may stop (`pg_ctl stop -m fast`, as an operator would) and start again on the same port."""

    def __init__(self) -> None:
        self.bindir = _pg_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="elastify-pg-"))
        self.port = free_port()
        self._as_postgres = ["su", "postgres", "-s", "/bin/sh", "-c"] if os.geteuid() == 0 else ["sh", "-c"]
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        self.data, self.log = self.root / "data", self.root / "log"
        self._pg(f"{self.bindir}/initdb -D {self.data} -U postgres --auth=trust -E UTF8 --no-sync")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}"

    def _pg(self, command: str, check: bool = True) -> None:
        subprocess.run([*self._as_postgres, command], check=check, capture_output=True)

    def start(self) -> None:
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._pg(f"{self.bindir}/pg_ctl -D {self.data} -l {self.log} -w -o '{options}' start")

    def stop(self, mode: str = "fast", check: bool = True) -> None:
        self._pg(f"{self.bindir}/pg_ctl -D {self.data} -m {mode} -w stop", check=check)


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A started PostgresServer, stopped and deleted afterwards."""
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.stop("immediate", check=False)
        shutil.rmtree(server.root, ignore_errors=True)


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A throwaway PostgreSQL cluster (trust auth, 127.0.0.1, free port); yields its base URL."""
    with postgres_server() as server:
        yield server.url


def create_database(server_url: str, name: str) -> str:
    import psycopg

    with psycopg.connect(server_url.replace("postgresql+psycopg", "postgresql") + "/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{server_url}/{name}"


@contextlib.contextmanager
def seaweedfs() -> Iterator[str]:
    """`weed mini` on loopback with its own ports; yields the S3 endpoint URL."""
    root = Path(tempfile.mkdtemp(prefix="elastify-weed-"))
    ports = {name: free_port() for name in (
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
        "s3.port", "admin.port", "admin.port.grpc", "debug.port",
    )}
    args = [str(VENV_BIN / "weed"), "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-admin.ui=false", "-webdav=false", "-master.telemetry=false",
            # Every test bucket is a collection with volumes of its own; left alone, `weed mini` sizes
            # volumes at 1 GiB and counts them from the free disk, so a fuller disk ran out of them
            # mid-suite ("No writable volumes and no free volumes left": InternalError on PutObject).
            "-master.volumeSizeLimitMB=64", "-volume.max=1000"]
    args += [f"-{name}={port}" for name, port in ports.items()]
    (root / "data").mkdir()
    log = root / "log"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    process = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for_port(ports["s3.port"], 60, process, log)
        endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        _wait_s3_ready(endpoint)
        yield endpoint
    finally:
        stop_group(process, timeout=5)
        shutil.rmtree(root, ignore_errors=True)


def _wait_s3_ready(endpoint: str, timeout: float = 60) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                          region_name="us-east-1")
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.create_bucket(Bucket="readiness")
            client.put_object(Bucket="readiness", Key="probe", Body=b"ok")
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


@contextlib.contextmanager
def ray_head(num_cpus: int = 2, num_gpus: int = 2) -> Iterator[str]:
    """A local Ray head (fake GPUs, no dashboard, auth off) that this process and subprocesses join."""
    import ray

    from cluster.embedded import keep_ray_on_loopback

    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    port = free_port()
    # Bound to 127.0.0.1 alone: Ray keeps a loopback node address only with this (cluster.embedded).
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", **keep_ray_on_loopback()}
    args = [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
            f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}", "--include-dashboard=false", "--disable-usage-stats",
            f"--temp-dir={temp}", f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--ray-client-server-port={free_port()}"]
    log = temp / "start.log"
    process = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        wait_for_port(port, 60, process, log)
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        yield address
    finally:
        ray.shutdown()
        stop_group(process, timeout=5)
        shutil.rmtree(temp, ignore_errors=True)
