"""What the API and CLI do to builds and packages: submit (with idempotency and quotas), cancel, retry,
list, describe, move aliases. No Ray here; the scheduler acts later.

Every function that takes `tenant` scopes to it: another tenant's build or package is reported as
missing (KeyError), so its existence does not leak. `tenant=None` means every tenant (admins).
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from cluster.accelerator import granted_resources
from cluster.capacity import Capacity
from cluster.dag import ExternalPath, plan
from cluster.db import lock_for_write
from cluster.ledger import charged_gpu_seconds
from cluster.models import (
    Alias,
    Artifact,
    Attempt,
    Build,
    Event,
    Package,
    Stage,
    StageInput,
    Tenant,
    Upload,
    utcnow,
)
from cluster.packages import alias_key, name_owner
from cluster.registry import Registry
from cluster.settings import GPU_STAGE_SECONDS
from cluster.sources import SourcePolicy, upload_key
from cluster.spec import BuildSpec, SpecError
from cluster.states import REOPENABLE, TERMINAL, Status, advance, reopen

ACTIVE = (Status.QUEUED.value, Status.RUNNING.value)


class QuotaExceeded(RuntimeError):
    """The tenant's quota refuses a new build (nothing was queued)."""


class IdempotencyConflict(RuntimeError):
    """The idempotency key was already used with a different spec."""


class SubmissionFailed(RuntimeError):
    """Writing a build's rows broke a database constraint that no valid spec can (a bug, not a retry)."""


class StateConflict(RuntimeError):
    """The build is not in a state that allows the request (e.g. retrying a running build)."""


@dataclass(frozen=True)
class Submission:
    build_id: str
    created: bool  # False: an earlier submission with the same idempotency key and spec


def ensure_tenant(session: Session, tenant: str) -> None:
    """Create the tenant row unless it exists. INSERT … ON CONFLICT DO NOTHING, so two first requests of
    one tenant racing each other both succeed (the loser waits for the winner's row) instead of failing."""
    if session.get(Tenant, tenant) is not None:
        return
    insert = postgresql_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(insert(Tenant).values(id=tenant, created_at=utcnow()).on_conflict_do_nothing(index_elements=["id"]))


def _locked_tenant(session: Session, tenant: str) -> Tenant:
    """The tenant row, locked for this transaction: quota checks and inserts of one tenant serialise (on
    SQLite the whole database's write lock, taken first: it has no row locks)."""
    lock_for_write(session)
    ensure_tenant(session, tenant)
    return session.get(Tenant, tenant, with_for_update=True, populate_existing=True)


def month_start(now: datetime | None = None) -> datetime:
    now = now or utcnow()
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def gpu_seconds_this_month(session: Session, tenant: str) -> float:
    """GPU-seconds of the tenant's attempts that started this UTC month; running ones count so far."""
    since = month_start()
    finished = session.scalar(
        select(func.coalesce(func.sum(Attempt.gpu_seconds), 0.0)).select_from(Attempt)
        .join(Stage, Stage.id == Attempt.stage_id).join(Build, Build.id == Stage.build_id)
        .where(Build.tenant_id == tenant, Attempt.started_at >= since, Attempt.ended_at.is_not(None))
    )
    now = utcnow()
    running = session.execute(
        select(Attempt.started_at, Attempt.num_gpus).select_from(Attempt)
        .join(Stage, Stage.id == Attempt.stage_id).join(Build, Build.id == Stage.build_id)
        .where(Build.tenant_id == tenant, Attempt.started_at >= since, Attempt.ended_at.is_(None), Attempt.num_gpus > 0)
    ).all()
    return float(finished) + sum((now - started).total_seconds() * gpus for started, gpus in running)


@dataclass(frozen=True)
class GpuNeed:
    """What a build reserves against its tenant's monthly GPU budget while it is queued or running: for each
    stage that will be granted GPUs, its GPUs × `stage_seconds`, the per-GPU-stage estimate (a spec says how
    many GPUs a stage asks for, never how long it runs: ELASTIFY_GPU_STAGE_SECONDS, default 600 s)."""

    gpus: float  # summed over the build's GPU stages: a stage on 2 GPUs counts 2
    stages: int  # how many of its stages get GPUs
    stage_seconds: float

    @property
    def seconds(self) -> float:
        return self.gpus * self.stage_seconds

    def describe(self) -> str:
        if not self.stages:
            return "this build gets no GPU and reserves nothing"
        stages, gpus = f"{self.stages} GPU stage{'s' * (self.stages != 1)}", f"{self.gpus:g} GPU{'s' * (self.gpus != 1)}"
        return (f"this build reserves {self.seconds:g} GPU-seconds ({stages}, {gpus} × {self.stage_seconds:g} s, "
                "the estimate per GPU stage set by ELASTIFY_GPU_STAGE_SECONDS)")


def assumed_cluster_gpus(capacity: Capacity | None) -> float:
    """The GPUs a stage under `accelerator: auto` will find, as far as the submitting process knows: the live
    nodes' or ELASTIFY_MAX_TASK_RESOURCES' num_gpus; unknown counts as one, so a reservation errs toward
    refusing a build, never toward overshooting the quota."""
    if capacity is not None and ("num_gpus" in capacity.largest or capacity.complete):
        return float(capacity.largest.get("num_gpus", 0.0))
    return 1.0


def gpu_need(resources: Iterable[Mapping[str, Any]], accelerator: str, cluster_gpus: float,
             stage_seconds: float = GPU_STAGE_SECONDS) -> GpuNeed:
    """The GpuNeed of stages with these resource dicts (planned nodes' or stage rows', cluster.accelerator)."""
    granted = [float(granted_resources(r, accelerator, cluster_gpus).get("num_gpus") or 0.0) for r in resources]
    return GpuNeed(sum(granted), sum(1 for g in granted if g > 0), stage_seconds)


def reserved_gpu_seconds(session: Session, tenant: str, now: datetime | None = None) -> float:
    """GPU-seconds the tenant's queued and running builds still hold: each one's reservation less what its
    attempts have been charged so far (never below zero: past its estimate, a build's charge counts as used)."""
    held = dict(session.execute(
        select(Build.id, Build.reserved_gpu_seconds)
        .where(Build.tenant_id == tenant, Build.status.in_(ACTIVE), Build.reserved_gpu_seconds > 0)
    ).all())
    charged = charged_gpu_seconds(session, held, now)
    return sum(max(0.0, reserved - charged.get(build_id, 0.0)) for build_id, reserved in held.items())


def enforce_quota(session: Session, tenant: Tenant, need: GpuNeed | None = None) -> None:
    """Raise QuotaExceeded if one more build would exceed the tenant's concurrency or monthly GPU budget.

    The GPU budget must hold what the tenant's attempts used this month, what its queued and running builds
    still reserve and `need`, this build's reservation; a budget already spent refuses even a build without
    GPUs (as before reservations), one merely reserved does not.
    Call it under the tenant row's lock (`_locked_tenant`), so concurrent submissions see each other's."""
    if tenant.max_concurrent_builds is not None:
        active = session.scalar(
            select(func.count()).select_from(Build).where(Build.tenant_id == tenant.id, Build.status.in_(ACTIVE))
        )
        if active >= tenant.max_concurrent_builds:
            raise QuotaExceeded(
                f"tenant {tenant.id} has {active} builds queued or running; its limit is {tenant.max_concurrent_builds}"
            )
    if tenant.gpu_hours_per_month is not None:
        need = need or GpuNeed(0.0, 0, GPU_STAGE_SECONDS)
        budget = tenant.gpu_hours_per_month * 3600
        now = utcnow()
        used, held = gpu_seconds_this_month(session, tenant.id), reserved_gpu_seconds(session, tenant.id, now)
        if used >= budget or (need.seconds > 0 and used + held + need.seconds > budget):
            raise QuotaExceeded(
                f"tenant {tenant.id} has used {used / 3600:.3f} of its {tenant.gpu_hours_per_month:g} GPU-hours "
                f"for {month_start(now):%Y-%m} ({used:.1f} GPU-seconds; its queued and running builds reserve "
                f"{held:.1f} more, of {budget:g} GPU-seconds in all); {need.describe()}"
            )


def set_quota(sessions: sessionmaker[Session], tenant: str, *, gpu_hours_per_month: float | None = None,
              max_concurrent_builds: int | None = None, clear: bool = False) -> Tenant:
    """Set a tenant's quotas (creating the tenant); `clear` removes both limits first."""
    with sessions.begin() as session:
        row = _locked_tenant(session, tenant)
        if clear:
            row.gpu_hours_per_month = row.max_concurrent_builds = None
        if gpu_hours_per_month is not None:
            row.gpu_hours_per_month = gpu_hours_per_month
        if max_concurrent_builds is not None:
            row.max_concurrent_builds = max_concurrent_builds
        return row


def _replay(session: Session, tenant: str, idempotency_key: str, spec_hash: str) -> Submission | None:
    existing = session.execute(
        select(Build.id, Build.spec_hash).where(Build.tenant_id == tenant, Build.idempotency_key == idempotency_key)
    ).first()
    if existing is None:
        return None
    if existing.spec_hash != spec_hash:
        raise IdempotencyConflict(
            f"idempotency key {idempotency_key!r} was used for build {existing.id} with a different spec"
        )
    return Submission(existing.id, False)


def submit(
    sessions: sessionmaker[Session],
    spec: BuildSpec,
    registry: Registry,
    tenant: str = "default",
    idempotency_key: str | None = None,
    enforce_quotas: bool = True,
    capacity: Capacity | None = None,
    sources: SourcePolicy | None = None,
    gpu_stage_seconds: float = GPU_STAGE_SECONDS,
) -> Submission:
    """Validate the spec, check idempotency and quotas, then write the build and its queued stages.

    The same idempotency key with the same spec returns the first build (created=False); with a
    different spec it raises IdempotencyConflict. A quota that refuses raises QuotaExceeded and
    writes nothing. With a `capacity`, a stage asking more than one task can ever get is a SpecError.
    With `sources` (the API and the operator CLI always pass the deployment's), every file the build
    reads must be an upload of the tenant or lie under the source roots (cluster.sources), else
    SourceRefused or SpecError; `None` is for trusted in-process callers (the demo, tests).
    The build reserves its GpuNeed (`gpu_stage_seconds` per GPU of each GPU stage) until it ends.
    """
    planned = plan(spec, registry)  # raises SpecError before anything is written
    if capacity is not None:
        _check_capacity(planned, capacity, spec.accelerator)
    need = gpu_need([node.resources for node in planned], spec.accelerator, assumed_cluster_gpus(capacity),
                    gpu_stage_seconds)
    spec_hash = spec.content_hash()
    try:
        with sessions.begin() as session:
            row = _locked_tenant(session, tenant)
            if idempotency_key is not None and (replay := _replay(session, tenant, idempotency_key, spec_hash)):
                return replay
            if name_owner(session, spec.publish.name) not in (None, tenant):
                raise StateConflict(f"package name {spec.publish.name} belongs to another tenant; choose another")
            if sources is not None:
                sources.check(session, tenant, spec, planned)
            if enforce_quotas:
                enforce_quota(session, row, need)
            return Submission(_insert_build(session, spec, spec_hash, planned, tenant, idempotency_key, need), True)
    except IntegrityError as err:
        # The one conflict a submission can meet by right: a concurrent submission with the same
        # idempotency key committed first (the tenant row lock serialises these, so this is a
        # backstop). Its build is the answer. Anything else is a bug, reported once, never retried.
        if idempotency_key is not None:
            with sessions() as session:
                if replay := _replay(session, tenant, idempotency_key, spec_hash):
                    return replay
        raise SubmissionFailed(f"build could not be stored: {err.orig}") from err


def uploaded_bytes(session: Session, tenant: str) -> int:
    return int(session.scalar(select(func.coalesce(func.sum(Upload.size), 0)).where(Upload.tenant_id == tenant)))


def check_upload_quota(session: Session, tenant: str, size: int, quota_bytes: int) -> None:
    """QuotaExceeded unless the tenant's uploads plus `size` more bytes fit in `quota_bytes`."""
    used = uploaded_bytes(session, tenant)
    if used + size > quota_bytes:
        raise QuotaExceeded(f"tenant {tenant} has {used} bytes of uploads; {size} more would exceed its "
                            f"upload quota of {quota_bytes} bytes (delete some with DELETE /v1/sources/<digest>)")


def record_upload(sessions: sessionmaker[Session], tenant: str, digest: str, kind: str, name: str, size: int,
                  quota_bytes: int) -> tuple[Upload, bool]:
    """Register a stored upload of `tenant` (the row, and whether it is new: the same content uploaded again
    is the same upload). The quota is checked under the tenant row's lock, so concurrent uploads cannot
    overshoot it together."""
    with sessions.begin() as session:
        _locked_tenant(session, tenant)
        existing = session.get(Upload, (tenant, digest))
        if existing is not None:
            return existing, False
        check_upload_quota(session, tenant, size, quota_bytes)
        row = Upload(tenant_id=tenant, digest=digest, kind=kind, name=name, size=size)
        session.add(row)
        session.flush()
        return row, True


def list_uploads(session: Session, tenant: str) -> list[Upload]:
    return session.scalars(select(Upload).where(Upload.tenant_id == tenant).order_by(Upload.created_at)).all()


def delete_upload(sessions: sessionmaker[Session], store, tenant: str, digest: str) -> None:
    """Forget an upload and delete its content (KeyError if the tenant has no such upload). A queued build
    that names it then fails at dispatch, naming the missing upload."""
    with sessions.begin() as session:
        lock_for_write(session)  # SQLite ignores FOR UPDATE: two deletes would both read the row
        row = session.get(Upload, (tenant, digest), with_for_update=True)
        if row is None:
            raise KeyError(f"no upload {digest}")
        session.delete(row)
    store.delete_prefix(upload_key(tenant, digest))


def _check_capacity(planned, capacity: Capacity, accelerator: str) -> None:
    """SpecError naming `stages.<stage>.resources.<resource>` (or `accelerator`, for the GPU that
    `accelerator: cuda` asks for) for each request no node can grant."""
    gpus = float(capacity.largest.get("num_gpus", 0.0))
    problems = {}
    for node in planned:
        for resource, message in capacity.problems(granted_resources(node.resources, accelerator, gpus)):
            by_accelerator = resource == "num_gpus" and node.resources.get("accelerated") and not node.resources.get("gpus_set")
            where = "accelerator" if by_accelerator else f"stages.{node.type}.resources.{resource}"
            problems.setdefault(where, f"cuda: stage {node.type} {message}" if by_accelerator else message)
    if problems:
        raise SpecError(list(problems.items()))


def _insert_build(session: Session, spec: BuildSpec, spec_hash: str, planned, tenant: str,
                  idempotency_key: str | None, need: GpuNeed) -> str:
    build = Build(id=uuid.uuid4().hex[:16], tenant_id=tenant, spec=spec.model_dump(mode="json"), spec_hash=spec_hash,
                  idempotency_key=idempotency_key, reserved_gpu_seconds=need.seconds)
    session.add(build)
    rows = {}
    for node in planned:
        rows[node.key] = Stage(
            build_id=build.id, key=node.key, type=node.type, shard=node.shard,
            settings=node.settings.model_dump(mode="json"),
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


def submit_build(
    sessions: sessionmaker[Session],
    spec: BuildSpec,
    registry: Registry,
    tenant: str = "default",
    idempotency_key: str | None = None,
    sources: SourcePolicy | None = None,
    gpu_stage_seconds: float = GPU_STAGE_SECONDS,
) -> str:
    """Queue a build (no quotas: the operator's own submissions, though they reserve their GPU need as well,
    against the tenant's next ones); return the build id."""
    return submit(sessions, spec, registry, tenant, idempotency_key, enforce_quotas=False, sources=sources,
                  gpu_stage_seconds=gpu_stage_seconds).build_id


def _owned_build(session: Session, build_id: str, tenant: str | None, lock: bool = False) -> Build:
    build = session.get(Build, build_id, with_for_update=lock or None)
    if build is None or (tenant is not None and build.tenant_id != tenant):
        raise KeyError(f"no build {build_id}")
    return build


def cancel_build(sessions: sessionmaker[Session], build_id: str, tenant: str | None = None) -> str:
    """Request cancellation: queued stages stop now; the scheduler cancels running Ray tasks."""
    with sessions.begin() as session:
        lock_for_write(session)  # SQLite ignores FOR UPDATE: concurrent cancels would each act on one read
        build = _owned_build(session, build_id, tenant, lock=True)
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
                     "wall_seconds": a.wall_seconds, "cpu_seconds": a.cpu_seconds, "gpu_seconds": a.gpu_seconds,
                     "bytes_fetched": a.bytes_fetched, "bytes_stored": a.bytes_stored, "bytes_cached": a.bytes_cached,
                     "peak_rss_bytes": a.peak_rss_bytes}
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


def retry_build(sessions: sessionmaker[Session], build_id: str, tenant: str | None = None,
                enforce_quotas: bool = True, capacity: Capacity | None = None,
                gpu_stage_seconds: float = GPU_STAGE_SECONDS) -> int:
    """Re-queue a failed or cancelled build's failed and cancelled stages; finished stages are kept
    (their artifacts feed the re-run). Returns how many stages were re-queued. The build reserves the
    GpuNeed of the re-queued stages on top of what it has been charged already."""
    with sessions.begin() as session:
        lock_for_write(session)  # before reading the build: the quota check below must see what is committed
        build = _owned_build(session, build_id, tenant, lock=True)
        if Status(build.status) not in REOPENABLE:
            raise StateConflict(f"build {build_id} is {build.status}; only failed or cancelled builds can be retried")
        stages = session.scalars(
            select(Stage).where(Stage.build_id == build_id, Stage.status.in_([s.value for s in REOPENABLE]))
        ).all()
        need = gpu_need([stage.resources for stage in stages], build.spec.get("accelerator", "auto"),
                        assumed_cluster_gpus(capacity), gpu_stage_seconds)
        if enforce_quotas:
            enforce_quota(session, _locked_tenant(session, build.tenant_id), need)
        charged = charged_gpu_seconds(session, [build_id]).get(build_id, 0.0)
        for stage in stages:  # a fresh retry budget, as if newly submitted
            reopen(session, Stage, stage.id, stage.status, attempts=0, error=None, not_before=None, started_at=None,
                   finished_at=None, cache_hit=False, lease_owner=None, lease_expires_at=None)
        reopen(session, Build, build_id, build.status, cancel_requested=False, error=None, finished_at=None,
               reserved_gpu_seconds=charged + need.seconds)
        kept = session.scalar(select(func.count()).where(Stage.build_id == build_id,
                                                         Stage.status == Status.SUCCEEDED.value))
        session.add(Event(build_id=build_id, kind="state",
                          message=f"retry requested: {len(stages)} stages re-queued, {kept} finished stages kept"))
        return len(stages)


# --------------------------------------------------------------------------- reading builds


def publish_name(column=Build.spec):
    return column[("publish", "name")].as_string()


def encode_cursor(created_at: datetime, build_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([created_at.isoformat(), build_id]).encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        created, build_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        return datetime.fromisoformat(created), str(build_id)
    except (ValueError, TypeError) as err:
        raise ValueError(f"cursor {cursor!r} is not one this service issued") from err


def list_builds(session: Session, tenant: str | None, *, status: list[str] | None = None, name: str | None = None,
                owner: str | None = None, limit: int = 50, cursor: str | None = None) -> tuple[list[dict], str | None]:
    """A page of builds, newest first, as summary dicts; and the cursor of the next page (None on the last)."""
    query = select(Build).order_by(Build.created_at.desc(), Build.id.desc()).limit(limit + 1)
    if tenant is not None:
        query = query.where(Build.tenant_id == tenant)
    if owner is not None:
        query = query.where(Build.tenant_id == owner)
    if status:
        query = query.where(Build.status.in_(status))
    if name is not None:
        query = query.where(publish_name() == name)
    if cursor is not None:
        created, build_id = decode_cursor(cursor)
        query = query.where((Build.created_at < created) | ((Build.created_at == created) & (Build.id < build_id)))
    builds = session.scalars(query).all()
    more = len(builds) > limit
    builds = builds[:limit]
    next_cursor = encode_cursor(builds[-1].created_at, builds[-1].id) if more else None
    return summaries(session, builds), next_cursor


def summaries(session: Session, builds: list[Build]) -> list[dict]:
    """Summary dicts (progress, cache hits, compute) for builds, in two grouped queries."""
    ids = [b.id for b in builds]
    terminal = [s.value for s in TERMINAL]
    stage_counts = {
        build_id: (total, done or 0, hits or 0)
        for build_id, total, done, hits in session.execute(
            select(Stage.build_id, func.count(), func.sum(case((Stage.status.in_(terminal), 1), else_=0)),
                   func.sum(case((Stage.cache_hit.is_(True), 1), else_=0)))
            .where(Stage.build_id.in_(ids)).group_by(Stage.build_id)
        )
    } if ids else {}
    compute = {
        build_id: (gpu or 0.0, cpu or 0.0)
        for build_id, gpu, cpu in session.execute(
            select(Stage.build_id, func.sum(Attempt.gpu_seconds), func.sum(Attempt.cpu_seconds))
            .select_from(Attempt).join(Stage, Stage.id == Attempt.stage_id)
            .where(Stage.build_id.in_(ids)).group_by(Stage.build_id)
        )
    } if ids else {}
    rows = []
    for build in builds:
        total, done, hits = stage_counts.get(build.id, (0, 0, 0))
        gpu, cpu = compute.get(build.id, (0.0, 0.0))
        publish = build.spec.get("publish") or {}
        rows.append({
            "id": build.id, "tenant": build.tenant_id, "status": build.status, "name": publish.get("name", ""),
            "version": publish.get("version", ""), "error": build.error, "created_at": build.created_at,
            "started_at": build.started_at, "finished_at": build.finished_at, "stages_total": total,
            "stages_done": done, "progress": done / total if total else 0.0, "cache_hits": hits,
            "gpu_seconds": float(gpu), "cpu_seconds": float(cpu),
        })
    return rows


def describe_build(session: Session, build_id: str, tenant: str | None) -> dict[str, Any]:
    """Everything about one build: summary, spec, stages with attempts and live progress, its package."""
    build = _owned_build(session, build_id, tenant)
    stages = session.scalars(select(Stage).where(Stage.build_id == build_id).order_by(Stage.id)).all()
    attempts: dict[int, list[Attempt]] = {}
    for attempt in session.scalars(
        select(Attempt).where(Attempt.stage_id.in_([s.id for s in stages])).order_by(Attempt.number)
    ):
        attempts.setdefault(attempt.stage_id, []).append(attempt)
    out = []
    for stage in stages:
        progress = None
        if stage.status == Status.RUNNING.value:
            event = session.scalar(select(Event).where(Event.stage_id == stage.id, Event.kind == "progress")
                                   .order_by(Event.id.desc()).limit(1))
            if event is not None and event.data:
                progress = {"done": int(event.data.get("done", 0)), "total": int(event.data.get("total", 0)),
                            "message": event.message}
        mine = attempts.get(stage.id, [])
        out.append({
            "key": stage.key, "type": stage.type, "shard": stage.shard, "status": stage.status,
            "cache_hit": stage.cache_hit, "error": stage.error, "started_at": stage.started_at,
            "finished_at": stage.finished_at,
            "seconds": (stage.finished_at - stage.started_at).total_seconds()
            if stage.finished_at and stage.started_at else None,
            "gpu_seconds": sum(a.gpu_seconds for a in mine), "cpu_seconds": sum(a.cpu_seconds for a in mine),
            "progress": progress,
            "attempts": [
                {"number": a.number, "status": a.status, "exit": a.exit, "error": a.error, "worker": a.worker,
                 "started_at": a.started_at, "ended_at": a.ended_at, "wall_seconds": a.wall_seconds,
                 "cpu_seconds": a.cpu_seconds, "gpu_seconds": a.gpu_seconds}
                for a in mine
            ],
        })
    package = None
    if build.status == Status.SUCCEEDED.value:
        target = build.spec.get("publish") or {}
        found = session.scalar(select(Package).where(Package.name == target.get("name"),
                                                     Package.version == target.get("version")))
        if found is not None:
            package = {"name": found.name, "version": found.version}
    return {**summaries(session, [build])[0], "spec": build.spec, "idempotency_key": build.idempotency_key,
            "cancel_requested": build.cancel_requested, "stages": out, "package": package}


def build_events(session: Session, build_id: str, tenant: str | None, after: int = 0, limit: int = 500) -> list[dict]:
    """The build's events after event id `after`, oldest first, with their stage keys."""
    _owned_build(session, build_id, tenant)
    rows = session.execute(
        select(Event, Stage.key).outerjoin(Stage, Stage.id == Event.stage_id)
        .where(Event.build_id == build_id, Event.id > after).order_by(Event.id).limit(limit)
    ).all()
    return [
        {"id": e.id, "time": e.created_at, "kind": e.kind, "level": e.level, "stage": key, "attempt": e.attempt,
         "message": e.message, "data": e.data}
        for e, key in rows
    ]


# --------------------------------------------------------------------------- packages


def _packages(session: Session, tenant: str | None, name: str | None = None):
    query = select(Package, Build.tenant_id).join(Build, Build.id == Package.build_id)
    if tenant is not None:
        query = query.where(Build.tenant_id == tenant)
    if name is not None:
        query = query.where(Package.name == name)
    return session.execute(query.order_by(Package.created_at, Package.id)).all()


def _aliases(session: Session, names) -> dict[int, list[str]]:
    by_package: dict[int, list[str]] = {}
    for alias in session.scalars(select(Alias).where(Alias.package_name.in_(list(names))).order_by(Alias.alias)):
        by_package.setdefault(alias.package_id, []).append(alias.alias)
    return by_package


def list_packages(session: Session, tenant: str | None) -> list[dict]:
    """One entry per package name the caller can see: version count, newest version, aliases."""
    rows = _packages(session, tenant)
    aliases = _aliases(session, {p.name for p, _ in rows})
    out: dict[tuple[str, str], dict] = {}
    for package, owner in rows:  # oldest first: the last one seen is the newest
        entry = out.setdefault((package.name, owner), {"name": package.name, "tenant": owner, "versions": 0,
                                                       "aliases": {}})
        entry["versions"] += 1
        entry["latest_version"], entry["updated_at"] = package.version, package.created_at
        entry["aliases"].update({a: package.version for a in aliases.get(package.id, [])})
    return sorted(out.values(), key=lambda e: (e["name"], e["tenant"]))


def package_versions(session: Session, name: str, tenant: str | None) -> list[dict]:
    rows = _packages(session, tenant, name)
    if not rows:
        raise KeyError(f"no package {name}")
    aliases = _aliases(session, {name})
    return [
        {"name": p.name, "version": p.version, "build_id": p.build_id, "tenant": owner,
         "manifest_sha256": p.manifest_sha256, "created_at": p.created_at, "aliases": aliases.get(p.id, [])}
        for p, owner in rows
    ]


def find_package(session: Session, name: str, version: str, tenant: str | None) -> Package:
    """A visible package by version, or by alias when no version has that name."""
    query = select(Package).join(Build, Build.id == Package.build_id).where(Package.name == name)
    if tenant is not None:
        query = query.where(Build.tenant_id == tenant)
    package = session.scalar(query.where(Package.version == version))
    if package is None:
        package = session.scalar(query.join(Alias, Alias.package_id == Package.id).where(Alias.alias == version))
    if package is None:
        raise KeyError(f"no package {name} {version}")
    return package


def move_alias(sessions: sessionmaker[Session], store, name: str, alias: str, version: str,
               tenant: str | None) -> dict:
    """Point `alias` of a package at one of its versions: the row, then the store's alias object."""
    with sessions.begin() as session:
        lock_for_write(session)  # SQLite ignores FOR UPDATE: two moves of a new alias would both insert it
        package = session.scalar(
            select(Package).join(Build, Build.id == Package.build_id)
            .where(Package.name == name, Package.version == version,
                   *([Build.tenant_id == tenant] if tenant is not None else []))
        )
        if package is None:
            raise KeyError(f"no package {name} {version}")
        row = session.get(Alias, (name, alias), with_for_update=True)
        if row is not None and tenant is not None:
            holder = session.scalar(select(Build.tenant_id).join(Package, Package.build_id == Build.id)
                                    .where(Package.id == row.package_id))
            if holder != tenant:  # another tenant's alias on a shared name: not this caller's to move
                raise KeyError(f"no alias {alias} of {name}")
        if row is None:
            row = Alias(package_name=name, alias=alias, package_id=package.id)
            session.add(row)
        else:
            row.package_id, row.updated_at = package.id, utcnow()
        session.flush()
        result = {"name": name, "alias": alias, "version": version, "updated_at": row.updated_at}
    store.put_bytes(alias_key(name, alias), version.encode())  # what device_sdk.pull reads from a bucket
    return result
