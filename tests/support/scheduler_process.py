"""A scheduler in its own process, for tests that kill it or run two side by side.

    python -m tests.support.scheduler_process DATABASE_URL STORE_URL REGISTRY [--idle-exit] [--wait-for FILE] [--ready FILE]

REGISTRY is `chain-noop` or `chain-sleep-fanout` (see tests.support.control_plane.chain_registry). It joins the
Ray cluster at ELASTIFY_RAY_ADDRESS.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import ray

from cluster.scheduler import Scheduler
from cluster.settings import Settings
from tests.support.control_plane import FAST, chain_registry
from workers import testing

REGISTRIES = {
    "chain-noop": lambda: chain_registry(testing.noop),
    "chain-sleep-fanout": lambda: chain_registry(testing.sleep, fan_out=True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("database_url")
    parser.add_argument("store_url")
    parser.add_argument("registry", choices=sorted(REGISTRIES))
    parser.add_argument("--idle-exit", action="store_true")
    parser.add_argument("--wait-for", type=Path)
    parser.add_argument("--ready", type=Path)
    parser.add_argument("--lease-seconds", type=float, default=FAST["lease_seconds"])
    args = parser.parse_args()
    options = {**FAST, "lease_seconds": args.lease_seconds}
    settings = Settings.from_env(database_url=args.database_url, store_url=args.store_url, **options)
    ray.init(address=settings.ray_address, logging_level="WARNING", log_to_driver=False)
    scheduler = Scheduler(settings, REGISTRIES[args.registry]()).start()
    if args.ready:
        args.ready.write_text(scheduler.owner)
    while args.wait_for and not args.wait_for.exists():
        time.sleep(0.05)
    try:
        scheduler.run(idle_exit=args.idle_exit)
    finally:
        scheduler.close()


if __name__ == "__main__":
    main()
