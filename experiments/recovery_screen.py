"""One screen of recovery settings: `bench.bench_recovery --worker` runs side by side, assembled into a JSON.

A screen changes one thing (the LoRA rank, the corpus, ...) and trains one level per setting on the
same package, window set and prompt set, one seed. Each run is NAME=OUT=CORPUS[=METHOD] (the worker's
--out and --corpus, and which of its methods: (c) `distill` unless given); the first is the baseline.
LAMBADA and the generation prompts are the same for every run, so they are compared paired; the held-out and validation slices come from the corpus, so they are
paired only between runs on the same corpus. With --decoding, each run's greedy output is also read
over all 32 prompts by experiments.decoding_screen (repeat-4 and the full model's NLL of it), against the baseline's
with a prompt-resampling bootstrap. The full model's numbers come from --reference, a
bench.bench_recovery reference read (recovery.json's `full_model`, or a screen's `quality["1.0"]`).

  .venv/bin/python -m experiments.recovery_screen --level 0.7 --what "..." --command "..." \\
      --run "48 prompts=/tmp/rb48=C48" --run "480 prompts=/tmp/rb480=C480" --out experiments/results/X.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from bench.common import ROOT, print_table
from pipeline.models.scoring import paired_ratio

METHOD = "distill"  # the worker's (c), a run's method unless its spec names another


def full_reference(path: Path) -> dict:
    data = json.loads(path.read_text())
    return data["full_model"] if "full_model" in data else data["quality"]["1.0"]


def load_run(out: Path, method: str) -> dict:
    """A worker's result for one method: {"runs": per level, "quality": per level}."""
    path = out / "runs" / f"{method}.json"
    if not path.is_file():
        raise SystemExit(f"error: no {method} run under {out} ({path} is missing)")
    return json.loads(path.read_text())


def final_repeat4(quality: dict, train: dict) -> tuple[float, str]:
    """The run's greedy repeat-4: the device SDK's read, or for a method the worker reads no generation of
    (the LM losses), the `--curve-repeats` point at the end of training (torch's decoder)."""
    if quality.get("repeat4") is not None:
        return quality["repeat4"], "device SDK"
    last = train["curve"][-1] if train.get("curve") else {}
    if last.get("tokens") != train["train_tokens"] or last.get("repeat4") is None:
        raise SystemExit("error: a run without a generation read needs --curve-repeats up to its last step")
    return last["repeat4"], "torch decoder, the curve's last point"


def assemble(runs: list[tuple[str, Path, Path, str]], level: str, reference: dict) -> dict:
    loaded = {name: (load_run(out, method), corpus, method) for name, out, corpus, method in runs}
    baseline, (base_data, base_corpus, _) = runs[0][0], loaded[runs[0][0]]
    rows = {}
    for name, (data, corpus, method) in loaded.items():
        quality, train = data["quality"][level], data["runs"][level]
        shared = ["lambada"] + (["heldout", "validation"] if corpus == base_corpus else [])
        repeat4, repeat4_read = final_repeat4(quality, train)
        rows[name] = {
            "method": method, "corpus": str(corpus),
            **{f"{s}_ppl": quality[f"{s}_ppl"] for s in ("lambada", "heldout", "validation")},
            "repeat4": repeat4, "repeat4_read": repeat4_read,
            "repeat4_vs_full": repeat4 / reference["repeat4"],
            "lambada_vs_full": paired_ratio(quality["lambada_nlls"], reference["lambada_nlls"]),
            **{f"{s}_vs_{baseline}": paired_ratio(quality[f"{s}_nlls"], base_data["quality"][level][f"{s}_nlls"])
               for s in shared},
            "train_wall_s": train["wall_s"], "train_tokens": train["train_tokens"], "mix": train["mix"],
            "curve": train["curve"], "sample": quality.get("sample"),
        }
    return {"level": level, "baseline": baseline, "full_lambada_ppl": math.exp(
        sum(reference["lambada_nlls"]) / len(reference["lambada_nlls"])), "full_repeat4": reference["repeat4"],
        "rows": rows}


def greedy_reads(path: Path, level: str, baseline_path: Path | None, resamples: int = 4000) -> dict:
    """One run's greedy output over all the prompts of a decoding_screen file (repeat-4 and judge NLL, pooled),
    and, against the baseline's file, the difference with a 95% bootstrap interval that resamples prompts
    (the same prompts on both sides)."""
    def load(file: Path) -> list[dict]:
        return json.loads(file.read_text())["levels"][level]["runs"]["greedy"]

    def pooled(rows: list[dict]) -> tuple[float, float]:
        return (sum(r["repeated_4grams"] for r in rows) / sum(r["four_grams"] for r in rows),
                sum(r["judge_nll_sum"] for r in rows) / sum(r["tokens"] for r in rows))

    rows = load(path)
    repeat4, judge = pooled(rows)
    result = {"prompts": len(rows), "repeat4": repeat4, "judge_nll": judge}
    if baseline_path is not None and baseline_path != path:
        base = load(baseline_path)
        if [r["prompt"] for r in base] != [r["prompt"] for r in rows]:
            raise SystemExit(f"error: {path} and {baseline_path} hold different prompts")
        generator, draws = random.Random(0), []
        for _ in range(resamples):
            picked = [generator.randrange(len(rows)) for _ in rows]
            ours, theirs = pooled([rows[i] for i in picked]), pooled([base[i] for i in picked])
            draws.append((ours[0] - theirs[0], ours[1] - theirs[1]))
        base_repeat, base_judge = pooled(base)
        for index, (name, value) in enumerate((("repeat4", repeat4 - base_repeat), ("judge_nll", judge - base_judge))):
            ordered = sorted(d[index] for d in draws)
            result[f"{name}_minus_baseline"] = {"difference": value, "low": ordered[int(0.025 * (resamples - 1))],
                                                "high": ordered[round(0.975 * (resamples - 1))]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True,
                        help="NAME=OUT=CORPUS[=METHOD] (default distill); the first is the baseline")
    parser.add_argument("--level", required=True)
    parser.add_argument("--reference", type=Path, default=ROOT / "experiments" / "results" / "recovery-unrecovered-screen.json")
    parser.add_argument("--what", required=True, help="what the screen changes and holds fixed")
    parser.add_argument("--command", required=True, help="the worker command line, for a rerun")
    parser.add_argument("--note", default="", help="the machine, contention, anything a rerun needs to know")
    parser.add_argument("--acceptance", type=Path,
                        help="a bench.bench_recovery result (recovery.json): also pair each run's LAMBADA with its (c) at the level")
    parser.add_argument("--decoding", action="append", default=[],
                        help="NAME=FILE: an `experiments.decoding_screen --settings greedy` read of that run's package")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = []
    for spec in args.run:
        parts = spec.split("=")
        if len(parts) not in (3, 4):
            raise SystemExit(f"error: --run takes NAME=OUT=CORPUS[=METHOD], got {spec!r}")
        runs.append((parts[0], Path(parts[1]), Path(parts[2]), parts[3] if len(parts) == 4 else METHOD))
    result = {"what": args.what, "command": args.command, "note": args.note,
              "reference": str(args.reference.relative_to(ROOT)) if args.reference.is_relative_to(ROOT) else
              str(args.reference), **assemble(runs, args.level, full_reference(args.reference))}
    if args.acceptance:
        acceptance = json.loads(args.acceptance.read_text())
        accepted = next((row for row in acceptance["rows"]
                         if row["level"] == args.level and row["method"] == METHOD), None)
        if accepted is None:
            raise SystemExit(f"error: {args.acceptance} has no {METHOD} row at level {args.level}")
        result["acceptance"] = {"file": str(args.acceptance), "tokens": acceptance["tokens_per_level"],
                                "lambada_ppl": accepted["lambada_ppl"], "repeat4": accepted["repeat4"],
                                "curve": acceptance["curves"][METHOD][args.level]}
        for name, out, _, method in runs:
            quality = load_run(out, method)["quality"][args.level]
            result["rows"][name]["lambada_vs_acceptance"] = paired_ratio(quality["lambada_nlls"],
                                                                         accepted["lambada_nlls"])
    if any("=" not in spec for spec in args.decoding):
        raise SystemExit(f"error: --decoding takes NAME=FILE, got {args.decoding!r}")
    decoding = dict(spec.split("=", 1) for spec in args.decoding)
    if set(decoding) - set(result["rows"]):
        raise SystemExit(f"error: --decoding names no run: {sorted(set(decoding) - set(result['rows']))}")
    baseline_file = Path(decoding[result["baseline"]]) if result["baseline"] in decoding else None
    for name, file in decoding.items():
        result["rows"][name]["greedy_all_prompts"] = greedy_reads(Path(file), args.level, baseline_file)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(args.out)
    baseline = result["baseline"]
    print_table(f"recovery screen at level {args.level} (ratios paired by window)",
                ["run", "LAMBADA ppl", "x full [95%]", f"x {baseline} [95%]", "repeat-4", "x full"],
                [[name, f"{r['lambada_ppl']:.1f}",
                  "{ratio:.3f} [{low:.3f}, {high:.3f}]".format(**r["lambada_vs_full"]),
                  "{ratio:.3f} [{low:.3f}, {high:.3f}]".format(**r[f"lambada_vs_{baseline}"]),
                  f"{r['repeat4']:.3f}", f"{r['repeat4_vs_full']:.2f}"] for name, r in result["rows"].items()])


if __name__ == "__main__":
    main()
