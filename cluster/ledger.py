"""The compute ledger: wall, CPU and GPU seconds of every attempt (failed ones too), rolled up, and the
live charge of attempts still running (from the usage their progress events report)."""

from __future__ import annotations

from sqlalchemy import func, select

from cluster.models import Attempt, Build, Event, Stage, utcnow

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


# Attempts whose row holds no measured charge (yet): running ones, and those the worker never reported back
# from (its process died, or its scheduler did). Their progress events carry what they had used so far.
UNMEASURED = Attempt.ended_at.is_(None) | Attempt.exit.in_(("crashed", "lease_expired"))


def compute_by_stage_type(session) -> dict[str, dict[str, float]]:
    """{stage type: {cpu_seconds, gpu_seconds}} of every attempt, running ones included, as monotonic counters.

    A running attempt is charged the CPU time and the wall time × GPUs granted that its last progress event
    reported (workers.runner measures both on the clocks its final result uses, so the final charge is never
    less); an attempt that ended unmeasured keeps the larger of its row and its last report. Scraped often, so
    the counters advance while a stage runs, instead of jumping when it ends."""
    totals: dict[str, dict[str, float]] = {}
    measured = session.execute(
        select(Stage.type, func.sum(Attempt.cpu_seconds), func.sum(Attempt.gpu_seconds)).select_from(Attempt)
        .join(Stage, Stage.id == Attempt.stage_id).where(~UNMEASURED).group_by(Stage.type)
    )
    for stage_type, cpu, gpu in measured:
        totals[stage_type] = {"cpu_seconds": float(cpu or 0.0), "gpu_seconds": float(gpu or 0.0)}
    reported = (
        select(Stage.type, Attempt.cpu_seconds, Attempt.gpu_seconds, Attempt.num_gpus,
               func.max(Event.data["cpu_seconds"].as_float()), func.max(Event.data["wall_seconds"].as_float()))
        .select_from(Attempt).join(Stage, Stage.id == Attempt.stage_id)
        .outerjoin(Event, (Event.stage_id == Attempt.stage_id) & (Event.attempt == Attempt.number)
                   & (Event.kind == "progress"))
        .where(UNMEASURED).group_by(Attempt.id, Stage.type)
    )
    for stage_type, cpu, gpu, num_gpus, cpu_so_far, wall_so_far in session.execute(reported):
        row = totals.setdefault(stage_type, {"cpu_seconds": 0.0, "gpu_seconds": 0.0})
        row["cpu_seconds"] += max(cpu or 0.0, cpu_so_far or 0.0)
        row["gpu_seconds"] += max(gpu or 0.0, (wall_so_far or 0.0) * (num_gpus or 0.0))
    return totals


def charged_gpu_seconds(session, build_ids, now=None) -> dict[str, float]:
    """{build id: GPU-seconds its attempts have been charged so far}: the measured charge of ended attempts,
    and wall time so far × GPUs granted of running ones (what replaces a build's GPU reservation)."""
    ids = list(build_ids)
    if not ids:
        return {}
    now = now or utcnow()
    charged = {
        build_id: float(gpu or 0.0)
        for build_id, gpu in session.execute(
            select(Stage.build_id, func.sum(Attempt.gpu_seconds)).select_from(Attempt)
            .join(Stage, Stage.id == Attempt.stage_id)
            .where(Stage.build_id.in_(ids), Attempt.ended_at.is_not(None)).group_by(Stage.build_id)
        )
    }
    running = session.execute(
        select(Stage.build_id, Attempt.started_at, Attempt.num_gpus).select_from(Attempt)
        .join(Stage, Stage.id == Attempt.stage_id)
        .where(Stage.build_id.in_(ids), Attempt.ended_at.is_(None), Attempt.num_gpus > 0)
    )
    for build_id, started, gpus in running:
        charged[build_id] = charged.get(build_id, 0.0) + max(0.0, (now - started).total_seconds()) * gpus
    return charged
