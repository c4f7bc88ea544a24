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


# Ray's switch for multi-node clusters (off by default on macOS and Windows). While it is on, Ray replaces a
# loopback node address (`--node-ip-address=127.0.0.1`, `_node_ip_address`) by the host's routable IP, so GCS,
# raylet and agents listen on that IP or on every interface. Off, they keep 127.0.0.1 and bind to it alone.
RAY_MULTI_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"


def keep_ray_on_loopback() -> dict[str, str]:
    """Make this process, and the Ray processes it or its children start, keep a loopback node address.

    For a single-machine Ray only (a loopback cluster has no other nodes): Ray refuses `ray start --address`
    of a worker node with this set. Returns the environment entry, for `ray start` subprocesses.
    """
    from ray._private import ray_constants  # read at import; a Ray imported already needs the value set

    os.environ[RAY_MULTI_NODE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    return {RAY_MULTI_NODE_ENV: "0"}


def is_loopback_address(address: str) -> bool:
    host = address.removeprefix("ray://").rpartition(":")[0].strip("[]")
    return host in (LOOPBACK, "localhost", "::1")


def connect_ray(settings: Settings, num_cpus: int | None = None) -> bool:
    """Join the Ray cluster at ELASTIFY_RAY_ADDRESS, or start a local one with no dashboard, bound to
    127.0.0.1 only (nothing of it is reachable from the network). False: this process had already joined."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if settings.ray_address:
        if is_loopback_address(settings.ray_address):  # a head bound to loopback is reached on loopback
            keep_ray_on_loopback()
        ray.init(address=settings.ray_address, logging_level=logging.WARNING, log_to_driver=False)
    else:
        keep_ray_on_loopback()
        ray.init(include_dashboard=False, num_cpus=num_cpus, logging_level=logging.WARNING, log_to_driver=False,
                 _node_ip_address=LOOPBACK)
    return True


@contextlib.contextmanager
def running_service(settings: Settings, registry: Registry) -> Iterator[Scheduler]:
    """Migrate the database, make the signing key on first start, join Ray, start a scheduler of `registry`.
    On exit the scheduler closes and Ray is left if this call joined it: the process is not left holding a
    cluster whose nodes then decide what its next API accepts (`cluster.capacity.current_capacity`)."""
    settings.home.mkdir(parents=True, exist_ok=True)
    migrate(settings.database_url)
    if is_sqlite(settings.database_url) and not os.environ.get("ELASTIFY_SIGNING_KEY"):
        settings.ensure_signing_key()
    joined = connect_ray(settings)
    scheduler = Scheduler(settings, registry).start()
    log.info("scheduler %s: database %s, store %s", scheduler.owner, settings.database_url, settings.store_url)
    try:
        yield scheduler
    finally:
        scheduler.close()
        if joined:
            import ray

            ray.shutdown()
