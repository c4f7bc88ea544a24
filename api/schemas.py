"""Request and response models of the REST API (/v1). Field names are the wire format: keep them stable.

Errors are RFC 9457 problem documents (`Problem`, media type application/problem+json).

Build logs over SSE (`GET /v1/builds/{id}/logs` with `Accept: text/event-stream`): one SSE event per
stored event, `id:` the event id (send it back as `Last-Event-ID` to resume), `event:` its kind
(`state`, `log` or `progress`), `data:` a `LogEvent` as JSON. When the build is terminal the stream
sends one `event: end` whose data is `{"status": <build status>}` and closes.
"""

from __future__ import annotations

from datetime import UTC
from datetime import datetime as _datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# The job store keeps naive UTC; on the wire every time carries its offset (RFC 3339, `…Z`).
datetime = Annotated[_datetime, AfterValidator(lambda t: t if t.tzinfo else t.replace(tzinfo=UTC))]
BuildStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
UsageGroup = Literal["tenant", "build", "stage_type", "day"]


class Schema(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- errors


class ProblemField(Schema):
    field: str = Field(description="where the problem is, dotted (e.g. `stages.profile.settings.windows`)")
    message: str


class Problem(Schema):
    """RFC 9457 problem details."""

    type: str = Field("about:blank", description="a URI naming the kind of problem")
    title: str
    status: int
    detail: str | None = None
    instance: str | None = Field(None, description="the request path")
    errors: list[ProblemField] | None = Field(None, description="validation problems, one per offending field")

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{
            "type": "https://elastify.dev/problems/quota-exceeded", "title": "Quota exceeded", "status": 429,
            "detail": "tenant acme has 2 builds queued or running; its limit is 2", "instance": "/v1/builds",
        }]},
    )


# --------------------------------------------------------------------------- builds


class AttemptOut(Schema):
    number: int
    status: BuildStatus
    exit: str | None = Field(None, description="ok, error, crashed, lease_expired, cancelled, interrupted")
    error: str | None = None
    worker: str
    started_at: datetime
    ended_at: datetime | None = None
    wall_seconds: float
    cpu_seconds: float
    gpu_seconds: float


class StageProgress(Schema):
    done: int
    total: int
    message: str = ""


class StageOut(Schema):
    key: str = Field(description="the DAG node, e.g. `profile` or `recover[0.5]`")
    type: str
    shard: str | None = None
    status: BuildStatus
    cache_hit: bool
    error: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    seconds: float | None = Field(None, description="wall time from first lease to finish")
    gpu_seconds: float
    cpu_seconds: float
    progress: StageProgress | None = Field(None, description="the latest progress report of a running stage")
    attempts: list[AttemptOut]


class PackageRef(Schema):
    name: str
    version: str


class BuildSummaryOut(Schema):
    id: str
    tenant: str
    status: BuildStatus
    name: str = Field(description="the package name the build publishes")
    version: str
    error: str | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    stages_total: int
    stages_done: int = Field(description="stages in a terminal state")
    progress: float = Field(ge=0, le=1, description="stages_done / stages_total")
    cache_hits: int
    gpu_seconds: float
    cpu_seconds: float

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "id": "5f0c2a9e1b7d4c3a", "tenant": "acme", "status": "running", "name": "smollm2-elastic", "version": "0.1.0",
        "error": None, "created_at": "2026-11-29T10:00:00Z", "started_at": "2026-11-29T10:00:01Z", "finished_at": None,
        "stages_total": 4, "stages_done": 1, "progress": 0.25, "cache_hits": 0, "gpu_seconds": 0.0, "cpu_seconds": 112.5,
    }]})


class BuildOut(BuildSummaryOut):
    spec: dict[str, Any]
    idempotency_key: str | None = None
    cancel_requested: bool
    stages: list[StageOut]
    package: PackageRef | None = None

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "id": "5f0c2a9e1b7d4c3a", "tenant": "acme", "status": "running", "name": "smollm2-elastic", "version": "0.1.0",
        "error": None, "created_at": "2026-11-29T10:00:00Z", "started_at": "2026-11-29T10:00:01Z", "finished_at": None,
        "stages_total": 2, "stages_done": 1, "progress": 0.5, "cache_hits": 1, "gpu_seconds": 0.0, "cpu_seconds": 0.0,
        "spec": {"source": {"model": "/models/smollm2"}, "levels": [0.5, 1.0],
                 "publish": {"name": "smollm2-elastic", "version": "0.1.0"}},
        "idempotency_key": "nightly-2026-11-29", "cancel_requested": False, "package": None,
        "stages": [
            {"key": "profile", "type": "profile", "shard": None, "status": "succeeded", "cache_hit": True, "error": None,
             "started_at": "2026-11-29T10:00:01Z", "finished_at": "2026-11-29T10:00:01Z", "seconds": 0.1,
             "gpu_seconds": 0.0, "cpu_seconds": 0.0, "progress": None, "attempts": []},
            {"key": "elastify", "type": "elastify", "shard": None, "status": "running", "cache_hit": False,
             "error": None, "started_at": "2026-11-29T10:00:02Z", "finished_at": None, "seconds": None,
             "gpu_seconds": 0.0, "cpu_seconds": 0.0, "progress": {"done": 12, "total": 30, "message": "layers"},
             "attempts": [{"number": 1, "status": "running", "exit": None, "error": None, "worker": "host:123:ab12cd",
                           "started_at": "2026-11-29T10:00:02Z", "ended_at": None, "wall_seconds": 0.0,
                           "cpu_seconds": 0.0, "gpu_seconds": 0.0}]},
        ],
    }]})


class BuildPage(Schema):
    items: list[BuildSummaryOut]
    next_cursor: str | None = Field(None, description="pass as `cursor` to get the next page; null on the last")


class LogEvent(Schema):
    id: int
    time: datetime
    kind: Literal["state", "log", "progress"] | str
    level: str
    stage: str | None = None
    attempt: int | None = None
    message: str
    data: dict[str, Any] | None = None

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "id": 42, "time": "2026-11-29T10:00:05Z", "kind": "progress", "level": "info", "stage": "profile",
        "attempt": 1, "message": "calibration windows", "data": {"done": 3, "total": 16},
    }]})


# --------------------------------------------------------------------------- packages


class PackageVersionOut(Schema):
    name: str
    version: str
    build_id: str
    tenant: str
    manifest_sha256: str
    created_at: datetime
    aliases: list[str]

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "name": "smollm2-elastic", "version": "0.1.0", "build_id": "5f0c2a9e1b7d4c3a", "tenant": "acme",
        "manifest_sha256": "9b1f" + "0" * 60, "created_at": "2026-11-29T10:02:00Z", "aliases": ["latest"],
    }]})


class PackageOut(Schema):
    name: str
    tenant: str
    versions: int
    latest_version: str = Field(description="the most recently published version")
    aliases: dict[str, str] = Field(description="alias → version")
    updated_at: datetime

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "name": "smollm2-elastic", "tenant": "acme", "versions": 2, "latest_version": "0.1.1",
        "aliases": {"latest": "0.1.1", "stable": "0.1.0"}, "updated_at": "2026-11-29T10:02:00Z",
    }]})


class PackageList(Schema):
    items: list[PackageOut]


class PackageVersionList(Schema):
    items: list[PackageVersionOut]


class AliasIn(Schema):
    version: str = Field(description="an existing version of the package")

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"version": "0.1.0"}]})


class AliasOut(Schema):
    name: str
    alias: str
    version: str
    updated_at: datetime

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "name": "smollm2-elastic", "alias": "stable", "version": "0.1.0", "updated_at": "2026-11-29T11:00:00Z",
    }]})


class PresignedUrl(Schema):
    url: str
    expires_in: int = Field(description="seconds")

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "url": "https://s3.example.com/bucket/packages/smollm2-elastic/0.1.0/model/config.json?X-Amz-Signature=…",
        "expires_in": 900,
    }]})


# --------------------------------------------------------------------------- usage, keys, health


class UsageRow(Schema):
    tenant: str | None = None
    build: str | None = None
    stage_type: str | None = None
    day: str | None = Field(None, description="UTC day of the attempt's start, YYYY-MM-DD")
    attempts: int
    wall_seconds: float
    cpu_seconds: float
    gpu_seconds: float
    cpu_hours: float
    gpu_hours: float


class UsageReport(Schema):
    group_by: list[UsageGroup]
    rows: list[UsageRow]
    total_gpu_hours: float
    total_cpu_hours: float

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "group_by": ["day", "stage_type"], "total_gpu_hours": 1.5, "total_cpu_hours": 0.25,
        "rows": [{"day": "2026-11-29", "stage_type": "recover", "attempts": 9, "wall_seconds": 5400.0,
                  "cpu_seconds": 900.0, "gpu_seconds": 5400.0, "cpu_hours": 0.25, "gpu_hours": 1.5}],
    }]})


class SigningKey(Schema):
    algorithm: Literal["ed25519"] = "ed25519"
    public_key: str = Field(description="the raw 32-byte public key, base64; devices pin it to verify packages")

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"algorithm": "ed25519", "public_key": "WvpTi+LjjCNCr/+dZ53ItQ0ZLWWsGHsuotEJKDS4CQE="}]})


class Health(Schema):
    status: Literal["ok"] = "ok"


class CheckResult(Schema):
    ok: bool
    detail: str = ""


class Readiness(Schema):
    status: Literal["ready", "not ready"]
    checks: dict[str, CheckResult]

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "status": "ready", "checks": {"database": {"ok": True, "detail": "reachable"},
                                      "store": {"ok": True, "detail": "reachable"},
                                      "ray": {"ok": True, "detail": "1 live nodes"}},
    }]})
