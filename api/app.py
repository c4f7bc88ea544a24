"""The REST API: `create_app(settings)` builds the FastAPI app over one job store, artifact store and registry.

    /v1/builds…     submit (Idempotency-Key, quotas), list, show, cancel, retry, logs (SSE | text)
    /v1/packages…   list, versions, manifest, files (Range | presigned S3 URL), aliases
    /v1/usage       GPU- and CPU-hours from the ledger
    /v1/sources     upload a model directory or data file, named in builds as upload:<digest>
    /v1/keys/signing, /healthz, /readyz, /metrics   (no token needed)
    /docs           Swagger UI, its script and style served from the pinned swagger-ui-bundle-v2 (no CDN)

Every other route needs `Authorization: Bearer <tenant token>` and sees only its tenant's objects
(admin tokens see all). Every error is application/problem+json (api/problems.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http import HTTPStatus

import swagger_ui_bundle
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.openapi.utils import get_openapi
from fastapi.staticfiles import StaticFiles

from api import dashboard, problems
from api.metrics import job_store_registry
from api.routes import EXAMPLES, builds, health, packages, sources, usage
from cluster.db import make_engine, session_factory
from cluster.registry import Registry
from cluster.settings import Settings
from cluster.sources import SourcePolicy
from cluster.spec import spec_model
from pipeline import chain

MAX_BODY_BYTES = 1 << 20


def create_app(settings: Settings, registry: Registry | None = None, *,
               ready_checks: dict[str, Callable[[], str]] | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app over `settings` (database, store, signing key) and the stages of `registry` (default: the
    ElastiLM and CLONE stages of pipeline.chain); the database must be migrated already."""
    # FastAPI's own /docs and /redoc load their script and style from a CDN: an air-gapped deployment
    # (or a strict proxy) gets a blank page. /docs is served from local assets instead (install_docs).
    app = FastAPI(title="Elastify", version="1", summary="Build elastic LLM packages; follow builds; download packages.",
                  docs_url=None, redoc_url=None)
    engine = make_engine(settings.database_url)
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = session_factory(engine)
    app.state.store = settings.store.open()
    app.state.registry = registry or default_registry()
    app.state.sources = SourcePolicy(settings.allowed_source_roots)
    app.state.metrics = job_store_registry(app.state.sessions)
    app.state.ready_checks = ready_checks if ready_checks is not None else {
        "database": health.database_check(app.state.sessions),
        "store": health.store_check(app.state.store),
        "ray": health.ray_check(settings.ray_address),
    }
    sources.sweep_upload_scratch()  # what uploads killed mid-body (with an earlier server) left in the temp dir
    problems.install(app)
    # POST /v1/sources streams its body to disk and applies ELASTIFY_MAX_UPLOAD_BYTES itself.
    app.add_middleware(problems.BodyLimit, limit=max_body_bytes, streamed=("/v1/sources",))
    # Submit takes the registry's BuildSpec, so the OpenAPI document shows every stage's settings.
    app.include_router(builds.submit_router(spec_model(app.state.registry)))
    for module in (builds, packages, sources, usage, health, dashboard):
        app.include_router(module.router)
    app.openapi = lambda: _openapi(app, max_body_bytes)
    install_docs(app)
    return app


DOCS_ASSETS = "/docs/assets"


def install_docs(app: FastAPI) -> None:
    """/docs: FastAPI's Swagger UI page, its script, style and icon served from the installed Swagger UI
    files (FastAPI's "self-hosting JavaScript and CSS for docs" recipe)."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def swagger_ui():
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} API",
                                   oauth2_redirect_url=app.swagger_ui_oauth2_redirect_url,
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")

    @app.get(app.swagger_ui_oauth2_redirect_url, include_in_schema=False)
    def swagger_ui_redirect():
        return get_swagger_ui_oauth2_redirect_html()


def default_registry() -> Registry:
    """The stages this service runs: pipeline.chain's, handed to the control plane (which names none)."""
    return Registry(chain.STAGES)


def app_from_env() -> FastAPI:
    """The app over `Settings.from_env()`: the factory uvicorn workers call (`elastify serve --workers N`)."""
    return create_app(Settings.from_env())


def _openapi(app: FastAPI, max_body_bytes: int) -> dict:
    """FastAPI's document, with every error response as application/problem+json with an example,
    and the errors every route can give (401 when it needs a token, 413 when it takes a body, 500)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    problem = {"$ref": "#/components/schemas/Problem"}
    examples = {**EXAMPLES, 413: f"the request body is larger than {max_body_bytes} bytes"}
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if operation.get("security"):
                responses.setdefault("401", {})
            if "requestBody" in operation:
                responses.setdefault("413", {})
            responses.setdefault("500", {})
            for code, response in responses.items():
                status = int(code)
                if status < 400 or (path == "/readyz" and status == 503):
                    continue
                response["description"] = HTTPStatus(status).phrase
                response["content"] = {"application/problem+json": {"schema": problem, "example": {
                    "type": "about:blank", "title": HTTPStatus(status).phrase, "status": status,
                    "detail": examples.get(status, HTTPStatus(status).description), "instance": path,
                }}}
                if status == 401:
                    response["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    app.openapi_schema = doc
    return doc


class ServerThread:
    """uvicorn serving an app from a background thread (used by `elastify up`, tests and benchmarks)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"):
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                     timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="elastify-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
