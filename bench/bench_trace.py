"""ElastiLM's end-to-end trace on SmolLM2: requests in six SLO classes served by the device SDK per policy.

The chain's stage code runs as in bench_decision_head.py (its functions, its cached outputs under
--out): latency → tlm-score → label → label-derive → tlm-decision for each head (--decision-steps),
held-in items 0..--train-items per task (180: 1,080 items over six tasks), labelled in shards of at most
45 items run as Ray tasks (--label-workers side by side); the held-out items (--test-ranges, from item
300) are labelled on the same grid and are asserted disjoint from the held-in ones.

Trace. `bench.trace.make_trace`: --requests requests in ElastiLM's six SLO classes (TTFT, TPOT
fractions) (1, 1), (0.8, 0.9), (0.6, 0.8), (0.4, 0.7), (0.2, 0.6), (0.2, 0.5); class k is tied to task
k mod len(tasks) (six tasks by default, one per class, with their five-shot blocks) and asks that
task's held-out items, each about equally often. Class skew α: class k gets a share
∝ (1 + α)^k (0 = loosest), rounded so the counts sum to the total; α = 0, +0.25 (tight-heavy), −0.25.
--seed shuffles the trace and seeds both decision heads' training.

Serving. One SDK model (`ElasticModel`, native decoder, --threads, one by default) serves every
request of the α = 0 trace once per served policy through `generate` with --new-tokens new tokens, item
by item (the item's full-model reference runs first, then its requests, the policies in an order that
rotates per request: load drift hits the reference and every policy alike; the requests are independent,
so serving them grouped changes nothing but the timing's fairness) (the
end-of-sequence token is switched off so every request decodes that many: TPOT needs them, the text is
not scored). SLO targets are absolute: the fractions times the full model's TTFT and TPOT for that same
prompt on this machine (full model, full prompt, no TLM; the median of --full-runs generate calls per
item). The SDK decides against this machine's device profile (`measure_profile`, measured at the start,
plus each TLM's own time) with the TLM decision and compression inside the measured TTFT; each policy's
copy of the profile recalibrates from the requests it serves (`Drift`, --drift-quantile, with the SDK's
serving headroom on top, --drift-headroom; ShortGPT's depth
profile the same way), as a device's would. A violation is
a measured TTFT or TPOT above its target. Policies, each picking a (prompt ratio, level) cell:

  ours (utility)     the utility head via the SDK's tlm_decider: the feasible cell most likely right
  ours (SLO-token)   ElastiLM's head via tlm_decider, restricted to the labelled grid
  LLM-Pruner         the largest feasible level on the full prompt (the SDK's own fallback, choose_level)
  LLMLingua-2        the TLM score head compresses: the largest feasible level, then the most-kept ratio
  ShortGPT           drop the layers of least block influence (the package's profile scores) down to
                     the deepest feasible depth: 0-width layers through the SDK's per-layer widths (as a
                     CLONE profile), each depth's latency line measured on this machine like a level's
  task lookup        the strongest simple policy: per task, the feasible cell most often right on the
                     held-in items, ties to the cheaper (a 6 × 15 table; the prompt's few-shot block
                     names its task); no TLM decision, the score head compresses below ratio 1
  random feasible    the exact expectation of a uniform draw among feasible cells (not served)
  oracle             the best feasible cell per item: an upper bound, not a policy (not served)

Each policy pays only the TLM parts it runs (`bench.trace.policy_profile`); every cost model counts
the question kept whole (ratio × the rest + the question) and, per level and depth, TTFT measured at
PROFILE_LENGTHS and interpolated. Ours skips the TLM where its own time is all that misses the SLO
(`tlm_decider`), serving the profile rule's level on the whole prompt. The accuracy of a request
is the label of the cell it was served at: the multiple-choice scoring of that item at that cell (option
log-likelihood, the `label` stage; ShortGPT's depths are scored here the same way). The served prompt is
compressed by the SDK's TLM as the device does, all but its question (the labelled prompt's `kept` end,
passed as `keep`; the label stage compresses the few-shot block and the passage as two texts, the SDK
as one); the label's compression is the label stage's.

α = ±0.25 reuse the α = 0 served results: every (item, class) pair of those traces occurs in the α = 0
trace (asserted), decisions are deterministic per pair, and the j-th request of a pair takes the pair's
j-th α = 0 measurement (cycling). Intervals are 95% bootstrap intervals resampling items (a request
repeating an item is not new evidence); the paired differences are ours (utility) − each baseline that
respects the cost model (and the best of them), over the same requests. The two unserved references
(random feasible, oracle) pick among the cells ours (utility)'s profile called feasible at that request,
its learned `Drift` and the headroom included, paying compression but no decision: the same feasible set
ours chose from, so the comparison is of the choice within it (`reference_mask` in its rows).
Violations are counted on this machine while others run: they mean something only on a quiet
machine; the load average is in the JSON.

  nice -n 5 .venv/bin/python -m bench.bench_trace --package /tmp/dh-bench/package --out /tmp/dh-bench/out
                                                        # the committed run (~1 h once labelled;
                                                        # labelling the 1,080 held-in items ~1 h on two cores)
  nice -n 5 .venv/bin/python -m bench.bench_trace --package ... --out ... --smoke   # a few minutes
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from bench.bench_decision_head import derive, held_in_tag, latency_and_score, sweep, train
from bench.common import ROOT, print_table, write_file
from bench.trace import (
    TRACE_CLASSES,
    bootstrap_ci,
    cell_cost_ms,
    feasible_mask,
    held_in_rates,
    largest_level_full_prompt,
    largest_level_most_kept,
    layer_drop_depths,
    make_trace,
    oracle,
    paired_difference_ci,
    policy_profile,
    random_feasible_expectation,
    utility_choice,
)
from device_sdk.format import CloneProfile
from device_sdk.latency import (
    SERVING_HEADROOM,
    SLO,
    Decision,
    Drift,
    LatencyProfile,
    predicted_ttft_ms,
)
from device_sdk.measure import measure_level, measure_profile, measure_tlm_latency
from device_sdk.runtime import ElasticModel
from device_sdk.tlm import TLM, tlm_decider
from pipeline.data.tasks import load_items
from pipeline.elastilm import label, slo_labels

PROFILE_LENGTHS = (32, 128, 256, 512, 1024)  # prompt tokens timed per level and depth: BoolQ's reach ~940
SERVED = ["ours (utility)", "ours (SLO-token)", "LLM-Pruner", "LLMLingua-2", "ShortGPT", "task lookup"]
BASELINES = ["LLM-Pruner", "LLMLingua-2", "ShortGPT", "random feasible", "task lookup"]
# "task hindsight" is the task lookup read from the held-out labels themselves: the best that any policy
# choosing per task (not per item) could score on these items, so the oracle's lead over it is per-item luck.
UNSERVED = ["random feasible", "task hindsight", "oracle"]
# The unserved references score on the cells this policy's profile called feasible at each request.
REFERENCE_POLICY = "ours (utility)"


class LabelledGrid:
    """An SLO-token TLM whose decision may pick only cells of the labelled grid (its own grid is wider)."""

    decision_head = "slo_token"

    def __init__(self, tlm_: TLM, ratios: list[float], levels: list[str]):
        self.tlm, self.ratios, self.levels = tlm_, ratios, levels

    def decide(self, prompt, ttft_fraction, tpot_fraction, is_feasible):
        ratio, level, met = self.tlm.decide(prompt, ttft_fraction, tpot_fraction,
                                            lambda r, m: r in self.ratios and m in self.levels and is_feasible(r, m))
        return (ratio, level, True) if met else (min(self.ratios), level, False)  # the grid's lightest


def shortgpt_profiles(model: ElasticModel, keeps: list[float]) -> dict[str, CloneProfile]:
    """`layer_drop_depths` of the full level by the package's block-influence scores, as CLONE profiles."""
    full = model.manifest.elastic.level(model.available_levels()[-1])
    depths = layer_drop_depths(full.attn_units, full.mlp_units, model.manifest.elastic.importance["layer_scores"],
                               keeps)
    return {name: CloneProfile(attn, mlp, ppl=math.nan, latency_ms=0.0, energy_j=0.0, origin="shortgpt")
            for name, (attn, mlp) in depths.items()}


def shortgpt_labels(package: Path, items, prompts: list[str], profiles: dict[str, CloneProfile],
                    path: Path) -> torch.Tensor:
    """[items, depths] correctness of the multiple-choice scoring at each depth on the labelled prompt at
    ratio 1 (as the label stage scores a cell); reused from `path` when it holds the same items and depths."""
    if path.is_file():
        saved = json.loads(path.read_text())
        if (saved["items"], saved.get("prompts"), sorted(saved["depths"])) == ([it.id for it in items], prompts,
                                                                           sorted(profiles)):
            columns = [saved["depths"].index(name) for name in profiles]
            return torch.tensor(saved["correct"], dtype=torch.bool)[:, columns]
    worker = label.LabelWorker(package, None)
    correct = torch.zeros(len(items), len(profiles), dtype=torch.bool)
    for d, profile in enumerate(profiles.values()):
        worker.model.set_widths(profile.attn_units, profile.mlp_units)
        for i, (item, prompt) in enumerate(zip(items, prompts, strict=True)):
            scores = label.choice_scores(worker.model, worker.tokenizer, [prompt], item.choices)
            correct[i, d] = int(scores[0].argmax()) == item.gold
    path.write_text(json.dumps({"items": [it.id for it in items], "prompts": prompts, "depths": list(profiles),
                                "correct": correct.tolist()}))
    return correct


def timed_generate(model: ElasticModel, prompt: str, new_tokens: int, **kwargs) -> dict:
    g = model.generate(prompt, max_new_tokens=new_tokens, **kwargs)
    return {"ttft_ms": g.ttft_ms, "tpot_ms": g.tpot_ms, "level": g.level, "decision": g.decision}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, required=True, help="elastified package with level adapters")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-decision-head"),
                        help="stage outputs (bench_decision_head's, reused)")
    parser.add_argument("--tasks", default="arc_easy,obqa,piqa,sciq,siqa,boolq")
    parser.add_argument("--ratios", default="0.5,0.7,1.0")
    parser.add_argument("--levels", default="0.3,0.5,0.7,0.9,1.0")
    parser.add_argument("--train-items", type=int, default=180,
                        help="per task, held in (6 × 180 = 1,080; with the 180 held out, 1,260 labelled)")
    parser.add_argument("--decision-steps", type=int, default=300, help="each decision head's training steps (batch 16)")
    parser.add_argument("--label-workers", type=int, default=2, help="label shards side by side, on Ray")
    parser.add_argument("--test-ranges", default="300:330", help="held-out item ranges per task")
    parser.add_argument("--shots", type=int, default=5,
                        help="the label stage's few-shot block (LabelSettings.shots); 0: zero-shot prompts")
    parser.add_argument("--margin-temperature", type=float, default=0.5)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--alphas", default="0,0.25,-0.25")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--full-runs", type=int, default=3, help="generate calls of the full model per item")
    parser.add_argument("--depths", default="0.4,0.5,0.6,0.7,0.8,0.9,1.0", help="ShortGPT: kept layer fractions")
    parser.add_argument("--drift-quantile", default="0.9",
                        help="every policy's profile scales predictions by this quantile of the measured ÷ predicted "
                             "ratios of the requests it served (device_sdk.latency.Drift); 'none': the profile as measured")
    parser.add_argument("--drift-headroom", type=float, default=SERVING_HEADROOM,
                        help="and by this margin on top (Drift.headroom; the SDK serves with SERVING_HEADROOM)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="4 held-out items per task, 48 requests")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "trace.json")
    parser.add_argument("--png", type=Path, default=ROOT / "bench" / "results" / "trace.png")
    parser.add_argument("--plot-only", action="store_true", help="redraw --png from the --results JSON")
    parser.add_argument("--markdown", action="store_true", help="print the README's tables from the --results JSON")
    args = parser.parse_args()
    if not args.drift_headroom >= 1.0:  # refused now, not after the device profile
        parser.error(f"--drift-headroom is a margin of at least 1, got {args.drift_headroom}")
    if args.markdown:
        print(markdown(json.loads(args.results.read_text())))
        return
    if args.plot_only:
        report = json.loads(args.results.read_text())
        plot(report["alphas"]["0.0"], args.png, report["held_out_items"], report["requests"])
        return
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = os.getloadavg()
    out, package = args.out, args.package
    tasks, ratios, levels = args.tasks.split(","), [float(x) for x in args.ratios.split(",")], args.levels.split(",")
    alphas = [float(a) for a in args.alphas.split(",")]
    if args.smoke:
        args.requests, args.full_runs = 48, 2
        args.results, args.png = out / "trace-smoke.json", out / "trace-smoke.png"  # not the committed results

    # ---- the chain's stages (cached under --out), held-out labels, the TLMs
    lat, score = latency_and_score(package, out)
    train_shards = sweep(package, score, out / "label", tasks, 0, args.train_items, ratios, levels, args.shots,
                         args.label_workers)
    test_pairs = []
    for span in args.test_ranges.split(","):
        start, stop = (int(x) for x in span.split(":"))
        shards = sweep(package, score, out / "label", tasks, start, stop - start, ratios, levels, args.shots,
                       args.label_workers)
        test_pairs += [(shards[f"correctness.{k}"], shards[f"meta.{k}"]) for k in range(len(shards) // 2)]
    tag = held_in_tag(tasks, args.shots, args.train_items)  # bench_decision_head's outputs are reused
    labels = derive(package, lat, train_shards, out / f"derive{tag}")
    heads = {name: TLM.load(train(score, labels, head, args.seed,
                                  out / f"decision-{head}-{args.margin_temperature}-{args.seed}{tag}-{args.decision_steps}steps",
                                  args.margin_temperature, args.decision_steps)[0])
             for name, head in (("ours (utility)", "utility"), ("ours (SLO-token)", "slo_token"))}
    correct, tokens, meta = slo_labels.load_shards(test_pairs)
    held_in_correct, _, held_in_meta = slo_labels.load_shards(
        [(train_shards[f"correctness.{k}"], train_shards[f"meta.{k}"]) for k in range(len(train_shards) // 2)])
    lookup = held_in_rates(held_in_correct, [item["task"] for item in held_in_meta["items"]])
    assert (meta["ratios"], meta["levels"]) == (ratios, levels)
    held_in = {item["id"] for item in held_in_meta["items"]}
    row = {item["id"]: i for i, item in enumerate(meta["items"])}
    if args.smoke:
        keep = {t: [it["id"] for it in meta["items"] if it["task"] == t][:4] for t in tasks}
        row = {i: row[i] for ids in keep.values() for i in ids}
    assert not held_in & set(row), "held-out items overlap the TLM's training items"
    prompts = {item["id"]: item["prompt"] for item in meta["items"]}
    kept = {item["id"]: item.get("kept", "") for item in meta["items"]}  # the question: served whole
    pools = [[i for i in row if meta["items"][row[i]]["task"] == tasks[k % len(tasks)]]
             for k in range(len(TRACE_CLASSES))]
    traces = {alpha: make_trace(args.requests, pools, alpha, args.seed) for alpha in alphas}

    # ---- the device: one SDK model, this machine's profile, ShortGPT's depths
    model = ElasticModel.load(package, allow_unsigned=True)
    model.eos_ids = set()  # every request decodes --new-tokens tokens
    # Every policy picks from the labelled grid, and only from it. The package's usable verdicts are set
    # aside: the baselines' cost-model rules do not read them, and a request's label already scores what a
    # weak level answers. They are kept in the JSON beside the results.
    verdicts = {shape.name: shape.usable for shape in model.manifest.elastic.levels}
    for shape in model.manifest.elastic.levels:
        shape.usable = shape.name in levels
    device = measure_profile(model, levels=levels, prompt_lengths=PROFILE_LENGTHS, repeats=5)
    tlm_latency = {name: measure_tlm_latency(head, repeats=3) for name, head in heads.items()}
    depth_profiles = shortgpt_profiles(model, [float(x) for x in args.depths.split(",")])
    depth_latency = {}
    for name, profile in depth_profiles.items():
        model.set_widths(profile.attn_units, profile.mlp_units)
        depth_latency[name] = measure_level(model, PROFILE_LENGTHS, decode_tokens=16, repeats=5)
    quantile = None if args.drift_quantile == "none" else float(args.drift_quantile)
    def drift() -> Drift:
        return Drift(quantile, headroom=args.drift_headroom)

    depth_device = LatencyProfile(device.weight_format, device.threads, depth_latency, drift=drift())
    model.profiles = lambda: depth_profiles  # served as CLONE profiles are
    items_by_id = {}
    for span in args.test_ranges.split(","):
        start, stop = (int(x) for x in span.split(":"))
        items_by_id |= {it.id: it for t in tasks for it in load_items([t], start, stop)}
    assert all(items_by_id[i].prompt() in prompts[i] for i in row)  # the labelled prompt is this item's
    depth_correct = shortgpt_labels(package, [items_by_id[i] for i in row], [prompts[i] for i in row],
                                    depth_profiles, out / f"shortgpt-labels{'-smoke' if args.smoke else ''}.json")
    depth_row = {item: d for d, item in enumerate(row)}
    full_cell = (ratios.index(1.0), levels.index(levels[-1]))
    deepest = list(depth_profiles).index("1.0")
    agree = statistics.fmean(float(depth_correct[depth_row[i], deepest] == correct[row[i], full_cell[0], full_cell[1]])
                             for i in row)
    print(f"[{time.perf_counter() - started:.0f} s] device profile, ShortGPT depths measured; "
          f"depth 1.0 labels agree with the grid's full cell on {agree:.3f} of items", flush=True)

    # ---- serve the α = 0 trace, every request once per policy
    n_tokens = {i: int(tokens[row[i]]) for i in row}
    n_kept = {i: len(model.tokenizer.encode(kept[i], add_special_tokens=False).ids) if kept[i] else 0 for i in row}

    task_of_prompt = {prompts[i]: meta["items"][row[i]]["task"] for i in row}
    hindsight = held_in_rates(correct[list(row.values())], [meta["items"][row[i]]["task"] for i in row])

    def baseline_decider(choose, decides: bool, compresses: bool):
        """A cost-model rule as the SDK's decide: `choose(mask, cost, prompt)` picks (ratio, level) indices."""
        def decide(prompt, prompt_tokens, slo, profile, _levels, kept_tokens=0):
            paid = policy_profile(profile, decides, compresses)
            mask = feasible_mask(paid, ratios, levels, prompt_tokens, slo, kept_tokens)
            cost = cell_cost_ms(paid, ratios, levels, prompt_tokens, args.new_tokens, kept_tokens)
            r, m, met = choose(mask, cost, prompt)
            return Decision(levels[m], ratios[r], met)
        return decide

    def serve(policy: str, item: str, slo: SLO) -> dict:
        if policy == "ShortGPT":
            mask = feasible_mask(depth_device, [1.0], list(depth_profiles), n_tokens[item], slo)
            _, d, met = largest_level_full_prompt(mask)
            name = list(depth_profiles)[d]
            served = timed_generate(model, prompts[item], args.new_tokens, slo=slo, level=levels[-1], profile=name)
            served.pop("decision")
            predicted = [depth_device.ttft_ms(name, n_tokens[item]), depth_device.tpot_ms(name)]
            depth_device.observe(name, n_tokens[item], served["ttft_ms"], served["tpot_ms"])  # as the SDK does a level's
            return served | {"cell": name, "feasible": met, "correct": bool(depth_correct[depth_row[item], d]),
                             "predicted_ms": predicted}
        seen = dataclasses.replace(model.latency_profile, drift=copy.deepcopy(model.latency_profile.drift))
        served = timed_generate(model, prompts[item], args.new_tokens, slo=slo, keep=kept[item])
        decision = served.pop("decision")
        r, m = ratios.index(decision.prompt_ratio), levels.index(decision.level)
        paid = policy_profile(seen, decision.tlm_ran, model.compress is not None)  # as the decision saw it
        predicted = [predicted_ttft_ms(paid, levels[m], ratios[r], n_tokens[item], n_kept[item]), paid.tpot_ms(levels[m])]
        served |= {"cell": [ratios[r], levels[m]], "feasible": decision.feasible, "tlm_ran": decision.tlm_ran,
                   "correct": bool(correct[row[item], r, m]), "predicted_ms": predicted}
        if policy == REFERENCE_POLICY:  # its cells as its profile stood, paying compression but no decision
            reference = policy_profile(seen, False, True)
            mask = feasible_mask(reference, ratios, levels, n_tokens[item], slo, n_kept[item])
            served["reference_mask"] = mask.int().tolist()
            cost = cell_cost_ms(reference, ratios, levels, n_tokens[item], args.new_tokens, n_kept[item])
            served["hindsight_cell"] = list(utility_choice(hindsight[task_of_prompt[prompts[item]]], mask, cost)[:2])
        return served

    setups = {
        "ours (utility)": (heads["ours (utility)"], tlm_decider(heads["ours (utility)"]), True),
        "ours (SLO-token)": (heads["ours (SLO-token)"],
                             tlm_decider(LabelledGrid(heads["ours (SLO-token)"], ratios, levels)), True),
        "LLM-Pruner": (None, baseline_decider(lambda mask, cost, prompt: largest_level_full_prompt(mask), False, False),
                       False),
        "LLMLingua-2": (heads["ours (utility)"],
                        baseline_decider(lambda mask, cost, prompt: largest_level_most_kept(mask), False, True), True),
        "ShortGPT": (None, None, False),
        # The task's held-in table decides (no TLM decision); cells below ratio 1 compress with the score head.
        "task lookup": (heads["ours (utility)"],
                        baseline_decider(lambda mask, cost, prompt: utility_choice(lookup[task_of_prompt[prompt]], mask,
                                                                                   cost), False, True), True),
    }
    profiles = {policy: LatencyProfile(device.weight_format, device.threads, device.levels,
                                       tlm=tlm_latency.get(policy, tlm_latency["ours (utility)"]), drift=drift())
                for policy in SERVED}

    def use(policy: str) -> None:
        head, decide, compresses = setups[policy]
        model.tlm, model.decide = head, decide
        model.compress = model._compress if compresses else None
        model.latency_profile = profiles[policy]

    # Served item by item: the full model's reference runs for an item, then every request asking it, each
    # by every policy in an order that rotates per request, so load drift on this shared machine hits the
    # reference and every policy alike (requests are independent, so the trace's own order changes nothing).
    base = traces[0.0]
    served = {policy: [None] * len(base) for policy in SERVED}
    full = {}
    for count, item in enumerate(row):
        use("LLM-Pruner")  # no TLM
        runs = [timed_generate(model, prompts[item], args.new_tokens, level=levels[-1]) for _ in range(args.full_runs)]
        full[item] = (statistics.median(r["ttft_ms"] for r in runs), statistics.median(r["tpot_ms"] for r in runs))
        for j in [j for j, request in enumerate(base) if request.item == item]:
            slo_class = TRACE_CLASSES[base[j].slo_class]
            target = SLO(slo_class[0] * full[item][0], slo_class[1] * full[item][1])
            for policy in SERVED[j % len(SERVED):] + SERVED[: j % len(SERVED)]:
                use(policy)
                result = serve(policy, item, target)
                result["violated"] = not target.met(result["ttft_ms"], result["tpot_ms"])
                served[policy][j] = result | {"target": [target.ttft_ms, target.tpot_ms], "item": item,
                                              "slo_class": base[j].slo_class}
        if (count + 1) % 20 == 0:
            print(f"[{time.perf_counter() - started:.0f} s] served the requests of {count + 1} items", flush=True)
    load_after = os.getloadavg()

    # ---- the α traces: per request, each policy's correctness and violation
    occurrences = {}
    for j, request in enumerate(base):
        occurrences.setdefault((request.item, request.slo_class), []).append(j)
    results = {}
    for alpha, trace in traces.items():
        seen: dict[tuple, int] = {}
        per = {p: {"correct": [], "violated": [], "feasible": []} for p in [*SERVED, *UNSERVED]}
        for request in trace:
            key = (request.item, request.slo_class)
            assert key in occurrences, "an α trace asks an (item, class) pair the α = 0 trace did not serve"
            j = occurrences[key][seen.get(key, 0) % len(occurrences[key])]
            seen[key] = seen.get(key, 0) + 1
            for policy in SERVED:
                for field in ("correct", "violated", "feasible"):
                    per[policy][field].append(served[policy][j][field])
            mask = torch.tensor(served[REFERENCE_POLICY][j]["reference_mask"], dtype=torch.bool)
            cells = correct[row[request.item]]
            per["random feasible"]["correct"].append(random_feasible_expectation(cells, mask))
            per["task hindsight"]["correct"].append(float(cells[tuple(served[REFERENCE_POLICY][j]["hindsight_cell"])]))
            per["oracle"]["correct"].append(oracle(cells, mask))
            for name in UNSERVED:
                per[name]["feasible"].append(bool(mask.any()))
        results[alpha] = summarise(trace, per)
    report = {"requests": args.requests, "served_requests_per_policy": len(base), "held_out_items": len(row),
              "items_per_task": {t: sum(meta["items"][row[i]]["task"] == t for i in row) for t in tasks},
              "class_tasks": [tasks[k % len(tasks)] for k in range(len(TRACE_CLASSES))],
              "classes": TRACE_CLASSES, "ratios": ratios, "levels": levels, "shortgpt_depths": list(depth_profiles),
              "shortgpt_depth_1_agrees_with_full_cell": agree, "new_tokens": args.new_tokens,
              "full_runs": args.full_runs, "shots": args.shots, "tasks": tasks, "threads": args.threads,
              "seed": args.seed, "smoke": args.smoke, "train_items_per_task": args.train_items,
              "decision_steps": args.decision_steps,
              "package": f"{model.manifest.name} {model.manifest.version} (build {model.manifest.build_id})",
              "package_usable_verdicts": verdicts,
              "loadavg_before": load_before, "loadavg_after": load_after,
              "seconds": round(time.perf_counter() - started, 1),
              "device_profile": {m: vars(v) for m, v in device.levels.items()},
              "tlm_latency": {k: vars(v) for k, v in tlm_latency.items()},
              "shortgpt_profile": {m: vars(v) for m, v in depth_latency.items()},
              "drift_quantile": quantile, "drift_headroom": args.drift_headroom if quantile else None,
              "drift_factors_at_end": {policy: {m: [profile.drift.factor("ttft", m), profile.drift.factor("tpot", m)]
                                                for m in profile.levels}
                                       for policy, profile in [*profiles.items(), ("ShortGPT", depth_device)]},
              "alphas": {str(a): r for a, r in results.items()},
              # per held-out item, its label at every (ratio, level) cell: every reference can be recomputed
              "held_out_correct": {i: correct[row[i]].int().tolist() for i in row},
              "served_alpha_0": served}  # per policy, per request of the α = 0 trace, in trace order (columns)
    write_report(args.results, report)
    for alpha, result in results.items():
        show(alpha, result, len(row))
    plot(results[0.0], args.png, len(row), args.requests)
    print(f"raw JSON: {args.results}; figure: {args.png}; load average {load_before} → {load_after}")


def write_report(path: Path, report: dict) -> None:
    """The summary indented; the per-request rows one line per policy, as columns, times to 0.01 ms; the
    held-out labels one line per item."""
    def column(values):
        return [round(v, 2) if isinstance(v, float) else [round(x, 2) for x in v] if isinstance(v, list)
                and all(isinstance(x, float) for x in v) else v for v in values]

    served = report["served_alpha_0"]
    columns = {policy: {key: column([row[key] for row in rows]) for key in rows[0]} for policy, rows in served.items()}
    compact = {"held_out_correct": report.get("held_out_correct", {}), "served_alpha_0": columns}
    summary = json.dumps({k: v for k, v in report.items() if k not in compact}, indent=2)
    blocks = [f'  "{key}": {{\n' + ",\n".join(f"    {json.dumps(name)}: {json.dumps(value, separators=(',', ':'))}"
                                             for name, value in entries.items()) + "\n  }"
              for key, entries in compact.items()]
    write_file(path, (f'{summary[:-2]},\n' + ",\n".join(blocks) + "\n}\n").encode())


def summarise(trace, per: dict) -> dict:
    """Per policy: accuracy overall and per class with item-resampling 95% intervals, violations; the paired
    difference ours (utility) − each cost-model-respecting baseline (and the best of them); ours ÷ oracle."""
    items = [r.item for r in trace]
    out = {"counts": [sum(r.slo_class == k for r in trace) for k in range(len(TRACE_CLASSES))], "policies": {}}
    for policy, rows in per.items():
        overall = bootstrap_ci(rows["correct"], items)
        classes = []
        for k in range(len(TRACE_CLASSES)):
            picked = [j for j, r in enumerate(trace) if r.slo_class == k]
            classes.append(bootstrap_ci([rows["correct"][j] for j in picked], [items[j] for j in picked]))
        entry = {"accuracy": overall, "per_class": classes, "feasible": sum(rows["feasible"])}
        if rows["violated"]:
            entry["violations"] = sum(rows["violated"])
            entry["violations_where_feasible"] = sum(v and f for v, f in zip(rows["violated"], rows["feasible"],
                                                                             strict=True))
        out["policies"][policy] = entry
    best = max(BASELINES, key=lambda p: out["policies"][p]["accuracy"][0])
    ours = per["ours (utility)"]["correct"]
    out["best_baseline"] = best
    out["paired_vs_best_baseline"] = paired_difference_ci(ours, per[best]["correct"], items)
    out["paired_vs_slo_token"] = paired_difference_ci(ours, per["ours (SLO-token)"]["correct"], items)
    out["paired_vs"] = {policy: paired_difference_ci(ours, per[policy]["correct"], items) for policy in BASELINES}
    out["ours_over_oracle"] = out["policies"]["ours (utility)"]["accuracy"][0] / out["policies"]["oracle"]["accuracy"][0]
    return out


def show(alpha: float, result: dict, items: int) -> None:
    def ci(v):
        return f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"

    rows = []
    for policy, entry in result["policies"].items():
        violations = f"{entry['violations']} ({entry['violations_where_feasible']})" if "violations" in entry else "—"
        rows.append([policy, ci(entry["accuracy"]), *(f"{c[0]:.2f}" for c in entry["per_class"]),
                     violations, entry["feasible"]])
    print_table(f"α = {alpha:+.2f}: {sum(result['counts'])} requests {result['counts']} over {items} held-out items; "
                "accuracy [95% item bootstrap]", ["policy", "overall", *map(str, TRACE_CLASSES),
                                                  "violations (where feasible)", "feasible"], rows)
    diff = result["paired_vs_best_baseline"]
    print(f"ours (utility) − {result['best_baseline']}: {diff[0]:+.3f} [{diff[1]:+.3f}, {diff[2]:+.3f}]; "
          f"− SLO-token {result['paired_vs_slo_token'][0]:+.3f}; ours ÷ oracle {result['ours_over_oracle']:.3f}")
    print("ours (utility) − " + "; ".join(f"{policy} {d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]"
                                          for policy, d in result["paired_vs"].items()))


def markdown(report: dict) -> str:
    """The README's two tables: α = 0 per policy and class; per α, ours against each baseline, paired."""
    def ci(v, digits=3):
        return f"{v[0]:.{digits}f} [{v[1]:.{digits}f}, {v[2]:.{digits}f}]"

    result = report["alphas"]["0.0"]
    classes = [f"({c[0]:g}, {c[1]:g}) {task}" for c, task in zip(report["classes"], report["class_tasks"], strict=True)]
    lines = [f"| α = 0, {report['requests']} requests | overall | {' | '.join(classes)} | measured violations: all "
             "(where its cost model saw a feasible cell) / requests with one |",
             "|---" * (len(classes) + 3) + "|"]
    for policy, entry in result["policies"].items():
        served = (f"{entry['violations']} ({entry['violations_where_feasible']})" if "violations" in entry
                  else "not served")
        lines.append(f"| {policy} | {ci(entry['accuracy'])} | "
                     f"{' | '.join(f'{c[0]:.2f}' for c in entry['per_class'])} | {served} / {entry['feasible']} |")
    baselines = list(result["paired_vs"])
    lines += ["", f"| α | ours (utility) | {' | '.join(f'− {b}' for b in baselines)} | − SLO-token head | "
                  "ours ÷ oracle |", "|---" * (len(baselines) + 4) + "|"]
    for alpha, res in report["alphas"].items():
        ours = res["policies"]["ours (utility)"]["accuracy"][0]
        lines.append(f"| {float(alpha):+.2f} | {ours:.3f} | "
                     f"{' | '.join(ci([100 * x for x in res['paired_vs'][b]], 1) for b in baselines)} | "
                     f"{ci([100 * x for x in res['paired_vs_slo_token']], 1)} | {res['ours_over_oracle']:.2f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path, items: int, requests: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(result["policies"])
    groups = [*map(str, TRACE_CLASSES), "overall"]
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for p, policy in enumerate(policies):
        entry = result["policies"][policy]
        values = [*entry["per_class"], entry["accuracy"]]
        xs = [g + (p - (len(policies) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v[0] for v in values], width, label=policy,
               yerr=[[v[0] - v[1] for v in values], [v[2] - v[0] for v in values]], capsize=2,
               error_kw={"elinewidth": 0.7, "ecolor": "0.35"})
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylim(0, 1.0)
    ax.set_xlabel("SLO class (TTFT, TPOT fraction of the full model)")
    ax.set_ylabel("accuracy (label of the served cell)")
    ax.set_title(f"SmolLM2 trace, α = 0: {requests} requests, {items} held-out items; 95% item-bootstrap intervals")
    ax.legend(ncol=len(policies), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
