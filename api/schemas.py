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


class BuildOut(BuildSummaryOut):
    spec: dict[str, Any]
    idempotency_key: str | None = None
    cancel_requested: bool
    stages: list[StageOut]
    package: PackageRef | None = None


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


# --------------------------------------------------------------------------- packages


class PackageVersionOut(Schema):
    name: str
    version: str
    build_id: str
    tenant: str
    manifest_sha256: str
    created_at: datetime
    aliases: list[str]


class PackageOut(Schema):
    name: str
    tenant: str
    versions: int
    latest_version: str = Field(description="the most recently published version")
    aliases: dict[str, str] = Field(description="alias → version")
    updated_at: datetime


class PackageList(Schema):
    items: list[PackageOut]


class PackageVersionList(Schema):
    items: list[PackageVersionOut]


class AliasIn(Schema):
    version: str = Field(description="an existing version of the package")


class AliasOut(Schema):
    name: str
    alias: str
    version: str
    updated_at: datetime


class PresignedUrl(Schema):
    url: str
    expires_in: int = Field(description="seconds")


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


class SigningKey(Schema):
    algorithm: Literal["ed25519"] = "ed25519"
    public_key: str = Field(description="the raw 32-byte public key, base64; devices pin it to verify packages")


class Health(Schema):
    status: Literal["ok"] = "ok"


class CheckResult(Schema):
    ok: bool
    detail: str = ""


class Readiness(Schema):
    status: Literal["ready", "not ready"]
    checks: dict[str, CheckResult]
