"""Which decision head to ship: ElastiLM's SLO-token head against the utility head, on held-out items.

Given an elastified SmolLM2 package with its level adapters (`--package`; e.g. the one
bench.bench_elastilm builds), this runs the chain's own stage code: latency → tlm-score → label
(held-in items 0.., held-out items from 300 on, the same grid) → label-derive → tlm-decision once
per head and seed, with the demo's decision settings (100 steps, batch 16). Every held-out item ×
ElastiLM SLO class is then decided by each head exactly as the SDK decides (feasible under the
cost model, the utility head's ties to the cheaper cell) and scored by the held-out correctness
tensor: a lookup. The reference rows are random feasible (its exact expectation) and the oracle.

The headline is the paired difference utility − slo_token per held-out item (mean over the SLO
classes and seeds), with its standard error over items. The decision stage's wall time is
reported per head (seed 0) at the demo's decision settings; the labels here are 80 items where the
demo's are 20, which only adds the utility head's one trunk pass per prompt. Raw JSON: bench/results/decision_head.json.

With several --train-items (per task, e.g. 20,200) every head is trained on each held-in prefix and
the paired difference larger − smaller per head says what labelling at scale buys; --shots 5 uses the
label stage's five-shot prompts (bench_trace's tasks, shards and held-out items).

  nice -n 5 .venv/bin/python -m bench.bench_decision_head --package /tmp/bench-elastilm/package --out /tmp/dh
  nice -n 5 .venv/bin/python -m bench.bench_decision_head --package /tmp/dh-bench/package --out /tmp/dh-bench/out \
      --tasks arc_easy,obqa,piqa,sciq,siqa,boolq --shots 5 --train-items 20,200 --test-items 30 \
      --heads slo_token,utility --slo-token-seeds 1 --results bench/results/decision_head_scale.json
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.common import ROOT, interleaved_medians, print_table, write_json
from bench.trace import TIGHT_CLASSES
from device_sdk.latency import SLO
from device_sdk.tlm import best_feasible_pair, best_utility_cell
from pipeline.elastilm import label, latency, slo_labels, tlm
from pipeline.stage import StageContext


def cached(path: Path, make):
    """`make()` once: a finished stage's output path is reused on a rerun."""
    return path if path.exists() else make()


def latency_and_score(package: Path, out: Path) -> tuple[Path, Path]:
    """The chain's latency and tlm-score stages at the bench's settings, cached under `out`."""
    lat = cached(out / "latency" / "latency.json", lambda: latency.run(
        {"package": package}, latency.LatencySettings(prompt_lengths=[32, 128], repeats=1),
        StageContext(work_dir=out / "latency"))["latency"])
    score = cached(out / "tlm-score" / "tlm", lambda: tlm.run_score(
        {"package": package}, tlm.ScoreSettings(passages=32, passage_words=60, steps=60),
        StageContext(work_dir=out / "tlm-score"))["tlm"])
    return lat, score


def sweep(package: Path, score: Path, out: Path, tasks: list[str], start: int, per_task: int, ratios, levels,
          shots: int = 0, workers: int = 1, chunk: int = 45):
    """Label shards for items [start, start + per_task) of every task, at most `chunk` items a shard, each
    shard reused from `out` when there (its directory names its range); zero-shot prompts unless `shots`
    (the label stage's few-shot block). With `workers` > 1 the missing shards run as Ray tasks of one CPU
    each, as the service fans the label stage out. Returns the `correctness.<k>`/`meta.<k>` inputs
    label-derive reads, shards in task order then item order."""
    shards, missing = {}, []
    for task in tasks:
        for first in range(start, start + per_task, chunk):
            stop = min(first + chunk, start + per_task)
            work = out / (f"{task}-{first}-{stop}" + (f"-{shots}shot" if shots else ""))
            if not (work / "correctness.json").is_file():
                settings = label.LabelSettings(tasks=[task], start=first, stop=stop, per_task=None,
                                               ratios=ratios, levels=levels, shots=shots)
                missing.append((settings, work))
            k = len(shards) // 2
            shards[f"correctness.{k}"] = work / "correctness.safetensors"
            shards[f"meta.{k}"] = work / "correctness.json"
    if workers > 1 and len(missing) > 1:
        import ray

        ray.init(num_cpus=workers, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, ignore_reinit_error=True)
        labelled = ray.remote(num_cpus=1, max_retries=0)(_label_shard)
        ray.get([labelled.remote(package, score, settings, work) for settings, work in missing])
    else:
        for settings, work in missing:
            _label_shard(package, score, settings, work)
    return shards


def _label_shard(package: Path, score: Path, settings, work: Path) -> None:
    started = time.perf_counter()
    label.run({"package": package, "tlm": score}, settings, StageContext(work_dir=work))
    print(f"labelled {settings.tasks[0]} [{settings.start}, {settings.stop}) in {time.perf_counter() - started:.0f} s",
          flush=True)


def held_in_tag(tasks: list[str], shots: int, per_task: int) -> str:
    """What a cached derive or decision-head directory was made from: the tasks (a short digest), the
    few-shot block, the held-in items per task. Runs over other tasks must not reuse it."""
    digest = hashlib.sha1(",".join(tasks).encode()).hexdigest()[:8]
    return f"-{len(tasks)}tasks-{digest}" + (f"-{shots}shot" if shots else "") + f"-{per_task}items"


def derive(package: Path, lat: Path, shards: dict, out: Path) -> Path:
    return cached(out / "labels.json", lambda: slo_labels.run_derive({"package": package, "latency": lat, **shards},
                                                                slo_labels.DeriveSettings(), StageContext(work_dir=out))["labels"])


def train(score: Path, labels: Path, head: str, seed: int, out: Path, temperature: float,
          steps: int = 100, init: str = "prior") -> tuple[Path, float]:
    """(trained TLM dir, the stage's wall seconds); a finished run under `out` is reused."""
    timing = out / "wall_seconds.json"
    if timing.is_file():
        return out / "tlm", json.loads(timing.read_text())["seconds"]
    started = time.perf_counter()
    settings = tlm.DecisionSettings(head=head, steps=steps, batch_size=16, seed=seed, margin_temperature=temperature,
                                    utility_init=init)
    done = tlm.run_decision({"tlm": score, "labels": labels}, settings, StageContext(work_dir=out))["tlm"]
    seconds = time.perf_counter() - started
    timing.write_text(json.dumps({"seconds": seconds}))
    return done, seconds


def choose(head: str, model, tokenizer, prompt: str, tokens: int, slo, ratios, levels, profile,
           kept: int = 0) -> tuple[int, int]:
    """The cell the SDK's rule picks under the cost model (grid indices), the last `kept` tokens served whole."""
    target = SLO.fraction(*slo)

    def ok(r, m):
        return latency.feasible(profile, m, r, tokens, target, kept)

    if head == "slo_token":
        # The head scores its own grid (every ratio and level it was built for); only the labelled
        # cells can be looked up, so the choice is the best labelled feasible pair, else the lightest.
        ratio_lp, level_lp = tlm.decision_log_probs(model, tokenizer, prompt, *slo)
        r, m, met = best_feasible_pair(ratio_lp, level_lp, model.config.ratio_grid, model.config.level_grid,
                                       lambda r, m: r in ratios and m in levels and ok(r, m))
        if not met:
            r, m = min(ratios), min(levels, key=float)
    else:
        r, m, _ = best_utility_cell(tlm.utility(model, tokenizer, prompt), ratios, levels, ok,
                                    lambda r, m: latency.cost_rank(profile, m, r, tokens, kept))
    return ratios.index(r), levels.index(m)


def best_cell(base_rate: torch.Tensor, cells: list[tuple[int, int]], ratios, levels, profile, tokens: int,
              kept: int) -> tuple[int, int]:
    """The feasible cell (grid indices among `cells`) with the best held-in accuracy, ties to the cheaper,
    as the SDK picks by utility: the static rule a utility head must beat."""
    feasible = {(ratios[r], levels[m]) for r, m in cells}
    r, m, _ = best_utility_cell(base_rate, ratios, levels, lambda r, m: (r, m) in feasible,
                                lambda r, m: latency.cost_rank(profile, m, r, tokens, kept))
    return ratios.index(r), levels.index(m)


def kept_tokens(package: Path, items: list[dict]) -> list[int]:
    """Each item's kept end (its question, served whole) in tokens, as the label stage records it; counted
    here the same way for shards labelled before it did."""
    if all("kept_tokens" in item for item in items):
        return [item["kept_tokens"] for item in items]
    tokenizer = AutoTokenizer.from_pretrained(str(package / "model"))
    return [item.get("kept_tokens", label.count_kept_tokens(tokenizer, item.get("kept", ""))) for item in items]


def mean_se(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) / len(values) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, required=True, help="elastified package with level adapters")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-decision-head"))
    parser.add_argument("--tasks", default="arc_easy,obqa,piqa,sciq")
    parser.add_argument("--ratios", default="0.5,0.7,1.0", help="the demo's")
    parser.add_argument("--levels", default="0.3,0.5,0.7,0.9,1.0")
    parser.add_argument("--train-items", default="20", help="per task, held in; a comma list compares sizes")
    parser.add_argument("--shots", type=int, default=0, help="the label stage's few-shot block (0: zero-shot)")
    parser.add_argument("--steps", type=int, default=100, help="decision-stage steps (batch 16), the demo's")
    parser.add_argument("--label-workers", type=int, default=1, help="label shards side by side, on Ray")
    parser.add_argument("--test-items", type=int, default=25, help="per task, held out (from item 300)")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--slo-token-seeds", type=int, default=None,
                        help="seeds of the SLO-token head (default --seeds; its training is the slow one)")
    parser.add_argument("--margin-temperature", type=float, default=0.5)
    parser.add_argument("--heads", default="slo_token,utility,utility T=0 (0/1 labels)",
                        help="which of the three to train and compare")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-timing", dest="timing", action="store_false",
                        help="skip the two heads' 10-step stage timing")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "decision_head.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out, package = args.out, args.package
    tasks, ratios = args.tasks.split(","), [float(x) for x in args.ratios.split(",")]
    levels = args.levels.split(",")
    sizes = [int(x) for x in args.train_items.split(",")]
    lat, score = latency_and_score(package, out)
    test_shards = sweep(package, score, out / "label", tasks, 300, args.test_items, ratios, levels, args.shots,
                        args.label_workers)
    labels = {size: derive(package, lat, sweep(package, score, out / "label", tasks, 0, size, ratios, levels,
                                               args.shots, args.label_workers),
                           out / f"derive{held_in_tag(tasks, args.shots, size)}")
              for size in sizes}
    keys = sorted(k.split(".", 1)[1] for k in test_shards if k.startswith("correctness."))
    correct, tokens, meta = slo_labels.load_shards([(test_shards[f"correctness.{k}"], test_shards[f"meta.{k}"])
                                               for k in keys])
    profile = slo_labels.load_profile({"latency": lat})
    kept = kept_tokens(package, meta["items"])
    heads = {"slo_token": ("slo_token", args.margin_temperature, "prior"),
             "utility": ("utility", args.margin_temperature, "prior"),
             "utility (random init)": ("utility", args.margin_temperature, "random"),
             "utility T=0 (0/1 labels)": ("utility", 0.0, "prior")}
    heads = {name: heads[name] for name in args.heads.split(",")}
    # row name -> (head name, head, temperature, init, held-in items per task); several sizes name rows by
    # their items
    heads = {(f"{name} @{size * len(tasks)}" if len(sizes) > 1 else name): (name, head, temperature, init, size)
             for size in sizes for name, (head, temperature, init) in heads.items()}
    # per head: [item] accuracy averaged over classes and seeds
    per_item = {name: torch.zeros(len(meta["items"])) for name in heads}
    per_class = {name: {str(slo): 0.0 for slo in TIGHT_CLASSES} for name in heads}
    stage_seconds = {}  # the decision stage's wall time per head (seed 0), at the demo's 100 steps × 16
    seeds = {name: args.slo_token_seeds or args.seeds if head == "slo_token" else args.seeds
             for name, (_, head, _, _, _) in heads.items()}
    kept_steps = {}  # the utility heads' step kept by held-in validation, per seed (0: the prior)
    for name, (_, head, temperature, init, size) in heads.items():
        for seed in range(seeds[name]):
            trained, seconds = train(score, labels[size], head, seed,
                                     out / f"decision-{head}-{temperature}-{init}-{seed}"
                                           f"{held_in_tag(tasks, args.shots, size)}-{args.steps}steps",
                                     temperature, args.steps, init)
            stage_seconds.setdefault(name, seconds)
            if head == "utility":
                kept_steps.setdefault(name, []).append(
                    json.loads((trained.parent / "tlm-decision.json").read_text())["kept_step"])
            model, tokenizer = tlm.load_tlm(trained)
            for slo in TIGHT_CLASSES:
                for i, item in enumerate(meta["items"]):
                    r, m = choose(head, model, tokenizer, item["prompt"], int(tokens[i]), slo, meta["ratios"],
                                  meta["levels"], profile, kept[i])
                    hit = float(correct[i, r, m])
                    per_item[name][i] += hit / (seeds[name] * len(TIGHT_CLASSES))
                    per_class[name][str(slo)] += hit / (seeds[name] * len(meta["items"]))
    # reference rows, no training: random feasible (its expectation), the oracle, and per held-in size the
    # strongest simple policy, the feasible cell with the best held-in accuracy (the same for every prompt)
    base_rates = {size: torch.tensor([cell["correct"] for cell in json.loads(labels[size].read_text())["cells"]],
                                     dtype=torch.float32).mean(0) for size in sizes}
    static = {(f"held-in best cell @{size * len(tasks)}" if len(sizes) > 1 else "held-in best cell"): size
              for size in sizes}
    for name in ("random feasible", "oracle", *static):
        per_item[name] = torch.zeros(len(meta["items"]))
        per_class[name] = {str(slo): 0.0 for slo in TIGHT_CLASSES}
    for slo in TIGHT_CLASSES:
        for i in range(len(meta["items"])):
            cells = slo_labels.feasible_pairs(profile, meta["ratios"], meta["levels"], int(tokens[i]), slo, kept[i])
            hits = [float(correct[i, r, m]) for r, m in cells] or [float(correct[i, 0, 0])]
            picks = {name: float(correct[i][best_cell(base_rates[size], cells, meta["ratios"], meta["levels"],
                                                      profile, int(tokens[i]), kept[i])])
                     for name, size in static.items()}
            for name, value in (("random feasible", statistics.fmean(hits)), ("oracle", max(hits)), *picks.items()):
                per_item[name][i] += value / len(TIGHT_CLASSES)
                per_class[name][str(slo)] += value / len(meta["items"])

    # The same stage at 10 steps, both heads round-robin under the same machine load (the 100-step wall
    # times above ran minutes apart on a shared machine): median of 3, after 1 warm-up each.
    def short_stage(head):
        settings = tlm.DecisionSettings(head=head, steps=10, batch_size=16, margin_temperature=args.margin_temperature)
        return lambda: tlm.run_decision({"tlm": score, "labels": labels[sizes[0]]}, settings,
                                        StageContext(work_dir=out / f"short-{head}"))

    short = None
    if args.timing:
        short = interleaved_medians({head: short_stage(head) for head in ("slo_token", "utility")}, repeats=3,
                                    warmup=1)
        print("decision stage at 10 steps × 16, interleaved medians: "
              + ", ".join(f"{head} {seconds:.1f} s" for head, seconds in short.items()))

    n = len(meta["items"])
    rows = []
    summary = {}
    for name in per_item:
        mean, se = mean_se(per_item[name].tolist())
        summary[name] = {"accuracy": mean, "se": se, "per_class": per_class[name]}
        rows.append([name, f"{mean:.3f} ± {se:.3f}", *(f"{per_class[name][str(s)]:.3f}" for s in TIGHT_CLASSES)])
    print_table(f"Held-out accuracy under the SLO classes ({n} items; ± SE over items; seeds {seeds})",
                ["head", "overall", *map(str, TIGHT_CLASSES)], rows)
    pairs = []  # (row, rival): the utility heads against the SLO-token head and random feasible, per size
    for size in sizes:
        rows = {base: name for name, (base, _, _, _, s) in heads.items() if s == size}
        static_row = next(name for name, s in static.items() if s == size)
        pairs += [(row, rival) for rival in (rows.get("slo_token"), "random feasible", static_row) if rival
                  for base, row in rows.items() if base != "slo_token"]
        pairs += [(rows["utility"], rows["utility (random init)"])] if {"utility", "utility (random init)"} <= set(rows) else []
    for small, large in itertools.pairwise(sizes):  # and what labelling more items buys each head
        pairs += [(name, rival) for name, (base, _, _, _, s) in heads.items() if s == large
                  for rival, (other, _, _, _, s2) in heads.items() if s2 == small and other == base]
    paired = {}
    for name, rival in pairs:
        mean, se = mean_se((per_item[name] - per_item[rival]).tolist())
        paired[f"{name} − {rival}"] = {"mean": mean, "se": se}
        print(f"paired {name} − {rival}: {mean:+.3f} ± {se:.3f} (SE, n={n})")
    print("decision stage wall time (100 steps × 16, seed 0): "
          + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in stage_seconds.items()))
    results = {"held_out_items": n, "tasks": tasks, "ratios": ratios, "levels": levels, "seeds": seeds,
               "train_items_per_task": sizes, "test_items_per_task": args.test_items, "shots": args.shots,
               "decision_steps": args.steps,
               "margin_temperature": args.margin_temperature, "threads": args.threads,
               "heads": summary, "paired": paired, "utility_kept_steps": kept_steps,
               "decision_stage_seconds": stage_seconds,
               "decision_stage_seconds_10_steps_interleaved": short,
               "grid_accuracy_held_out": correct.float().mean(0).tolist()}
    write_json(args.results, results)


if __name__ == "__main__":
    main()
