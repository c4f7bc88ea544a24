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
Throughput (`throughput`): grid points per second of the label worker (zero-copy switching, a
level's ratios batched), of the same model one grid point per call, and of a copy-based
re-materialiser that builds each point's sub-model from the full model in memory (kept weights
copied, that level's LoRA attached, no reload), timed per held-out item over the whole grid; and
two label shards through the real worker path on a Ray head with 1 vs 2 CPUs. Raw JSON goes to
bench/results/labelling.json. Defaults are the full grids: levels 0.2…1.0 × prompt ratios 0.3…1.0,
ARC-E, OBQA, PIQA and SciQ.

  .venv/bin/python -m bench.bench_elastilm --out /tmp/bench-elastilm
  .venv/bin/python -m bench.bench_elastilm --out /tmp/bench-elastilm --throughput-only   # labelling speed alone
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.common import ROOT, print_table, write_json
from bench.trace import TIGHT_CLASSES
from device_sdk.format import Level, parse_levels, read_manifest
from device_sdk.kernels import make_linear
from device_sdk.latency import SLO
from device_sdk.llama import Transformer
from device_sdk.lora import ATTN_PROJECTIONS, PROJECTIONS, projection_key
from device_sdk.runtime import ElasticModel
from pipeline.data.tasks import load_items
from pipeline.elastilm import label, latency, recover, slo_labels, tlm
from pipeline.stage import StageContext, quiet_context


def build_package(out: Path, levels: list[float], ctx: StageContext, calibration: list[str] | None = None,
                  name: str = "package", profile_settings: dict | None = None,
                  elastify_settings: dict | None = None, model: Path | None = None) -> Path:
    """SmolLM2 (or the HF directory `model`) profiled (block influence, 8 x 128 tokens of `calibration`,
    default the build's; other ProfileSettings as given) and elastified (the build's ElastifySettings but for those given)."""
    from pipeline.assets import prepare_smollm2
    from pipeline.elastilm.elastify import ElastifySettings, elastify
    from pipeline.elastilm.profile import ProfileSettings, profile
    from pipeline.models.loading import load_model

    loaded = load_model(model or prepare_smollm2())
    importance = profile(loaded.model, loaded.tokenizer, loaded.architecture,
                         ProfileSettings(windows=8, window_length=128, layer_method="block_influence",
                                         **({"calibration": calibration} if calibration else {}),
                                         **(profile_settings or {})), ctx)
    path = out / name
    elastify(loaded.model, loaded.tokenizer, loaded.architecture, importance, ElastifySettings(levels=levels, **(elastify_settings or {})), path,
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


def rematerialise(full: ElasticModel, level: str) -> SimpleNamespace:
    """The level as a standalone model built from `full`, already in memory: every projection's kept
    rows (or columns) copied out into their own tensors, and only this level's LoRA attached.

    What a labeller without zero-copy switching does at best: nothing is read from disk, a projection
    the level keeps whole and the tensors no level prunes (embeddings, norms, LM head) are shared,
    and the rest is one copy of what the level keeps. `label.choice_scores` only reads `.transformer`.
    """
    shape = full.manifest.elastic.level(level)
    source = full.transformer
    weights = {"model.embed_tokens.weight": source.embed_tokens, "model.norm.weight": source.norm.weight,
               "lm_head.weight": source.lm_head.storage}
    adapter = full.adapters.get(shape.name, {})
    for index, block in enumerate(source.layers):
        prefix = f"model.layers.{index}"
        weights[f"{prefix}.input_layernorm.weight"] = block.input_layernorm.weight
        weights[f"{prefix}.post_attention_layernorm.weight"] = block.post_attention_layernorm.weight
        for name in PROJECTIONS:
            linear = block.projection(name).linear
            units = (shape.attn_units if name in ATTN_PROJECTIONS else shape.mlp_units)[index]
            rows = units * linear.unit_size
            kept = linear.storage if rows == linear.storage.shape[0] else linear.storage[:rows].clone()
            key = projection_key(index, name)
            weights[f"{key}.weight" if linear.unit_axis == "out" else f"{key}.weight_t"] = kept
            if linear.bias is not None:  # a row-unit bias is cut with its rows; a column-unit bias is whole
                cut = linear.unit_axis == "out" and rows < linear.bias.shape[0]
                weights[f"{key}.bias"] = linear.bias[:rows].clone() if cut else linear.bias
    model = Transformer(full.manifest.architecture, weights, partial(make_linear, weight_format=full.weight_format))
    for index, block in enumerate(model.layers):
        for name in PROJECTIONS:
            block.projection(name).lora = adapter.get(projection_key(index, name))
    return SimpleNamespace(transformer=model)


def mean_se(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def throughput(package: Path, tlm_dir: Path, items, ratios, levels, seed: int = 0, on_item=None) -> dict:
    """Grid points per second of three labelling paths, timed per item over the whole grid.

    Every path compresses each (item, ratio) once with the TLM inside its timed span, as the
    stage does, and scores with the same model already in memory (one load, all LoRAs read):
      rematerialise  per grid point, copy the level's kept weights into a standalone sub-model
                     with that level's LoRA (`rematerialise`), then score the point
      switching      per grid point, a zero-copy level switch, then score the point
      worker         the label worker's sweep: a switch per (item, level), that level's ratios
                     scored as one batch
    The paths run round-robin per item in rotating order (drift and other tenants hit all
    alike). Rates are points / mean seconds per item, with the delta-method standard error;
    speedups are ratios of mean item times with a paired bootstrap over items.
    """
    worker = label.LabelWorker(package, tlm_dir)
    full = worker.model
    per_item = len(ratios) * len(levels)

    def compressions(item):
        return [worker.compress(item.question, ratio, ["?"]) for ratio in ratios]

    def one_by_one(item, build):
        correct = torch.zeros(len(ratios), len(levels), dtype=torch.bool)
        for r, question in enumerate(compressions(item)):
            for m, level in enumerate(levels):
                correct[r, m] = label.answer_correct(build(level), worker.tokenizer, item, question)
        return correct

    def switched(level):
        worker.set_level(level)
        return full

    paths = {
        "rematerialise": lambda item: one_by_one(item, lambda level: rematerialise(full, level)),
        "switching": lambda item: one_by_one(item, switched),
        "worker": lambda item: worker.sweep([item], ratios, levels, ["?"], quiet_context())[0],
    }
    for run in paths.values():  # warm-up: caches, allocator, the TLM's first calls
        run(items[0])
    seconds = {name: [] for name in paths}
    answers = {name: [] for name in paths}
    load = []
    names = list(paths)

    def so_far(done: int) -> dict:
        reference = torch.stack(answers["switching"])
        agreement = {name: float((torch.stack(answers[name]) == reference).float().mean()) for name in names}
        return summarise(seconds, per_item, seed) | {
            "items": done, "item_ids": [item.id for item in items[:done]],
            "answers_agree_with_switching": agreement, "loadavg_1min_per_item": load}

    for i, item in enumerate(items):
        for name in names[i % len(names):] + names[: i % len(names)]:
            started = time.perf_counter()
            answers[name].append(paths[name](item))
            seconds[name].append(time.perf_counter() - started)
        load.append(os.getloadavg()[0])
        print(f"  item {i + 1}/{len(items)} {item.id}: "
              + ", ".join(f"{n} {seconds[n][-1]:.2f} s" for n in names), flush=True)
        if on_item is not None and i:  # so a run stopped early still leaves its items' numbers
            on_item(so_far(i + 1))
    return so_far(len(items))


def summarise(seconds: dict[str, list[float]], per_item: int, seed: int = 0) -> dict:
    """Per path: grid points/s = points per item / mean item seconds, with its delta-method standard
    error; for switching and the worker, the speedup over re-materialising (ratio of mean item times)
    with the standard error and 95% interval of a paired bootstrap over items."""
    n = len(seconds["rematerialise"])
    rng = random.Random(seed)
    draws = [[rng.randrange(n) for _ in range(n)] for _ in range(10_000)]
    paths = {}
    for name, values in seconds.items():
        mean, se = mean_se(values)
        rate = per_item / mean
        paths[name] = {"points_per_s": rate, "points_per_s_se": rate * se / mean,
                       "item_seconds_mean": mean, "item_seconds_se": se, "item_seconds": values}
    for name in ("switching", "worker"):
        boot = sorted(sum(seconds["rematerialise"][j] for j in d) / sum(seconds[name][j] for j in d) for d in draws)
        paths[name]["speedup_vs_rematerialise"] = statistics.fmean(seconds["rematerialise"]) / statistics.fmean(seconds[name])
        paths[name]["speedup_se"] = statistics.stdev(boot)
        paths[name]["speedup_ci95"] = [boot[len(boot) // 40], boot[-len(boot) // 40 - 1]]
    return {"points_per_item": per_item, "paths": paths}


def ray_labelling_seconds(package: Path, tlm_dir: Path, workers: int, shards: int, settings: dict, home: Path) -> float:
    """Wall time of `shards` label shards submitted at once through the worker path on a Ray head of `workers` CPUs.

    Each shard is the real `label` stage attempt (workers.runner.execute via workers.ray_tasks),
    one CPU each, so one worker runs the shards in turn and two run them side by side.
    """
    import ray

    from pipeline.chain import run_label
    from tests.support import services
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


def labelling(package: Path, score: Path, tasks: list[str], ratios: list[float], levels: list[str],
              args, settings: dict) -> dict:
    """The throughput comparison and the Ray 1-vs-2 run; writes the raw JSON to `args.results`, prints a table."""
    items = [item for task in tasks for item in load_items([task], 300, 300 + args.throughput_items)]
    load_before = os.getloadavg()
    header = {"settings": settings, "cpus": os.cpu_count(), "threads": args.threads, "loadavg_before": load_before,
              "ratios": ratios, "levels": levels, "items_planned": len(items)}

    def write(partial: dict) -> None:
        write_json(args.results, header | partial | {"complete": False})

    speed = header | throughput(package, score, items, ratios, levels, on_item=write) | {"complete": True}
    speed["loadavg_after"] = os.getloadavg()
    write_json(args.results, speed)  # again below with the Ray run, if any
    if not args.no_ray:
        # Throughput only: the first items of each task, the whole grid, two shards.
        ray_settings = {"tasks": tasks, "per_task": args.ray_items, "ratios": ratios}
        one = ray_labelling_seconds(package, score, 1, 2, ray_settings, args.out / "ray")
        load_between = os.getloadavg()
        two = ray_labelling_seconds(package, score, 2, 2, ray_settings, args.out / "ray")
        speed["ray"] = {"shards": 2, "items": len(tasks) * args.ray_items, "one_worker_s": one, "two_workers_s": two,
                        "speedup": one / two, "loadavg_after_one": load_between, "loadavg_after_two": os.getloadavg()}
        write_json(args.results, speed)
    paths = speed["paths"]
    rows = [
        ["re-materialise per grid point (copy kept weights + the level's LoRA, no reload)", "rematerialise"],
        ["one loaded model, zero-copy switch, one grid point per call", "switching"],
        ["label worker: switch per (item, level), that level's ratios in one batch", "worker"],
    ]
    print_table(f"labelling throughput: {speed['items']} items x {speed['points_per_item']} grid points, "
                f"{speed['threads']} thread(s), mean ± SE over items", ["path", "grid points/s", "vs re-materialise"],
                [[label_, f"{paths[k]['points_per_s']:.2f} ± {paths[k]['points_per_s_se']:.2f}",
                  "1.00x" if k == "rematerialise" else
                  f"{paths[k]['speedup_vs_rematerialise']:.2f}x ± {paths[k]['speedup_se']:.2f} "
                  f"[{paths[k]['speedup_ci95'][0]:.2f}, {paths[k]['speedup_ci95'][1]:.2f}]"] for label_, k in rows])
    if "ray" in speed:
        ray = speed["ray"]
        print(f"{ray['shards']} label shards ({ray['items']} items): 1 Ray worker {ray['one_worker_s']:.1f} s, "
              f"2 workers {ray['two_workers_s']:.1f} s, {ray['speedup']:.2f}x")
    print(f"answers agree with switching: {speed['answers_agree_with_switching']}; "
          f"load average before {load_before}, after {speed['loadavg_after']}; raw JSON: {args.results}")
    return speed


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
    parser.add_argument("--no-ray", action="store_true", help="skip the 1-vs-2 Ray worker labelling run")
    parser.add_argument("--throughput-only", action="store_true",
                        help="only the labelling throughput (package, recovery, TLM score head, then the timing); "
                             "no latency stage, labels, decision heads or SLO-policy table")
    parser.add_argument("--throughput-items", type=int, default=6, help="per task, held out, for the throughput")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "labelling.json",
                        help="where the labelling throughput's raw JSON goes")
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
    if not args.throughput_only and not (reuse and read_manifest(package).latency_profile):
        lat = stage("latency", lambda: latency.run({"package": package}, latency.LatencySettings(prompt_lengths=[32, 128], repeats=2),
                                                   StageContext(work_dir=args.out / "latency"))["latency"])
        latency.apply_latency(package, json.loads(Path(lat).read_text()))
    score = args.out / "tlm-score" / "tlm"
    if not (reuse and score.is_dir()):
        score = stage("tlm-score", lambda: tlm.run_score(
            {"package": package}, tlm.ScoreSettings(passages=48, passage_words=80, steps=120, lr=1e-4),
            StageContext(work_dir=args.out / "tlm-score")))["tlm"]
    bench_settings = {"threads": args.threads, "recover_steps": args.recover_steps, "tasks": tasks,
                      "throughput_items_per_task": args.throughput_items, "ray_items_per_task": args.ray_items}
    speed = stage("throughput", lambda: labelling(package, score, tasks, ratios, level_names, args, bench_settings))
    if args.throughput_only:
        return

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
    labels_path = slo_labels.run_derive({"package": package, **train_shards}, slo_labels.DeriveSettings(),
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
    correct, tokens, meta = slo_labels.load_shards([(test_shards[f"correctness.{k}"], test_shards[f"meta.{k}"])
                                               for k in keys])
    profile = latency.profile_from_manifest(read_manifest(package))
    rng = random.Random(0)
    policies = ["ours", "llm-pruner", "prompt-only", "random", "oracle", "lightest"]
    table = {}
    for slo in TIGHT_CLASSES:
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


if __name__ == "__main__":
    main()
