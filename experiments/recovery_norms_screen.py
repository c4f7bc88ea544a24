"""A screen of the one recovery lever left for greedy loops: per-level norm gains and an output-head LoRA.

Today each level trains a LoRA on its seven projections only; the RMSNorm gains and the output head are
the full model's at every level. A level whose blocks write less into the residual stream (fewer
neurons and heads) might need its own gains, and its loops are a failure of the next-token
distribution, which the head shapes. The package cannot carry either yet, so this screen measures them
before the format changes: it trains the variant with the acceptance run's settings (`--baseline`'s
saved `RecoverSettings`: corpus mix, schedule, seed) and reads it and the baseline's saved adapter the
same way, in torch: LAMBADA perplexity (paired over windows) and greedy repeat-4 over the report card's
32 prompts × 64 tokens, the full model read alongside. Both are read by this script, so the pair is
like with like even though the package's own reads go through the device SDK.

  .venv/bin/python -m experiments.recovery_norms_screen --package /tmp/rb/package \\
      --baseline /tmp/rb-base0.7/runs/distill.json --variant norms --out /tmp/rn-norms
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import torch

from bench.bench_recovery import EvalSets, greedy_repeat4, training_kinds
from bench.common import ROOT, print_table
from device_sdk.format import atomic_write_bytes
from pipeline.elastilm.evaluate import GENERATION_PROMPTS
from pipeline.models.scoring import paired_ratio
from pipeline.settings import RecoverSettings
from pipeline.stage import StageContext

NORMS = ["input_layernorm", "post_attention_layernorm", "norm"]  # peft matches by name suffix: every RMSNorm
VARIANTS = {"baseline": ([], False), "norms": (NORMS, False), "norms+head": (NORMS, True)}


def build(package: Path, settings: RecoverSettings, variant: str):
    from peft import LoraConfig, get_peft_model

    from pipeline.elastilm.recover import LevelViews, lora_target_names
    from pipeline.models.elastic import ElasticCausalLM

    saved_modules, head = VARIANTS[variant]
    model = ElasticCausalLM.from_package(package)
    views = LevelViews(model, settings.level)
    # The head's LoRA adapts the output projection only: the tied input embedding stays the full model's.
    targets = lora_target_names(views.hf, settings.targets) + (["lm_head"] if head else [])
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets, modules_to_save=saved_modules or None, bias="none",
                        task_type="CAUSAL_LM")
    full = max(model.elastic.levels, key=lambda lv: lv.ratio).name
    return views, get_peft_model(views.hf, config), full


def read(views, sets: EvalSets, tokenizer, max_new_tokens: int) -> dict:
    from pipeline.models.scoring import window_nlls

    started = time.perf_counter()
    nlls = window_nlls(views.hf, sets.windows["lambada"], 4)  # peft injects in place: views.hf carries it
    repeat4, sample = greedy_repeat4(views.hf, tokenizer, max_new_tokens)
    return {"lambada_nlls": nlls, "lambada_ppl": math.exp(sum(nlls) / len(nlls)), "repeat4": repeat4,
            "sample": sample, "read_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", type=Path, required=True)
    parser.add_argument("--baseline", type=Path, required=True, help="a bench.bench_recovery worker's runs/distill.json")
    parser.add_argument("--variant", choices=[v for v in VARIANTS if v != "baseline"], required=True)
    parser.add_argument("--level", default="0.7")
    parser.add_argument("--lambada-windows", type=int, default=48)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, help="override the baseline's steps (a smoke run; not comparable)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--results", type=Path, help="write the JSON here too (experiments/results/...)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the stage's progress, every 5 s
    from transformers import AutoTokenizer

    from pipeline.elastilm.recover import make_loss, mixed_batches, train_torch, warm_start
    from pipeline.models.scoring import window_nlls

    baseline_run = json.loads(args.baseline.read_text())["runs"][args.level]
    settings = RecoverSettings(**baseline_run["settings"])
    if args.steps:
        settings = settings.model_copy(update={"steps": args.steps, "warmup_steps": 1})
    corpus = Path(baseline_run["corpus"])
    tokenizer = AutoTokenizer.from_pretrained(str(args.package / "model"))
    sets = EvalSets(tokenizer, corpus, argparse.Namespace(lambada_windows=args.lambada_windows, heldout_windows=1,
                                                          validation_windows=1, eval_len=128))
    result = {"level": args.level, "variant": args.variant, "settings": settings.model_dump(mode="json"),
              "baseline_adapter": baseline_run["adapter"], "lambada_windows": args.lambada_windows,
              "prompts": len(GENERATION_PROMPTS), "gen_tokens": args.gen_tokens, "threads": args.threads}

    # The baseline: its saved adapter on a fresh model (same level, so warm start copies it whole).
    views, peft_model, full = build(args.package, settings, "baseline")
    warm_start(peft_model, Path(baseline_run["adapter"]), settings)
    result["baseline"] = read(views, sets, tokenizer, args.gen_tokens)
    with peft_model.disable_adapter(), views.at(full):
        result["full_model"] = read(views, sets, tokenizer, args.gen_tokens)
    print(json.dumps({k: {m: v for m, v in r.items() if m != "lambada_nlls"}
                      for k, r in result.items() if k in ("baseline", "full_model")}), flush=True)

    torch.manual_seed(settings.seed)
    batches, _ = mixed_batches(tokenizer, training_kinds(corpus), settings)
    views, peft_model, full = build(args.package, settings, args.variant)
    result["trainable_params"] = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    started = time.perf_counter()
    losses = train_torch(peft_model, views.hf, batches, settings, StageContext(work_dir=args.out),
                         make_loss(settings, views, full, peft_model))
    result["train_wall_s"] = round(time.perf_counter() - started, 1)
    result["train_loss_first_last"] = [losses[0], losses[-1]]
    result[args.variant] = read(views, sets, tokenizer, args.gen_tokens)
    with peft_model.disable_adapter(), views.at(full):  # the teacher must still be the full model, gains included
        teacher_nlls = window_nlls(views.hf, sets.windows["lambada"], 4)
    if max(abs(a - b) for a, b in zip(teacher_nlls, result["full_model"]["lambada_nlls"], strict=True)) > 1e-4:
        raise SystemExit("error: with the adapter off the trained model is no longer the full model")
    full_nlls, base_nlls = result["full_model"]["lambada_nlls"], result["baseline"]["lambada_nlls"]
    for name in ("baseline", args.variant):
        result[name]["lambada_vs_full"] = paired_ratio(result[name]["lambada_nlls"], full_nlls)
        full_rate = result["full_model"]["repeat4"]
        result[name]["repeat4_vs_full"] = result[name]["repeat4"] / full_rate if full_rate else None
    result[args.variant]["lambada_vs_baseline"] = paired_ratio(result[args.variant]["lambada_nlls"], base_nlls)
    text = json.dumps(result, indent=1).encode()
    atomic_write_bytes(args.out / "screen.json", text)
    if args.results:
        atomic_write_bytes(ROOT / args.results, text)

    def ratio(entry: dict | None) -> str:
        return "1" if entry is None else f"{entry['ratio']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"

    print_table(f"level {args.level}: {args.variant} against the baseline adapter, {len(base_nlls)} LAMBADA windows, "
                f"{len(GENERATION_PROMPTS)} prompts x {args.gen_tokens} greedy tokens",
                ["read", "LAMBADA ppl", "÷ full [95%]", "÷ baseline [95%]", "repeat-4", "÷ full"],
                [[name, f"{result[name]['lambada_ppl']:.1f}", ratio(result[name].get("lambada_vs_full")),
                  ratio(result[name].get("lambada_vs_baseline")) if name != "full_model" else "",
                  f"{result[name]['repeat4']:.3f}",
                  f"{result[name].get('repeat4_vs_full') or 0:.2f}" if name != "full_model" else "1"]
                 for name in ("full_model", "baseline", args.variant)])

if __name__ == "__main__":
    main()
