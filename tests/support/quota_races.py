"""Concurrent submissions and uploads of one tenant, released together, for the quota race tests on
SQLite (tests/unit/cluster) and PostgreSQL (tests/integration)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import func, select

from cluster.models import Build, Upload
from cluster.service import QuotaExceeded, record_upload, submit
from cluster.spec import parse_spec
from tests.support.api import spec
from tests.support.control_plane import chain_registry


def race(count: int, attempt) -> list[str]:
    """Run `attempt(i)` in `count` threads released by one barrier; 'ok' or 'quota' per thread."""
    start = threading.Barrier(count)

    def one(index: int) -> str:
        start.wait()
        try:
            attempt(index)
            return "ok"
        except QuotaExceeded:
            return "quota"

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def concurrent_submissions(sessions, tenant: str, count: int) -> list[str]:
    registry = chain_registry()
    specs = [parse_spec(spec(version=str(i)), registry) for i in range(count)]
    return race(count, lambda i: submit(sessions, specs[i], registry, tenant=tenant))


# Every stage of the chain on one GPU: a build reserves 3 GPU stages × the per-GPU-stage estimate.
ON_A_GPU = {stage: {"resources": {"num_gpus": 1}} for stage in ("first", "second", "third")}


def concurrent_gpu_submissions(sessions, tenant: str, count: int, stage_seconds: float,
                               stages: dict | None = None) -> list[str]:
    """`count` builds whose `stages` (default: every stage) ask for one GPU, submitted at once; each reserves
    its GPU stages × `stage_seconds` against the tenant's GPU-hour quota."""
    registry = chain_registry()
    # No stage cache: builds that run then each charge their own GPU time.
    specs = [parse_spec(spec(version=str(i), stages=stages or ON_A_GPU, cache=False), registry) for i in range(count)]
    return race(count, lambda i: submit(sessions, specs[i], registry, tenant=tenant, gpu_stage_seconds=stage_seconds))


def submitted_of(sessions, tenant: str) -> list[str]:
    with sessions() as session:
        return list(session.scalars(select(Build.id).where(Build.tenant_id == tenant)))


def concurrent_uploads(sessions, tenant: str, count: int, size: int, quota: int) -> list[str]:
    return race(count, lambda i: record_upload(sessions, tenant, f"{i:064x}", "file", f"u{i}", size, quota))


def builds_of(sessions, tenant: str) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Build).where(Build.tenant_id == tenant))


def uploaded_of(sessions, tenant: str) -> int:
    with sessions() as session:
        return session.scalar(select(func.coalesce(func.sum(Upload.size), 0)).where(Upload.tenant_id == tenant))
