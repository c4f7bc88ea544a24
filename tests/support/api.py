"""Helpers for the REST API tests: an app over a given database and store, tokens, specs, and rows
that stand in for what the scheduler and the publish stage write (for unit tests without Ray)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from fastapi import FastAPI
from sqlalchemy import select

from api.app import create_app
from api.auth import create_token
from cluster.db import migrate
from cluster.models import Attempt, Build, Package, Stage, utcnow
from cluster.packages import package_prefix
from cluster.settings import Settings
from device_sdk.format import MANIFEST, canonical_json, sha256_file
from tests.support.control_plane import chain_registry


@dataclass
class Api:
    app: FastAPI
    settings: Settings

    @property
    def sessions(self):
        return self.app.state.sessions

    @property
    def store(self):
        return self.app.state.store

    def token(self, tenant: str, admin: bool = False) -> dict[str, str]:
        return {"Authorization": f"Bearer {create_token(self.sessions, tenant, admin=admin)}"}


def make_api(tmp_path: Path, database_url: str | None = None, store=None, registry=None, **settings) -> Api:
    """An app over a migrated database (default: SQLite in tmp_path) and a store (default: local)."""
    database_url = database_url or f"sqlite:///{tmp_path / 'api.db'}"
    migrate(database_url)
    store_fields = {} if store is None else dict(store_url=store.url, store_endpoint=store.endpoint_url,
                                                 store_access_key=store.access_key, store_secret_key=store.secret_key)
    config = Settings(home=tmp_path / "home", database_url=database_url, **store_fields, **settings)
    config.ensure_signing_key()
    app = create_app(config, registry or chain_registry(), ready_checks={"database": lambda: "fake: always ready"})
    app.state.store.ensure_ready()
    return Api(app, config)


def spec(name: str = "test", version: str = "1", levels=(1.0,), **extra) -> dict:
    return {"source": {"model": "unused"}, "levels": list(levels), "publish": {"name": name, "version": version},
            **extra}


def finish_build(api: Api, build_id: str, status: str = "succeeded", gpu_seconds: float = 0.0,
                 cpu_seconds: float = 1.0, started: datetime | None = None) -> None:
    """Finish a chain_registry build as the scheduler would, one attempt per stage that ran:
    succeeded (all stages), or failed ("first" succeeded, "second" failed, "third" cancelled)."""
    started = started or utcnow() - timedelta(seconds=5)
    ended = started + timedelta(seconds=5)
    outcome = {"first": "succeeded", "second": "failed", "third": "cancelled"}
    with api.sessions.begin() as session:
        build = session.get(Build, build_id)
        build.status, build.started_at, build.finished_at = status, started, ended
        for stage in session.scalars(select(Stage).where(Stage.build_id == build_id)):
            stage.status = "succeeded" if status == "succeeded" else outcome[stage.type]
            stage.finished_at = ended
            if stage.status == "cancelled":
                continue
            stage.started_at, stage.attempts = started, 1
            session.add(Attempt(stage_id=stage.id, number=1, worker="test", status=stage.status,
                                exit="ok" if stage.status == "succeeded" else "error", num_gpus=1.0,
                                wall_seconds=5.0, cpu_seconds=cpu_seconds, gpu_seconds=gpu_seconds,
                                started_at=started, ended_at=ended))


def publish_files(api: Api, build_id: str, name: str, version: str, files: dict[str, bytes],
                  tmp_path: Path) -> str:
    """Put a package's files and a manifest listing them into the store and register it; the manifest digest."""
    prefix = package_prefix(name, version)
    listing = []
    for path, content in files.items():
        local = tmp_path / "pkg-src" / name / version / path
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(content)
        api.store.put_file(f"{prefix}/{path}", local)
        listing.append({"path": path, "size": len(content), "sha256": sha256_file(local)})
    manifest = canonical_json({"name": name, "version": version, "files": listing})
    api.store.put_bytes(f"{prefix}/{MANIFEST}", manifest)
    digest = hashlib.sha256(manifest).hexdigest()
    with api.sessions.begin() as session:
        session.add(Package(name=name, version=version, build_id=build_id, uri=prefix, manifest_sha256=digest))
    return digest


def sse_events(lines) -> list[tuple[str, dict]]:
    """(event, data) pairs from the lines of a text/event-stream."""
    events, event, data = [], "message", []
    for line in lines:
        if line == "":
            if data:
                events.append((event, json.loads("\n".join(data))))
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    return events
