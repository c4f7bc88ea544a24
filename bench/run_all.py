"""Run the benchmarks in turn, each as `python -m bench.NAME`, and name the ones that fail.

Each prints its table and writes its raw JSON under bench/results/.

    .venv/bin/python -m bench.run_all [NAME ...]     e.g. -m bench.run_all elastic_linear level_switch
    .venv/bin/python -m bench.run_all --list         the benchmarks, without running them
"""

from __future__ import annotations

import argparse
import subprocess
import sys

BENCHMARKS = [
    "bench_ablation",
    "bench_api_load",
    "bench_client_pull",
    "bench_clone",
    "bench_decision_head",
    "bench_device",
    "bench_elastic_linear",
    "bench_elastilm",
    "bench_export",
    "bench_gpu_recovery",
    "bench_label_scale",
    "bench_level_switch",
    "bench_profile_memory",
    "bench_recovery",
    "bench_scheduler",
    "bench_tlm_step",
    "bench_trace",
]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help="benchmarks to run, with or without the bench_ prefix (default: all)")
    parser.add_argument("--list", action="store_true", help="print the benchmarks and exit")
    args = parser.parse_args()
    wanted = {name if name.startswith("bench_") else f"bench_{name}" for name in args.names}
    if unknown := wanted - set(BENCHMARKS):
        parser.error(f"no such benchmark: {', '.join(sorted(unknown))} (see --list)")
    selected = [name for name in BENCHMARKS if not wanted or name in wanted]
    if args.list:
        print("\n".join(selected))
        return 0
    failed = []
    for name in selected:
        print(f"\n=== {name}", flush=True)
        if subprocess.run([sys.executable, "-m", f"bench.{name}"]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
