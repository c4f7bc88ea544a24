"""Scheduler benchmarks on a real local Ray: per-stage overhead and no-op throughput (SQLite vs
PostgreSQL), and fan-out scaling of a CPU-bound stage with 1 vs 2 Ray workers (goal ≥ 1.7×).

    .venv/bin/python -m bench.bench_scheduler [--builds 60] [--shards 8] [--iterations 1500000]

Overhead per stage = (stage leased → result recorded) − the worker's own wall time for it,
i.e. what the database round trips, Ray dispatch and result collection add to every stage.
Raw JSON: bench/results/scheduler.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.table import Table
from sqlalchemy import select

from bench.common import console, write_results
from cluster.db import migrate
from cluster.models import Attempt, Stage
from cluster.registry import Registry
from cluster.scheduler import Scheduler
from cluster.service import submit_build
from cluster.settings import Settings
from cluster.spec import parse_spec
from pipeline.contract import Resources, Shard
from tests.support import services
from tests.support.control_plane import FAST, chain_registry
from workers import testing


def _spec(stages: dict, levels=(1.0,)):
    return parse_spec({"source": {"model": "unused"}, "levels": list(levels), "publish": {"name": "bench", "version": "1"},
                       "stages": {name: {"settings": own} for name, own in stages.items()}})


def _run(settings: Settings, registry: Registry, specs: list, max_inflight: int = 64) -> tuple[float, Scheduler]:
    migrate(settings.database_url)
    scheduler = Scheduler(settings, registry, max_inflight=max_inflight).start()
    build_ids = [submit_build(scheduler.sessions, spec, registry) for spec in specs]
    started = time.perf_counter()
    scheduler.run_until_done(build_ids, timeout=1800)
    return time.perf_counter() - started, scheduler


def noop_throughput(database_url: str, store: Path, builds: int) -> dict:
    """Throughput with a deep pipeline; overhead with at most one stage per Ray CPU in flight, so
    that no stage waits in Ray's queue and what is left is the scheduler's own cost."""
    settings = Settings(home=store.parent, database_url=database_url, store_url=str(store), **FAST)
    registry = chain_registry(testing.noop)

    def specs(run: str):
        return [_spec({"first": {"tag": f"{run}{i}a"}, "second": {"tag": f"{run}{i}b"}, "third": {"tag": f"{run}{i}c"}})
                for i in range(builds)]

    _run(settings, registry, specs("warm")[:4])[1].close()  # start Ray's worker processes first
    elapsed, scheduler = _run(settings, registry, specs("deep"))
    scheduler.close()
    _, scheduler = _run(settings, registry, specs("paced"), max_inflight=2)
    with scheduler.sessions() as session:
        rows = session.execute(
            select(Stage.started_at, Stage.finished_at, Attempt.wall_seconds).join(Attempt, Attempt.stage_id == Stage.id)
            .where(Stage.settings["tag"].as_string().like("paced%"))
        ).all()
    scheduler.close()
    overheads = sorted((end - start).total_seconds() - wall for start, end, wall in rows)
    return {"per_s": 3 * builds / elapsed, "overhead_ms": 1000 * statistics.median(overheads),
            "p95_ms": 1000 * overheads[int(0.95 * (len(overheads) - 1))]}


def fanout_seconds(workers: int, shards: int, iterations: int, home: Path) -> float:
    """Wall time of one fanned-out CPU-bound stage (first shard leased → last shard recorded)."""
    import ray

    registry = Registry([testing.tiny_stage(
        "burn", testing.burn, resources=Resources(num_cpus=1),
        fan_out=lambda spec, settings: [Shard(str(i), {"tag": f"s{i}"}) for i in range(shards)],
    )])
    ray.shutdown()
    with services.ray_head(num_cpus=workers, num_gpus=0):
        settings = Settings(home=home, database_url=f"sqlite:///{home / 'fan.db'}", store_url=str(home / "store"), **FAST)
        # Warm the worker pool so process start-up is not what is being measured.
        _run(settings, registry, [_spec({"burn": {"iterations": 1000, "warm": True}})])[1].close()
        _, scheduler = _run(settings, registry, [_spec({"burn": {"iterations": iterations}})])
        with scheduler.sessions() as session:
            spans = session.execute(
                select(Stage.started_at, Stage.finished_at).where(Stage.settings["iterations"].as_integer() == iterations)
            ).all()
        scheduler.close()
    return (max(end for _, end in spans) - min(start for start, _ in spans)).total_seconds()


def _burn(iterations: int) -> None:
    import hashlib

    value = b"x"
    for _ in range(iterations):
        value = hashlib.sha256(value).digest()


def machine_ceiling(workers: int, shards: int, iterations: int) -> float:
    """The same work in a plain process pool: what this machine allows, without Ray or a scheduler."""
    import multiprocessing

    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(_burn, [iterations] * shards)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builds", type=int, default=60, help="no-op builds (3 stages each) per database")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=1_500_000, help="sha256 rounds per CPU-bound shard")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="elastify-bench-"))
    load_before = os.getloadavg()

    results = {}
    with services.ray_head(num_cpus=2, num_gpus=0):
        results["SQLite"] = noop_throughput(f"sqlite:///{home / 'bench.db'}", home / "store-sqlite", args.builds)
        with services.postgres() as server:
            url = services.create_database(server, "bench")
            results["PostgreSQL"] = noop_throughput(url, home / "store-pg", args.builds)
    table = Table(title=f"No-op stages on local Ray (2 CPUs): {3 * args.builds} stages per database")
    for column in ("database", "no-op stages/s", "overhead/stage median ms", "p95 ms", "throughput vs SQLite"):
        table.add_column(column, justify="right")
    for name, r in results.items():
        table.add_row(name, f"{r['per_s']:.1f}", f"{r['overhead_ms']:.1f}", f"{r['p95_ms']:.1f}",
                      f"{r['per_s'] / results['SQLite']['per_s']:.2f}×")
    console.print(table)

    one = fanout_seconds(1, args.shards, args.iterations, home / "fan1")
    two = fanout_seconds(2, args.shards, args.iterations, home / "fan2")
    table = Table(title=f"Fan-out of a CPU-bound stage: {args.shards} shards × {args.iterations} sha256 rounds")
    for column in ("Ray workers", "seconds", "speed-up vs 1 worker", "goal"):
        table.add_column(column, justify="right")
    table.add_row("1", f"{one:.1f}", "1.00×", "")
    table.add_row("2", f"{two:.1f}", f"{one / two:.2f}×", "≥ 1.70×")
    pool_one, pool_two = (machine_ceiling(n, args.shards, args.iterations) for n in (1, 2))
    table.add_row("2 (plain process pool, no Ray)", f"{pool_two:.1f}", f"{pool_one / pool_two:.2f}×", "machine ceiling")
    console.print(table)
    write_results("scheduler", args, [{"database": name} | r for name, r in results.items()], load_before,
                  fanout={"ray_workers_1_s": one, "ray_workers_2_s": two, "speedup": one / two,
                          "process_pool_1_s": pool_one, "process_pool_2_s": pool_two,
                          "process_pool_speedup": pool_one / pool_two})


if __name__ == "__main__":
    main()
