"""Recovery benchmark on SmolLM2 (CPU): four ways to train a level's LoRA, at equal tokens.

  (a) lm-ptb        LM loss on PTB train (the recovery before issue 13)
  (b) lm-corpus     LM loss on the recovery corpus (pipeline.elastilm.corpus)
  (c) distill       distillation from the same weights at level 1.0, on the recovery corpus
  (d) distill-warm  (c), each level's LoRA starting from the next larger level's (c)/(d) LoRA;
                    the largest recovered level has none above it, so its (d) is its (c)
  (e) distill-onpolicy  (c), with a share (--on-policy) of steps on the level's own greedy
                    continuation of the window's first --rollout-prefix tokens (RecoverExperiments.on_policy),
                    with --unlikelihood weight on the tokens of the 4-grams it repeats there
  (f) distill-corrected  (c), with the same share of on-policy steps, but each token the level writes
                    that is outside the full model's top --correct-top-k replaced by the full model's
                    argmax (RecoverExperiments.rollout = "corrected"; speculative KD)

Every method trains each level on `steps × batch × seq_len` tokens with the same settings
otherwise; the training loop is the recover stage's own (pipeline.elastilm.recover: LevelViews, add_lora,
warm_start, make_loss, train_torch), run here step by step so quality can be read at checkpoints
during training (the tokens-to-quality curve). Quality is out of domain, on the same windows for
every method: LAMBADA perplexity and the held-out slice of the generated corpus, each as a ratio
to the full model, both read through the device SDK's ElasticModel with the level's adapter
installed (as a device runs it); and generation health, the repeated-4-gram rate of greedy
output (ElasticModel.generate at the level) on 32 fixed everyday prompts × 64 tokens, against
the full model's, for (a), (c), (d) and the full model (decoding is the slowest part on a shared
CPU). The curve's points (LAMBADA) are read on the training model (same weights, same windows). Settings (lr, temperature) are fixed, not tuned on the reported sets; the validation
slice (every 20th recovery text, kept out of training) is recorded along the curve.

The corpus is generated once by the full model and cached by content hash under
~/.cache/elastify/bench/. Three worker processes train side by side, one thread each ((a)+(b), (c)+(d),
(e)); on 2 cores they share.

  .venv/bin/python -m bench.bench_recovery --steps 384 --lr 2e-3 --dropout 0 --lambada-windows 48 \
      --compare-calibration none --no-compare-previous             # the committed run (~100 min, 2 cores)
  .venv/bin/python -m bench.bench_recovery --steps 2 --smoke     # end-to-end check, minutes
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.bench_elastilm import build_package
from bench.common import RESULTS, print_table, write_json
from device_sdk.format import WEIGHTS, read_manifest
from pipeline.data.calibration import make_windows, text_windows
from pipeline.elastilm.evaluate import GENERATION_PROMPTS, repeated_4gram_rate
from pipeline.models.scoring import paired_ratio
from pipeline.settings import CorpusSettings, RecoverExperiments, RecoverSettings
from pipeline.stage import StageContext

CACHE = Path.home() / ".cache" / "elastify" / "bench"
METHODS = {
    "lm-ptb": "(a) LM loss, PTB train",
    "lm-corpus": "(b) LM loss, recovery corpus",
    "distill": "(c) distillation, recovery corpus",
    "distill-warm": "(d) (c) + warm start",
    "distill-onpolicy": "(e) (c) + on-policy steps with unlikelihood",
    "distill-corrected": "(f) (c) + on-policy steps the full model corrects",
}
# Two processes side by side, about equal work: LM steps cost ~3/4 of a distillation step.
WORKERS = {"lm": ["lm-ptb", "lm-corpus"], "distill": ["distill", "distill-warm"], "onpolicy": ["distill-onpolicy"],
           "corrected": ["distill-corrected"]}
ON_POLICY_METHODS = {"distill-onpolicy", "distill-corrected"}
VALIDATION_EVERY = 20  # every n-th recovery text is the validation slice, never trained on
# Greedy decoding runs ~5 tokens/s on one contended core, so generation health is measured for
# today's recovery, the distillation methods and the full model (32 x 64 tokens each per level).
GENERATION_METHODS = {"lm-ptb", "distill", "distill-warm", *ON_POLICY_METHODS}

# The report card's generation-health prompts; the smoke run trims this list in place.
EVERYDAY_PROMPTS = list(GENERATION_PROMPTS)


# --------------------------------------------------------------------------- measures


class EvalSets:
    """The windows every method is measured on: LAMBADA, the held-out generated slice, the validation slice."""

    def __init__(self, tokenizer, corpus_dir: Path, args) -> None:
        from pipeline.data.recovery_text import load_heldout_texts, load_recovery_texts

        heldout = load_heldout_texts(corpus_dir)
        slots = len(tokenizer("\n\n".join(heldout), add_special_tokens=False)["input_ids"]) // args.eval_len
        self.windows = {
            "lambada": make_windows(tokenizer, "lambada", args.lambada_windows, args.eval_len, seed=1),
            "heldout": text_windows(tokenizer, heldout, min(args.heldout_windows, slots), args.eval_len, 1),
            "validation": text_windows(tokenizer, load_recovery_texts(corpus_dir)[::VALIDATION_EVERY],
                                       args.validation_windows, args.eval_len, 1),
        }

    def sizes(self) -> dict:
        return {name: list(w.shape) for name, w in self.windows.items()}


# --------------------------------------------------------------------------- package and corpus


# Importance as the build made it before issue 13: KV groups ranked by Taylor, their count rounded to nearest.
PREVIOUS_BUILD = {"profile": {"attn_method": "taylor"}, "elastify": {"attn_rounding": "nearest"}}


def prepare_package(out: Path, reuse: bool, calibration: str | None = None, previous: bool = False) -> Path:
    """The bench's package: importance profiled as the build does by default, or on `calibration`
    text, or as the build did before issue 13 (`previous`)."""
    name = "package" + (f"-calibrated-{calibration}" if calibration else "") + ("-previous" if previous else "")
    if reuse and (out / name / "manifest.json").is_file():
        return out / name
    return build_package(out, [0.5, 0.7, 1.0], StageContext(work_dir=out),
                         calibration=[calibration] if calibration else None, name=name,
                         profile_settings=PREVIOUS_BUILD["profile"] if previous else None,
                         elastify_settings=PREVIOUS_BUILD["elastify"] if previous else None)


def compare_importance(args, sets: EvalSets, calibration: str | None = None, previous: bool = False) -> dict:
    """Issue 13 item 3: the levels without recovery when importance is profiled on other text
    (`calibration`) or as the build did before (`previous`), at equal calibration tokens, on the
    same windows; paired against the build's default."""
    from pipeline.settings import DEFAULT_CALIBRATION

    reference = json.loads((args.out / "runs" / "reference.json").read_text())["quality"]
    package = prepare_package(args.out, args.reuse, calibration, previous)
    levels = args.levels.split(",")
    quality = sdk_quality(package, levels, sets, args.gen_tokens, set())
    if previous:
        changed, default, other = "importance", "KV groups by leave-one-out, count rounded up", \
            "KV groups by Taylor, count rounded to nearest (the build before issue 13)"
    else:
        changed, default, other = "calibration", ", ".join(DEFAULT_CALIBRATION), calibration
    return {"changed": changed, "default": default, "other": other, "windows": "8 x 128 tokens each",
            "levels": {lv: {"other": quality_row(quality[lv], reference["1.0"]),
                            "other_vs_default": {n: paired_ratio(quality[lv][f"{n}_nlls"], reference[lv][f"{n}_nlls"])
                                                 for n in ("lambada", "heldout")}}
                       for lv in levels}}


def corpus_settings(args) -> CorpusSettings:
    return CorpusSettings(prompts=args.prompts, max_new_tokens=args.max_new_tokens, heldout_fraction=0.25, seed=0)


def weights_digest(package: Path) -> str:
    digest = hashlib.sha256()
    with open(package / WEIGHTS, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare_corpus(package: Path, settings: CorpusSettings, shards: int) -> Path:
    """The recovery corpus of the package's full model, cached by (settings, weights) digest; shards generate side by side."""
    from tokenizers import Tokenizer

    from pipeline.elastilm.corpus import check_disjoint, generation_speed, merge_corpus

    key = hashlib.sha256((settings.model_dump_json() + weights_digest(package)).encode()).hexdigest()[:16]
    target = CACHE / f"recovery-corpus-{key}"
    if (target / "recovery.jsonl").is_file():
        return target
    shard_dirs = [CACHE / f"recovery-corpus-{key}.shard{k}" for k in range(shards)]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.bench_recovery", "--generate-shard", str(k),
                               "--shards", str(shards), "--package", str(package),
                               "--corpus-json", settings.model_dump_json(), "--shard-out", str(shard_dirs[k])],
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for k in range(shards) if not (shard_dirs[k] / "generated.jsonl").is_file()]
    if any(p.wait() for p in procs):
        raise RuntimeError("corpus generation failed")
    tokenizer = Tokenizer.from_file(str(package / "model" / "tokenizer.json"))
    merge_corpus(shard_dirs, target, tokenizer)
    check_disjoint(target)
    print(f"corpus generation: {generation_speed(shard_dirs)}", flush=True)
    return target


def generate_one_shard(args) -> None:
    from pipeline.elastilm.corpus import generate_shard

    torch.set_num_threads(1)
    settings = CorpusSettings.model_validate_json(args.corpus_json).model_copy(
        update={"shard": args.generate_shard, "shards": args.shards})
    generate_shard(Path(args.package), settings, Path(args.shard_out))


# --------------------------------------------------------------------------- training with checkpoints


class CheckpointedBatches:
    """The training batches, calling `evaluate(step)` before batch `step` for each checkpoint and after the last.

    train_torch iterates it; an evaluation runs between two optimizer steps, with no grad.
    """

    def __init__(self, batches: list, checkpoints: set[int], evaluate) -> None:
        self.batches, self.checkpoints, self.evaluate = batches, checkpoints, evaluate

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for step, batch in enumerate(self.batches):
            if step in self.checkpoints:
                self.evaluate(step)
            yield batch
        self.evaluate(len(self.batches))


def recover_settings(args, method: str, level: str) -> RecoverSettings:
    distill = method.startswith("distill")
    return RecoverSettings(level=level, corpus=["ptb:train"], steps=args.steps, batch_size=args.batch_size,
                           seq_len=args.seq_len, lr=args.lr, warmup_steps=max(1, args.steps // 20),
                           loss="distill" if distill else "lm", temperature=args.temperature, top_k=0,
                           warm_start=method == "distill-warm", seed=args.seed, precision=args.precision,
                           dropout=args.dropout, rank=args.rank, alpha=args.alpha,
                           experimental=RecoverExperiments(
                               lm_weight=args.lm_weight if distill else 0.0,
                               divergence=args.divergence,
                               on_policy=args.on_policy if method in ON_POLICY_METHODS else 0.0,
                               rollout_prefix=args.rollout_prefix,
                               rollout="corrected" if method == "distill-corrected" else "student",
                               correct_top_k=args.correct_top_k,
                               unlikelihood=args.unlikelihood if method == "distill-onpolicy" else 0.0),
                           **({"mix": parse_mix(args.mix)} if args.mix else {}))


def parse_mix(text: str) -> dict[str, float]:
    """`generated=1,passages=0,ptb=0` -> RecoverSettings.mix (kinds it does not name get no share)."""
    try:
        return {kind.strip(): float(share) for kind, share in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise SystemExit(f"--mix: {text!r} is not kind=share,kind=share") from None


def train_level(package: Path, corpus_dir: Path, method: str, level: str, args, init_adapter: Path | None,
                out: Path) -> dict:
    from transformers import AutoTokenizer

    from pipeline.elastilm.recover import (
        LevelViews,
        add_lora,
        corpus_batches,
        eval_loss,
        make_loss,
        mixed_batches,
        save_adapter,
        train_torch,
        unit_major_adapter,
        warm_start,
    )
    from pipeline.models.elastic import ElasticCausalLM

    settings = recover_settings(args, method, level)
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(package / "model"))
    sets = EvalSets(tokenizer, corpus_dir, args)
    mix = None
    if method == "lm-ptb":
        batches = corpus_batches(tokenizer, settings)
    else:  # the recover stage's mix of the corpus's kinds of text, without the validation slice
        batches, mix = mixed_batches(tokenizer, training_kinds(corpus_dir), settings)
    model = ElasticCausalLM.from_package(package)
    full = max(model.elastic.levels, key=lambda lv: lv.ratio).name
    views = LevelViews(model, level)
    peft_model = add_lora(views.hf, settings)
    if init_adapter is not None:
        warm_start(peft_model, init_adapter, settings)
    tokens_per_step = settings.batch_size * settings.seq_len
    curve = []
    started = time.perf_counter()

    def evaluate(step: int) -> None:  # LAMBADA (and greedy loops) along the way; the SDK reads the rest at the end
        point = {"step": step, "tokens": step * tokens_per_step,
                 "lambada_ppl": math.exp(eval_loss(views.hf, sets.windows["lambada"], 4))}
        if args.curve_repeats:
            point["repeat4"], _ = greedy_repeat4(views.hf, tokenizer, args.gen_tokens)
        point["elapsed_s"] = round(time.perf_counter() - started, 1)
        curve.append(point)
        print(f"  [{method} {level}] step {step}: LAMBADA ppl {point['lambada_ppl']:.1f}"
              + (f", repeat-4 {point['repeat4']:.3f}" if args.curve_repeats else "")
              + f" ({point['elapsed_s']} s)", flush=True)

    checkpoints = {round(args.steps * f) for f in (0, 0.25, 0.5, 0.75)}
    losses = train_torch(peft_model, views.hf, CheckpointedBatches(batches, checkpoints, evaluate), settings,
                         StageContext(work_dir=out), make_loss(settings, views, full, peft_model))
    wall = time.perf_counter() - started
    adapter = out / f"{method}-{level}.safetensors"
    save_adapter(unit_major_adapter(peft_model), adapter, settings)
    return {"method": method, "level": level, "adapter": str(adapter), "steps": settings.steps,
            "train_tokens": settings.steps * tokens_per_step, "wall_s": round(wall, 1),
            "train_loss_first": losses[0], "train_loss_last": losses[-1], "curve": curve,
            "warm_start_from": str(init_adapter) if init_adapter else None, "corpus": str(corpus_dir), "mix": mix,
            "settings": settings.model_dump(mode="json")}


def training_kinds(corpus_dir: Path) -> dict[str, list[str]]:
    """The corpus's texts by kind, less every VALIDATION_EVERY-th record (the validation slice)."""
    from pipeline.data.recovery_text import RECOVERY_FILE, corpus_kind

    kinds: dict[str, list[str]] = {}
    for index, line in enumerate((corpus_dir / RECOVERY_FILE).read_text().splitlines()):
        if index % VALIDATION_EVERY:
            record = json.loads(line)
            kinds.setdefault(corpus_kind(record["source"]), []).append(record["text"])
    return kinds


# --------------------------------------------------------------------------- SDK evaluation


def sdk_quality(package: Path, levels: list[str], sets: EvalSets, max_new_tokens: int, generate: set[str],
                per_prompt: bool = False) -> dict:
    """Per level, through the device SDK (adapters as installed): perplexities, and greedy generation health
    at the levels in `generate` (with `per_prompt`, each prompt's generated tokens too)."""
    from pipeline.models.elastic import serving_model
    from pipeline.models.scoring import window_nlls

    model = serving_model(package)
    results = {}
    for level in levels:
        model.set_level(level)
        row = {}
        for name, windows in sets.windows.items():
            row[f"{name}_nlls"] = window_nlls(model, windows, 4)
            row[f"{name}_ppl"] = math.exp(sum(row[f"{name}_nlls"]) / len(windows))
        results[level] = row
        if level not in generate:
            continue
        started = time.perf_counter()
        outputs = [model.generate(p, max_new_tokens=max_new_tokens, level=level) for p in EVERYDAY_PROMPTS]
        tokens = [[t for t in o.tokens if t not in model.eos_ids] for o in outputs]
        row["repeat4"] = repeated_4gram_rate(tokens)
        if per_prompt:
            row["outputs"] = tokens
        row["sample"] = {p: o.text for p, o in list(zip(EVERYDAY_PROMPTS, outputs, strict=True))[:3]}
        row["generation_s"] = round(time.perf_counter() - started, 1)
        print(f"  [sdk {package.name} {level}] " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()
                                                             if isinstance(v, float)), flush=True)
    return results


@torch.no_grad()
def greedy_repeat4(hf, tokenizer, max_new_tokens: int) -> tuple[float, list[str]]:
    """The repeated-4-gram rate of `hf`'s greedy output on the everyday prompts (torch's decoder, not the SDK's),
    and the first three texts."""
    was_training = hf.training
    hf.eval()
    outputs, texts = [], []
    for prompt in EVERYDAY_PROMPTS:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        new = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                          pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id)]
        outputs.append(new)
        texts.append(tokenizer.decode(new))
    hf.train(was_training)
    return repeated_4gram_rate(outputs), texts[:3]


def run_worker(args) -> None:
    """Train and evaluate this worker's methods at every recovered level, top-down; one JSON per method."""
    from transformers import AutoTokenizer

    from pipeline.elastilm.recover import copy_package, install_adapters

    torch.set_num_threads(1)
    package, corpus_dir, out = Path(args.package), Path(args.corpus), Path(args.out)
    levels = sorted(args.levels.split(","), key=float, reverse=True)
    tokenizer = AutoTokenizer.from_pretrained(str(package / "model"))
    sets = EvalSets(tokenizer, corpus_dir, args)
    methods = args.methods.split(",") if args.methods else WORKERS[args.worker]
    if unknown := set(methods) - set(WORKERS[args.worker]):
        raise SystemExit(f"error: worker {args.worker} trains {', '.join(WORKERS[args.worker])}, not {', '.join(sorted(unknown))}")
    for method in methods:
        result_path = out / "runs" / f"{method}.json"
        if args.reuse and result_path.is_file():
            continue
        runs = {}
        for index, level in enumerate(levels):
            init = None
            if method == "distill-warm" and index > 0:
                init = Path(runs[levels[index - 1]]["adapter"])
            elif method == "distill-warm":  # the largest recovered level starts cold: it is (c)'s run
                runs[level] = json.loads((out / "runs" / "distill.json").read_text())["runs"][level] | {
                    "method": method, "reused_from": "distill"}
                continue
            runs[level] = train_level(package, corpus_dir, method, level, args, init, out / "adapters")
        installed = out / f"package-{method}"
        copy_package(package, installed)
        install_adapters(installed, {lv: Path(r["adapter"]) for lv, r in runs.items()})
        reused = {lv for lv, r in runs.items() if r.get("reused_from")}
        quality = sdk_quality(installed, [lv for lv in levels if lv not in reused], sets, args.gen_tokens,
                              set(levels) if method in GENERATION_METHODS else set())
        for level in reused:  # the same adapter as (c)'s at this level
            quality[level] = json.loads((out / "runs" / "distill.json").read_text())["quality"][level]
        result_path.parent.mkdir(parents=True, exist_ok=True)
        result_path.write_text(json.dumps({"method": method, "runs": runs, "quality": quality}, indent=2))
    if args.worker == "lm" and not (args.reuse and (out / "runs" / "reference.json").is_file()):
        # the full model and the levels without recovery, same windows and prompts (and their loops)
        quality = sdk_quality(package, [*levels, "1.0"], sets, args.gen_tokens, {*levels, "1.0"})
        (out / "runs" / "reference.json").write_text(json.dumps({"quality": quality}, indent=2))


# --------------------------------------------------------------------------- report


def rate_ratio(rate: float, full_rate: float) -> float:
    """A level's repeated-4-gram rate over the full model's (1 when both are 0, inf when only the full model's is)."""
    if full_rate:
        return rate / full_rate
    return float("inf") if rate else 1.0


def assemble(args, corpus_dir: Path, sets_sizes: dict, wall: float) -> dict:
    out = Path(args.out)
    reference = json.loads((out / "runs" / "reference.json").read_text())["quality"]
    full = reference["1.0"]
    methods = {m: json.loads((out / "runs" / f"{m}.json").read_text()) for m in METHODS
               if (out / "runs" / f"{m}.json").is_file()}  # (e) only where its worker ran
    corpus_manifest = json.loads((corpus_dir / "corpus.json").read_text())
    tokens = args.steps * args.batch_size * args.seq_len
    rows = []
    for level in sorted(args.levels.split(","), key=float, reverse=True):
        unrecovered = reference[level]
        rows.append({"level": level, "method": "none", "repeat4": None, **quality_row(unrecovered, full),
                     "repeat4_ratio": rate_ratio(unrecovered["repeat4"], full["repeat4"]) if "repeat4" in unrecovered
                     else None})
        for method, data in methods.items():
            q = data["quality"][level]
            rows.append({"level": level, "method": method, "repeat4": None, **quality_row(q, full),
                         "repeat4_ratio": rate_ratio(q["repeat4"], full["repeat4"]) if "repeat4" in q else None})
    # Method against method on the same windows: below 1 with the whole interval is a win, not noise.
    pairs = [("distill", "lm-corpus"), ("distill", "lm-ptb"), ("lm-corpus", "lm-ptb"), ("distill-warm", "distill")]
    versus = {f"{a} / {b} @ {level}": {name: paired_ratio(methods[a]["quality"][level][f"{name}_nlls"],
                                                         methods[b]["quality"][level][f"{name}_nlls"])
                                       for name in ("lambada", "heldout")}
              for a, b in pairs for level in args.levels.split(",")}
    second_seed = None
    if args.second_seed is not None:  # (c) at the lowest level again, another seed: how much of a gap is noise
        level = min(args.levels.split(","), key=float)
        q = json.loads((second_seed_dir(out, args.second_seed) / "runs" / "distill.json").read_text())["quality"][level]
        second_seed = {"seed": args.second_seed, "method": "distill", "level": level, **quality_row(q, full),
                       "repeat4_ratio": rate_ratio(q["repeat4"], full["repeat4"])}
    by = {(r["level"], r["method"]): r for r in rows}
    goals = {
        "level 0.7 LAMBADA <= 1.6x full (best method)": min(by[("0.7", m)]["lambada_ratio"] for m in methods) <= 1.6,
        "level 0.5 LAMBADA <= 2.5x full (best method)": min(by[("0.5", m)]["lambada_ratio"] for m in methods) <= 2.5,
        "distillation (c) beats LM (b) on LAMBADA at every level (95% interval below 1)": all(
            versus[f"distill / lm-corpus @ {lv}"]["lambada"]["high"] < 1 for lv in args.levels.split(",")),
        "distillation (c) beats LM (a) and (b) on LAMBADA at every level (95% interval below 1)": all(
            max(versus[f"distill / {m} @ {lv}"]["lambada"]["high"] for m in ("lm-corpus", "lm-ptb")) < 1
            for lv in args.levels.split(",")),
        "repeat-4 rate <= 2x full at every level (method (c))": all(
            by[(lv, "distill")]["repeat4_ratio"] <= 2 for lv in args.levels.split(",")),
        "repeat-4 rate <= 2x full at every level (method (d))": all(
            by[(lv, "distill-warm")]["repeat4_ratio"] <= 2 for lv in args.levels.split(",")),
    }
    return {
        "model": "SmolLM2-135M-Instruct", "device": "CPU, 1 thread per method process (two processes side by side)",
        "seed": args.seed, "levels": args.levels.split(","),
        "tokens_per_level": tokens, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "settings": {"lr": args.lr, "temperature": args.temperature, "rank": args.rank, "alpha": args.alpha,
                     "precision": args.precision, "dropout": args.dropout,
                     "selection": "fixed a priori; not tuned on LAMBADA or the held-out slice"},
        "eval_windows": sets_sizes, "generation": {"prompts": len(EVERYDAY_PROMPTS), "max_new_tokens": args.gen_tokens,
                                                   "decoding": "greedy, device SDK ElasticModel.generate"},
        "corpus": {"dir": str(corpus_dir), "recovery": corpus_manifest["recovery"],
                   "heldout": corpus_manifest["heldout"], "generation": corpus_manifest["generation"]},
        "full_model": full, "rows": rows, "second_seed": second_seed, "versus": versus, "goals": goals,
        "curves": {m: {lv: r["curve"] for lv, r in d["runs"].items()} for m, d in methods.items()},
        "train_wall_s": {m: {lv: r["wall_s"] for lv, r in d["runs"].items()} for m, d in methods.items()},
        "total_wall_s": round(wall, 1),
    }


def quality_row(quality: dict, full: dict) -> dict:
    """A level's SDK quality with its perplexity ratios to the full model, each with a paired 95% interval."""
    ratios = {}
    for name in ("lambada", "heldout"):
        interval = paired_ratio(quality[f"{name}_nlls"], full[f"{name}_nlls"])
        ratios[f"{name}_ratio"] = interval["ratio"]
        ratios[f"{name}_interval"] = [interval["low"], interval["high"]]
    return {**quality, **ratios}


def second_seed_dir(out: Path, seed: int) -> Path:
    return Path(out) / f"seed-{seed}"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = results["levels"]
    full = results["full_model"]
    fig, axes = plt.subplots(1, len(levels) + 1, figsize=(5 * (len(levels) + 1), 4.2))
    colors = {"lm-ptb": "tab:gray", "lm-corpus": "tab:blue", "distill": "tab:red", "distill-warm": "tab:purple",
              "distill-onpolicy": "tab:green", "distill-corrected": "tab:olive"}
    for ax, level in zip(axes, sorted(levels, key=float, reverse=True), strict=False):
        for method, per_level in results["curves"].items():
            points = per_level[level]
            ax.plot([p["tokens"] / 1000 for p in points], [p["lambada_ppl"] / full["lambada_ppl"] for p in points],
                    marker="o", color=colors[method], label=METHODS[method])
        goal = {"0.7": 1.6, "0.5": 2.5}.get(level)
        if goal:
            ax.axhline(goal, ls="--", color="black", lw=1, label=f"goal {goal}x")
        none = next(r for r in results["rows"] if r["level"] == level and r["method"] == "none")
        ax.axhline(none["lambada_ratio"], ls=":", color="tab:gray", lw=1, label="no recovery")
        if results.get("previous"):
            before = results["previous"]["levels"][level]["other"]["lambada_ratio"]
            ax.axhline(before, ls=":", color="tab:orange", lw=1, label="no recovery, importance before issue 13")
        ax.set(title=f"level {level}: tokens to quality", xlabel="training tokens per level (thousands)",
               ylabel="LAMBADA perplexity / full model's")
        ax.set_ylim(bottom=1.0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    methods = [m for m in METHODS if m in GENERATION_METHODS and m in results["curves"]]
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        rows = [next(r for r in results["rows"] if r["level"] == lv and r["method"] == method)
                for lv in sorted(levels, key=float, reverse=True)]
        ax.bar([i + k * width for i in range(len(rows))], [r["repeat4"] for r in rows], width,
               color=colors.get(method, "tab:olive"), label=METHODS.get(method, "no recovery"))
    ax.axhline(full["repeat4"], color="black", lw=1, label="full model")
    ax.axhline(2 * full["repeat4"], color="black", ls="--", lw=1, label="2x full (goal)")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(levels))], [f"level {lv}" for lv in
                                                                       sorted(levels, key=float, reverse=True)])
    ax.set(title=f"repeated-4-gram rate, {results['generation']['prompts']} prompts x "
                 f"{results['generation']['max_new_tokens']} greedy tokens", ylabel="rate")
    ax.set_ylim(0, 1.35)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.suptitle(f"SmolLM2-135M recovery at {results['tokens_per_level']} tokens per level (seed {results['seed']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def with_interval(ratio: float, interval: list[float]) -> str:
    return f"{ratio:.2f}x [{interval[0]:.2f}, {interval[1]:.2f}]"


def report(results: dict) -> None:
    def row(r: dict, method: str) -> list:
        return [r["level"], method, f"{r['lambada_ppl']:.1f}", with_interval(r["lambada_ratio"], r["lambada_interval"]),
                f"{r['heldout_ppl']:.2f}", with_interval(r["heldout_ratio"], r["heldout_interval"]),
                "-" if r["repeat4"] is None else f"{r['repeat4']:.3f}",
                "-" if r["repeat4_ratio"] is None else f"{r['repeat4_ratio']:.2f}x"]

    rows = [row(r, r["method"]) for r in results["rows"]]
    full = results["full_model"]
    if results.get("second_seed"):
        rows.append(row(results["second_seed"], f"distill, seed {results['second_seed']['seed']}"))
    rows.append(["1.0", "full model", f"{full['lambada_ppl']:.1f}", "1.00x", f"{full['heldout_ppl']:.2f}", "1.00x",
                 f"{full['repeat4']:.3f}", "1.00x"])
    sizes = results["eval_windows"]
    print_table(f"recovery at {results['tokens_per_level']} tokens per level ({results['steps']} steps x "
                f"{results['batch_size']} x {results['seq_len']}), seed {results['seed']}; LAMBADA "
                f"{sizes['lambada'][0]}x{sizes['lambada'][1]} tokens, held-out {sizes['heldout'][0]}x"
                f"{sizes['heldout'][1]}, {results['generation']['prompts']} prompts x "
                f"{results['generation']['max_new_tokens']} tokens",
                ["level", "method", "LAMBADA ppl", "/ full [95%]", "held-out ppl", "/ full [95%]", "repeat-4", "/ full"],
                rows)
    print_table("method against method, same windows (ratio of perplexities, paired 95% interval)",
                ["pair @ level", "LAMBADA", "held-out"],
                [[key, *(with_interval(v[n]["ratio"], [v[n]["low"], v[n]["high"]]) for n in ("lambada", "heldout"))]
                 for key, v in results["versus"].items()])
    for key in ("calibration", "previous"):
        if not results.get(key):
            continue
        cal = results[key]
        print_table(f"{cal['changed']}: {cal['other']} instead of {cal['default']} ({cal['windows']}), "
                    "no recovery", ["level", "LAMBADA / full", "held-out / full", "LAMBADA / default's",
                                    "held-out / default's"],
                    [[lv, with_interval(r["other"]["lambada_ratio"], r["other"]["lambada_interval"]),
                      with_interval(r["other"]["heldout_ratio"], r["other"]["heldout_interval"]),
                      *(with_interval(r["other_vs_default"][n]["ratio"],
                                      [r["other_vs_default"][n]["low"], r["other_vs_default"][n]["high"]])
                        for n in ("lambada", "heldout"))] for lv, r in cal["levels"].items()])
    print_table("methods", ["method", "what"], [["none", "no recovery (the elastified level as is)"],
                                                 *([k, v] for k, v in METHODS.items())])
    print_table("goals", ["goal", "met"], [[k, "yes" if v else "NO"] for k, v in results["goals"].items()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-recovery"))
    parser.add_argument("--levels", default="0.7,0.5")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=RecoverSettings().lr)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--divergence", choices=["forward", "reverse", "jsd"], default=RecoverExperiments().divergence,
                        help="of the distillation methods (RecoverExperiments.divergence)")
    parser.add_argument("--lm-weight", type=float, default=0.0,
                        help="(c), (d): add this weight × the LM loss on the corpus to the distillation loss")
    parser.add_argument("--mix", default="",
                        help="(b)-(f): shares of the corpus's kinds of text, e.g. generated=1,passages=0,ptb=0 "
                             "(default: RecoverSettings.mix)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="RecoverSettings.precision: auto is bf16 autocast on CPUs with native bf16")
    parser.add_argument("--dropout", type=float, default=RecoverSettings().dropout, help="LoRA dropout")
    parser.add_argument("--rank", type=int, default=RecoverSettings().rank, help="LoRA rank")
    parser.add_argument("--alpha", type=float, default=RecoverSettings().alpha, help="LoRA alpha (scale alpha / rank)")
    parser.add_argument("--on-policy", type=float, default=0.5, help="(e)'s share of steps on the level's own text")
    parser.add_argument("--rollout-prefix", type=int, default=32, help="(e): window tokens the level continues")
    parser.add_argument("--unlikelihood", type=float, default=1.0, help="(e): weight on its repeated 4-grams")
    parser.add_argument("--onpolicy", action="store_true",
                        help="also run (e) as a third worker (screened without gain: experiments/results/recovery-onpolicy-screen.json)")
    parser.add_argument("--second-seed", type=int, help="also train (c) at the lowest level with this seed")
    parser.add_argument("--prompts", type=int, default=480, help="corpus prompts the full model answers")
    parser.add_argument("--max-new-tokens", type=int, default=80, help="per corpus answer")
    parser.add_argument("--lambada-windows", type=int, default=24)
    parser.add_argument("--heldout-windows", type=int, default=16)
    parser.add_argument("--validation-windows", type=int, default=8)
    parser.add_argument("--eval-len", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--curve-repeats", action="store_true",
                        help="also read greedy repeat-4 (torch's decoder) at every curve point: ~2 min each")
    parser.add_argument("--compare-calibration", default="passages",
                        help="also profile importance on this corpus (none: skip) and compare the unrecovered levels")
    parser.add_argument("--no-compare-previous", dest="compare_previous", action="store_false",
                        help="skip the unrecovered levels of the build's importance before issue 13")
    parser.add_argument("--smoke", action="store_true", help="a few prompts and windows: checks the path, not quality")
    parser.add_argument("--reuse", action="store_true", help="reuse the package and finished runs under --out")
    parser.add_argument("--no-results", action="store_true", help="do not write bench/results/")
    # internal: one worker process / one corpus shard
    parser.add_argument("--corrected", action="store_true",
                        help="also run (f) as another worker: on-policy steps written by the level, corrected by "
                             "the full model (RecoverExperiments.rollout)")
    parser.add_argument("--correct-top-k", type=int, default=RecoverExperiments().correct_top_k,
                        help="(f): the full model's top k that keeps the level's token")
    parser.add_argument("--prepare-only", action="store_true", help="build the package and corpus, print their paths")
    parser.add_argument("--worker", choices=sorted(WORKERS))
    parser.add_argument("--methods", help="with --worker: only these of its methods (comma-separated)")
    parser.add_argument("--package")
    parser.add_argument("--corpus")
    parser.add_argument("--generate-shard", type=int)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--corpus-json")
    parser.add_argument("--shard-out")
    args = parser.parse_args()
    if args.smoke:
        args.lambada_windows, args.heldout_windows, args.validation_windows, args.gen_tokens = 4, 2, 2, 8
        args.prompts, args.max_new_tokens, args.eval_len = 12, 16, 32
        EVERYDAY_PROMPTS[:] = EVERYDAY_PROMPTS[:3]
    args.compare_calibration = None if args.compare_calibration == "none" else args.compare_calibration
    if args.generate_shard is not None:
        return generate_one_shard(args)
    if args.methods and not args.worker:
        raise SystemExit("error: --methods picks among a --worker's methods; give --worker too")
    if args.worker:
        return run_worker(args)

    started = time.perf_counter()
    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    package = prepare_package(args.out, args.reuse)
    assert [lv.name for lv in read_manifest(package).elastic.levels] == ["0.5", "0.7", "1.0"]
    corpus_dir = prepare_corpus(package, corpus_settings(args), args.shards)
    print(f"package {package}, corpus {corpus_dir}", flush=True)
    if args.prepare_only:  # for screening one worker by hand (--worker ... --package P --corpus C)
        return
    common = ["--out", str(args.out), "--package", str(package), "--corpus", str(corpus_dir),
              *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
                  "levels", "steps", "batch_size", "seq_len", "lr", "temperature", "divergence", "lm_weight", "mix", "seed", "precision", "dropout", "rank", "alpha", "on_policy", "rollout_prefix", "unlikelihood", "correct_top_k", "lambada_windows",
                  "heldout_windows", "validation_windows", "eval_len", "gen_tokens"))]
    common += ["--curve-repeats"] * args.curve_repeats
    common += ["--smoke"] * args.smoke + ["--reuse"] * args.reuse
    workers = [name for name in WORKERS if {"onpolicy": args.onpolicy, "corrected": args.corrected}.get(name, True)]
    procs = {name: subprocess.Popen([sys.executable, "-m", "bench.bench_recovery", "--worker", name, *common],
                                    env={**os.environ, "OMP_NUM_THREADS": "1"}) for name in workers}
    if args.second_seed is not None:  # in the distillation worker's slot once it is done
        procs["distill"].wait()
        lowest = min(args.levels.split(","), key=float)
        procs["second seed"] = subprocess.Popen(
            [sys.executable, "-m", "bench.bench_recovery", "--worker", "distill", *common, f"--levels={lowest}",
             f"--seed={args.second_seed}", f"--out={second_seed_dir(args.out, args.second_seed)}"],
            env={**os.environ, "OMP_NUM_THREADS": "1"})
    failed = [name for name, proc in procs.items() if proc.wait()]
    if failed:
        raise SystemExit(f"workers failed: {failed}")
    from transformers import AutoTokenizer

    sets = EvalSets(AutoTokenizer.from_pretrained(str(package / "model")), corpus_dir, args)
    comparisons = {"calibration": compare_importance(args, sets, calibration=args.compare_calibration)
                   if args.compare_calibration else None,
                   "previous": compare_importance(args, sets, previous=True) if args.compare_previous else None}
    results = assemble(args, corpus_dir, sets.sizes(), time.perf_counter() - started) | comparisons
    (args.out / "recovery.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "recovery.png")
    if not args.no_results and not args.smoke:
        write_json(RESULTS / "recovery.json", results)
        plot(results, RESULTS / "recovery.png")
    report(results)


if __name__ == "__main__":
    main()
