"""REST API under load on loopback: 50 concurrent clients send 500 mixed requests (submit, list,
get, usage) to uvicorn over PostgreSQL, once with 1 worker process and once with 2 (`elastify
serve --workers`). Checks no 5xx and that every accepted submission is exactly one build (none
lost, none duplicated, replays of an Idempotency-Key answer the first build); prints p50/p99 per
request type, and as the baseline the p50 of the same mix from one client in the same run (no
queueing). GET /healthz (no database) is mixed in as a floor.

    .venv/bin/python -m bench.bench_api_load [--clients 50] [--requests 500] [--tenants 5] [--workers 1,2]

The scheduler does not run: builds stay queued, which is the heaviest case for listing.
Raw JSON: bench/results/api_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import httpx
from sqlalchemy import delete, func, select

from bench.common import ROOT, console, print_table, write_results
from cluster.models import Build, Event, Stage, StageInput
from tests.support import services

MIX = {"submit": 0.25, "replay": 0.05, "list": 0.25, "get": 0.25, "usage": 0.20}


def bench_app():
    """The app each uvicorn worker builds: settings from BENCH_* variables, the cheap test registry."""
    from api.app import create_app
    from cluster.settings import Settings
    from tests.support.control_plane import chain_registry

    home = Path(os.environ["BENCH_API_HOME"])
    settings = Settings(home=home, database_url=os.environ["BENCH_API_DATABASE_URL"], store_url=str(home / "store"))
    settings.ensure_signing_key()
    return create_app(settings, chain_registry())


def serve(database_url: str, home: str, port: int, workers: int) -> None:
    """The API server: uvicorn with `workers` processes, as `elastify serve --workers` runs it."""
    import uvicorn

    os.environ.update(BENCH_API_HOME=home, BENCH_API_DATABASE_URL=database_url,
                      PYTHONPATH=str(ROOT))
    uvicorn.run("bench.bench_api_load:bench_app", factory=True, host="127.0.0.1", port=port, workers=workers,
                log_level="warning", access_log=False)


def spec(tenant: str, n: int) -> dict:
    return {"source": {"model": "unused"}, "levels": [0.5, 1.0],
            "publish": {"name": f"{tenant}-pkg", "version": f"1.{n}"}}


async def client_loop(client: httpx.AsyncClient, tenant: str, token: str, plan: list[str], results: list,
                      accepted: dict, rng: random.Random) -> None:
    auth = {"Authorization": f"Bearer {token}"}
    mine: list[tuple[str, str, dict]] = []  # (key, build id, spec) of accepted submissions
    for kind in plan:
        if kind == "replay" and not mine:
            kind = "submit"
        if kind == "get" and not mine:
            kind = "list"
        started = time.perf_counter()
        if kind == "submit":
            key, body = uuid.uuid4().hex, spec(tenant, rng.randrange(10**6))
            response = await client.post("/v1/builds", json=body, headers={**auth, "Idempotency-Key": key})
            if response.status_code in (200, 201):
                mine.append((key, response.json()["id"], body))
                accepted[(tenant, key)].append((response.status_code, response.json()["id"]))
        elif kind == "replay":
            key, build_id, body = rng.choice(mine)
            response = await client.post("/v1/builds", json=body, headers={**auth, "Idempotency-Key": key})
            if response.status_code in (200, 201):
                accepted[(tenant, key)].append((response.status_code, response.json()["id"]))
        elif kind == "list":
            response = await client.get("/v1/builds", params={"limit": 20}, headers=auth)
        elif kind == "get":
            response = await client.get(f"/v1/builds/{rng.choice(mine)[1]}", headers=auth)
        elif kind == "usage":
            response = await client.get("/v1/usage", params={"group_by": ["day", "stage_type"]}, headers=auth)
        else:
            response = await client.get("/healthz")
        results.append((kind, response.status_code, time.perf_counter() - started))


async def load(url: str, tokens: dict[str, str], clients: int, requests: int, seed: int = 0):
    rng = random.Random(seed)
    kinds = rng.choices(list(MIX), weights=list(MIX.values()), k=requests)
    plans = [kinds[i::clients] for i in range(clients)]
    for plan in plans:  # the baseline, interleaved with the real work: ~1 in 10 of each client's requests
        for position in range(0, len(plan) + 1, 10):
            plan.insert(position, "healthz")
    results, accepted = [], defaultdict(list)
    tenants = list(tokens)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(
            client_loop(client, tenants[i % len(tenants)], tokens[tenants[i % len(tenants)]], plan, results, accepted,
                        random.Random(seed + i))
            for i, plan in enumerate(plans)
        ))
        wall = time.perf_counter() - started
    return results, accepted, wall


def check_builds(sessions, accepted: dict) -> tuple[int, int, int]:
    """(accepted keys, builds in the database, problems): each accepted key is one build, replays agree."""
    problems = 0
    with sessions() as session:
        rows = session.execute(select(Build.tenant_id, Build.idempotency_key, Build.id)).all()
        count = session.scalar(select(func.count()).select_from(Build))
    by_key = {(tenant, key): build_id for tenant, key, build_id in rows}
    for key, answers in accepted.items():
        ids = {build_id for _, build_id in answers}
        created = sum(status == 201 for status, _ in answers)
        if len(ids) != 1 or created != 1 or by_key.get(key) not in ids:
            problems += 1
    problems += len(set(by_key) - set(accepted))  # builds nobody was told about
    return len(accepted), count, problems


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def by_kind(results) -> dict[str, list[float]]:
    grouped = defaultdict(list)
    for kind, _, seconds in results:
        grouped[kind].append(seconds)
    return grouped


def clear_builds(sessions) -> None:
    with sessions.begin() as session:
        for table in (StageInput, Event, Stage, Build):
            session.execute(delete(table))


def run_server(database_url: str, home: str, sessions, tokens, workers: int, clients: int, requests: int):
    """One measured run against a fresh server: (1-client baseline, loaded results, accepted, wall)."""
    port = services.free_port()
    process = multiprocessing.get_context("spawn").Process(target=serve, args=(database_url, home, port, workers))
    process.start()
    try:
        services.wait_for_port(port, 60)
        url = f"http://127.0.0.1:{port}"
        alone, _, _ = asyncio.run(load(url, tokens, 1, 150, seed=99))  # the baseline; warms every worker up
        clear_builds(sessions)
        results, accepted, wall = asyncio.run(load(url, tokens, clients, requests))
    finally:
        process.terminate()
        process.join(15)
    return alone, results, accepted, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--tenants", type=int, default=5)
    parser.add_argument("--workers", default="1,2", help="uvicorn worker counts to compare")
    args = parser.parse_args()
    worker_counts = [int(w) for w in args.workers.split(",")]

    from api.auth import create_token
    from cluster.db import make_engine, migrate, session_factory

    load_before = os.getloadavg()
    runs, ok, checks = {}, True, {}
    with services.postgres() as server, tempfile.TemporaryDirectory(prefix="bench-api-") as home:
        database_url = services.create_database(server, "bench_api")
        migrate(database_url)
        sessions = session_factory(make_engine(database_url))
        tokens = {f"tenant{i}": create_token(sessions, f"tenant{i}") for i in range(args.tenants)}
        for workers in worker_counts:
            alone, results, accepted, wall = run_server(database_url, home, sessions, tokens, workers, args.clients,
                                                        args.requests)
            keys, builds, problems = check_builds(sessions, accepted)
            statuses = Counter(status for _, status, _ in results)
            server_errors = sum(n for status, n in statuses.items() if status >= 500)
            console.print(f"{workers} worker(s): statuses {dict(sorted(statuses.items()))}; 5xx: {server_errors}; "
                          f"accepted submissions {keys}, builds in the database {builds}, lost or duplicated: {problems}")
            ok &= server_errors == 0 and problems == 0 and keys == builds
            checks[workers] = {"statuses": dict(sorted(statuses.items())), "server_errors": server_errors,
                               "accepted_submissions": keys, "builds": builds, "lost_or_duplicated": problems}
            runs[workers] = (by_kind(alone), by_kind(results), wall, len(results))
            clear_builds(sessions)

    first = worker_counts[0]
    single = runs[first][0]
    columns = ["request", "n", "1 client p50 ms"]
    for workers in worker_counts:
        columns += [f"{workers}w p50 ms", f"{workers}w p99 ms"]
    rows, raw = [], []
    for kind in ["healthz", *MIX]:
        if not single[kind] or not runs[first][1][kind]:
            continue
        row = [kind, len(runs[first][1][kind]), f"{statistics.median(single[kind]) * 1e3:.1f}"]
        raw.append({"request": kind, "n": len(runs[first][1][kind]), "one_client_p50_s": statistics.median(single[kind])})
        for workers in worker_counts:
            p50, p99 = percentiles(runs[workers][1][kind])
            row += [f"{p50 * 1e3:.0f}", f"{p99 * 1e3:.0f}"]
            raw[-1] |= {f"workers_{workers}_p50_s": p50, f"workers_{workers}_p99_s": p99}
        rows.append(row)
    throughput = {w: (n - len(loaded["healthz"])) / wall for w, (_, loaded, wall, n) in runs.items()}
    rows.append(["requests/s", "", ""] + [cell for w in worker_counts for cell in (f"{throughput[w]:.0f}", "")])
    print_table(f"API load: {args.clients} clients, {args.requests} mixed requests (+healthz), PostgreSQL, "
                f"uvicorn workers {args.workers}", columns, rows)
    if len(worker_counts) > 1:
        last = worker_counts[-1]
        console.print(f"{last} workers vs {first}: {throughput[last] / throughput[first]:.2f}× requests/s")
    if not ok:
        console.print("[bold red]FAILED[/]: 5xx answers or lost/duplicated builds")
    write_results("api_load", args, raw, load_before, ok=ok, checks=checks,
                  requests_per_s={str(w): value for w, value in throughput.items()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
