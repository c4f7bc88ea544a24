"""Usage: GPU- and CPU-hours from the compute ledger, grouped by tenant, build, stage type and day."""

from __future__ import annotations

from datetime import date, datetime, time, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Request

from api.routes import CallerDep, problems, sessions
from api.schemas import UsageGroup, UsageReport
from cluster.ledger import usage_rows

router = APIRouter(prefix="/v1/usage", tags=["usage"])


@router.get("", response_model=UsageReport, responses=problems(422))
def usage(
    request: Request,
    caller: CallerDep,
    group_by: Annotated[list[UsageGroup] | None, Query(description="one or more of tenant, build, stage_type, day")] = None,
    tenant: Annotated[str | None, Query(max_length=64, description="admins: one tenant; others see only their own")] = None,
    build: Annotated[str | None, Query(max_length=32)] = None,
    stage_type: Annotated[str | None, Query(max_length=64)] = None,
    since: Annotated[date | None, Query(description="first UTC day, inclusive")] = None,
    until: Annotated[date | None, Query(description="last UTC day, inclusive")] = None,
) -> dict:
    """Wall, CPU and GPU time of every attempt (failed ones too), rolled up by the chosen groups."""
    groups = list(dict.fromkeys(group_by or ["tenant"]))
    scope = caller.scope if caller.scope is not None else tenant
    if caller.scope is not None and tenant not in (None, caller.scope):
        rows = []  # another tenant's usage is not this caller's to see
    else:
        with sessions(request)() as session:
            rows = usage_rows(
                session, groups, tenant=scope, build_id=build, stage_type=stage_type,
                since=datetime.combine(since, time()) if since else None,
                # The last day has no next day to stop before: no upper bound (not an OverflowError, a 500).
                until=datetime.combine(until + timedelta(days=1), time()) if until and until < date.max else None,
            )
    for row in rows:
        row["gpu_hours"], row["cpu_hours"] = row["gpu_seconds"] / 3600, row["cpu_seconds"] / 3600
    return {"group_by": groups, "rows": rows, "total_gpu_hours": sum(r["gpu_hours"] for r in rows),
            "total_cpu_hours": sum(r["cpu_hours"] for r in rows)}
