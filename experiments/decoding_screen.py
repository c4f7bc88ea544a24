"""Do decoding penalties stop a level's loops, and what do they cost? Per level of a built package.

Every level is run on the report card's 32 everyday prompts (`pipeline.elastilm.evaluate.GENERATION_PROMPTS`,
64 new tokens, as `elastify-device generate --level L` runs them) under greedy decoding and under the
penalties the device SDK serves (`device_sdk.runtime.Sampling`): CTRL's `repetition_penalty` and
OpenAI's `frequency_penalty`, each still greedy. Two measures per output:

  repeat-4   the share of its 4-grams that already came earlier in it (the report card's measure);
  judge NLL  the mean per-token NLL of the continuation under the full model (level 1.0 as the package
             serves it), given the prompt: how plausible the full model finds the text. A loop the
             full model has started it also predicts, so greedy loops score well here; the measure
             compares the outputs that do not loop.

Select on one split, report on the other: the even-numbered prompts choose each level's decoding (the
lowest judge NLL among the settings whose repeat-4 rate is at most --repeat-ratio x the full model's
greedy rate there; the lowest rate when none is), the odd-numbered ones report it. Intervals are 95%
percentile bootstraps that resample whole prompts. Decoding is deterministic, so one run is the result.

  .venv/bin/python -m experiments.decoding_screen [--package DIR]     (default: make demo's package)
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from rich.progress import track

from bench.common import ROOT, print_table

RESULTS = ROOT / "experiments" / "results" / "decoding.json"
DEMO_NAME = "smollm2-135m-elastic"  # api.commands.cluster.demo_spec's publish name
SETTINGS = {  # name -> Sampling penalties (greedy throughout)
    "greedy": {},
    "repetition 1.1": {"repetition_penalty": 1.1},
    "repetition 1.2": {"repetition_penalty": 1.2},
    "repetition 1.3": {"repetition_penalty": 1.3},
    "frequency 0.5": {"frequency_penalty": 0.5},
}

_model = None


def _load(package: str, threads: int) -> None:
    global _model
    import torch

    from device_sdk.runtime import ElasticModel

    torch.set_num_threads(threads)
    logging.getLogger("device_sdk.runtime").setLevel(logging.ERROR)  # forcing an unusable level is the point here
    _model = ElasticModel.load(Path(package), allow_unsigned=True)


def run_setting(level: str, setting: str, new_tokens: int) -> dict:
    """Per prompt: the output's tokens, its repeated-4-gram flags and its per-token NLLs under the full model."""
    import torch

    from device_sdk.runtime import Sampling
    from pipeline.elastilm.evaluate import GENERATION_PROMPTS, repeated_ngram_starts

    model = _model
    sampling = Sampling(temperature=0, **SETTINGS[setting])
    started = time.perf_counter()
    outputs = [model.generate(p, max_new_tokens=new_tokens, level=level, sampling=sampling) for p in GENERATION_PROMPTS]
    model.set_level("1.0")
    rows = []
    for prompt, out in zip(GENERATION_PROMPTS, outputs, strict=True):
        tokens = [t for t in out.tokens if t not in model.eos_ids]
        repeated = set(repeated_ngram_starts(tokens))
        prompt_ids = model.tokenizer.encode(prompt).ids
        nlls = []
        if tokens:
            with torch.inference_mode():
                logits = model.logits(torch.tensor([prompt_ids + tokens]))[0, len(prompt_ids) - 1 : -1].float()
            nlls = torch.nn.functional.cross_entropy(logits, torch.tensor(tokens), reduction="none").tolist()
        rows.append({"prompt": prompt, "text": out.text, "repeated": [i in repeated for i in range(len(tokens) - 3)],
                     "judge_nlls": nlls})
    return {"level": level, "setting": setting, "prompts": rows, "wall_s": round(time.perf_counter() - started, 1)}


def pooled(rows: list[dict], key: str) -> dict:
    """The pooled mean of `key` over the rows' values (per 4-gram or per token), prompts resampled whole."""
    from bench.trace import bootstrap_ci

    values = [float(v) for row in rows for v in row[key]]
    clusters = [i for i, row in enumerate(rows) for _ in row[key]]
    if not values:
        return {"mean": None, "low": None, "high": None, "n": 0}
    mean, low, high = bootstrap_ci(values, clusters)
    return {"mean": mean, "low": low, "high": high, "n": len(values)}


def compact(row: dict) -> dict:
    """What the JSON keeps of one output: its text and the sums the pooled measures are made of."""
    return {"prompt": row["prompt"], "text": row["text"], "repeated_4grams": sum(row["repeated"]),
            "four_grams": len(row["repeated"]), "judge_nll_sum": sum(row["judge_nlls"]), "tokens": len(row["judge_nlls"])}


def split_summary(run: dict, parity: int) -> dict:
    rows = run["prompts"][parity::2]
    return {"repeat4": pooled(rows, "repeated"), "judge_nll": pooled(rows, "judge_nlls"), "prompts": len(rows)}


def ratio(rate: float, full_rate: float) -> float:
    return rate / full_rate if full_rate else float("inf") if rate else 1.0


def choose(level_runs: dict[str, dict], full_rate: float, repeat_ratio: float) -> str:
    """The setting for one level, from the selection split: the most plausible among those that do not loop."""
    summaries = {setting: split_summary(run, 0) for setting, run in level_runs.items()}
    calm = [s for s, summary in summaries.items() if summary["repeat4"]["mean"] <= repeat_ratio * full_rate]
    if calm:
        return min(calm, key=lambda s: summaries[s]["judge_nll"]["mean"])
    return min(summaries, key=lambda s: summaries[s]["repeat4"]["mean"])


def demo_package() -> Path:
    """The package `make demo` last published to the local store (its `latest` alias)."""
    from cluster.settings import Settings

    packages = Path(Settings.from_env().store_url) / "packages" / DEMO_NAME
    alias = packages / "aliases" / "latest"
    if not alias.is_file():
        raise SystemExit(f"error: no demo package in {packages}: run `make demo` or pass --package")
    return packages / alias.read_text().strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, help="a built package (default: make demo's, from the local store)")
    parser.add_argument("--levels", default="1.0,0.9,0.7,0.5")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat-ratio", type=float, default=2.0, help="the usable bound: x the full model's rate")
    parser.add_argument("--workers", type=int, default=2, help="processes, one torch thread each")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"a subset of {', '.join(SETTINGS)}; "
                        "greedy is always run (the full model's greedy rate is the bound)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.package = args.package or demo_package()
    if not (args.package / "manifest.json").is_file():
        raise SystemExit(f"error: {args.package} is not a package (no manifest.json)")
    levels = args.levels.split(",")
    if "1.0" not in levels:
        raise SystemExit("error: --levels must include 1.0 (the full model's greedy rate is the bound)")
    unknown = set(args.settings.split(",")) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"error: unknown --settings {sorted(unknown)}; known: {', '.join(SETTINGS)}")
    settings = [s for s in SETTINGS if s == "greedy" or s in args.settings.split(",")]
    started = time.perf_counter()
    jobs = [(level, setting) for level in levels for setting in settings]
    with ProcessPoolExecutor(args.workers, initializer=_load, initargs=(str(args.package), 1)) as pool:
        futures = {pool.submit(run_setting, *job, args.new_tokens): job for job in jobs}
        runs = {futures[done]: done.result()
                for done in track(as_completed(futures), total=len(jobs), description="levels x decodings")}
    full_rate = split_summary(runs[("1.0", "greedy")], 0)["repeat4"]["mean"]
    report_full = split_summary(runs[("1.0", "greedy")], 1)
    results = {"package": str(args.package), "manifest_version": json.loads((args.package / "manifest.json")
                                                                               .read_text()).get("version"),
               "prompts": "pipeline.elastilm.evaluate.GENERATION_PROMPTS: even-numbered select, odd-numbered report",
               "new_tokens": args.new_tokens, "repeat_ratio_bound": args.repeat_ratio,
               "settings": {s: SETTINGS[s] for s in settings},
               "full_greedy_repeat4_select": full_rate, "full_greedy_report": report_full, "levels": {}}
    table = []
    for level in levels:
        level_runs = {setting: runs[(level, setting)] for setting in settings}
        chosen = choose(level_runs, full_rate, args.repeat_ratio)
        report = {setting: split_summary(run, 1) for setting, run in level_runs.items()}
        results["levels"][level] = {
            "chosen": chosen, "select": {s: split_summary(r, 0) for s, r in level_runs.items()}, "report": report,
            "samples": {s: [row["text"] for row in r["prompts"][1:6:2]] for s, r in level_runs.items()},
            "runs": {s: [compact(row) for row in r["prompts"]] for s, r in level_runs.items()}}
        for setting in ("greedy", chosen) if chosen != "greedy" else ("greedy",):
            r = report[setting]
            table.append([level, setting + (" (chosen)" if setting == chosen else ""),
                          f"{r['repeat4']['mean']:.3f} [{r['repeat4']['low']:.3f}, {r['repeat4']['high']:.3f}]",
                          f"{ratio(r['repeat4']['mean'], report_full['repeat4']['mean']):.1f}x",
                          f"{r['judge_nll']['mean']:.2f} [{r['judge_nll']['low']:.2f}, {r['judge_nll']['high']:.2f}]"])
    results["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(args.out)
    print_table(f"Decoding per level, report split ({report_full['prompts']} prompts x {args.new_tokens} tokens); "
                f"chosen on the other {report_full['prompts']}",
                ["level", "decoding", "repeat-4 [95%]", "÷ full greedy", "judge NLL [95%]"], table)
    for level in levels:
        chosen = results["levels"][level]["chosen"]
        print(f"{level} {chosen}: {results['levels'][level]['samples'][chosen][0]!r}")
    print(f"wrote {args.out} ({results['wall_s']} s)")


if __name__ == "__main__":
    main()
