"""The /v1 routes, one module per resource; shared dependencies and error documentation here."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from api.auth import Caller, current_caller
from api.problems import ProblemError
from api.schemas import Problem

CallerDep = Annotated[Caller, Depends(current_caller)]


def require_json(request: Request) -> None:
    """Refuse a body that is not JSON with 415: parsed anyway it would be a 422 about its fields,
    which tells the caller nothing about the real mistake (a form post, YAML, no Content-Type)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ProblemError(415, f"send the body as application/json, not {media or 'without a Content-Type'}",
                           kind="unsupported-media-type", headers={"Accept-Post": "application/json"})


JsonBody = Depends(require_json)  # a route parameter after the caller's, so a missing token is still a 401

EXAMPLES = {
    400: "the cursor is not one this service issued",
    401: "send `Authorization: Bearer <token>`",
    403: "only admin tokens may do this",
    404: "no build 5f0c2a9e1b7d4c3a",
    409: "idempotency key 'nightly-1' was used for build 5f0c2a9e1b7d4c3a with a different spec",
    413: "the request body is larger than 1048576 bytes",
    415: "send the body as application/json, not application/x-www-form-urlencoded",
    416: "bytes=900-999 is outside the file's 512 bytes",
    422: "the build spec is invalid",
    429: "tenant acme has 2 builds queued or running; its limit is 2",
    500: "internal error; the server log has the details",
    503: "not ready: database unreachable",
}


def problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for error statuses; app.openapi() rewrites them to application/problem+json."""
    return {code: {"model": Problem, "description": EXAMPLES.get(code, "")} for code in codes}


def sessions(request: Request):
    return request.app.state.sessions


def store(request: Request):
    return request.app.state.store
