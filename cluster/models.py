"""The job store's tables (SQLAlchemy 2). The schema is created by Alembic (infra/migrations).

Times are naive UTC, supplied by Python (not the server clock) so SQLite and PostgreSQL
compare them the same way.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from cluster.states import Status


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime}


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Quotas, enforced when a build is submitted or retried; None means no limit.
    gpu_hours_per_month: Mapped[float | None] = mapped_column(Float)
    max_concurrent_builds: Mapped[int | None] = mapped_column(Integer)


class ApiToken(Base):
    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)  # never the token itself
    name: Mapped[str] = mapped_column(String(128), default="")
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)  # sees every tenant
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class Build(Base):
    __tablename__ = "builds"
    STATE_KIND = "build"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    spec: Mapped[dict[str, Any]]
    spec_hash: Mapped[str] = mapped_column(String(64), index=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), default=Status.QUEUED.value, index=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # GPU-seconds this build holds against its tenant's monthly budget while queued or running (its GPU
    # stages × the per-GPU-stage estimate, set at submit and at retry; cluster.service.GpuNeed). Once it
    # ends, only its attempts' measured charge counts.
    reserved_gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    stages: Mapped[list[Stage]] = relationship(back_populates="build", order_by="Stage.id")
    __table_args__ = (UniqueConstraint("tenant_id", "idempotency_key"),)


class Stage(Base):
    """One DAG node of one build (a fan-out shard is its own node)."""

    __tablename__ = "stages"
    STATE_KIND = "stage"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    build_id: Mapped[str] = mapped_column(ForeignKey("builds.id"), index=True)
    key: Mapped[str] = mapped_column(String(128))  # "profile", "recover[0.5]"
    type: Mapped[str] = mapped_column(String(64))  # the registration name
    shard: Mapped[str | None] = mapped_column(String(64))
    settings: Mapped[dict[str, Any]]
    resources: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default=Status.QUEUED.value)
    attempts: Mapped[int] = mapped_column(default=0)
    max_attempts: Mapped[int] = mapped_column(default=3)
    not_before: Mapped[datetime | None]  # retry backoff: not leased before this time
    cache_key: Mapped[str | None] = mapped_column(String(64), index=True)
    cache_hit: Mapped[bool] = mapped_column(Boolean, default=False)
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[datetime | None]
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    build: Mapped[Build] = relationship(back_populates="stages")
    inputs: Mapped[list[StageInput]] = relationship(foreign_keys="StageInput.stage_id", order_by="StageInput.name")
    __table_args__ = (UniqueConstraint("build_id", "key"), Index("ix_stages_status_not_before", "status", "not_before"))


class StageInput(Base):
    """A DAG edge: input `name` of a stage is an upstream stage's output, or an external path."""

    __tablename__ = "stage_inputs"
    stage_id: Mapped[int] = mapped_column(ForeignKey("stages.id"), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    upstream_id: Mapped[int | None] = mapped_column(ForeignKey("stages.id"), index=True)
    upstream_output: Mapped[str | None] = mapped_column(String(64))
    external: Mapped[str | None] = mapped_column(Text)


class Attempt(Base):
    __tablename__ = "attempts"
    STATE_KIND = "attempt"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    stage_id: Mapped[int] = mapped_column(ForeignKey("stages.id"), index=True)
    number: Mapped[int]
    worker: Mapped[str] = mapped_column(String(128))  # the scheduler that dispatched it
    status: Mapped[str] = mapped_column(String(16), default=Status.RUNNING.value)
    exit: Mapped[str | None] = mapped_column(String(32))  # ok, error, crashed, lease_expired, cancelled
    error: Mapped[str | None] = mapped_column(Text)
    num_cpus: Mapped[float] = mapped_column(Float, default=0.0)
    num_gpus: Mapped[float] = mapped_column(Float, default=0.0)
    wall_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    cpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)  # wall × GPUs granted
    # What the attempt moved (workers.runner measures it; None for attempts that never reported): bytes
    # read from the store, bytes it added to the store (content already there is not stored again), bytes
    # served by the node's cache, and the worker process's peak resident memory while it ran.
    bytes_fetched: Mapped[int | None] = mapped_column(BigInteger)
    bytes_stored: Mapped[int | None] = mapped_column(BigInteger)
    bytes_cached: Mapped[int | None] = mapped_column(BigInteger)
    peak_rss_bytes: Mapped[int | None] = mapped_column(BigInteger)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Last renewal of the stage's lease by the scheduler that ran this attempt: a lease-expired
    # attempt is charged up to here, not for the whole outage until another scheduler noticed.
    heartbeat_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    # When the store sweeper deleted what this (failed or cancelled) attempt had uploaded.
    outputs_swept_at: Mapped[datetime | None]
    __table_args__ = (UniqueConstraint("stage_id", "number"),)


class Artifact(Base):
    __tablename__ = "artifacts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    stage_id: Mapped[int] = mapped_column(ForeignKey("stages.id"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    uri: Mapped[str] = mapped_column(Text)  # key prefix in the artifact store
    digest: Mapped[str] = mapped_column(String(64), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (UniqueConstraint("stage_id", "name"),)


class Upload(Base):
    """A source a tenant uploaded (POST /v1/sources): an artifact at sources/<tenant>/<digest> in the store,
    named in specs as `upload:<digest>`. Content-addressed per tenant, so one tenant never reads another's."""

    __tablename__ = "uploads"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 of the artifact's index
    kind: Mapped[str] = mapped_column(String(8))  # "file" or "dir" (an archive, unpacked)
    name: Mapped[str] = mapped_column(String(255), default="")  # what the uploader called it
    size: Mapped[int] = mapped_column(BigInteger)  # bytes of its files: what the quota counts
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Package(Base):
    __tablename__ = "packages"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    version: Mapped[str] = mapped_column(String(64))
    build_id: Mapped[str] = mapped_column(ForeignKey("builds.id"))
    uri: Mapped[str] = mapped_column(Text)  # packages/<name>/<version>
    manifest_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (UniqueConstraint("name", "version"),)


class Alias(Base):
    __tablename__ = "aliases"
    package_name: Mapped[str] = mapped_column(String(128), primary_key=True)
    alias: Mapped[str] = mapped_column(String(64), primary_key=True)
    package_id: Mapped[int] = mapped_column(ForeignKey("packages.id"))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class Event(Base):
    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    build_id: Mapped[str] = mapped_column(ForeignKey("builds.id"), index=True)
    stage_id: Mapped[int | None] = mapped_column(ForeignKey("stages.id"))
    attempt: Mapped[int | None]
    kind: Mapped[str] = mapped_column(String(16))  # state, log, progress
    level: Mapped[str] = mapped_column(String(16), default="info")
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
