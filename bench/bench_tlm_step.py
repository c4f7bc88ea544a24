"""Seconds per training step of ElastiLM's SLO-token decision head: fp32 vs bf16 autocast, with and
without dropout in the frozen trunk (the stage's behaviour before and after it ran the trunk as served).

The rows are a real build's `label-derive` output (`--labels`; by default the newest local build's
under $ELASTIFY_HOME/store, e.g. `make demo`'s, which labels 20 few-shot ARC-E and SciQ items into
~830 SLO rows), the TLM the same build's `tlm-score` output (`--tlm`). Every case runs `--steps` steps
of `train_decision_head` (batch 16, the same batches: seed 0) per sample, round-robin, `--repeats`
samples; the table gives the median seconds per step and each case's ratio to the old one (fp32,
trunk dropout) in the same run.

  .venv/bin/python -m bench.bench_tlm_step        # after make demo (~5 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from bench.common import ROOT, print_table, write_json
from pipeline.elastilm import tlm as tlm_module
from pipeline.models.precision import cpu_has_native_bf16

CASES = {  # name: (precision, dropout in the frozen trunk)
    "fp32, trunk dropout (before)": ("float32", True),
    "bf16, trunk dropout": ("bfloat16", True),
    "fp32, no trunk dropout": ("float32", False),
    "bf16, no trunk dropout (now, on native bf16)": ("bfloat16", False),
}


def run_case(model, tokenizer, rows, steps: int, precision: str, trunk_dropout: bool) -> float:
    if trunk_dropout:  # the old behaviour: every submodule in training mode, the frozen trunk included
        model.train = lambda mode=True: nn.Module.train(model, mode)
    try:
        started = time.perf_counter()
        tlm_module.train_decision_head(model, tokenizer, rows, steps=steps, precision=precision)
        return (time.perf_counter() - started) / steps
    finally:
        model.__dict__.pop("train", None)


def newest_demo_outputs() -> tuple[Path, Path]:
    """(labels.json, TLM dir) of the newest local build that has both (a local store's layout)."""
    home = Path(os.environ.get("ELASTIFY_HOME", Path.home() / ".cache" / "elastify"))
    builds = sorted((home / "store" / "builds").glob("*/"), key=lambda p: p.stat().st_mtime, reverse=True)
    for build in builds:
        labels = build / "label-derive" / "a1" / "labels" / "files" / "labels.json"
        tlm_dir = build / "tlm-score" / "a1" / "tlm" / "files"
        if labels.is_file() and tlm_dir.is_dir():
            return labels, tlm_dir
    raise SystemExit(f"no build with labels and a TLM under {home / 'store'}: run `make demo` first, "
                     "or pass --labels and --tlm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labels", type=Path, help="a label-derive labels.json (default: the newest build's)")
    parser.add_argument("--tlm", type=Path, help="a tlm-score TLM directory (default: the same build's)")
    parser.add_argument("--rule", default="capable")
    parser.add_argument("--steps", type=int, default=3, help="steps per sample")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "tlm_step.json")
    args = parser.parse_args()

    if (args.labels is None) != (args.tlm is None):
        parser.error("give both --labels and --tlm, or neither")
    if args.labels is None:
        args.labels, args.tlm = newest_demo_outputs()
    torch.set_num_threads(args.threads)
    rows = json.loads(args.labels.read_text())["rules"][args.rule]
    model, tokenizer = tlm_module.load_tlm(args.tlm)
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    run_case(model, tokenizer, rows, 1, "float32", False)  # warm-up
    for _ in range(args.repeats):
        for name, (precision, trunk_dropout) in CASES.items():
            samples[name].append(run_case(model, tokenizer, rows, args.steps, precision, trunk_dropout))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    before = medians["fp32, trunk dropout (before)"]
    print_table(f"SLO-token head, s/step (batch 16, {args.threads} thread(s), median of {args.repeats} × "
                f"{args.steps} steps)", ["case", "s/step", "samples' range", "÷ before"],
                [[name, f"{value:.2f}", f"{min(samples[name]):.2f}–{max(samples[name]):.2f}", f"{value / before:.2f}"]
                 for name, value in medians.items()])
    write_json(args.results, {
        "labels": str(args.labels), "rows": len(rows), "prompts": len({row["prompt"] for row in rows}), "rule": args.rule,
        "steps_per_sample": args.steps, "repeats": args.repeats, "threads": args.threads,
        "cpu_native_bf16": cpu_has_native_bf16(), "loadavg_before": os.getloadavg(),
        "seconds_per_step": samples, "median": medians,
    })


if __name__ == "__main__":
    main()
