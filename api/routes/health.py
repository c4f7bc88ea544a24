"""Health, readiness, the signing key and Prometheus metrics: the routes that need no token."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from api.problems import ProblemError
from api.routes import problems
from api.schemas import Health, Readiness, SigningKey
from cluster.settings import SettingsError

router = APIRouter(tags=["health"])
# Readiness checks run on threads of their own, never on the shared pool that sync routes use: a frozen
# store then blocks at most these few threads, and /healthz and /v1/builds keep answering.
READY_CHECK_THREADS = 4
READY_CHECK_TIMEOUT_S = 2.0
_ready_pool = ThreadPoolExecutor(READY_CHECK_THREADS, thread_name_prefix="elastify-readyz")
# At most one run of each check at a time: concurrent /readyz share it, so a frozen store holds one
# thread, not all of them, and the other checks still get theirs.
_in_flight: dict[Callable[[], str], Future] = {}
_in_flight_lock = threading.Lock()


def _shared_run(check: Callable[[], str]) -> Future:
    with _in_flight_lock:
        running = _in_flight.get(check)
        if running is None or running.done():
            running = _in_flight[check] = _ready_pool.submit(check)
        return running


@router.get("/healthz", response_model=Health)
async def healthz() -> dict:
    """The process is up (no dependencies are checked, and no thread is needed: it answers on the loop)."""
    return {"status": "ok"}


def database_check(sessions) -> Callable[[], str]:
    def check() -> str:
        with sessions() as session:
            session.execute(text("SELECT 1"))
        return "reachable"

    return check


def store_check(store) -> Callable[[], str]:
    def check() -> str:
        store.exists("readyz")  # one round trip; raises if the store is unreachable
        return "reachable"

    return check


def ray_check(address: str) -> Callable[[], str]:
    """Joined to Ray: live nodes. An API process that has not joined (it need not) checks that the
    cluster's address (ELASTIFY_RAY_ADDRESS, host:port or ray://host:port) accepts connections."""

    def check() -> str:
        import ray

        if ray.is_initialized():
            alive = [node for node in ray.nodes() if node.get("Alive")]
            if not alive:
                raise RuntimeError("no live Ray nodes")
            return f"{len(alive)} live nodes"
        host, _, port = address.removeprefix("ray://").rpartition(":")
        if not host or not port.isdigit():
            raise RuntimeError("this process is not connected to Ray and ELASTIFY_RAY_ADDRESS names no host:port")
        with socket.create_connection((host, int(port)), timeout=2):
            return f"{address} accepts connections"

    return check


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness, "description": "a check failed"}})
async def readyz(request: Request):
    """Ready to serve: the database, the artifact store and Ray each answer."""
    async def outcome(check) -> dict:
        try:
            run = asyncio.wrap_future(_shared_run(check))
            detail = await asyncio.wait_for(asyncio.shield(run), READY_CHECK_TIMEOUT_S)
            return {"ok": True, "detail": detail}
        except TimeoutError:
            return {"ok": False, "detail": f"no answer within {READY_CHECK_TIMEOUT_S:g} s"}
        except Exception as err:  # any failure means not ready; say which and why
            return {"ok": False, "detail": f"{type(err).__name__}: {err}"[:500]}

    checks = request.app.state.ready_checks
    answers = await asyncio.gather(*(outcome(check) for check in checks.values()))
    results = dict(zip(checks, answers, strict=True))
    ready = all(r["ok"] for r in results.values())
    body = Readiness(status="ready" if ready else "not ready", checks=results)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get("/v1/keys/signing", response_model=SigningKey, tags=["keys"], responses=problems(503))
def signing_key(request: Request) -> dict:
    """The Ed25519 public key that signs every manifest; devices pin it."""
    try:
        return {"public_key": request.app.state.settings.public_key_b64()}
    except SettingsError as err:
        raise ProblemError(503, str(err), kind="no-signing-key") from None


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition"}})
def metrics(request: Request) -> Response:
    """Prometheus metrics, read from the job store at scrape time (every replica reports the same)."""
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)
