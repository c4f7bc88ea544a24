"""CLONE on SmolLM2: searched profiles vs uniform width and the best collected record, collection on
1 vs 2 Ray workers, expert routing accuracy, and soft vs top-1 vs uniform expert mixing.

    .venv/bin/python bench/bench_clone.py [--samples 96] [--shards 4] [--reuse] [--skip-ray]

1. Package: block-influence profile → elastify (levels 0.5/0.75/1.0); the latency stage measures
   this host and its profile goes into the manifest, so every vector is priced by the same model.
2. clone-collect runs through the real scheduler on a local Ray head with 1, then 2, worker CPUs
   (same shards, same vectors; a warm-up run first, so process start is not measured).
3. clone-search per budget (strict: the lowest perplexity within the budget); then, at each
   profile's predicted latency, the widest uniform configuration (non-anchor layers at one keep
   ratio, found by bisection, not quantised to bins) and the best collected record that fits the
   budget, all on the same held-out PTB text.
4. experts: one LoRA per task, routing accuracy on held-out prompts, and multiple-choice accuracy
   / gold-answer NLL on mixed-task held-out prompts with soft, top-1, uniform and no mixing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import print_table

from device_sdk.format import read_manifest
from pipeline.clone_collect import Collector, CollectSettings
from pipeline.clone_search import SearchSettings, install_profiles, search
from pipeline.stage import StageContext

BUDGETS = [{"name": "fast", "latency": 0.75, "energy": 0.75}, {"name": "frugal", "latency": 0.6, "energy": 0.6}]


def log_ctx(work: Path) -> StageContext:
    def progress(task, done, total):
        if done == total or done % 10 == 0:
            print(f"  {task}: {done}/{total}", flush=True)

    return StageContext(work_dir=work, on_progress=progress)


def prepare(out: Path, reuse: bool, ctx: StageContext) -> Path:
    from bench_elastilm import build_package

    from pipeline.latency import LatencySettings, apply_latency, build_cost_model

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
    from tests.integration import services

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
    from pipeline.clone_collect import collect

    paths = []
    for shard in range(shards):
        result = collect(package, CollectSettings(**{**own, "shard": shard, "shards": shards}), ctx)
        paths.append(out / f"records.{shard}.json")
        paths[-1].write_text(json.dumps(result))
    return paths


# --------------------------------------------------------------------------- uniform baseline


@torch.inference_mode()
def uniform_at(collector: Collector, latency_ms: float, energy_j: float | None) -> dict:
    """The widest uniform keep ratio (non-anchor layers) whose predicted latency (and energy) are no more."""
    from pipeline.elastify import ElastifySettings, layer_widths
    from pipeline.lm import perplexity

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
    attn, mlp = widths(low)
    collector.model.set_widths(attn, mlp)
    ppl = perplexity(collector.model, collector.windows, collector.settings.batch_size)
    cost = collector.price(attn, mlp)
    return {"ratio": low, "ppl": ppl, "latency_ms": cost.latency_ms, "energy_j": cost.energy_j, "attn_units": attn,
            "mlp_units": mlp}


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
    from pipeline.experts import ExpertSettings, build_experts, expert_name, install_experts, split_task

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


def collection_table(args, timing: tuple[float, float], load: float) -> dict:
    one, two = timing
    print_table(f"clone-collect, {args.samples} vectors in {args.shards} shards (load avg {load:.1f} at start)",
                ["Ray workers", "seconds", "speed-up vs 1 worker", "goal"],
                [[1, f"{one:.1f}", "1.00×", ""], [2, f"{two:.1f}", f"{one / two:.2f}×", "≥ 1.7×"]])
    return {"one_worker_s": one, "two_workers_s": two, "speedup": one / two, "load": load}


def clone_tables(args, package: Path, ctx: StageContext) -> dict:
    """Collection (1 vs 2 Ray workers), search, and the profile comparison table."""
    own = {"budgets": BUDGETS, "samples": args.samples, "windows": args.windows, "window_length": args.window_length,
           "seed": 0}
    load = os.getloadavg()[0]
    timing_file = args.out / "collection.json"
    if args.reuse and timing_file.is_file() and json.loads(timing_file.read_text())["own"] == own:
        saved = json.loads(timing_file.read_text())  # a previous run's records and timings
        paths, timing, load = [Path(p) for p in saved["paths"]], saved["timing"], saved["load"]
    elif args.skip_ray:
        paths = collect_in_process(package, own, args.shards, args.out, ctx)
        timing = None
    else:
        one, _ = collect_on_ray(1, package, own, args.shards, args.out / "ray1")
        two, paths = collect_on_ray(2, package, own, args.shards, args.out / "ray2")
        timing = (one, two)
        timing_file.write_text(json.dumps({"own": own, "paths": [str(p) for p in paths], "timing": timing,
                                           "load": load}))

    if args.only_collection:
        return {"collection": collection_table(args, timing, load)} if timing else {}
    # strict: both the profile and the collected record it is compared with are the lowest
    # perplexity within the budget, so a perplexity difference is not bought with latency.
    found = search(package, paths, SearchSettings(epochs=args.epochs, candidates=args.candidates, rounds=args.rounds,
                                                  beam_width=args.beam_width, strict=True), ctx)
    (args.out / "profiles.json").write_text(json.dumps(found, indent=1))
    collector = Collector(package, CollectSettings(**own))
    rows, summary = [], {}
    for name, entry in found["clone"]["profiles"].items():
        budget = entry["budget"]
        searched = found["search"][name]["best_searched"]  # lowest ppl within the budget, search candidates
        collected = found["search"][name]["best_collected"]  # the same among the collected records
        if searched is None:
            raise SystemExit(f"budget {name}: no search candidate fits the budget; raise --candidates or --rounds")
        uniform = uniform_at(collector, searched["latency_ms"], searched["energy_j"])
        uniform["scores"] = collector.scores(uniform["ppl"], collector.price(uniform["attn_units"], uniform["mlp_units"]))
        for label, row in (("searched (CLONE)", searched), ("uniform width, same latency", uniform),
                           ("best collected record in budget", collected)):
            rows.append([name, label, f"{row['ppl']:.1f}", f"{row['latency_ms']:.0f}", f"{row['energy_j']:.2f}",
                         f"{1000 * row['scores'][name]:.3f}", f"{budget['latency_ms']:.0f} / {budget['energy_j']:.2f}"])
        summary[name] = {"searched": searched, "uniform": uniform, "collected": collected, "profile": entry}
    print_table("CLONE profiles on SmolLM2 (held-out PTB perplexity; cost-model latency and energy per request)",
                ["budget", "configuration", "ppl", "latency ms", "energy J", "score ×1000", "budget ms / J"], rows)
    if timing:
        summary["collection"] = collection_table(args, timing, load)

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

    summary["seconds"] = time.time() - started
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"total {summary['seconds']:.0f} s; results in {args.out}", flush=True)


if __name__ == "__main__":
    main()
