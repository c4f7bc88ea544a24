"""device_sdk.pull of SmolLM2 through the REST API vs the same files from a plain HTTP bucket.

    .venv/bin/python -m bench.bench_client_pull [--package DIR] [--repeats 3] [--workers 4]

Three registries hold the same signed package: a directory (no HTTP), a static HTTP bucket
(Starlette StaticFiles under uvicorn: Range, no auth) and the Elastify API (/v1: bearer token,
tenant-scoped package lookup in SQLite, manifest check, Range from the local store). Both servers
run in their own processes. Rows: a full pull and a max_level=0.5 pull (many byte ranges),
seconds (median of interleaved repeats, verification included), MB/s, and the ratio to the
static bucket measured in the same run. Raw JSON: bench/results/client_pull.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_device import bench_package, sign_copy
from bench.common import console, print_table, write_results
from device_sdk.registry import pull, read_local_state
from tests.support import services


def serve_api(home: str, database_url: str, port: int) -> None:
    from api.app import ServerThread, create_app
    from cluster.settings import Settings
    from tests.support.control_plane import chain_registry

    app = create_app(Settings(home=Path(home), database_url=database_url), chain_registry(), ready_checks={})
    with ServerThread(app, port=port):
        while True:
            time.sleep(3600)


def serve_static(root: str, port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.staticfiles import StaticFiles

    app = Starlette(routes=[Mount("/", StaticFiles(directory=root))])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def start(target, *args) -> multiprocessing.Process:
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    services.wait_for_port(args[-1], 60)
    return process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, help="an elastic package directory (default: bench_device's SmolLM2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4, help="parallel range fetches per pull")
    args = parser.parse_args()
    # Here, not at the top: the spawned servers import this module, and the static bucket needs none of the API.
    from tests.support.api import make_api
    from tests.support.live_api import LiveAPI

    load_before = os.getloadavg()
    home = Path(os.environ.get("ELASTIFY_HOME", Path.home() / ".cache" / "elastify"))
    package = args.package or bench_package(home)
    with tempfile.TemporaryDirectory(prefix="elastify-pull-bench-") as scratch:
        scratch = Path(scratch)
        registry_dir, public_key = sign_copy(package, scratch)
        api = make_api(scratch / "api")
        live = LiveAPI(api, url="")
        live.publish(registry_dir / "packages" / "smollm2" / "1.0.0", "bench")
        token = live.token("bench")
        store_root = Path(api.settings.store_url)
        api.app.state.engine.dispose()
        api_port, static_port = services.free_port(), services.free_port()
        servers = [start(serve_api, str(api.settings.home), api.settings.database_url, api_port),
                   start(serve_static, str(store_root), static_port)]
        registries = {
            "directory (no HTTP)": str(registry_dir),
            "static HTTP bucket (baseline)": f"http://127.0.0.1:{static_port}",
            "Elastify API /v1": f"http://127.0.0.1:{api_port}/v1",
        }
        cases = [(name, level) for level in (None, 0.5) for name in registries]
        seconds: dict[tuple[str, float | None], list[float]] = {case: [] for case in cases}
        sizes: dict[float | None, int] = {}
        try:
            for repeat in range(args.repeats + 1):  # the first round warms the page cache and is not counted
                for name, level in cases:
                    cache = scratch / "cache"
                    started = time.perf_counter()
                    path = pull("smollm2", "1.0.0", registry=registries[name], public_key=public_key, token=token,
                                max_level=level, cache_dir=cache, workers=args.workers)
                    elapsed = time.perf_counter() - started
                    sizes[level] = read_local_state(path)["bytes"]
                    shutil.rmtree(cache)
                    if repeat:
                        seconds[(name, level)].append(elapsed)
        finally:
            for server in servers:
                server.terminate()
                server.join(10)
    rows, raw = [], []
    for name, level in cases:
        median = statistics.median(seconds[(name, level)])
        baseline = statistics.median(seconds[("static HTTP bucket (baseline)", level)])
        rows.append([name, "full" if level is None else f"max_level={level}", f"{sizes[level] / 1e6:.0f} MB",
                     f"{median:.2f}", f"{sizes[level] / 1e6 / median:.0f}", f"{median / baseline:.2f}x"])
        raw.append({"registry": name, "max_level": level, "bytes": sizes[level], "seconds": seconds[(name, level)],
                    "median_s": median, "vs_static_bucket": median / baseline})
    print_table(f"pull SmolLM2 (verify included), {args.workers} parallel ranges, median of {args.repeats}",
                ["registry", "pull", "bytes", "seconds", "MB/s", "vs static bucket"], rows)
    console.print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    write_results("client_pull", args, raw, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
