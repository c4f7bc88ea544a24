"""ElastiLM benchmark on SmolLM2: accuracy per SLO class for six policies, SLO violations, labelling throughput.

Runs the offline chain as plain stage calls: cheap profile → elastify → recover per
level → latency → tlm-score → label (train items) → derive → tlm-decision (both label rules),
then labels held-out items over the same grid so every policy's answer is a lookup:

  ours            decision head (most-capable labels), highest joint log-prob feasible pair
  lightest        the same head trained on "lightest correct" labels
  llm-pruner      level = largest level <= the TTFT fraction, no compression
  prompt-only     full model, the largest feasible prompt ratio
  random          a random feasible pair
  oracle          correct if any feasible pair is correct

A policy whose pair is infeasible under the cost model counts one SLO violation.
Throughput: grid points per second of the label worker (zero-copy switching, a level's ratios
batched), of the same model one grid point per call, and of re-materialising the sub-model
(reload + copy of the kept weights) per grid point; and two label shards through
the real worker path on a Ray head with 1 vs 2 CPUs. Defaults are the full grids: levels
0.2…1.0 × prompt ratios 0.3…1.0, ARC-E, OBQA, PIQA and SciQ.

  .venv/bin/python bench/bench_elastilm.py --out /tmp/bench-elastilm
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from common import print_table

from device_sdk.format import Level, parse_levels, read_manifest
from device_sdk.latency import SLO
from pipeline import label, latency, recover, tlm
from pipeline.label import SLO_CLASSES
from pipeline.stage import StageContext, quiet_context


def build_package(out: Path, levels: list[float], ctx: StageContext) -> Path:
    from pipeline.assets import prepare_smollm2
    from pipeline.elastify import ElastifySettings, elastify
    from pipeline.models import load_model
    from pipeline.profile import ProfileSettings, profile

    loaded = load_model(prepare_smollm2())
    importance = profile(loaded.model, loaded.tokenizer, loaded.architecture,
                         ProfileSettings(windows=8, window_length=128, layer_method="block_influence"), ctx)
    path = out / "package"
    elastify(loaded.model, loaded.tokenizer, loaded.architecture, importance, ElastifySettings(levels=levels), path,
             name="smollm2-bench", source=loaded.source, overwrite=True)
    return path


def policy_choice(policy, item_index, prompt, tokens, slo, ratios, levels, profile, correct, heads, rng):
    """(ratio index, level index) a policy picks for one item under one SLO class."""
    target = SLO.fraction(*slo)

    def ok(r, m):
        return latency.feasible(profile, levels[m], ratios[r], tokens, target)

    pairs = [(r, m) for r in range(len(ratios)) for m in range(len(levels)) if ok(r, m)]
    if policy in ("ours", "lightest"):
        model, tok = heads[policy]
        # only pairs on the labelled grid (the TLM's ratio classes may be a superset of it)
        ratio, level, feasible_found = tlm.decide(model, tok, prompt, slo[0], slo[1],
                                     lambda r, m: r in ratios and latency.feasible(profile, m, r, tokens, target))
        return (ratios.index(ratio), levels.index(level)) if feasible_found else (0, 0)
    if policy == "llm-pruner":
        fitting = [m for m, name in enumerate(levels) if Level(name).ratio <= slo[0] + 1e-9] or [0]
        return len(ratios) - 1, max(fitting)
    if policy == "prompt-only":
        full = len(levels) - 1
        fitting = [r for r in range(len(ratios)) if ok(r, full)] or [0]
        return max(fitting), full
    if policy == "random":
        return rng.choice(pairs) if pairs else (0, 0)
    if policy == "oracle":
        right = [p for p in pairs if correct[item_index, p[0], p[1]]]
        return right[0] if right else (pairs[0] if pairs else (0, 0))
    raise ValueError(policy)


def throughput(package: Path, tlm_dir: Path, items, ratios, levels) -> dict:
    """Grid points per second, every path compressing each (item, ratio) once as the stage does:
    the label worker's own sweep (one model, zero-copy level switches, a level's ratios scored
    as one batch); the same model scoring one grid point per call (what switching alone gives);
    and re-materialising the sub-model per grid point, as ElastiLM's labeller rebuilds it."""
    from device_sdk.elastic import ElasticLinear
    from pipeline.elastic_model import serving_model

    worker = label.LabelWorker(package, tlm_dir)
    points = len(items) * len(ratios) * len(levels)

    def rate(run_point=None) -> float:
        start = time.perf_counter()
        if run_point is None:
            worker.sweep(items, ratios, levels, ["?"], quiet_context())
        else:
            for item in items:
                for question in [worker.compress(item.question, ratio, ["?"]) for ratio in ratios]:
                    for level in levels:
                        run_point(item, question, level)
        return points / (time.perf_counter() - start)

    def switching(item, question, level):
        worker.set_level(level)
        label.answer_correct(worker.model, worker.tokenizer, item, question)

    def rematerialising(item, question, level):
        model = serving_model(package)  # reload the weights and adapters ...
        model.set_level(level)
        linears = [m for block in model.transformer.layers for m in block.modules() if isinstance(m, ElasticLinear)]
        for module in linears:  # ... and materialise the level's own copy
            units, copy = module.units, module.active_weight.clone()
            module.cursor, module.level_widths = None, []  # a standalone layer, no longer following levels
            module.storage = torch.nn.Parameter(copy, requires_grad=False)
            module.max_units = units
            module.set_width(units)
        label.answer_correct(model, worker.tokenizer, item, question)

    sweep, one_by_one, rematerialise = rate(), rate(switching), rate(rematerialising)
    return {"sweep_points_per_s": sweep, "switching_points_per_s": one_by_one,
            "rematerialise_points_per_s": rematerialise, "speedup": sweep / rematerialise,
            "switching_speedup": one_by_one / rematerialise}


def ray_labelling_seconds(package: Path, tlm_dir: Path, workers: int, shards: int, settings: dict, home: Path) -> float:
    """Wall time of `shards` label shards submitted at once through the worker path on a Ray head of `workers` CPUs.

    Each shard is the real `label` stage attempt (workers.runner.execute via workers.ray_tasks),
    one CPU each, so one worker runs the shards in turn and two run them side by side.
    """
    import ray

    from pipeline.chain import run_label
    from tests.integration import services
    from workers.ray_tasks import submit
    from workers.runner import ExternalInput, StageTask
    from workers.store import StoreConfig

    def task(index: int, tag: str) -> StageTask:
        return StageTask(
            build_id=f"bench-{workers}-{tag}", stage_id=index, stage_key=f"label[{index}]", attempt=1,
            run=run_label,
            inputs={"package": ExternalInput(str(package)), "tlm": ExternalInput(str(tlm_dir))},
            outputs=("correctness", "meta"), settings=label.LabelSettings(**settings, shard=index, shards=shards),
            store=StoreConfig(str(home / f"store-{workers}")), output_prefix=f"bench/{workers}/{tag}/{index}")

    ray.shutdown()
    with services.ray_head(num_cpus=workers, num_gpus=0):
        warm = [submit(task(i, "warm"), {"num_cpus": 1}) for i in range(workers)]  # start the worker processes
        ray.get(warm)
        started = time.perf_counter()
        results = ray.get([submit(task(i, "timed"), {"num_cpus": 1}) for i in range(shards)])
        elapsed = time.perf_counter() - started
    failed = [r["error"] for r in results if not r["ok"]]
    if failed:
        raise RuntimeError(f"label shards failed: {failed}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-elastilm"))
    parser.add_argument("--levels", default="0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0")
    parser.add_argument("--ratios", default="0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0")
    parser.add_argument("--tasks", default="arc_easy,obqa,piqa,sciq")
    parser.add_argument("--train-items", type=int, default=20, help="per task, for the decision labels")
    parser.add_argument("--test-items", type=int, default=20, help="per task, held out")
    parser.add_argument("--recover-steps", type=int, default=20)
    parser.add_argument("--decision-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reuse", action="store_true", help="reuse finished stage outputs under --out")
    parser.add_argument("--ray-items", type=int, default=8, help="per task, for the 1-vs-2 Ray worker labelling run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = StageContext(work_dir=args.out)
    timings = {}

    def stage(name, fn):
        started = time.perf_counter()
        result = fn()
        timings[name] = round(time.perf_counter() - started, 1)
        print(f"[{name}] {timings[name]} s", flush=True)
        return result

    levels = [level.ratio for level in parse_levels(args.levels.split(","))]
    ratios = [float(x) for x in args.ratios.split(",")]
    tasks = args.tasks.split(",")
    reuse = args.reuse and (args.out / "package" / "model").is_dir()
    package = args.out / "package" if reuse else stage("elastify", lambda: build_package(args.out, levels, ctx))
    level_names = [read_manifest(package).elastic.level(lv).name for lv in levels]
    recovered = {}
    for name in level_names[:-1]:
        if reuse and (args.out / f"recover-{name}" / "recover.json").is_file():
            recovered[name] = json.loads((args.out / f"recover-{name}" / "recover.json").read_text())
            continue
        settings = recover.RecoverSettings(level=name, steps=args.recover_steps, batch_size=2, seq_len=128,
                                           eval_windows=8, lr=5e-4, warmup_steps=2)
        outputs = stage(f"recover {name}", lambda n=name, s=settings: recover.run(
            {"package": package}, s, StageContext(work_dir=args.out / f"recover-{n}")))
        recovered[name] = json.loads(Path(outputs["metrics"]).read_text())
        recover.install_adapters(package, {name: outputs["adapter"]})
    if not (reuse and read_manifest(package).latency_profile):
        lat = stage("latency", lambda: latency.run({"package": package}, latency.LatencySettings(prompt_lengths=[32, 128], repeats=2),
                                                   StageContext(work_dir=args.out / "latency"))["latency"])
        latency.apply_latency(package, json.loads(Path(lat).read_text()))
    score = args.out / "tlm-score" / "tlm"
    if not (reuse and score.is_dir()):
        score = stage("tlm-score", lambda: tlm.run_score(
            {"package": package}, tlm.ScoreSettings(passages=48, passage_words=80, steps=120, lr=1e-4),
            StageContext(work_dir=args.out / "tlm-score")))["tlm"]

    def sweep(name, start, per_task):
        shards = {}
        for index, task in enumerate(tasks):
            done = args.out / f"{name}-{task}"
            if reuse and (done / "correctness.json").is_file():
                shards[f"correctness.{index}"] = done / "correctness.safetensors"
                shards[f"meta.{index}"] = done / "correctness.json"
                continue
            settings = label.LabelSettings(tasks=[task], start=start, stop=start + per_task, per_task=None, ratios=ratios)
            out = label.run({"package": package, "tlm": score}, settings,
                            StageContext(work_dir=args.out / f"{name}-{task}"))
            shards[f"correctness.{index}"], shards[f"meta.{index}"] = out["correctness"], out["meta"]
        return shards

    train_shards = stage("label train", lambda: sweep("label-train", 0, args.train_items))
    labels_path = label.run_derive({"package": package, **train_shards}, label.DeriveSettings(),
                                   StageContext(work_dir=args.out / "derive"))["labels"]
    heads = {}
    for policy, rule in (("ours", "capable"), ("lightest", "lightest")):
        trained = args.out / f"decision-{rule}" / "tlm"
        if not (reuse and trained.is_dir()):
            trained = stage(f"tlm-decision {rule}", lambda r=rule: tlm.run_decision(
                {"tlm": score, "labels": labels_path}, tlm.DecisionSettings(rule=r, steps=args.decision_steps, batch_size=8),
                StageContext(work_dir=args.out / f"decision-{r}")))["tlm"]
        heads[policy] = tlm.load_tlm(trained)
    test_shards = stage("label held-out", lambda: sweep("label-test", 300, args.test_items))
    keys = sorted(k.split(".", 1)[1] for k in test_shards if k.startswith("correctness."))
    correct, tokens, meta = label.load_shards([(test_shards[f"correctness.{k}"], test_shards[f"meta.{k}"])
                                               for k in keys])
    profile = latency.profile_from_manifest(read_manifest(package))
    rng = random.Random(0)
    policies = ["ours", "llm-pruner", "prompt-only", "random", "oracle", "lightest"]
    table = {}
    for slo in SLO_CLASSES:
        row = {}
        for policy in policies:
            hits = violations = 0
            for i, item in enumerate(meta["items"]):
                r, m = policy_choice(policy, i, item["prompt"], int(tokens[i]), slo, meta["ratios"], meta["levels"],
                                     profile, correct, heads, rng)
                hits += bool(correct[i, r, m])
                ok = latency.feasible(profile, meta["levels"][m], meta["ratios"][r], int(tokens[i]), SLO.fraction(*slo))
                violations += not ok
            row[policy] = {"accuracy": hits / len(meta["items"]), "violations": violations}
        table[str(slo)] = row
    items = label.load_items(tasks[:1], 300, 302)
    speed = stage("throughput", lambda: throughput(package, score, items, ratios, level_names))
    # Throughput only: the first items of each task, the whole grid, two shards.
    ray_settings = {"tasks": tasks, "per_task": args.ray_items, "ratios": ratios}
    ray_one = stage("label on 1 Ray worker", lambda: ray_labelling_seconds(
        package, score, 1, 2, ray_settings, args.out / "ray"))
    ray_two = stage("label on 2 Ray workers", lambda: ray_labelling_seconds(
        package, score, 2, 2, ray_settings, args.out / "ray"))
    speed |= {"ray_1_worker_s": ray_one, "ray_2_workers_s": ray_two, "ray_speedup": ray_one / ray_two}
    results = {"recover": {k: {"before": v["eval_loss_before"], "after": v["eval_loss_after"]}
                           for k, v in recovered.items()},
               "grid_accuracy": correct.float().mean(0).tolist(), "ratios": meta["ratios"], "levels": meta["levels"],
               "held_out_items": len(meta["items"]), "slo_table": table, "throughput": speed, "timings_s": timings}
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print_table("recovery: eval loss per level", ["level", "before", "after"],
                [[name, f"{v['before']:.3f}", f"{v['after']:.3f}"] for name, v in results["recover"].items()])
    print_table(f"accuracy per SLO class on {len(meta['items'])} held-out items [SLO violations by the cost model]",
                ["SLO (TTFT, TPOT)", *policies],
                [[slo, *(f"{row[p]['accuracy']:.3f} [{row[p]['violations']}]" for p in policies)]
                 for slo, row in table.items()])
    print_table("labelling throughput", ["measure", "baseline", "ours", "ratio"], [
        ["grid points/s: label worker (zero-copy, a level's ratios batched) vs re-materialising per point",
         f"{speed['rematerialise_points_per_s']:.2f}", f"{speed['sweep_points_per_s']:.2f}", f"{speed['speedup']:.1f}x"],
        ["grid points/s: zero-copy, one point per call vs re-materialising per point",
         f"{speed['rematerialise_points_per_s']:.2f}", f"{speed['switching_points_per_s']:.2f}",
         f"{speed['switching_speedup']:.1f}x"],
        ["2 label shards: 2 Ray workers vs 1 (s)", f"{ray_one:.1f}", f"{ray_two:.1f}",
         f"{speed['ray_speedup']:.2f}x"],
    ])

if __name__ == "__main__":
    main()
