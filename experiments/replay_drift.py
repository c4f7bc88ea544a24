"""What the SDK's profile recalibration (`device_sdk.latency.Drift`) would have said about a served trace.

Replays a bench.bench_trace run's per-request rows (its raw JSON, `served_alpha_0`) in the order they were
served (item by item, as bench_trace serves them) through a fresh `Drift` per policy: before each
request, would the recalibrated prediction of the cell it was served at still meet the request's
target? Then the request's measured TTFT and TPOT are observed, as the SDK does after serving. For
the requests whose profile saw a feasible cell this counts the violations the recalibration would have
caught (the cell rejected), those it lets through, and the requests that met their SLO but whose cell
it would have rejected (a lighter cell would have been served; its accuracy is not known here). A
counterfactual on one cell, not a served run: the policy would have picked another cell, and what
that cell measures is not in the rows. Only the policies whose rows' `predicted_ms` hold exactly the
profile's prediction are replayed (LLM-Pruner, LLMLingua-2 style, ShortGPT; the runs before
`Decision.tlm_ran` added the TLM's decision time to ours even where it was skipped; from it on, every
served policy's are).

A run served under `Drift` already holds the recalibrated prediction in its rows; replaying a fresh
`Drift` over it would count the recalibration twice, so such a run is replayed with `--quantiles off`
and a sweep of `--headrooms` (`Drift.headroom`, a margin on top of what the run's profile predicted).
This is how the SDK's default headroom was chosen, on experiments/results/trace-run1.json and trace-run2.json:

  .venv/bin/python -m experiments.replay_drift --trace bench/results/trace.json --label-dir /tmp/dh-bench/out/label
  .venv/bin/python -m experiments.replay_drift \
      --trace experiments/results/trace-run1.json experiments/results/trace-run2.json \
      --label-dir /tmp/trace-run/out/label --quantiles off --headrooms 1,1.02,1.04,1.06,1.08,1.1 \
      --results experiments/results/drift_headroom_replay.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import ROOT, print_table
from device_sdk.format import atomic_write_bytes
from device_sdk.latency import SLO, Drift

REPLAYED = ["LLM-Pruner", "LLMLingua-2", "ShortGPT"]


def replay(rows: dict, order: list[int], quantile: float | None, headroom: float) -> dict:
    drift = Drift(quantile=quantile, headroom=1.0)  # the headroom is swept here, not taken from the SDK
    counts = {"feasible": 0, "violations": 0, "caught": 0, "let_through": 0, "met_but_rejected": 0,
              "met_and_accepted": 0}
    for j in order:
        cell = str(rows["level"][j] or rows["cell"][j])  # ShortGPT's rows name their depth as the cell
        predicted_ttft, predicted_tpot = rows["predicted_ms"][j]
        ttft, tpot = rows["ttft_ms"][j], rows["tpot_ms"][j]
        target = SLO(*rows["target"][j])
        accepted = target.met(predicted_ttft * headroom * drift.factor("ttft", cell),
                              predicted_tpot * headroom * drift.factor("tpot", cell))
        if rows["feasible"][j]:
            counts["feasible"] += 1
            if rows["violated"][j]:
                counts["violations"] += 1
                counts["let_through" if accepted else "caught"] += 1
            else:
                counts["met_and_accepted" if accepted else "met_but_rejected"] += 1
        drift.observe("ttft", cell, ttft, predicted_ttft)
        if tpot is not None:
            drift.observe("tpot", cell, tpot, predicted_tpot)
    return counts


def serving_order(report: dict, label_dir: Path) -> list[int]:
    """bench_trace serves every request of an item together, items in the held-out shards' order (task by
    task), each item's requests in trace order: the order the rows cannot tell, the shards can."""
    first = next(iter(report["served_alpha_0"].values()))
    held_out = [item["id"] for task in report["tasks"]
                for shard in sorted(label_dir.glob(f"{task}-3*-{report['shots']}shot"))
                for item in json.loads((shard / "correctness.json").read_text())["items"]]
    rank = {item: k for k, item in enumerate(held_out)}
    return sorted(range(len(first["item"])), key=lambda j: (rank[first["item"][j]], j))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, nargs="+", default=[ROOT / "bench" / "results" / "trace.json"])
    parser.add_argument("--label-dir", type=Path, default=Path("/tmp/dh-bench/out/label"),
                        help="bench.bench_trace's label shards (the held-out ones give the serving order)")
    parser.add_argument("--quantiles", default="0.5,0.9", help="a fresh Drift's quantiles; 'off': none")
    parser.add_argument("--headrooms", default="1.0")
    parser.add_argument("--results", type=Path, default=ROOT / "experiments" / "results" / "drift_replay.json")
    args = parser.parse_args()
    quantiles = [None if q == "off" else float(q) for q in args.quantiles.split(",")]
    headrooms = [float(h) for h in args.headrooms.split(",")]
    results, rows = {"traces": {}}, []
    for trace in args.trace:
        report = json.loads(trace.read_text())
        if report.get("drift_quantile") is not None and quantiles != [None]:
            raise SystemExit(f"{trace} was served under Drift: its predictions are recalibrated already; "
                             "replay it with --quantiles off")
        served = report["served_alpha_0"]
        policies = list(served) if "tlm_ran" in served["ours (utility)"] else REPLAYED  # exact predictions
        order = serving_order(report, args.label_dir)
        summary = results["traces"].setdefault(trace.name, {"requests": len(order), "policies": {}})
        for quantile in quantiles:
            for headroom in headrooms:
                total = dict.fromkeys(("feasible", "violations", "caught", "let_through", "met_but_rejected"), 0)
                for policy in policies:
                    counts = replay(served[policy], order, quantile, headroom)
                    summary["policies"].setdefault(policy, {})[f"{quantile}×{headroom}"] = counts
                    total = {k: v + counts[k] for k, v in total.items()}
                    rows.append([trace.name, policy, str(quantile), headroom, counts["feasible"],
                                 counts["violations"], counts["caught"], counts["let_through"],
                                 counts["met_but_rejected"]])
                summary.setdefault("all", {})[f"{quantile}×{headroom}"] = total
                rows.append([trace.name, "all", str(quantile), headroom, *total.values()])
    print_table("Drift replayed over served traces: requests whose profile saw a feasible cell",
                ["trace", "policy", "quantile", "headroom", "feasible", "violations", "caught", "let through",
                 "met but rejected"], rows)
    atomic_write_bytes(args.results, json.dumps(results, indent=2).encode())
    print(f"raw JSON: {args.results}")


if __name__ == "__main__":
    main()
