"""The compute ledger: wall, CPU and GPU seconds of every attempt (failed ones too), rolled up."""

from __future__ import annotations

from sqlalchemy import func, select

from cluster.models import Attempt, Build, Stage

GROUPS = {
    "build": Stage.build_id,
    "stage_type": Stage.type,
    "tenant": Build.tenant_id,
    "day": func.date(Attempt.started_at),  # the attempt's UTC start day; date() exists in SQLite and PostgreSQL
}


def usage(session, by: str, **filters) -> dict[str, dict[str, float]]:
    """{group key: {attempts, wall_seconds, cpu_seconds, gpu_seconds}}; filters: build_id, tenant."""
    if by not in GROUPS:
        raise ValueError(f"group by one of {sorted(GROUPS)}, not {by!r}")
    column = GROUPS[by]
    query = (
        select(column, func.count(Attempt.id), func.sum(Attempt.wall_seconds), func.sum(Attempt.cpu_seconds),
               func.sum(Attempt.gpu_seconds))
        .select_from(Attempt)
        .join(Stage, Stage.id == Attempt.stage_id)
        .join(Build, Build.id == Stage.build_id)
        .group_by(column)
    )
    if "build_id" in filters:
        query = query.where(Stage.build_id == filters["build_id"])
    if "tenant" in filters:
        query = query.where(Build.tenant_id == filters["tenant"])
    return {
        str(key): {"attempts": n, "wall_seconds": wall or 0.0, "cpu_seconds": cpu or 0.0, "gpu_seconds": gpu or 0.0}
        for key, n, wall, cpu, gpu in session.execute(query)
    }


def usage_rows(session, group_by: list[str], *, tenant: str | None = None, build_id: str | None = None,
               stage_type: str | None = None, since=None, until=None) -> list[dict]:
    """Rows of {<each group>: key, attempts, wall/cpu/gpu seconds}, grouped by several columns at once
    (e.g. day × stage_type); `since` ≤ attempt start < `until` (naive UTC datetimes)."""
    unknown = [g for g in group_by if g not in GROUPS]
    if unknown:
        raise ValueError(f"group by any of {sorted(GROUPS)}, not {unknown}")
    columns = [GROUPS[g] for g in group_by]
    query = (
        select(*columns, func.count(Attempt.id), func.sum(Attempt.wall_seconds), func.sum(Attempt.cpu_seconds),
               func.sum(Attempt.gpu_seconds))
        .select_from(Attempt)
        .join(Stage, Stage.id == Attempt.stage_id)
        .join(Build, Build.id == Stage.build_id)
        .group_by(*columns)
        .order_by(*columns)
    )
    for column, value in ((Build.tenant_id, tenant), (Stage.build_id, build_id), (Stage.type, stage_type)):
        if value is not None:
            query = query.where(column == value)
    if since is not None:
        query = query.where(Attempt.started_at >= since)
    if until is not None:
        query = query.where(Attempt.started_at < until)
    rows = []
    for *keys, n, wall, cpu, gpu in session.execute(query):
        rows.append({**{g: str(k) for g, k in zip(group_by, keys, strict=True)}, "attempts": n,
                     "wall_seconds": wall or 0.0, "cpu_seconds": cpu or 0.0, "gpu_seconds": gpu or 0.0})
    return rows
