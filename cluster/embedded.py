"""Embedded mode: the whole service on one machine (SQLite, local Ray without dashboard, local store).

Production runs the same `Scheduler` with other settings (PostgreSQL, a Ray address, S3).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from cluster.db import is_sqlite, migrate
from cluster.registry import Registry
from cluster.scheduler import Scheduler
from cluster.settings import Settings

log = logging.getLogger("elastify.embedded")


def connect_ray(settings: Settings, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at ELASTIFY_RAY_ADDRESS, or start a local one with no dashboard."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if settings.ray_address:
        ray.init(address=settings.ray_address, logging_level=logging.WARNING, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, num_cpus=num_cpus, logging_level=logging.WARNING, log_to_driver=False)


@contextlib.contextmanager
def running_service(settings: Settings, registry: Registry) -> Iterator[Scheduler]:
    """Migrate the database, make the signing key on first start, join Ray, start a scheduler of `registry`."""
    settings.home.mkdir(parents=True, exist_ok=True)
    migrate(settings.database_url)
    if is_sqlite(settings.database_url) and not os.environ.get("ELASTIFY_SIGNING_KEY"):
        settings.ensure_signing_key()
    connect_ray(settings)
    scheduler = Scheduler(settings, registry).start()
    log.info("scheduler %s: database %s, store %s", scheduler.owner, settings.database_url, settings.store_url)
    try:
        yield scheduler
    finally:
        scheduler.close()
