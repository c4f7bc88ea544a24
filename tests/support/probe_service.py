"""Replay a hostile tenant's inputs against a live `elastify up` (issue 16's probe).

A real `elastify up` (PostgreSQL, SeaweedFS, Ray), tokens for tenants acme (A) and beta (B); A uploads
a tiny model and builds a package from it, the only build. Then every case below must be refused, a
4xx from the API or a non-zero exit with a message from `elastify-device`, within a per-request
timeout, while /healthz keeps answering; afterwards no database row and no store object has been
added or removed by them. Cross-tenant reads that answer 200 with a list must list none of A's.

    .venv/bin/python -m tests.support.probe_service   # starts its own services; writes bench/results/probe_service.json

tests/integration/test_probe_service.py runs `probe` on the test session's services (`make test`).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from tests.support import services

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "probe_service.json"
REQUEST_TIMEOUT = 15.0  # seconds; a request still open then counts as a hang
CLI_TIMEOUT = 120.0
HEALTH_TIMEOUT = 5.0
BUILD_TIMEOUT = 300.0
MAX_UPLOAD = 4 << 20  # ELASTIFY_MAX_UPLOAD_BYTES of the probed service: the tiny model fits, 5 MiB does not
PACKAGE = "probe-a"


@dataclass
class Case:
    group: str
    name: str
    expected: str  # a status ("413"), "4xx", "refused" (non-zero exit, a message) or "200 checked" (see Probe.http)
    outcome: int | None  # HTTP status or exit code; None: no answer within the timeout
    message: str
    field: str | None  # the field a 4xx must name (the intended reason), if any
    seconds: float
    refused: bool


@dataclass
class Probe:
    url: str
    tokens: dict[str, str]
    cases: list[Case] = field(default_factory=list)

    def auth(self, tenant: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[tenant]}"} if tenant else {}

    def http(self, group: str, name: str, method: str, path: str, tenant: str | None = "beta",
             status: int | None = None, field: str | None = None, check: Callable[[dict], bool] | None = None,
             **request) -> Case:
        """One request; refused if it answers `status` (any 4xx if None) and its problem names `field`
        (when given: refused for the reason the case is about), or, with `check`, if it answers 200 with
        a body `check` accepts (a list showing none of A's, say)."""
        headers = {**self.auth(tenant), **request.pop("headers", {})}
        started = time.monotonic()
        try:
            with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT) as client:
                response = client.request(method, path, headers=headers, **request)
            answer, message = response.status_code, _problem_text(response)
            if check is not None:
                refused = answer == 200 and check(response.json())
            else:
                named = _problem_fields(response)
                refused = (answer == status if status else 400 <= answer < 500) and (
                    field is None or any(f == field or f.startswith(field + ".") for f in named))
        except httpx.TimeoutException:
            answer, message, refused = None, f"no answer within {REQUEST_TIMEOUT} s", False
        except httpx.TransportError as err:  # e.g. the server closed the connection mid-body: not a clear answer
            answer, message, refused = None, f"{type(err).__name__}: {err}", False
        expected = "200 checked" if check else str(status) if status else "4xx"
        return self._record(group, name, expected, answer, message, field, started, refused)

    def cli(self, group: str, commands: list[tuple[str, list[str], dict[str, str]]]) -> None:
        """`elastify-device` commands, (name, args, env) each, two at a time (most of each is importing);
        each is refused if it exits non-zero and says why on stderr, with no traceback."""
        def one(command) -> Case:
            name, args, env = command
            started = time.monotonic()
            try:
                done = subprocess.run([str(services.VENV_BIN / "elastify-device"), *args], env=env,
                                      capture_output=True, text=True, timeout=CLI_TIMEOUT)
                code, message = done.returncode, (done.stderr.strip().splitlines() or [""])[-1]
                refused = code != 0 and bool(message) and "Traceback" not in done.stderr
            except subprocess.TimeoutExpired:
                code, message, refused = None, f"still running after {CLI_TIMEOUT} s", False
            return Case(group, name, "refused", code, message[:400], None, round(time.monotonic() - started, 3),
                        refused)

        with ThreadPoolExecutor(2) as pool:
            self.cases += pool.map(one, commands)

    def _record(self, group, name, expected, outcome, message, field, started, refused) -> Case:
        case = Case(group, name, expected, outcome, message[:400], field, round(time.monotonic() - started, 3),
                    refused)
        self.cases.append(case)
        return case


def _problem_text(response: httpx.Response) -> str:
    """A problem's title, detail and bad fields in one line, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    if not isinstance(body, dict) or "title" not in body:
        return json.dumps(body)[:200]
    fields = "; ".join(f"{e.get('field')}: {e.get('message')}" for e in body.get("errors") or [])
    return " — ".join(part for part in (body.get("title"), body.get("detail"), fields) if part)


def _problem_fields(response: httpx.Response) -> list[str]:
    """The fields a validation problem names, without FastAPI's leading `body.` (`stages.profile.…`)."""
    try:
        errors = response.json().get("errors") or []
    except (ValueError, AttributeError):
        return []
    return [str(e.get("field", "")).removeprefix("body.") for e in errors]


# --------------------------------------------------------------------------- the live service


def service_env(work: Path, database_url: str, store_url: str, store_endpoint: str, ray_address: str) -> dict:
    """What an operator sets for `elastify up` against these services (the signing key made here), plus the
    probe's own temp dir, source root, upload limit and trust store (nothing outside `work` is written)."""
    from cluster.settings import Settings

    roots = work / "roots"
    roots.mkdir(parents=True, exist_ok=True)
    Settings(home=work / "home").ensure_signing_key()  # an operator provides it outside embedded mode
    (work / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "ELASTIFY_HOME": str(work / "home"), "ELASTIFY_DATABASE_URL": database_url,
            "ELASTIFY_STORE_URL": store_url, "ELASTIFY_STORE_ENDPOINT": store_endpoint,
            "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "ELASTIFY_RAY_ADDRESS": ray_address,
            "RAY_AUTH_MODE": "disabled", "ELASTIFY_SOURCE_ROOTS": str(roots),
            "ELASTIFY_MAX_UPLOAD_BYTES": str(MAX_UPLOAD), "TMPDIR": str(work / "tmp"),
            "ELASTIFY_TRUST_STORE": str(work / "trust.json"), "HF_HUB_OFFLINE": "1"}


class LiveService:
    """`elastify up` in its own process group on a free loopback port."""

    def __init__(self, env: dict, log: Path):
        self.env, self.log, self.port = env, log, services.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LiveService:
        self.process = subprocess.Popen(
            [str(services.VENV_BIN / "elastify"), "up", "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.env, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        services.wait_for_port(self.port, 120, self.process, self.log)
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is not None:  # what the service said is the first thing to read when the probe breaks
            print(f"elastify up's log ends:\n{self.log.read_text(errors='replace')[-4000:]}", file=sys.stderr)
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                pass
        services.stop_group(self.process)

    def token(self, tenant: str) -> str:
        created = subprocess.run([str(services.VENV_BIN / "elastify"), "tokens", "create", "--tenant", tenant],
                                 env=self.env, capture_output=True, text=True, check=True, timeout=CLI_TIMEOUT)
        return created.stdout.strip()


class HealthWatch(threading.Thread):
    """Polls /healthz every 0.25 s while the cases run; records each answer's latency or its failure."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.latencies, self.failures = url, [], []
        self.stopped = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=HEALTH_TIMEOUT) as client:
            while not self.stopped.is_set():
                started = time.monotonic()
                try:
                    ok = client.get("/healthz").status_code == 200
                    self.latencies.append(time.monotonic() - started)
                    if not ok:
                        self.failures.append("not 200")
                except httpx.HTTPError as err:
                    self.failures.append(f"{type(err).__name__} after {time.monotonic() - started:.1f} s")
                self.stopped.wait(0.25)

    def summary(self) -> dict:
        ordered = sorted(self.latencies)
        return {"polls": len(ordered) + len(self.failures), "failures": self.failures,
                "p50_ms": round(1000 * ordered[len(ordered) // 2], 1) if ordered else None,
                "max_ms": round(1000 * ordered[-1], 1) if ordered else None}


def footprint(database_url: str, store) -> dict:
    """Rows per table of the job store and every object key in the artifact store."""
    from sqlalchemy import create_engine, func, select

    from cluster.models import Base

    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            rows = {table.name: connection.scalar(select(func.count()).select_from(table))
                    for table in Base.metadata.sorted_tables}
    finally:
        engine.dispose()
    return {"rows": rows, "objects": store.list("")}


# --------------------------------------------------------------------------- inputs


def tar_gz(members: Iterator[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        for info, content in members:
            tar.addfile(info, io.BytesIO(content) if content is not None else None)
    return data.getvalue()


def _member(name: str, content: bytes = b"x", kind: bytes = tarfile.REGTYPE, target: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, len(content) if kind == tarfile.REGTYPE else 0, target
    return info, content if kind == tarfile.REGTYPE else None


def model_archive(model_dir: Path) -> bytes:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        tar.add(model_dir, arcname=model_dir.name)
    return data.getvalue()


def build_spec(model: str, calibration_file: str, package: str, **changes) -> dict:
    """The cheapest real build of a tiny model (profile on one window, elastify, publish); `changes`
    replace top-level fields or, as `stages=…`, are merged into the stages."""
    from pipeline.chain import ELASTILM_STAGES

    stages = {"profile": {"settings": {"windows": 1, "window_length": 16, "layer_method": "block_influence"}},
              "elastify": {"settings": {"align": 8}}, "evaluate": {"enabled": False},
              **{stage: {"enabled": False} for stage in ELASTILM_STAGES}}
    stages.update(changes.pop("stages", {}))
    return {"source": {"model": model}, "calibration": [calibration_file], "levels": [0.5, 1.0], "stages": stages,
            "publish": {"name": package, "version": "1"}, **changes}


def chunks(total: int, size: int = 64 << 10) -> Iterator[bytes]:
    """A body with no Content-Length (chunked transfer), `total` bytes."""
    for start in range(0, total, size):
        yield b"a" * min(size, total - start)


# --------------------------------------------------------------------------- the probe


def probe(work: Path, database_url: str, store_url: str, store_endpoint: str, ray_address: str) -> dict:
    """Run every case against a fresh `elastify up` on these services; the per-case results and checks."""
    import treebank

    from tests.support.tiny import save_tiny
    from workers.store import StoreConfig

    clock, seconds, load_before = time.monotonic(), {}, round(os.getloadavg()[0], 2)

    def lap(phase: str) -> None:
        nonlocal clock
        seconds[phase], clock = round(time.monotonic() - clock, 1), time.monotonic()

    env = service_env(work, database_url, store_url, store_endpoint, ray_address)
    roots = Path(env["ELASTIFY_SOURCE_ROOTS"])
    calibration = roots / "calib.txt"
    calibration.write_text(treebank.penn["valid"][:40000])
    model = save_tiny("llama_gqa", roots / "tiny")  # A uploads it; B names it under the source root
    store = StoreConfig(store_url, store_endpoint, "test", "test").open()

    with LiveService(env, work / "up.log") as service:
        run = Probe(service.url, {tenant: service.token(tenant) for tenant in ("acme", "beta")})
        lap("start")
        setup = _setup(run, model, calibration)
        lap("A's build")
        before = footprint(database_url, store)
        watch = HealthWatch(service.url)
        watch.start()
        try:
            _api_cases(run, setup, model, calibration)
            lap("API cases")
            _device_cases(run, setup, env, work / "device")
            lap("device cases")
        finally:
            watch.stopped.set()
            watch.join()
        after = footprint(database_url, store)
        scratch_left = sorted(p.name for p in (work / "tmp").glob("elastify-upload-*"))
    seconds["total"] = round(sum(seconds.values()) + time.monotonic() - clock, 1)
    return {
        "cases": [asdict(c) for c in run.cases],
        "controls": setup["controls"],
        "not_refused": [f"{c.group}/{c.name}" for c in run.cases if not c.refused],
        "hangs": [f"{c.group}/{c.name}" for c in run.cases if c.outcome is None],
        "healthz": watch.summary(),
        "rows_changed": {t: (before["rows"][t], after["rows"][t]) for t in before["rows"]
                         if before["rows"][t] != after["rows"][t]},
        "objects_added": sorted(set(after["objects"]) - set(before["objects"])),
        "objects_removed": sorted(set(before["objects"]) - set(after["objects"])),
        "upload_scratch_left": scratch_left,
        "seconds": seconds,
        "load_average_1min": {"before": load_before, "after": round(os.getloadavg()[0], 2)},
    }


def _setup(run: Probe, model: Path, calibration: Path) -> dict:
    """A uploads the tiny model and builds PACKAGE from it. While the build runs, B tries to read, cancel
    and follow it (recorded as cases); the build must still succeed."""
    with httpx.Client(base_url=run.url, timeout=REQUEST_TIMEOUT) as client:
        uploaded = client.post("/v1/sources", content=model_archive(model),
                               headers={**run.auth("acme"), "Content-Type": "application/gzip"})
        assert uploaded.status_code == 201, uploaded.text
        source = uploaded.json()
        submitted = client.post("/v1/builds", json=build_spec(source["source"], str(calibration), PACKAGE),
                                headers=run.auth("acme"))
        assert submitted.status_code == 201, submitted.text
        build = submitted.json()["id"]
        for name, method, path in (("read A's running build", "GET", f"/v1/builds/{build}"),
                                   ("cancel A's running build", "POST", f"/v1/builds/{build}/cancel"),
                                   ("follow A's running build's logs", "GET", f"/v1/builds/{build}/logs")):
            run.http("cross-tenant", name, method, path, status=404)
        deadline = time.monotonic() + BUILD_TIMEOUT
        while (status := client.get(f"/v1/builds/{build}", headers=run.auth("acme")).json()["status"]) not in (
                "succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"A's build did not finish in {BUILD_TIMEOUT} s"
            time.sleep(0.5)
        assert status == "succeeded", client.get(f"/v1/builds/{build}/logs", headers=run.auth("acme")).text[-3000:]
        key = client.get("/v1/keys/signing").json()["public_key"]
        usage = client.get("/v1/usage", params={"group_by": "build"}, headers=run.auth("acme")).json()
        own = client.get(f"/v1/packages/{PACKAGE}/1/manifest", headers=run.auth("acme")).status_code
    # What B is refused, A gets: the refusals below are about the caller, not a broken setup.
    controls = {"A's build": status, "A's usage rows": len(usage["rows"]), "A reads its manifest": own}
    assert usage["rows"] and own == 200, controls
    return {"build": build, "source": source, "key": key, "controls": controls}


def _api_cases(run: Probe, setup: dict, model: Path, calibration: Path) -> None:
    """B's specs are valid but for the one field each case is about (B's model is under the source root),
    and each must be refused naming that field."""
    source, build = setup["source"], setup["build"]
    calib = str(calibration)

    def submit(group: str, name: str, field: str | None, status: int = 422, **changes) -> None:
        run.http(group, name, "POST", "/v1/builds", status=status, field=field,
                 json=build_spec(str(model), calib, "probe-b", **changes))

    for name, levels in (("levels that round to one name", [0.1234561, 0.1234562, 1.0]), ("a boolean level", [True]),
                         ("a level of 1e-9", [1e-9, 1.0]), ("levels not increasing", [1.0, 0.5]),
                         ("a level above 1", [0.5, 1.5]), ("no levels", []),
                         ("5000 levels", [round((i + 1) / 5000, 4) for i in range(5000)])):
        submit("levels", name, "levels", levels=levels)

    for name, stages, where in (
            ("align 0", {"elastify": {"settings": {"align": 0}}}, "stages.elastify.settings.align"),
            ("windows -1", {"profile": {"settings": {"windows": -1}}}, "stages.profile.settings.windows"),
            ('layer_method "zzz"', {"profile": {"settings": {"layer_method": "zzz"}}},
             "stages.profile.settings.layer_method"),
            ('align "x"', {"elastify": {"settings": {"align": "x"}}}, "stages.elastify.settings.align"),
            ("an unknown stage", {"zzz": {}}, "stages.zzz"),
            ("an unknown setting", {"profile": {"settings": {"zzz": 1}}}, "stages.profile.settings.zzz"),
            ("max_attempts 1000", {"profile": {"max_attempts": 1000}}, "stages.profile.max_attempts")):
        submit("settings", name, where, stages=stages)

    # More than the largest Ray node offers would wait forever holding B's concurrency quota.
    for name, resources, where in (("num_cpus 1000", {"num_cpus": 1000}, "stages.profile.resources.num_cpus"),
                                   ("num_gpus 1000", {"num_gpus": 1000}, "stages.profile.resources.num_gpus"),
                                   ("a custom resource no node has", {"custom": {"tpu": 1}},
                                    "stages.profile.resources.custom.tpu")):
        submit("capacity", name, where, stages={"profile": {"resources": resources}})

    root = calibration.parent
    submit("sources", "/etc/passwd as calibration", "calibration.0", 403, calibration=["/etc/passwd"])
    submit("sources", "100,000 calibration files", "calibration", calibration=["/a"] * 100_000)
    submit("sources", "source.model outside the roots", "source.model", 403, source={"model": "/etc"})
    submit("sources", "a relative source.model", "source.model", source={"model": "models/../../etc"})
    submit("sources", "../ out of a source root", "source.model", source={"model": f"{root}/../../etc"})
    # compression_data is read by tlm-score only (the spec's other stages never open it), so that stage is on.
    submit("sources", "compression_data outside the roots", "source.compression_data", 403,
           source={"model": str(model), "compression_data": "/etc/shadow"}, stages={"tlm-score": {"enabled": True}})
    submit("sources", "an evaluate corpus outside the roots", "stages.evaluate.settings.corpora", 403,
           stages={"evaluate": {"enabled": True, "settings": {"corpora": ["/etc/passwd"]}}})
    submit("sources", "A's upload named by B", "source.model", source={"model": source["source"]})
    for name, body in (("an archive member named ../", tar_gz([_member("m/../../evil.txt")])),
                       ("an absolute archive member", tar_gz([_member("/etc/evil.txt")])),
                       ("an archive with a symlink out",
                        tar_gz([_member("m/x", kind=tarfile.SYMTYPE, target="/etc/passwd")])),
                       ("an archive with a hard link",
                        tar_gz([_member("m/a"), _member("m/b", kind=tarfile.LNKTYPE, target="m/a")])),
                       ("an archive member 2000 directories deep", tar_gz([_member("m/" + "a/" * 2000 + "x")]))):
        run.http("sources", name, "POST", "/v1/sources", status=422, content=body,
                 headers={"Content-Type": "application/gzip"})
    run.http("sources", "an upload named ../../x", "POST", "/v1/sources", status=422, params={"name": "../../x.txt"},
             content=b"text", headers={"Content-Type": "application/octet-stream"})
    run.http("sources", "publish name ..", "POST", "/v1/builds", status=422, field="publish.name",
             json={**build_spec(str(model), calib, "probe-b"), "publish": {"name": "..", "version": "1"}})
    for name, path, where in (
            ("a package file path with ../", f"/v1/packages/{PACKAGE}/1/files/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
             "path.path"),
            ("a package name ..", "/v1/packages/%2e%2e/versions", "path.name"),
            ("an encoded ../ to the alias objects", f"/v1/packages/{PACKAGE}/1/files/..%2f..%2faliases%2flatest",
             "path.path"),
            ("a file the manifest does not list", f"/v1/packages/{PACKAGE}/1/files/model/extra.bin", None)):
        # Even the owner stays inside the package and its manifest's file list.
        run.http("traversal", name, "GET", path, tenant="acme", status=422 if where else 404, field=where)

    # Query strings: refused, or (the last representable day) answered with A's whole usage; never a 500.
    run.http("query", "a page of 100,000 builds", "GET", "/v1/builds", params={"limit": 100_000}, status=422,
             field="query.limit")
    run.http("query", "a cursor the service did not issue", "GET", "/v1/builds", params={"cursor": "A" * 500},
             status=400)
    run.http("query", "A's usage until 9999-12-31", "GET", "/v1/usage", params={"until": "9999-12-31"},
             tenant="acme", check=lambda body: body["rows"] != [])
    run.http("query", "usage by an unknown group", "GET", "/v1/usage", params={"group_by": "zzz"}, status=422,
             field="query.group_by.0")
    run.http("query", "a JSON body nested 100,000 deep", "POST", "/v1/builds", status=400,
             content=b"[" * 100_000 + b"]" * 100_000, headers={"Content-Type": "application/json"})

    big_spec = build_spec(str(model), calib, "probe-b")
    big_spec["publish"]["aliases"] = ["a" * 100] * 12000
    run.http("body size", "a 2 MiB build spec", "POST", "/v1/builds", status=413, json=big_spec)
    run.http("body size", "a 2 MiB chunked build spec", "POST", "/v1/builds", status=413, content=chunks(2 << 20),
             headers={"Content-Type": "application/json"})
    run.http("body size", "an upload over the limit (declared)", "POST", "/v1/sources", status=413,
             params={"name": "big.bin"},
             content=b"a" * (MAX_UPLOAD + 1), headers={"Content-Type": "application/octet-stream"})
    run.http("body size", "an upload over the limit (chunked)", "POST", "/v1/sources", status=413,
             params={"name": "big.bin"},
             content=chunks(MAX_UPLOAD + (1 << 20)), headers={"Content-Type": "application/octet-stream"})
    bomb = tar_gz([_member("m/zeros.bin", bytes(MAX_UPLOAD + (1 << 20)))])
    run.http("body size", f"a {len(bomb) >> 10} KiB archive unpacking over the limit", "POST", "/v1/sources",
             status=413, content=bomb, headers={"Content-Type": "application/gzip"})

    spec_bytes = json.dumps(build_spec(str(model), calib, "probe-b")).encode()
    for media in ("text/plain", "application/x-www-form-urlencoded", "application/xml"):
        run.http("content type", f"a build spec as {media}", "POST", "/v1/builds", status=415, content=spec_bytes,
                 headers={"Content-Type": media})
    run.http("content type", "a build spec with no Content-Type", "POST", "/v1/builds", status=415,
             content=spec_bytes)
    run.http("content type", "an upload as application/json", "POST", "/v1/sources", status=415, content=b"{}",
             headers={"Content-Type": "application/json"})
    run.http("content type", "an alias as text/plain", "PUT", f"/v1/packages/{PACKAGE}/aliases/stable",
             tenant="acme", status=415, content=b'{"version": "1"}', headers={"Content-Type": "text/plain"})

    group = "cross-tenant"
    weights = f"/v1/packages/{PACKAGE}/1/files/model/weights.safetensors"
    for name, method, path in (("read A's build", "GET", f"/v1/builds/{build}"),
                               ("cancel A's build", "POST", f"/v1/builds/{build}/cancel"),
                               ("retry A's build", "POST", f"/v1/builds/{build}/retry"),
                               ("read A's build logs", "GET", f"/v1/builds/{build}/logs"),
                               ("delete A's upload", "DELETE", f"/v1/sources/{source['digest']}"),
                               ("list A's package versions", "GET", f"/v1/packages/{PACKAGE}/versions"),
                               ("read A's manifest", "GET", f"/v1/packages/{PACKAGE}/1/manifest"),
                               ("read A's weights", "GET", weights),
                               ("presign A's weights", "GET", weights + "?presign=true")):
        run.http(group, name, method, path, status=404)
    run.http(group, "move A's alias", "PUT", f"/v1/packages/{PACKAGE}/aliases/latest", status=404,
             json={"version": "1"})
    submit(group, "publish under A's package name", None, 409, publish={"name": PACKAGE, "version": "2"})
    run.http(group, "list builds of owner acme", "GET", "/v1/builds", params={"owner": "acme"},
             check=lambda body: body["items"] == [])
    run.http(group, "list packages", "GET", "/v1/packages",
             check=lambda body: all(p["name"] != PACKAGE for p in body["items"]))
    run.http(group, "list sources", "GET", "/v1/sources",
             check=lambda body: all(s["digest"] != source["digest"] for s in body["items"]))
    run.http(group, "usage of tenant acme", "GET", "/v1/usage", params={"tenant": "acme"},
             check=lambda body: body["rows"] == [])
    run.http(group, "usage of A's build", "GET", "/v1/usage", params={"build": build, "group_by": "build"},
             check=lambda body: body["rows"] == [])
    run.http(group, "follow A's build's logs from event 0", "GET", f"/v1/builds/{build}/logs", status=404,
             headers={"Accept": "text/event-stream", "Last-Event-ID": "0"})
    run.http(group, "no token", "GET", f"/v1/builds/{build}", tenant=None, status=401)
    run.http(group, "a forged token", "GET", f"/v1/builds/{build}", tenant=None, status=401,
             headers={"Authorization": "Bearer elst_" + "0" * 40})


def _flip_last_byte(path: Path) -> None:
    """Flip one bit of a weights file's last byte (tensor data, not the header)."""
    with open(path, "r+b") as weights:
        weights.seek(-1, os.SEEK_END)
        last = weights.read(1)[0]
        weights.seek(-1, os.SEEK_END)
        weights.write(bytes([last ^ 1]))


def _device_cases(run: Probe, setup: dict, up_env: dict, work: Path) -> None:
    """`elastify-device` on A's package: pull from the live API with the service's key pinned, then
    tampered copies through verify, load (`generate` loads first) and pull."""
    from device_sdk.format import MANIFEST, WEIGHTS, atomic_write_bytes, canonical_json, read_manifest
    from device_sdk.registry import LOCAL_STATE
    from tests.support.sdk_packages import public_bytes, publish, sign_package, signing_key

    device = [str(services.VENV_BIN / "elastify-device")]
    work.mkdir(parents=True, exist_ok=True)
    api, cache = f"{run.url}/v1", work / "cache"
    env = {**up_env, "ELASTIFY_TOKEN": run.tokens["acme"], "ELASTIFY_HOME": str(work / "home")}

    def must(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([*device, *args], env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT)
        assert done.returncode == 0, f"elastify-device {' '.join(args)}: {done.stderr}"
        return done

    must("trust", "add", PACKAGE, setup["key"])
    must("pull", PACKAGE, "1", "--registry", api, "--cache-dir", str(cache))
    installed = cache / PACKAGE / "1"

    flipped = Path(shutil.copytree(installed, work / "flipped"))
    _flip_last_byte(flipped / WEIGHTS)
    sidecar = Path(shutil.copytree(flipped, work / "sidecar"))  # the installed copy's local record, made to lie
    atomic_write_bytes(sidecar / LOCAL_STATE, canonical_json({"name": PACKAGE, "version": "1", "max_level": None,
                                                              "files": [], "verified": True, "bytes": 0}))
    forged = Path(shutil.copytree(flipped, work / "forged"))
    sign_package(forged, signing_key(9))  # a consistent manifest of the altered bytes, signed by another key
    unsigned = Path(shutil.copytree(forged, work / "unsigned"))
    manifest = read_manifest(unsigned)
    manifest.signature = None
    atomic_write_bytes(unsigned / MANIFEST, canonical_json(manifest.to_dict()))
    registries = {}
    for package in (flipped, forged, unsigned):
        registries[package.name] = work / f"registry-{package.name}"
        (publish(package, registries[package.name], name=PACKAGE, version="1") / LOCAL_STATE).unlink(missing_ok=True)

    other_key = base64.b64encode(public_bytes(signing_key(9))).decode()
    pull = ["pull", PACKAGE, "1", "--registry", api, "--cache-dir"]
    load = ["hi", "--max-new-tokens", "1"]
    run.cli("device", [
        ("pull with B's token", [*pull, str(work / "b")], {**env, "ELASTIFY_TOKEN": run.tokens["beta"]}),
        ("pull with no key pinned", [*pull, str(work / "u")],
         {**env, "ELASTIFY_TRUST_STORE": str(work / "empty-trust.json")}),
        ("pull with a key other than the pinned one", [*pull, str(work / "o"), "--public-key", other_key], env),
        ("pull a name with ../", ["pull", f"../{PACKAGE}", "1", "--registry", api, "--cache-dir", str(work / "t")], env),
        ("verify a flipped weight bit", ["verify", str(flipped)], env),
        ("load a flipped weight bit", ["generate", str(flipped), *load], env),
        ("load a flipped bit beside a forged local record", ["generate", str(sidecar), *load], env),
        ("verify a manifest forged with another key", ["verify", str(forged)], env),
        ("load a manifest forged with another key", ["generate", str(forged), *load], env),
        ("verify an unsigned manifest", ["verify", str(unsigned)], env),
        ("load an unsigned manifest", ["generate", str(unsigned), *load], env),
        *((f"pull {what} from a directory registry",
           ["pull", PACKAGE, "1", "--registry", str(registries[name]), "--cache-dir", str(work / f"from-{name}")], env)
          for what, name in (("a flipped weight bit", "flipped"), ("a forged manifest", "forged"),
                             ("an unsigned manifest", "unsigned"))),
    ])
    setup["controls"]["refused pulls installed nothing"] = not any(
        (work / d / PACKAGE / "1").exists() for d in ("b", "u", "o", "from-flipped", "from-forged", "from-unsigned"))

    # A copy altered after install is re-verified by the next pull and replaced, not returned as it is.
    _flip_last_byte(installed / WEIGHTS)
    repaired = must("pull", PACKAGE, "1", "--registry", api, "--cache-dir", str(cache))
    must("verify", str(installed))
    setup["controls"]["pull replaced a copy altered after install"] = "does not verify" in repaired.stderr


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="elastify-probe-") as scratch, services.postgres() as server, \
            services.seaweedfs() as endpoint, services.ray_head(num_cpus=2, num_gpus=0) as ray_address:
        database_url = services.create_database(server, "probe")
        results = probe(Path(scratch), database_url, f"s3://probe-{uuid.uuid4().hex[:8]}/elastify", endpoint,
                        ray_address)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'group':<13} {'case':<52} {'got':>4} {'s':>6}  message")
    for case in results["cases"]:
        mark = "" if case["refused"] else "  <-- NOT REFUSED"
        print(f"{case['group']:<13} {case['name'][:52]:<52} {case['outcome']!s:>4} {case['seconds']:6.2f}  "
              f"{case['message'][:90]}{mark}")
    problems = {k: results[k] for k in ("not_refused", "hangs", "rows_changed", "objects_added", "objects_removed",
                                        "upload_scratch_left") if results[k]}
    print(f"{len(results['cases'])} cases, healthz {results['healthz']}, {results['seconds']} s; wrote {RESULTS}")
    print("problems:", problems or "none")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
