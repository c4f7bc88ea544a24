"""REST API under load on loopback: 50 concurrent clients send 500 mixed requests (submit, list,
get, usage) to one uvicorn process over PostgreSQL. Checks no 5xx and that every accepted
submission is exactly one build (none lost, none duplicated, replays of an Idempotency-Key
answer the first build); prints p50/p99 per request type, the p50 of the same requests from one
client in the same run (the baseline: no queueing), and GET /healthz (no database) under load.

    .venv/bin/python bench/bench_api_load.py [--clients 50] [--requests 500] [--tenants 5]

The scheduler does not run: builds stay queued, which is the heaviest case for listing.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from sqlalchemy import delete, func, select  # noqa: E402

from bench.common import console, print_table  # noqa: E402
from cluster.models import Build, Event, Stage, StageInput  # noqa: E402
from tests.integration import services  # noqa: E402

MIX = {"submit": 0.25, "replay": 0.05, "list": 0.25, "get": 0.25, "usage": 0.20}


def serve(database_url: str, home: str, port: int) -> None:
    """The API server process: one uvicorn worker, the cheap test registry."""
    from api.app import ServerThread, create_app
    from cluster.settings import Settings
    from tests.integration.control_plane import chain_registry

    settings = Settings(home=Path(home), database_url=database_url, store_url=str(Path(home) / "store"))
    settings.ensure_signing_key()
    ServerThread(create_app(settings, chain_registry()), port=port).server.run()


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--tenants", type=int, default=5)
    args = parser.parse_args()

    from api.auth import create_token
    from cluster.db import make_engine, migrate, session_factory

    with services.postgres() as server, tempfile.TemporaryDirectory(prefix="bench-api-") as home:
        database_url = services.create_database(server, "bench_api")
        migrate(database_url)
        sessions = session_factory(make_engine(database_url))
        tokens = {f"tenant{i}": create_token(sessions, f"tenant{i}") for i in range(args.tenants)}
        port = services.free_port()
        process = multiprocessing.get_context("spawn").Process(target=serve, args=(database_url, home, port), daemon=True)
        process.start()
        try:
            services.wait_for_port(port, 60)
            url = f"http://127.0.0.1:{port}"
            alone, _, _ = asyncio.run(load(url, tokens, 1, 150, seed=99))  # the baseline; warms the server up
            with sessions.begin() as session:  # start the measured run from an empty build table
                session.execute(delete(StageInput))
                session.execute(delete(Event))
                session.execute(delete(Stage))
                session.execute(delete(Build))
            results, accepted, wall = asyncio.run(load(url, tokens, args.clients, args.requests))
        finally:
            process.terminate()
            process.join(10)
        keys, builds, problems = check_builds(sessions, accepted)

    statuses = Counter(status for _, status, _ in results)
    server_errors = sum(n for status, n in statuses.items() if status >= 500)
    by_kind = defaultdict(list)
    for kind, _, seconds in results:
        by_kind[kind].append(seconds)
    single = defaultdict(list)
    for kind, _, seconds in alone:
        single[kind].append(seconds)
    rows = []
    for kind in ["healthz", *MIX]:
        samples = sorted(by_kind[kind])
        if not samples or not single[kind]:
            continue
        p50, p99 = statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))]
        base = statistics.median(single[kind])
        rows.append([kind, len(samples), f"{p50 * 1e3:.1f}", f"{p99 * 1e3:.1f}", f"{base * 1e3:.1f}",
                     f"{p50 / base:.1f}×"])
    measured = len(results) - len(by_kind["healthz"])
    print_table(f"API load: {args.clients} clients, {measured} requests (+{len(by_kind['healthz'])} healthz), "
                f"PostgreSQL, {wall:.1f} s, {measured / wall:.0f} req/s",
                ["request", "n", "p50 ms", "p99 ms", "1 client p50 ms", "p50 vs 1 client"], rows)
    console.print(f"statuses {dict(sorted(statuses.items()))}; 5xx: {server_errors}; accepted submissions {keys}, "
                  f"builds in the database {builds}, lost or duplicated: {problems}")
    ok = server_errors == 0 and problems == 0 and keys == builds
    if not ok:
        console.print("[bold red]FAILED[/]: 5xx answers or lost/duplicated builds")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
