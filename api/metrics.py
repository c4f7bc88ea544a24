"""Prometheus metrics, computed from the job store at scrape time.

The scheduler may run in another process (or several), so counting in this process would miss
its work; the database holds every build, attempt and lease expiry, and each API replica
reports the same numbers from it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from sqlalchemy import case, func, select
from sqlalchemy.exc import DBAPIError

from cluster.db import DATABASE_OUTAGES, is_connection_error
from cluster.ledger import compute_by_stage_type
from cluster.models import Attempt, Build, Stage
from cluster.states import Status

DURATION_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0)


class JobStoreCollector(Collector):
    def __init__(self, sessions):
        self.sessions = sessions

    def collect(self):
        try:
            with self.sessions() as session:
                builds = dict(session.execute(select(Build.status, func.count()).group_by(Build.status)).all())
                queued = session.scalar(
                    select(func.count()).select_from(Stage).join(Build, Build.id == Stage.build_id)
                    .where(Stage.status == Status.QUEUED.value, Build.cancel_requested.is_(False))
                )
                finished = Attempt.ended_at.is_not(None)
                columns = [func.sum(case((Attempt.wall_seconds <= bound, 1), else_=0)) for bound in DURATION_BUCKETS]
                durations = session.execute(
                    select(Stage.type, func.count(), func.sum(Attempt.wall_seconds), *columns).select_from(Attempt)
                    .join(Stage, Stage.id == Attempt.stage_id).where(finished).group_by(Stage.type)
                ).all()
                compute = compute_by_stage_type(session)
                expiries = session.scalar(select(func.count()).select_from(Attempt).where(Attempt.exit == "lease_expired"))
        except DBAPIError as err:
            if not is_connection_error(err):
                raise
            return  # the database is down: nothing to read now; DatabaseOutageCollector still answers

        by_state = GaugeMetricFamily("elastify_builds", "Builds by state", labels=["state"])
        for state in Status:
            by_state.add_metric([state.value], builds.get(state.value, 0))
        yield by_state
        yield GaugeMetricFamily("elastify_queue_depth", "Stages queued in builds not being cancelled", value=queued)
        histogram = HistogramMetricFamily("elastify_stage_duration_seconds",
                                          "Wall time of finished stage attempts, by stage type", labels=["stage_type"])
        for stage_type, count, total, *cumulative in durations:
            buckets = [(floatToGoString(bound), int(n or 0)) for bound, n in zip(DURATION_BUCKETS, cumulative, strict=True)]
            histogram.add_metric([stage_type], buckets + [("+Inf", count)], float(total or 0.0))
        yield histogram
        gpu_seconds = CounterMetricFamily("elastify_gpu_seconds", "GPU-seconds of all attempts (failed ones too)",
                                          labels=["stage_type"])
        # CPU time the stage processes used (user + system), as `usage` and the dashboard's CPU-hours report it,
        # running attempts included (so rate() shows load as it happens): a CPU-only deployment's GPU series stays 0.
        cpu_seconds = CounterMetricFamily("elastify_cpu_seconds", "CPU-seconds of all attempts (failed ones too)",
                                          labels=["stage_type"])
        for stage_type, charged in sorted(compute.items()):
            gpu_seconds.add_metric([stage_type], charged["gpu_seconds"])
            cpu_seconds.add_metric([stage_type], charged["cpu_seconds"])
        yield gpu_seconds
        yield cpu_seconds
        yield CounterMetricFamily("elastify_lease_expiries", "Stage leases that expired (a worker or scheduler died)",
                                  value=expiries)


class DatabaseOutageCollector(Collector):
    """What this process's scheduler met of database outages (cluster.db.DATABASE_OUTAGES): counted in the
    process, since the database cannot record its own absence. Zero in an API process without a scheduler."""

    def collect(self):
        yield CounterMetricFamily("elastify_database_errors", "Database round trips of the scheduler that failed "
                                  "for want of a connection (each retried after a backoff)", value=DATABASE_OUTAGES.errors)
        yield CounterMetricFamily("elastify_database_reconnects", "Times the scheduler reconnected after a database "
                                  "outage", value=DATABASE_OUTAGES.reconnects)


def job_store_registry(sessions) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseOutageCollector())
    registry.register(JobStoreCollector(sessions))
    return registry
