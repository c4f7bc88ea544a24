"""PostgreSQL stopped (`pg_ctl stop -m fast`) under a scheduler that runs a build, then started again: the
scheduler backs off and reconnects instead of exiting, collects the stage that finished in Ray meanwhile,
and the build finishes. Its own PostgreSQL server, since this test stops it; Ray is the package's."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from cluster.db import DATABASE_OUTAGES, migrate
from cluster.service import build_summary, submit_build
from tests.support import services
from tests.support.control_plane import chain_registry, make_settings, spec_for, started
from workers import testing
from workers.store import StoreConfig

pytestmark = pytest.mark.integration
OUTAGE_SECONDS = 3.0


@pytest.fixture
def stoppable_postgres():
    with services.postgres_server() as server:
        yield server


def test_the_scheduler_waits_out_a_postgresql_outage_and_the_build_finishes(tmp_path, stoppable_postgres,
                                                                             ray_cluster, caplog):
    url = services.create_database(stoppable_postgres.url, "outage")
    migrate(url)
    registry = chain_registry(testing.sleep)
    settings = make_settings(tmp_path, url, StoreConfig(str(tmp_path / "store")), db_retry_base_seconds=0.2,
                             db_retry_max_seconds=1.0)
    scheduler = started(settings, registry)
    pid_file = tmp_path / "pid"
    # The first stage runs 1.5 s: it finishes in Ray while the database is down, and is recorded after.
    spec = spec_for({"first": {"seconds": 1.5, "pid_file": str(pid_file), "tag": "a"},
                     "second": {"seconds": 0.1, "tag": "b"}, "third": {"seconds": 0.1, "tag": "c"}})
    build_id = submit_build(scheduler.sessions, spec, registry)
    outage: dict[str, float] = {}

    def stop_then_start() -> None:
        while not pid_file.exists():
            time.sleep(0.02)
        outage["stopped"] = time.monotonic()
        stoppable_postgres.stop("fast")
        time.sleep(OUTAGE_SECONDS)
        stoppable_postgres.start()
        outage["started"] = time.monotonic()

    errors, reconnects = DATABASE_OUTAGES.errors, DATABASE_OUTAGES.reconnects
    operator = threading.Thread(target=stop_then_start, daemon=True)
    operator.start()
    try:
        with caplog.at_level(logging.WARNING, logger="elastify.scheduler"):
            scheduler.run_until_done([build_id], timeout=60)  # raises if the loop ends on the outage
    finally:
        operator.join(timeout=30)
        scheduler.close()
    assert set(outage) == {"stopped", "started"}  # the outage happened while the build ran

    summary = build_summary(scheduler.sessions, build_id)
    assert summary["status"] == "succeeded", summary
    first = summary["stages"][0]
    assert first["key"] == "first" and [(a["status"], a["exit"]) for a in first["attempts"]] == [("succeeded", "ok")]
    assert DATABASE_OUTAGES.errors > errors and DATABASE_OUTAGES.reconnects - reconnects >= 1
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("database unreachable") for m in messages)
    assert any(m.startswith("database reachable again after") for m in messages)
