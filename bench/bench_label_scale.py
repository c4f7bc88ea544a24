"""Labelling with few-shot prompts, and what 1,200 items cost (issue 14 items 3 and 4).

Given an elastified SmolLM2 package with its level adapters and a score-head TLM (e.g. those
bench.bench_decision_head leaves), on the six labelled tasks:

1. prompt length per task: tokens of the few-shot block and the median labelled prompt (first 200 items);
2. the few-shot prefix's KV cache: the label worker's sweep with the prefix prefilled once per
   (task, ratio, level) and reused by every item, against the same sweep running each whole prompt,
   and against today's zero-shot prompts; the three run round-robin per task, `--repeats` times, on
   the same `--reuse-items` items and a small grid (`--reuse-ratios` x `--reuse-levels`: the gain is
   per grid cell) in one process, the TLM's compression inside every time. The gain grows with the
   items that share a prefix: a shard holds ~100 per task where this measures a few;
3. scale: `--scale-items` items per task through the label stage's own entry (`pipeline.elastilm.label.run`),
   `--shards` shards one after another, each in its own process with one thread (wall time, peak
   memory, the progress reports it made), extrapolated to 1,200 items on two cores (two shards side
   by side) and to the full 8 × 9 grid.

Raw JSON: bench/results/label_scale.json.

  nice -n 5 .venv/bin/python -m bench.bench_label_scale --package /tmp/dh-bench/package \
      --tlm /tmp/dh-bench/out/tlm-score/tlm
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import ROOT, print_table, write_json
from pipeline.data.tasks import few_shot_block, load_items
from pipeline.elastilm import label
from pipeline.settings import LabelSettings
from pipeline.stage import StageContext, quiet_context

TASKS = LabelSettings().tasks
LABELLED_ITEMS = 1200  # issue 14: >= 1,200 labelled items over six tasks
FULL_GRID_CELLS = 8 * 9  # the TLM's 8 ratios x a package's 9 levels


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan"))


def prompt_lengths(worker: label.LabelWorker, shots: int) -> dict:
    rows = {}
    for task in TASKS:
        items = load_items([task], 0, 200)
        block = few_shot_block(task, shots)
        full = worker.prompt_tokens(items, shots).tolist()
        zero = worker.prompt_tokens(items, 0).tolist()
        rows[task] = {"block_tokens": len(worker.ids(block + "\n\n")), "median_prompt_tokens": statistics.median(full),
                      "median_zero_shot_tokens": statistics.median(zero), "items": len(items)}
    return rows


def reuse_bench(worker: label.LabelWorker, args, ratios, levels) -> dict:
    """Seconds per task sweep in each mode, round-robin; the order of the modes rotates every repeat."""
    modes = {"reused": (args.shots, True), "whole": (args.shots, False), "zero_shot": (0, True)}
    seconds = {task: {mode: [] for mode in modes} for task in TASKS}
    worst = 0.0
    for repeat in range(args.repeats):
        order = list(modes)[repeat % 3:] + list(modes)[:repeat % 3]
        for task in TASKS:
            items = load_items([task], 300, 300 + args.reuse_items)  # held out: throughput only
            results = {}
            for mode in order:
                shots, reuse = modes[mode]
                started = time.perf_counter()
                results[mode] = worker.sweep_scored(items, ratios, levels, ["?"], quiet_context(), shots, reuse)
                seconds[task][mode].append(time.perf_counter() - started)
            if not torch.equal(results["reused"][0], results["whole"][0]):
                raise RuntimeError(f"{task}: reusing the prefix changed an answer")
            worst = max(worst, float((results["reused"][1] - results["whole"][1]).abs().max()))
            print(f"repeat {repeat} {task}: " + ", ".join(f"{m} {seconds[task][m][-1]:.1f} s" for m in modes),
                  flush=True)
    per_task = {}
    for task in TASKS:
        row = {}
        for mode in modes:
            mean, se = mean_se([s / args.reuse_items for s in seconds[task][mode]])
            row[f"{mode}_s_per_item"], row[f"{mode}_se"] = mean, se
        ratios_ = [w / r for w, r in zip(seconds[task]["whole"], seconds[task]["reused"], strict=True)]
        row["speedup"], row["speedup_se"] = mean_se(ratios_)
        row["seconds"] = seconds[task]
        per_task[task] = row
    totals = {mode: [sum(seconds[t][mode][k] for t in TASKS) for k in range(args.repeats)] for mode in modes}
    speedup = [w / r for w, r in zip(totals["whole"], totals["reused"], strict=True)]
    cost = [r / z for r, z in zip(totals["reused"], totals["zero_shot"], strict=True)]
    return {"items_per_task": args.reuse_items, "repeats": args.repeats, "per_task": per_task,
            "speedup_all_tasks": mean_se(speedup), "few_shot_reused_vs_zero_shot": mean_se(cost),
            "max_abs_margin_difference": worst}


def shard_child(spec: dict) -> None:
    """One label shard through the stage's entry, in this process; prints its JSON line."""
    torch.set_num_threads(spec["threads"])
    reports = []
    ctx = StageContext(work_dir=Path(spec["work_dir"]), on_progress=lambda task, done, total: reports.append(done))
    started = time.perf_counter()
    outputs = label.run({"package": Path(spec["package"]), "tlm": Path(spec["tlm"])},
                        LabelSettings(**spec["settings"]), ctx)
    elapsed = time.perf_counter() - started
    meta = json.loads(Path(outputs["meta"]).read_text())
    print(json.dumps({"seconds": elapsed, "items": len(meta["items"]), "progress_reports": len(reports),
                      "last_report": reports[-1] if reports else None,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def scale_bench(args, ratios, levels) -> dict:
    shards = []
    for shard in range(args.shards):
        spec = {"package": str(args.package), "tlm": str(args.tlm), "threads": args.threads,
                "work_dir": str(args.out / f"shard-{shard}"),
                "settings": {"tasks": TASKS, "per_task": args.scale_items, "shard": shard, "shards": args.shards,
                             "ratios": ratios, "levels": levels, "shots": args.shots}}
        done = subprocess.run([sys.executable, "-m", "bench.bench_label_scale", "--shard-json", json.dumps(spec)], check=True,
                              capture_output=True, text=True, cwd=ROOT)
        shards.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"shard {shard}: {shards[-1]}", flush=True)
    # The worker's load (model, LoRAs, TLM) is paid once per shard; items cost the rest.
    load = _worker_load_seconds(args)
    items = sum(s["items"] for s in shards)
    per_item = (sum(s["seconds"] for s in shards) - load * len(shards)) / items
    per_core = LABELLED_ITEMS / 2  # two shards side by side on two cores
    cells = len(ratios) * len(levels)
    return {"per_task": args.scale_items, "shards": shards, "items": items, "worker_load_s": load,
            "seconds_per_item": per_item, "grid_cells": cells,
            "extrapolated_1200_items_2_cores_s": load + per_core * per_item,
            "extrapolated_1200_items_2_cores_full_grid_s": load + per_core * per_item * FULL_GRID_CELLS / cells}


def _worker_load_seconds(args) -> float:
    started = time.perf_counter()
    label.LabelWorker(args.package, args.tlm)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", type=Path, help="elastified package with level adapters")
    parser.add_argument("--tlm", type=Path, help="a score-head TLM directory")
    parser.add_argument("--ratios", default="0.5,0.7,1.0", help="the demo's and bench_decision_head's")
    parser.add_argument("--levels", default="0.3,0.5,0.7,0.9,1.0")
    parser.add_argument("--shots", type=int, default=LabelSettings().shots)
    parser.add_argument("--reuse-items", type=int, default=8, help="items per task in the reuse comparison")
    parser.add_argument("--reuse-ratios", default="0.5,1.0")
    parser.add_argument("--reuse-levels", default="0.5,1.0")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale-items", type=int, default=20, help="items per task in the scale run")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-label-scale"))
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "label_scale.json")
    parser.add_argument("--shard-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shard_json:
        return shard_child(json.loads(args.shard_json))
    torch.set_num_threads(args.threads)
    ratios, levels = [float(x) for x in args.ratios.split(",")], args.levels.split(",")
    worker = label.LabelWorker(args.package, args.tlm)
    result = {"tasks": TASKS, "shots": args.shots, "ratios": ratios, "levels": levels, "threads": args.threads,
              "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(), "adapted_levels": worker.adapted_levels,
              "prompt_lengths": prompt_lengths(worker, args.shots)}
    reuse_grid = [float(x) for x in args.reuse_ratios.split(",")], args.reuse_levels.split(",")
    result["reuse"] = reuse_bench(worker, args, *reuse_grid) | {"ratios": reuse_grid[0], "levels": reuse_grid[1]}
    result["loadavg_after_reuse"] = os.getloadavg()
    write_json(args.results, result)
    del worker
    if not args.skip_scale:
        result["scale"] = scale_bench(args, ratios, levels)
        result["loadavg_after_scale"] = os.getloadavg()
        write_json(args.results, result)
    lengths, reuse = result["prompt_lengths"], result["reuse"]["per_task"]
    print_table(f"few-shot prompts ({args.shots} shots), grid {reuse_grid[0]} x {reuse_grid[1]}, "
                f"{args.threads} thread(s); s per item: mean ± SE over {args.repeats} repeats",
                ["task", "block tokens", "median prompt", "zero-shot s/item", "few-shot reused s/item",
                 "whole prompts s/item", "reuse speedup"],
                [[t, lengths[t]["block_tokens"], lengths[t]["median_prompt_tokens"],
                  f"{reuse[t]['zero_shot_s_per_item']:.2f} ± {reuse[t]['zero_shot_se']:.2f}",
                  f"{reuse[t]['reused_s_per_item']:.2f} ± {reuse[t]['reused_se']:.2f}",
                  f"{reuse[t]['whole_s_per_item']:.2f} ± {reuse[t]['whole_se']:.2f}",
                  f"{reuse[t]['speedup']:.2f}x ± {reuse[t]['speedup_se']:.2f}"] for t in TASKS])
    speed, se = result["reuse"]["speedup_all_tasks"]
    print(f"all tasks: reuse {speed:.2f}x ± {se:.2f}; few-shot (reused) / zero-shot cost "
          f"{result['reuse']['few_shot_reused_vs_zero_shot'][0]:.2f}x; max |margin difference| "
          f"{result['reuse']['max_abs_margin_difference']:.2e}")
    if "scale" in result:
        scale = result["scale"]
        print(f"scale: {scale['items']} items in {len(scale['shards'])} shards, {scale['seconds_per_item']:.2f} s/item; "
              f"1,200 items on 2 cores ~ {scale['extrapolated_1200_items_2_cores_s'] / 3600:.2f} h at this grid, "
              f"{scale['extrapolated_1200_items_2_cores_full_grid_s'] / 3600:.2f} h at the full grid")
    print(f"raw JSON: {args.results}")


if __name__ == "__main__":
    main()
