"""RFC 9457 problem details: every 4xx and 5xx leaves the API as application/problem+json.

Routes raise `ProblemError` (or the cluster's own exceptions, mapped here); FastAPI's validation
errors become 422 with one `errors` entry per offending field, like SpecError.problems.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.schemas import Problem
from cluster.service import IdempotencyConflict, QuotaExceeded, StateConflict
from cluster.sources import SourceRefused
from cluster.spec import SpecError, validation_problems

PROBLEM_JSON = "application/problem+json"
PROBLEMS = "https://elastify.dev/problems/"
log = logging.getLogger("elastify.api")


class ProblemError(Exception):
    def __init__(self, status: int, detail: str, *, kind: str | None = None, title: str | None = None,
                 errors: list[tuple[str, str]] | None = None, headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status, self.detail, self.kind, self.title = status, detail, kind, title
        self.errors, self.headers = errors, headers


def not_found(detail: str) -> ProblemError:
    return ProblemError(404, detail, kind="not-found")


def problem_response(request_path: str, status: int, detail: str | None, *, kind: str | None = None,
                     title: str | None = None, errors: list[tuple[str, str]] | None = None,
                     headers: dict[str, str] | None = None) -> JSONResponse:
    body = Problem(
        type=PROBLEMS + kind if kind else "about:blank",
        title=title or HTTPStatus(status).phrase,
        status=status,
        detail=detail,
        instance=request_path,
        errors=[{"field": f, "message": m} for f, m in errors] if errors is not None else None,
    )
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status, media_type=PROBLEM_JSON,
                        headers=headers)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every error into a problem document."""

    @app.exception_handler(ProblemError)
    async def _problem(request: Request, err: ProblemError):
        return problem_response(request.url.path, err.status, err.detail, kind=err.kind, title=err.title,
                                errors=err.errors, headers=err.headers)

    @app.exception_handler(SpecError)
    async def _spec(request: Request, err: SpecError):
        return problem_response(request.url.path, 422, "the build spec is invalid", kind="invalid-spec",
                                errors=err.problems)

    @app.exception_handler(SourceRefused)  # before SpecError's handler in the lookup: the more specific class
    async def _source(request: Request, err: SourceRefused):
        return problem_response(request.url.path, 403, "the build reads files outside the allowed source roots",
                                kind="source-refused", errors=err.problems)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError):
        # A build spec's unknown stages and settings are described with what the registry allows.
        errors = [(field if field != "(document)" else "(request)", message)
                  for field, message in validation_problems(err.errors(), registry=request.app.state.registry)]
        return problem_response(request.url.path, 422, "the request is invalid", kind="invalid-request",
                                errors=errors)

    @app.exception_handler(QuotaExceeded)
    async def _quota(request: Request, err: QuotaExceeded):
        return problem_response(request.url.path, 429, str(err), kind="quota-exceeded", title="Quota exceeded")

    @app.exception_handler(IdempotencyConflict)
    async def _idempotency(request: Request, err: IdempotencyConflict):
        return problem_response(request.url.path, 409, str(err), kind="idempotency-conflict")

    @app.exception_handler(StateConflict)
    async def _state(request: Request, err: StateConflict):
        return problem_response(request.url.path, 409, str(err), kind="state-conflict")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        return problem_response(request.url.path, err.status_code, str(err.detail), headers=err.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(request.url.path, 500, "internal error; the server log has the details")


class BodyLimit:
    """Refuse request bodies over `limit` bytes with 413, whether or not they declare a Content-Length.

    Routes under `streamed` prefixes (uploads) receive their body unbuffered and enforce their own limit."""

    def __init__(self, app: ASGIApp, limit: int, streamed: tuple[str, ...] = ()):
        self.app, self.limit, self.streamed = app, limit, streamed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.streamed and scope["path"].rstrip("/") in self.streamed):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        # Read the body up front (it is small by definition) and hand it on as one message.
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await self._refuse(scope, receive, send)
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem_response(scope["path"], 413, f"the request body is larger than {self.limit} bytes",
                                    kind="body-too-large")
        await response(scope, receive, send)
