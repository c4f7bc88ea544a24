"""What the API and CLI do to builds: submit, cancel, describe. No Ray here; the scheduler acts later."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from cluster.dag import ExternalPath, plan
from cluster.models import Artifact, Attempt, Build, Event, Package, Stage, StageInput, Tenant, utcnow
from cluster.registry import Registry
from cluster.spec import BuildSpec
from cluster.states import TERMINAL, Status, advance


def ensure_tenant(session: Session, tenant: str) -> None:
    if session.get(Tenant, tenant) is None:
        session.add(Tenant(id=tenant))
        session.flush()


def submit_build(
    sessions: sessionmaker[Session],
    spec: BuildSpec,
    registry: Registry,
    tenant: str = "default",
    idempotency_key: str | None = None,
) -> str:
    """Validate the spec, then write the build and one queued stage row per DAG node; return the build id."""
    planned = plan(spec, registry)  # raises SpecError before anything is written
    with sessions.begin() as session:
        ensure_tenant(session, tenant)
        if idempotency_key is not None:
            existing = session.scalar(
                select(Build.id).where(Build.tenant_id == tenant, Build.idempotency_key == idempotency_key)
            )
            if existing is not None:
                return existing
        build = Build(
            id=uuid.uuid4().hex[:16],
            tenant_id=tenant,
            spec=spec.model_dump(mode="json"),
            spec_hash=spec.content_hash(),
            idempotency_key=idempotency_key,
        )
        session.add(build)
        rows = {}
        for node in planned:
            rows[node.key] = Stage(
                build_id=build.id, key=node.key, type=node.type, shard=node.shard, settings=node.settings,
                resources=node.resources, max_attempts=node.max_attempts,
            )
            session.add(rows[node.key])
        session.flush()
        for node in planned:
            for name, source in node.inputs.items():
                if isinstance(source, ExternalPath):
                    session.add(StageInput(stage_id=rows[node.key].id, name=name, external=source.path))
                else:
                    session.add(StageInput(
                        stage_id=rows[node.key].id, name=name, upstream_id=rows[source.stage_key].id,
                        upstream_output=source.output,
                    ))
        session.add(Event(build_id=build.id, kind="state", message=f"submitted with {len(planned)} stages"))
        return build.id


def cancel_build(sessions: sessionmaker[Session], build_id: str) -> str:
    """Request cancellation: queued stages stop now; the scheduler cancels running Ray tasks."""
    with sessions.begin() as session:
        build = session.get(Build, build_id, with_for_update=True)
        if build is None:
            raise KeyError(f"no build {build_id}")
        if Status(build.status) in TERMINAL:
            return build.status
        build.cancel_requested = True
        session.execute(
            update(Stage)
            .where(Stage.build_id == build_id, Stage.status == Status.QUEUED.value)
            .values(status=Status.CANCELLED.value, finished_at=utcnow(), error="build cancelled")
        )
        running = session.scalar(
            select(func.count()).where(Stage.build_id == build_id, Stage.status == Status.RUNNING.value)
        )
        if not running:
            advance(session, Build, build_id, build.status, Status.CANCELLED, finished_at=utcnow(), error="cancelled")
        session.add(Event(build_id=build_id, kind="state", message="cancellation requested"))
    return Status.CANCELLED.value


def build_summary(sessions: sessionmaker[Session], build_id: str) -> dict[str, Any]:
    """A build, its stages (with attempts and compute), cache hits and its package, as plain data."""
    with sessions() as session:
        build = session.get(Build, build_id)
        if build is None:
            raise KeyError(f"no build {build_id}")
        stages = []
        for stage in session.scalars(select(Stage).where(Stage.build_id == build_id).order_by(Stage.id)):
            attempts = session.scalars(select(Attempt).where(Attempt.stage_id == stage.id).order_by(Attempt.number)).all()
            duration = (stage.finished_at - stage.started_at).total_seconds() if stage.finished_at and stage.started_at else None
            stages.append({
                "key": stage.key, "type": stage.type, "status": stage.status, "cache_hit": stage.cache_hit,
                "error": stage.error, "seconds": duration,
                "attempts": [
                    {"number": a.number, "status": a.status, "exit": a.exit, "error": a.error,
                     "wall_seconds": a.wall_seconds, "cpu_seconds": a.cpu_seconds, "gpu_seconds": a.gpu_seconds}
                    for a in attempts
                ],
                "artifacts": {
                    a.name: {"uri": a.uri, "digest": a.digest, "size": a.size}
                    for a in session.scalars(select(Artifact).where(Artifact.stage_id == stage.id))
                },
            })
        target = build.spec.get("publish") or {}
        package = None
        if build.status == Status.SUCCEEDED.value:  # the package this build published (or found identical)
            package = session.scalar(
                select(Package).where(Package.name == target.get("name"), Package.version == target.get("version"))
            )
        return {
            "id": build.id, "tenant": build.tenant_id, "status": build.status, "error": build.error,
            "stages": stages, "cache_hits": sum(s["cache_hit"] for s in stages),
            "package": None if package is None else {"name": package.name, "version": package.version, "uri": package.uri},
        }
