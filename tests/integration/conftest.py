"""Real services for integration tests, started once for this package: PostgreSQL, SeaweedFS (S3) and Ray.

Nothing here is mocked; see tests/support/services.py for how each one starts and stops. Package
scope, not session: they stop when the last integration test is done, so Ray's idle workers and the
servers do not take CPU from the unit tests that run after them.
"""

from __future__ import annotations

import os
import uuid

import pytest

from tests.support import services


@pytest.fixture(scope="package")
def postgres_server():
    with services.postgres() as url:
        yield url


@pytest.fixture
def pg_url(postgres_server) -> str:
    """A fresh, migrated database on the session's PostgreSQL server."""
    from cluster.db import migrate

    url = services.create_database(postgres_server, f"t_{uuid.uuid4().hex[:10]}")
    migrate(url)
    return url


@pytest.fixture(scope="package")
def seaweedfs():
    with services.seaweedfs() as endpoint:
        yield endpoint


@pytest.fixture
def s3_store(seaweedfs):
    """StoreConfig of a fresh bucket on the session's SeaweedFS."""
    from workers.store import StoreConfig

    config = StoreConfig(f"s3://t-{uuid.uuid4().hex[:10]}/elastify", seaweedfs, "test", "test")
    config.open().ensure_ready()
    return config


@pytest.fixture(scope="package")
def ray_cluster():
    """A local Ray head with 2 CPUs and 2 fake GPUs that tests and scheduler subprocesses join."""
    with services.ray_head(num_cpus=2, num_gpus=2) as address:
        yield address


@pytest.fixture(scope="package")
def cluster_env(ray_cluster):
    """Environment for scheduler subprocesses that must join the same Ray head."""
    return {**os.environ, "ELASTIFY_RAY_ADDRESS": ray_cluster, "RAY_AUTH_MODE": "disabled"}
