"""CLONE on SmolLM2: searched profiles vs a random search of the same evaluation budget, uniform width
and the best collected record, selected on one split and reported on another; collection on 1 vs 2
Ray workers; expert routing accuracy, and soft vs top-1 vs uniform expert mixing.

    .venv/bin/python -m bench.bench_clone [--samples 96] [--seeds 0 1 2] [--reuse] [--skip-ray]

1. Package: block-influence profile → elastify (levels 0.5/0.75/1.0); the latency stage measures
   this host and its profile goes into the manifest, so every vector is priced by the same model.
2. clone-collect runs through the real scheduler on a local Ray head with 1, then 2, worker CPUs
   (same shards, same vectors; a warm-up run first, so process start is not measured). The machine
   is shared: the load average goes into the JSON.
3. Per seed: clone-search (strict: the lowest selection-split perplexity within the budget among
   its candidates), and as its control a random search that measures exactly as many vectors per
   budget, within the same budget, picked by the same rule on the same split. Every selected
   configuration is then re-scored on the report split (PTB test, disjoint from PTB valid), beside
   uniform width at the searched profile's predicted latency (non-anchor layers at one keep ratio,
   bisection, not quantised to bins) and the best collected record within the budget. Mean ± standard
   error over seeds; the collection (seed 0) is shared by all seeds.
4. experts: one LoRA per task, routing accuracy on held-out prompts, and multiple-choice accuracy
   / gold-answer NLL on mixed-task held-out prompts with soft, top-1, uniform and no mixing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.bench_elastilm import build_package
from bench.common import RESULTS, print_table, write_json
from device_sdk.format import read_manifest
from pipeline.clone.collect import Collector, CollectSettings, bins_to_widths, read_records
from pipeline.clone.search import SearchSettings, best_feasible, feasible, install_profiles, search
from pipeline.stage import StageContext

BUDGETS = [{"name": "fast", "latency": 0.75, "energy": 0.75}, {"name": "frugal", "latency": 0.6, "energy": 0.6}]


def log_ctx(work: Path) -> StageContext:
    def progress(task, done, total):
        if done == total or done % 10 == 0:
            print(f"  {task}: {done}/{total}", flush=True)

    return StageContext(work_dir=work, on_progress=progress)


def prepare(out: Path, reuse: bool, ctx: StageContext) -> Path:
    from pipeline.elastilm.latency import LatencySettings, apply_latency, build_cost_model

    package = out / "package"
    if reuse and (package / "manifest.json").is_file() and read_manifest(package).latency_profile:
        return package
    build_package(out, [0.5, 0.75, 1.0], ctx)
    report = build_cost_model(package, LatencySettings(prompt_lengths=[32, 128], decode_tokens=8, repeats=2,
                                                       threads=1), ctx)
    apply_latency(package, report)
    return package


# --------------------------------------------------------------------------- collection on Ray


def collect_on_ray(workers: int, package: Path, own: dict, shards: int, home: Path) -> tuple[float, list[Path]]:
    """Wall time (first shard leased → last recorded) of a fanned-out clone-collect, and its record files."""
    import ray

    from cluster.db import migrate
    from cluster.registry import Registry
    from cluster.scheduler import Scheduler
    from cluster.service import submit_build
    from cluster.settings import Settings
    from cluster.spec import parse_spec
    from pipeline.chain import run_clone_collect
    from pipeline.contract import Resources, Shard, Stage

    registry = Registry([Stage(
        name="clone-collect", run=run_clone_collect, settings=CollectSettings, inputs={"package": "source.model"},
        outputs=("records",), resources=Resources(num_cpus=1),
        fan_out=lambda spec, settings: [Shard(str(i), {"shard": i, "shards": shards}) for i in range(shards)],
    )])

    def run(settings: Settings, stage_settings: dict) -> Scheduler:
        spec = parse_spec({"source": {"model": str(package)}, "levels": [1.0], "publish": {"name": "b", "version": "1"},
                           "stages": {"clone-collect": {"settings": stage_settings}}}, registry)
        migrate(settings.database_url)
        scheduler = Scheduler(settings, registry).start()
        scheduler.run_until_done([submit_build(scheduler.sessions, spec, registry)], timeout=3600)
        return scheduler

    ray.shutdown()
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    # Ray gives a task as many OMP threads as CPUs it holds, unless the environment already says:
    # drop this process's setting so each shard computes on exactly one core in both runs.
    threads = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        return _timed_collection(workers, package, own, shards, home, run)
    finally:
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = threads


def _timed_collection(workers, package, own, shards, home, run) -> tuple[float, list[Path]]:
    from sqlalchemy import select

    from cluster.models import Stage
    from cluster.settings import Settings
    from tests.support import services

    with services.ray_head(num_cpus=workers, num_gpus=0):
        # The scheduler's production settings: the tests' fast polling costs a worker ~10% of a
        # core once every core is busy.
        settings = Settings(home=home, database_url=f"sqlite:///{home / 'clone.db'}", store_url=str(home / "store"))
        run(settings, {**own, "samples": 2 * shards, "windows": 1, "window_length": 16, "seed": 99}).close()  # warm
        scheduler = run(settings, own)
        with scheduler.sessions() as session:
            spans = session.execute(select(Stage.started_at, Stage.finished_at, Stage.status)
                                    .where(Stage.settings["seed"].as_integer() == own["seed"])).all()
        scheduler.close()
    if len(spans) != shards or any(status != "succeeded" for _, _, status in spans):
        raise RuntimeError(f"collection on {workers} worker(s) did not succeed: {spans}")
    paths = sorted(p for p in (home / "store").rglob("records.json")
                   if json.loads(p.read_text())["settings"]["seed"] == own["seed"])
    return (max(end for _, end, _ in spans) - min(start for start, _, _ in spans)).total_seconds(), paths


def collect_in_process(package: Path, own: dict, shards: int, out: Path, ctx: StageContext) -> list[Path]:
    from pipeline.clone.collect import collect

    paths = []
    for shard in range(shards):
        result = collect(package, CollectSettings(**{**own, "shard": shard, "shards": shards}), ctx)
        paths.append(out / f"records.{shard}.json")
        paths[-1].write_text(json.dumps(result))
    return paths


# --------------------------------------------------------------------------- baselines and the report split


def uniform_widths(collector: Collector, latency_ms: float, energy_j: float | None) -> tuple[float, list, list]:
    """The widest uniform keep ratio (non-anchor layers; bisection, not quantised to bins) whose
    predicted latency (and energy) are no more: (ratio, KV groups, neurons)."""
    from pipeline.elastilm.elastify import ElastifySettings, layer_widths

    manifest = collector.manifest
    arch, anchors = manifest.architecture, set(manifest.elastic.anchor_layers)
    cut = ElastifySettings(align=collector.settings.align)

    def widths(ratio):
        pairs = [(arch.kv_heads, arch.intermediate) if layer in anchors or ratio >= 1.0 else
                 ((0, 0) if ratio <= 0 else layer_widths(arch, ratio, cut)) for layer in range(arch.layers)]
        return [a for a, _ in pairs], [m for _, m in pairs]

    def fits(ratio):
        cost = collector.price(*widths(ratio))
        return cost.latency_ms <= latency_ms and (energy_j is None or cost.energy_j <= energy_j)

    low, high = 0.0, 1.0
    for _ in range(20):
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return (low, *widths(low))


def random_search(collector: Collector, known: set, counts: dict[str, int], budgets: dict, seed: int,
                  band: float) -> list[dict]:
    """clone-search's control: per budget, as many vectors as the search measured for it, each a random
    bin per non-anchor layer (anchors whole), kept only if the cost model (free: nothing is measured)
    puts it within the budget and at no less than `band` of its latency, so that, like the
    search's, every draw spends the budget; all are measured on the selection split."""
    manifest, settings = collector.manifest, collector.settings
    anchors, top = set(manifest.elastic.anchor_layers), len(settings.ratio_bins) - 1
    rng, seen, measured = random.Random(seed), set(known), []
    for name, budget in budgets.items():
        floor = band * budget["latency_ms"] if budget["latency_ms"] is not None else 0.0
        drawn = attempts = 0
        while drawn < counts[name]:
            attempts += 1
            if attempts > 100_000 * counts[name]:
                raise SystemExit(f"budget {name}: random vectors rarely land in [{band}·T, T]; lower --random-band")
            vector = [top if layer in anchors else rng.randrange(top + 1) for layer in range(manifest.architecture.layers)]
            cost = asdict(collector.price(*bins_to_widths(manifest, vector, settings)))
            if tuple(vector) in seen or cost["latency_ms"] < floor or not feasible(cost, budget):
                continue
            seen.add(tuple(vector))
            measured.append(collector.evaluate(vector, "random"))
            drawn += 1
    return measured


class ReportSplit:
    """Per-window NLLs on the report split (disjoint from the selection split), one measurement per widths."""

    def __init__(self, collector: Collector):
        self.collector, self.cache = collector, {}

    @torch.inference_mode()
    def nlls(self, attn: list[int], mlp: list[int]) -> list[float]:
        from pipeline.models.scoring import window_nlls

        key = (tuple(attn), tuple(mlp))
        if key not in self.cache:
            self.collector.model.set_widths(attn, mlp)
            self.cache[key] = window_nlls(self.collector.model, self.collector.windows, self.collector.settings.batch_size)
        return self.cache[key]

    def ppl(self, attn: list[int], mlp: list[int]) -> float:
        values = self.nlls(attn, mlp)
        return math.exp(sum(values) / len(values))

    @property
    def tokens(self) -> int:
        windows = self.collector.windows
        return windows.shape[0] * (windows.shape[1] - 1)  # predicted tokens

# --------------------------------------------------------------------------- experts


def choice_scores_sdk(model, prompt: str, choices: list[str]) -> torch.Tensor:
    """Mean log-probability of each option's tokens after `prompt` (its last 128 tokens), from the SDK's logits."""
    context = model.tokenizer.encode(prompt, add_special_tokens=False).ids[-128:]
    continuations = [model.tokenizer.encode(" " + c, add_special_tokens=False).ids or [0] for c in choices]
    rows = [context + c for c in continuations]
    width = max(len(r) for r in rows)
    logits = model.logits(torch.tensor([r + [0] * (width - len(r)) for r in rows])).float().log_softmax(-1)
    return torch.stack([logits[i, torch.arange(len(context) - 1, len(context) - 1 + len(c)), torch.tensor(c)].mean()
                        for i, c in enumerate(continuations)])


def experts_bench(package: Path, out: Path, steps: int, batch_size: int, per_task: int,
                  ctx: StageContext) -> tuple[dict, dict]:
    from device_sdk.runtime import ElasticModel
    from pipeline.clone.experts import ExpertSettings, build_experts, expert_name, install_experts, split_task

    settings = ExpertSettings(steps=steps, batch_size=batch_size, seq_len=128, held_out=32)
    experts_dir = out / "experts"
    report = build_experts(package, settings, experts_dir, ctx)
    copy = out / "package-experts"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(package, copy)
    install_experts(copy, experts_dir)
    model = ElasticModel.load(copy, allow_unsigned=True)  # an unsigned copy this bench just wrote
    items = [(expert_name(task), item) for task in settings.tasks for item in split_task(task, settings)[1][:per_task]]
    random.Random(0).shuffle(items)  # mixed-task prompts
    results = {}
    for mode in ("none", "soft", "top1", "uniform"):
        correct, nll = 0, 0.0
        for _, item in ctx.track(items, f"experts: {mode}"):
            if mode == "none":
                model.set_level(model.available_levels()[-1])
            else:
                model.mix_experts(item.prompt(), mode)
            scores = choice_scores_sdk(model, item.prompt(), item.choices)
            correct += int(scores.argmax()) == item.gold
            nll -= float(scores[item.gold])
        results[mode] = {"accuracy": correct / len(items), "gold_nll": nll / len(items), "items": len(items)}
    return report, results


# --------------------------------------------------------------------------- main


def mean_se(values: list[float]) -> dict:
    """Mean and standard error of the mean (sample standard deviation / √n)."""
    n = len(values)
    mean = sum(values) / n
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else float("nan")
    return {"mean": mean, "se": se, "n": n, "values": values}


def collection_table(args, timing: tuple[float, float], load: list[float]) -> dict:
    one, two = timing
    print_table(f"clone-collect, {args.samples} vectors in {args.shards} shards (load avg {load[0]:.1f} at start, "
                "shared machine)", ["Ray workers", "seconds", "speed-up vs 1 worker", "goal"],
                [[1, f"{one:.1f}", "1.00×", ""], [2, f"{two:.1f}", f"{one / two:.2f}×", "≥ 1.7×"]])
    return {"one_worker_s": one, "two_workers_s": two, "speedup": one / two, "loadavg_at_start": load}


def collect_records(args, package: Path, own: dict, ctx: StageContext) -> tuple[list[Path], dict | None]:
    """The collection's record files, and its 1-vs-2 Ray worker timing (None with --skip-ray)."""
    timing_file = args.out / "collection.json"
    if args.reuse and timing_file.is_file() and json.loads(timing_file.read_text())["own"] == own:
        saved = json.loads(timing_file.read_text())  # a previous run's records and timings
        timing = saved["timing"] and collection_table(args, saved["timing"], saved["load"])
        return [Path(p) for p in saved["paths"]], timing
    load = list(os.getloadavg())
    if args.skip_ray:
        paths, timing = collect_in_process(package, own, args.shards, args.out, ctx), None
    else:
        one, _ = collect_on_ray(1, package, own, args.shards, args.out / "ray1")
        two, paths = collect_on_ray(2, package, own, args.shards, args.out / "ray2")
        timing = (one, two)
    timing_file.write_text(json.dumps({"own": own, "paths": [str(p) for p in paths], "timing": timing, "load": load}))
    return paths, timing and collection_table(args, timing, load)


def one_seed(seed: int, package: Path, paths: list[Path], collected: list[dict], budgets: dict,
             settings: SearchSettings, valid: Collector, reported, uniform_row, report: ReportSplit, args,
             ctx: StageContext) -> dict:
    """clone-search and its random control with one seed. Each side's profile is what clone-search
    ships: the lowest selection-split perplexity within the budget among the collected records and
    its own candidates; then all re-scored on the report split."""
    from pipeline.models.scoring import paired_ratio

    started = time.time()
    found = search(package, paths, settings, ctx)
    if seed == args.seeds[0]:
        (args.out / "profiles.json").write_text(json.dumps(found, indent=1))
    searched_pool = [r for r in found["records"] if r["origin"] == "search"]
    counts = {name: found["search"][name]["candidates"] for name in budgets}
    searched_at = time.time()
    random_pool = random_search(valid, {tuple(r["bins"]) for r in collected}, counts, budgets, seed, args.random_band)
    run = {"seed": seed, "evaluations": counts, "search_s": searched_at - started, "random_s": time.time() - searched_at,
           "loadavg": list(os.getloadavg()), "budgets": {}}
    for name, budget in budgets.items():
        searched = best_feasible(collected + searched_pool, budget)
        randomly = best_feasible(collected + random_pool, budget)
        rows = {"searched": reported(searched), "random": reported(randomly),
                "uniform": uniform_row(searched["latency_ms"], searched["energy_j"])}
        for rival in ("random", "uniform"):
            rows[f"searched_vs_{rival}_windows"] = paired_ratio(
                report.nlls(searched["attn_units"], searched["mlp_units"]),
                report.nlls(rows[rival]["attn_units"], rows[rival]["mlp_units"]))
        run["budgets"][name] = rows
    return run


def clone_tables(args, package: Path, ctx: StageContext) -> dict:
    """Collection (1 vs 2 Ray workers); per seed, clone-search and a random search of the same
    evaluation budget, both selecting on PTB valid; every selected configuration, uniform width at
    the same predicted latency and the best collected record re-scored on PTB test."""
    own = {"budgets": BUDGETS, "samples": args.samples, "windows": args.windows, "window_length": args.window_length,
           "seed": 0}
    paths, timing = collect_records(args, package, own, ctx)
    if args.only_collection:
        return {"collection": timing} if timing else {}
    header, collected = read_records(paths)
    budgets = header["budgets"]
    valid = Collector(package, CollectSettings(**own))  # the selection split, as the collection's
    report = ReportSplit(Collector(package, CollectSettings(**{**own, "corpus": [args.report_corpus],
                                                                "windows": args.report_windows})))
    arch = valid.manifest.architecture
    full_nlls = report.nlls([arch.kv_heads] * arch.layers, [arch.intermediate] * arch.layers)

    def reported(record: dict) -> dict:
        """A configuration selected on the selection split, re-scored on the report split."""
        keys = ("origin", "bins", "attn_units", "mlp_units", "latency_ms", "energy_j")
        return {**{k: record[k] for k in keys if k in record}, "selection_ppl": record.get("ppl"),
                "report_ppl": report.ppl(record["attn_units"], record["mlp_units"])}

    def uniform_row(latency_ms: float, energy_j: float | None) -> dict:
        ratio, attn, mlp = uniform_widths(valid, latency_ms, energy_j)
        cost = valid.price(attn, mlp)
        return reported({"origin": f"uniform {ratio:.3f}", "bins": None, "attn_units": attn, "mlp_units": mlp,
                         "latency_ms": cost.latency_ms, "energy_j": cost.energy_j}) | {"ratio": ratio}

    # Deterministic rows: the best collected record within the budget, uniform width at the budget.
    fixed = {name: {"collected": reported(best_feasible(collected, budget)),
                    "uniform_at_budget": uniform_row(budget["latency_ms"], budget["energy_j"])}
             for name, budget in budgets.items()}
    search_settings = {"epochs": args.epochs, "candidates": args.candidates, "rounds": args.rounds,
                       "beam_width": args.beam_width, "strict": True}
    runs = []
    for seed in args.seeds:
        # A finished seed is kept (with --reuse), so a run cut short resumes at the next seed.
        seed_file = args.out / f"seed-{seed}.json"
        key = {"own": own, "search": search_settings, "band": args.random_band, "report": args.report_corpus,
               "report_windows": args.report_windows}
        if args.reuse and seed_file.is_file() and json.loads(seed_file.read_text())["key"] == key:
            runs.append(json.loads(seed_file.read_text())["run"])
            continue
        runs.append(one_seed(seed, package, paths, collected, budgets, SearchSettings(**search_settings, seed=seed),
                             valid, reported, uniform_row, report, args, ctx))
        seed_file.write_text(json.dumps({"key": key, "run": runs[-1]}))
        print(f"  seed {seed}: " + "; ".join(
            f"{name}: searched {r['searched']['report_ppl']:.1f}, random {r['random']['report_ppl']:.1f}, "
            f"uniform {r['uniform']['report_ppl']:.1f}" for name, r in runs[-1]["budgets"].items()), flush=True)

    summary = {}
    rows = []
    for name, budget in budgets.items():
        per_seed = [run["budgets"][name] for run in runs]
        entry = {"budget": budget, "collected": fixed[name]["collected"], "uniform_at_budget": fixed[name]["uniform_at_budget"]}
        for kind in ("searched", "random", "uniform"):
            entry[kind] = {measure: mean_se([r[kind][measure] for r in per_seed])
                           for measure in ("report_ppl", "selection_ppl", "latency_ms", "energy_j")
                           if per_seed[0][kind][measure] is not None}
        for rival in ("random", "uniform"):
            entry[f"searched_over_{rival}"] = mean_se([r["searched"]["report_ppl"] / r[rival]["report_ppl"]
                                                       for r in per_seed])
        entry["searched_over_collected"] = mean_se([r["searched"]["report_ppl"] / fixed[name]["collected"]["report_ppl"]
                                                    for r in per_seed])
        summary[name] = entry

        def cell(stat):
            return f"{stat['mean']:.1f} ± {stat['se']:.1f}"

        label = f"{name} ({budget['latency_ms']:.0f} ms)"
        rows += [[label, "CLONE profile", cell(entry["searched"]["selection_ppl"]),
                  cell(entry["searched"]["report_ppl"]), f"{entry['searched']['latency_ms']['mean']:.0f}",
                  f"{entry['searched_over_random']['mean']:.3f} ± {entry['searched_over_random']['se']:.3f}"],
                 ["", "random search", cell(entry["random"]["selection_ppl"]),
                  cell(entry["random"]["report_ppl"]), f"{entry['random']['latency_ms']['mean']:.0f}", ""],
                 ["", "uniform @ CLONE latency", "", cell(entry["uniform"]["report_ppl"]),
                  f"{entry['uniform']['latency_ms']['mean']:.0f}",
                  f"{entry['searched_over_uniform']['mean']:.3f} ± {entry['searched_over_uniform']['se']:.3f}"],
                 ["", f"uniform @ budget (keep {fixed[name]['uniform_at_budget']['ratio']:.3f})", "",
                  f"{fixed[name]['uniform_at_budget']['report_ppl']:.1f}",
                  f"{fixed[name]['uniform_at_budget']['latency_ms']:.0f}", ""],
                 ["", "best collected", f"{fixed[name]['collected']['selection_ppl']:.1f}",
                  f"{fixed[name]['collected']['report_ppl']:.1f}", f"{fixed[name]['collected']['latency_ms']:.0f}",
                  f"{entry['searched_over_collected']['mean']:.3f} ± {entry['searched_over_collected']['se']:.3f}"]]
    print_table(f"CLONE on SmolLM2: selected on {args.windows}×{args.window_length} ptb:valid tokens, reported on "
                f"{report.tokens} {args.report_corpus} tokens; mean ± SE over {len(args.seeds)} seeds",
                ["budget", "configuration", "valid ppl", "test ppl", "latency ms", "searched ÷ this (test ppl)"], rows)
    summary.update({"runs": runs, "full_model_report_ppl": math.exp(sum(full_nlls) / len(full_nlls)),
                    "report_split": {"corpus": args.report_corpus, "windows": args.report_windows,
                                     "window_length": args.window_length, "tokens": report.tokens},
                    "selection_split": {"corpus": own.get("corpus", ["ptb:valid"]), "windows": args.windows,
                                        "window_length": args.window_length},
                    "collected_records": len(collected), "header": header})
    if timing:
        summary["collection"] = timing

    copy = args.out / "package-profiles"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(package, copy)
    install_profiles(copy, args.out / "profiles.json")  # the profiles validate as a manifest section
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "elastify-bench-clone")
    parser.add_argument("--reuse", action="store_true", help="reuse the package of a previous run")
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window-length", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--candidates", type=int, default=40, help="per budget and search round")
    parser.add_argument("--rounds", type=int, default=3, help="search rounds per budget")
    parser.add_argument("--beam-width", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="search seeds (and random-search seeds)")
    parser.add_argument("--random-band", type=float, default=0.9,
                        help="random search draws only vectors predicted at ≥ this fraction of the budget's latency")
    parser.add_argument("--report-corpus", default="ptb:test", help="the split selected configurations are reported on")
    parser.add_argument("--report-windows", type=int, default=16)
    parser.add_argument("--json", type=Path, default=RESULTS / "clone.json")
    parser.add_argument("--expert-steps", type=int, default=40)
    parser.add_argument("--expert-batch", type=int, default=4)
    parser.add_argument("--skip-clone", action="store_true", help="only the experts part")
    parser.add_argument("--expert-items", type=int, default=8, help="held-out items per task for the mixing table")
    parser.add_argument("--skip-ray", action="store_true", help="collect in this process, no 1-vs-2 worker timing")
    parser.add_argument("--skip-experts", action="store_true")
    parser.add_argument("--only-collection", action="store_true", help="only the 1-vs-2 Ray worker collection timing")
    parser.add_argument("--threads", type=int, default=2, help="torch threads outside the Ray workers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = log_ctx(args.out)
    started = time.time()
    loadavg = {"start": list(os.getloadavg())}  # the machine is shared: what else ran shows here

    package = prepare(args.out, args.reuse, ctx)
    summary = {} if args.skip_clone else clone_tables(args, package, ctx)
    if not args.skip_experts:
        report, mixing = experts_bench(package, args.out, args.expert_steps, args.expert_batch, args.expert_items, ctx)
        accuracy = report["router_accuracy"]
        print_table("Expert routing on held-out prompts (MiniLM centroids, 64 training prompts per task)",
                    ["task", "routed to its expert"], [[k, f"{v:.3f}"] for k, v in accuracy.items()])
        print_table("Mixed-task held-out prompts: expert mixing (full width)",
                    ["mixing", "MC accuracy", "gold-answer NLL", "items"],
                    [[mode, f"{r['accuracy']:.3f}", f"{r['gold_nll']:.3f}", r["items"]] for mode, r in mixing.items()])
        summary["experts"] = {"router_accuracy": accuracy, "mixing": mixing, "training": report["training"]}

    loadavg["end"] = list(os.getloadavg())
    summary.update({"seconds": time.time() - started, "loadavg": loadavg, "cpus": os.cpu_count(),
                    "torch_threads": args.threads, "argv": vars(args)})
    text = json.dumps(summary, indent=1, default=str)
    (args.out / "summary.json").write_text(text)
    write_json(args.json, summary, indent=1)
    print(f"total {summary['seconds']:.0f} s; results in {args.json}", flush=True)


if __name__ == "__main__":
    main()
