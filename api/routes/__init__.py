"""The /v1 routes, one module per resource; shared dependencies and error documentation here."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from api.auth import Caller, current_caller
from api.schemas import Problem

CallerDep = Annotated[Caller, Depends(current_caller)]

EXAMPLES = {
    400: "the cursor is not one this service issued",
    401: "send `Authorization: Bearer <token>`",
    403: "only admin tokens may do this",
    404: "no build 5f0c2a9e1b7d4c3a",
    409: "idempotency key 'nightly-1' was used for build 5f0c2a9e1b7d4c3a with a different spec",
    413: "the request body is larger than 1048576 bytes",
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
