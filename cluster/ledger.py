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
