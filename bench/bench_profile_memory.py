"""Peak RSS of importance profiling against plain inference on SmolLM2 (goal ≤ 1.3×).

    .venv/bin/python -m bench.bench_profile_memory [--windows 16] [--length 128]

Each mode runs in a fresh process (peak RSS is per process). Inference = one no-grad
forward over the same calibration windows; profiling = the Taylor pass (forward + backward
with per-weight gradients folded into unit scores and freed at once). Raw JSON: bench/results/profile_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from bench.common import print_table, write_results


def child(mode: str, windows: int, length: int) -> None:
    # Imported here, in the child only: its peak RSS is the one measured.
    from pipeline.assets import prepare_smollm2
    from pipeline.data.calibration import make_windows
    from pipeline.elastilm.profile import unit_importance
    from pipeline.models.loading import load_model
    from pipeline.models.scoring import mean_nll

    loaded = load_model(prepare_smollm2())
    batch = make_windows(loaded.tokenizer, "ptb:train", windows, length, seed=0)
    started = time.perf_counter()
    if mode == "inference":
        mean_nll(loaded.model, batch, batch_size=windows)
    else:
        unit_importance(loaded.model, loaded.architecture, batch, "param_first")
    seconds = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"mode": mode, "peak_mb": peak_mb, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--child", choices=["inference", "profile"])
    args = parser.parse_args()
    if args.child:
        child(args.child, args.windows, args.length)
        return

    load_before = os.getloadavg()
    results = {}
    for mode in ("inference", "profile"):
        out = subprocess.run(
            [sys.executable, "-m", "bench.bench_profile_memory", "--child", mode, "--windows", str(args.windows),
             "--length", str(args.length)],
            check=True, capture_output=True, text=True,
        ).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    base = results["inference"]["peak_mb"]
    rows = [[mode, f"{r['peak_mb']:.0f}", f"{r['seconds']:.1f}", f"{r['peak_mb'] / base:.2f}×"] for mode, r in results.items()]
    print_table(f"SmolLM2 peak RSS, {args.windows}×{args.length} calibration tokens in one batch",
                ["mode", "peak RSS MB", "seconds", "vs inference"], rows)
    write_results("profile_memory", args, [r | {"vs_inference": r["peak_mb"] / base} for r in results.values()],
                  load_before)


if __name__ == "__main__":
    main()
