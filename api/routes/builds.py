"""Builds: submit (idempotent, quota-checked), list, show, cancel, retry, and logs (SSE or plain text).

Submit is made per app by `submit_router(spec_model)`: its body is the BuildSpec of the app's
registry, so every stage's settings are validated (422 naming every bad field) and documented.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import PlainTextResponse, StreamingResponse
from fastapi.sse import format_sse_event
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from api.problems import ProblemError, not_found
from api.routes import CallerDep, JsonBody, problems, sessions
from api.schemas import BuildOut, BuildPage, BuildStatus, LogEvent
from cluster.capacity import current_capacity
from cluster.models import Build
from cluster.service import build_events, cancel_build, describe_build, list_builds, retry_build, submit
from cluster.spec import BuildSpec, published_build
from cluster.states import TERMINAL, Status

router = APIRouter(prefix="/v1/builds", tags=["builds"])
BUILD_ID = r"^[0-9a-f]{1,32}$"
SSE_POLL_SECONDS = 0.5
LOG_PAGE = 500  # events read per query
SSE_KEEPALIVE_SECONDS = 15.0

SPEC_EXAMPLE = {
    "source": {"model": "/models/smollm2-135m-instruct"},
    "levels": [0.5, 1.0],
    "stages": {"profile": {"settings": {"windows": 2, "window_length": 32}}},
    "publish": {"name": "smollm2-elastic", "version": "0.1.0", "aliases": ["latest"]},
}


def _describe(request: Request, build_id: str, scope: str | None) -> dict:
    with sessions(request)() as session:
        try:
            return describe_build(session, build_id, scope)
        except KeyError:
            raise not_found(f"no build {build_id}") from None


BuildId = Annotated[str, Path(pattern=BUILD_ID, description="the build id")]


def _refuse_a_published_version(request: Request, spec: BuildSpec, tenant: str, idempotency_key: str | None) -> None:
    """409 when spec.publish names a version that exists, unless this is a replay of an earlier submission
    (its Idempotency-Key was used already: `submit` answers with that build, or a 409 of its own)."""
    with sessions(request)() as session:
        if idempotency_key is not None and session.scalar(
                select(Build.id).where(Build.tenant_id == tenant, Build.idempotency_key == idempotency_key)):
            return
        build_id = published_build(session, spec.publish, tenant)
    if build_id is not None:
        raise ProblemError(409, f"{spec.publish.name} {spec.publish.version} is already published (build "
                                f"{build_id}); a published version never changes: set another publish.version",
                           kind="version-exists", errors=[("publish.version", "already published")])


def submit_router(spec_model: type[BuildSpec]) -> APIRouter:
    """`POST /v1/builds` taking `spec_model` (cluster.spec.spec_model of the app's registry)."""
    submit_routes = APIRouter(prefix="/v1/builds", tags=["builds"])

    def submit_build(
        spec: BuildSpec,
        request: Request,
        response: Response,
        caller: CallerDep,
        _json: Annotated[None, JsonBody],
        idempotency_key: Annotated[str | None, Header(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")] = None,
    ) -> dict:
        """Queue a build. With `Idempotency-Key`, the same key and spec return the first build (200) and the
        same key with another spec is a 409. A quota that refuses answers 429 and queues nothing. Every file
        the build reads is an `upload:<digest>` of the caller (POST /v1/sources) or a path under the server's
        source roots: a path outside them is a 403 naming the field. A name and version already published
        is a 409 (bump `publish.version`)."""
        _refuse_a_published_version(request, spec, caller.tenant, idempotency_key)
        capacity = current_capacity(request.app.state.settings.max_task_resources)
        submission = submit(sessions(request), spec, request.app.state.registry, caller.tenant, idempotency_key,
                            capacity=capacity, sources=request.app.state.sources,
                            gpu_stage_seconds=request.app.state.settings.gpu_stage_seconds)
        if not submission.created:
            response.status_code = 200
        response.headers["Location"] = f"/v1/builds/{submission.build_id}"
        return _describe(request, submission.build_id, caller.tenant)

    # The annotations are strings (PEP 563), resolved in this module's globals: name the model itself.
    submit_build.__annotations__["spec"] = spec_model
    submit_routes.post(
        "", status_code=201, response_model=BuildOut,
        responses={200: {"model": BuildOut, "description": "a replay: the build first submitted with this Idempotency-Key"},
                   **problems(403, 409, 415, 422, 429)},
        openapi_extra={"requestBody": {"content": {"application/json": {"example": SPEC_EXAMPLE}}}},
    )(submit_build)
    return submit_routes


@router.get("", response_model=BuildPage, responses=problems(400, 422))
def list_builds_route(
    request: Request,
    caller: CallerDep,
    status: Annotated[list[BuildStatus] | None, Query(description="any of these states")] = None,
    name: Annotated[str | None, Query(description="the package name the build publishes", max_length=128)] = None,
    owner: Annotated[str | None, Query(description="the tenant (admins see all tenants)", max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> dict:
    """Builds newest first, filtered by status, package name and owner, a page at a time."""
    with sessions(request)() as session:
        try:
            items, next_cursor = list_builds(session, caller.scope, status=status, name=name, owner=owner,
                                             limit=limit, cursor=cursor)
        except ValueError as err:
            raise ProblemError(400, str(err), kind="bad-cursor") from None
    return {"items": items, "next_cursor": next_cursor}


@router.get("/{build_id}", response_model=BuildOut, responses=problems(404, 422))
def get_build(build_id: BuildId, request: Request, caller: CallerDep) -> dict:
    """One build: stages, attempts, live progress, cache hits, GPU-seconds and its package."""
    return _describe(request, build_id, caller.scope)


@router.post("/{build_id}/cancel", response_model=BuildOut, responses=problems(404, 422))
def cancel(build_id: BuildId, request: Request, caller: CallerDep) -> dict:
    """Cancel: queued stages stop now, running ones are cancelled by the scheduler. Idempotent."""
    try:
        cancel_build(sessions(request), build_id, caller.scope)
    except KeyError:
        raise not_found(f"no build {build_id}") from None
    return _describe(request, build_id, caller.scope)


@router.post("/{build_id}/retry", response_model=BuildOut, responses=problems(404, 409, 422, 429))
def retry(build_id: BuildId, request: Request, caller: CallerDep) -> dict:
    """Re-run a failed or cancelled build: its failed and cancelled stages are queued again, finished
    stages are reused. A build in any other state is a 409."""
    settings = request.app.state.settings
    try:
        retry_build(sessions(request), build_id, caller.scope, capacity=current_capacity(settings.max_task_resources),
                    gpu_stage_seconds=settings.gpu_stage_seconds)
    except KeyError:
        raise not_found(f"no build {build_id}") from None
    return _describe(request, build_id, caller.scope)


@router.get(
    "/{build_id}/logs",
    response_class=Response,
    responses={
        200: {"description": "`text/event-stream` (Accept: text/event-stream) follows the build until it ends; "
                             "otherwise `text/plain`, the log so far",
              "content": {"text/event-stream": {"schema": {"type": "string"}},
                          "text/plain": {"schema": {"type": "string"}}}},
        **problems(404, 422),
    },
)
async def logs(
    build_id: BuildId,
    request: Request,
    caller: CallerDep,
    accept: Annotated[str | None, Header()] = None,
    last_event_id: Annotated[int | None, Header(ge=0, description="resume an SSE stream after this event")] = None,
    after: Annotated[int, Query(ge=0, description="only events after this event id")] = 0,
):
    """The build's events: a live Server-Sent Events stream, or the plain-text log so far."""
    scope = caller.scope
    start = max(after, last_event_id or 0)

    def page(after_id: int) -> tuple[list[dict], str]:
        # Status first: if it is terminal, the events written with that change are visible too.
        with sessions(request)() as session:
            status = session.scalar(select(Build.status).where(Build.id == build_id))
            try:
                return build_events(session, build_id, scope, after_id, LOG_PAGE), status
            except KeyError:
                raise not_found(f"no build {build_id}") from None

    events, status = await run_in_threadpool(page, start)
    if "text/event-stream" not in (accept or ""):
        lines = [_log_line(e) for e in events]
        while len(events) == LOG_PAGE:  # the whole log, a page of events at a time
            events, _ = await run_in_threadpool(page, events[-1]["id"])
            lines += [_log_line(e) for e in events]
        return PlainTextResponse("".join(lines))

    async def stream():
        nonlocal events, status
        seen = start
        quiet = 0.0
        while True:
            for event in events:
                seen = event["id"]
                yield format_sse_event(data_str=LogEvent(**event).model_dump_json(), event=event["kind"],
                                       id=str(event["id"]))
            if Status(status) in TERMINAL and not events:
                yield format_sse_event(data_str=json.dumps({"status": status}), event="end")
                return
            if await request.is_disconnected():
                return
            quiet = 0.0 if events else quiet + SSE_POLL_SECONDS
            if quiet >= SSE_KEEPALIVE_SECONDS:  # a comment line: clients and proxies see a live stream during long stages
                quiet = 0.0
                yield b": keepalive\n\n"
            if not events:
                await asyncio.sleep(SSE_POLL_SECONDS)
            events, status = await run_in_threadpool(page, seen)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _log_line(event: dict) -> str:
    where = f"[{event['stage']}] " if event["stage"] else ""
    if event["kind"] == "progress" and event["data"]:
        return f"{event['time']:%Y-%m-%dT%H:%M:%S} {where}{event['message']} {event['data'].get('done')}/{event['data'].get('total')}\n"
    return f"{event['time']:%Y-%m-%dT%H:%M:%S} {event['level']:<5} {where}{event['message']}\n"
