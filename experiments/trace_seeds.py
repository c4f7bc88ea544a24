"""bench.bench_trace runs of one package under different --seed values, read together.

A run's seed shuffles its trace and seeds both decision heads' training, so one run says little about
which head is better: the heads differ by a few requests in each. This reads the served policies'
per-request rows (`served_alpha_0`) of several runs of the same package (so the same held-out items,
labelled the same) and prints, per run and pooled, each served policy's accuracy and its paired
difference from each of ours' heads, with 95% bootstrap intervals that resample items, an item asked in two
runs being one cluster. The unserved references (random feasible, oracle) have no per-request rows in
every run, so they are not pooled.

  .venv/bin/python -m experiments.trace_seeds experiments/results/trace-run5.json bench/results/trace.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import ROOT, print_table
from bench.trace import bootstrap_ci, paired_difference_ci
from device_sdk.format import atomic_write_bytes

HEADS = ["ours (utility)", "ours (SLO-token)"]


def served_rows(report: dict) -> dict[str, dict[str, list]]:
    """Per served policy, its per-request columns: `correct`, `item`, `violated`, `feasible`."""
    return {policy: {key: columns[key] for key in ("correct", "item", "violated", "feasible")}
            for policy, columns in report["served_alpha_0"].items()}


def compare(runs: list[dict[str, dict[str, list]]]) -> dict[str, dict]:
    """Per policy: accuracy [95%], each of ours' heads − it [95%] paired over the same requests, violations
    where feasible; the requests of every run in `runs` together."""
    policies = [p for p in runs[0] if all(p in run for run in runs)]
    items = [item for run in runs for item in run[HEADS[0]]["item"]]
    correct = {policy: [float(c) for run in runs for c in run[policy]["correct"]] for policy in policies}
    out = {}
    for policy in policies:
        violations = sum(v and f for run in runs
                         for v, f in zip(run[policy]["violated"], run[policy]["feasible"], strict=True))
        out[policy] = {"accuracy": bootstrap_ci(correct[policy], items),
                       "minus": {head: paired_difference_ci(correct[head], correct[policy], items)
                                 for head in HEADS if head != policy},
                       "violations_where_feasible": violations,
                       "feasible": sum(f for run in runs for f in run[policy]["feasible"])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", type=Path, nargs="+", help="bench.bench_trace raw JSONs of one package")
    parser.add_argument("--results", type=Path, default=ROOT / "experiments" / "results" / "trace-seeds.json")
    args = parser.parse_args()
    reports = [json.loads(path.read_text()) for path in args.traces]
    packages = {report["package"] for report in reports}
    if len(packages) != 1:
        parser.error(f"the runs served different packages ({', '.join(sorted(packages))}); their labels differ")
    seeds = [report["seed"] for report in reports]
    if len(set(seeds)) != len(seeds):
        parser.error(f"the runs share a seed ({seeds}): they are repeats, not seeds")
    runs = [served_rows(report) for report in reports]
    table = {str(path.name): compare([run]) for path, run in zip(args.traces, runs, strict=True)}
    table["pooled"] = compare(runs)

    def ci(v, scale=1.0, digits=3, sign=""):
        return f"{scale * v[0]:{sign}.{digits}f} [{scale * v[1]:{sign}.{digits}f}, {scale * v[2]:{sign}.{digits}f}]"

    for name, entry in table.items():
        rows = [[policy, ci(e["accuracy"]),
                 *("—" if head not in e["minus"] else ci(e["minus"][head], 100, 1, "+") for head in HEADS),
                 f"{e['violations_where_feasible']} / {e['feasible']}"] for policy, e in entry.items()]
        print_table(f"{name}: accuracy [95% item bootstrap]",
                    ["policy", "accuracy", *(f"{head} − it, points" for head in HEADS),
                     "violations where feasible / requests with a cell"], rows)
    report = {"package": packages.pop(), "runs": [str(p) for p in args.traces], "seeds": seeds, "table": table}
    atomic_write_bytes(args.results, (json.dumps(report, indent=2) + "\n").encode())
    print(f"raw JSON: {args.results}")


if __name__ == "__main__":
    main()
