"""Device SDK benchmark on SmolLM2-135M: decode against HF transformers and llama.cpp, fairly.

    .venv/bin/python -m bench.bench_device [--package DIR] [--threads 1 2] [--rounds 3] [--llama-python PY]

Contenders: the SDK (fp32, fp16, int8, int4 through `ElasticModel.generate`), HF transformers
`generate` (fp32) and llama.cpp (llama-cpp-python's `Llama.generate`, from its own venv,
default `.venv-llama`) on the packaged Q4_1 GGUF and on Q8_0, F16, Q4_0 and Q4_K_M re-quantisations of it.

Fairness: every decode measurement is its own subprocess, started with a clean environment
(PATH, HOME and locale only; HF_HUB_OFFLINE=1 for transformers, which it needs to load
offline): nothing this process or its caller set (OMP_*, ELASTIFY_*, MKL_*, HF_*) reaches a
contender; what the SDK sets for itself on import is the SDK's own behaviour. Every contender
is timed by the same code (`time_decode`): the same prompt token ids, NEW_TOKENS new tokens
with end-of-sequence never ending a run, a perf_counter stamp as each token is handed to the
caller, and the median step between stamps over TIMED_RUNS runs after one warm-up run.
Rounds alternate the contenders (rotated order) and thread counts; the load average is
recorded around every measurement; tables show the median over rounds and its range, and
ratios are taken within a round, at equal thread counts.

Also (SDK only, one subprocess at the first thread count): TPOT(m)/TPOT(1.0) against the
active-parameter fraction per level, a level switch against a 256-token TTFT, and the bytes
of a max_level=0.5 pull against a full one. Raw results go to bench/results/device.json.
Without --package it elastifies SmolLM2 once (small Taylor profile) into the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "device.json"
PROMPT = "The history of the city begins in the early middle ages, when"
NEW_TOKENS = 48
TIMED_RUNS = 2
LEVELS = "0.25,0.5,0.75,1.0"
SDK_FORMATS = ("fp32", "fp16", "int8", "int4")
# (label, llama.cpp file type to re-quantise the packaged Q4_1 to, or None for the file as is)
LLAMA_CPP_TYPES = (("Q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0"), ("F16", "LLAMA_FTYPE_MOSTLY_F16"), ("Q4_1", None),
                   ("Q4_0", "LLAMA_FTYPE_MOSTLY_Q4_0"), ("Q4_K_M", "LLAMA_FTYPE_MOSTLY_Q4_K_M"))
# The headline pairs: (SDK contender, rival) compared at equal thread counts.
PAIRS = (("SDK int8", "llama.cpp Q8_0"), ("SDK int4", "llama.cpp Q4_0"), ("SDK int4", "llama.cpp Q4_K_M"),
         ("SDK fp16", "llama.cpp F16"), ("SDK fp32", "HF fp32"), ("SDK int8", "llama.cpp Q4_1"))
GOALS = {("SDK int8", "llama.cpp Q8_0"): 1.3, ("SDK int4", "llama.cpp Q4_0"): 1.2, ("SDK fp32", "HF fp32"): 3.0}
ENV_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")  # what a process needs to start, nothing that tunes it


# --------------------------------------------------------------------------- worker side
# Runs in the contender's own interpreter (llama.cpp's venv included), as `python -m bench.bench_device
# --worker` from the repository root: stdlib imports only at module level; each engine imports its own
# libraries (bench.llama_kernels is stdlib only).


def time_decode(generate, runs: int = TIMED_RUNS) -> dict:
    """Time `generate(stamp)`, which decodes NEW_TOKENS tokens from the prompt and calls `stamp()`
    as each one is handed over. One warm-up run, then `runs` timed ones; the statistic is the
    median step (time between consecutive stamps, so prefill is not in it) over all of them.
    Also the process's CPU time per step, first to last stamp: on a machine shared with other
    jobs it shows the work a token costs where wall time shows the share of the cores it got."""
    generate(lambda: None)
    steps, walls, cpu_per_step = [], [], []
    for _ in range(runs):
        stamps: list[tuple[float, float]] = []
        started = time.perf_counter()
        generate(lambda stamps=stamps: stamps.append((time.perf_counter(), time.process_time())))
        walls.append(time.perf_counter() - started)
        if len(stamps) != NEW_TOKENS:
            raise RuntimeError(f"{len(stamps)} tokens handed over, not {NEW_TOKENS}")
        steps += [b[0] - a[0] for a, b in zip(stamps, stamps[1:], strict=False)]
        cpu_per_step.append((stamps[-1][1] - stamps[0][1]) / (len(stamps) - 1))
    step = statistics.median(steps)
    return {"tok_s": 1.0 / step, "step_median_ms": step * 1000, "steps": len(steps),
            "step_mean_ms": statistics.fmean(steps) * 1000, "cpu_ms_per_step": [c * 1000 for c in cpu_per_step],
            "run_wall_s": walls, "run_tok_s_incl_prefill": [NEW_TOKENS / wall for wall in walls]}


def sdk_generator(spec: dict):
    """`ElasticModel.generate(stream=True)` at level 1.0; a stamp per streamed piece (one per token,
    checked), the end of sequence must not come (checked: the run would be short)."""
    import torch

    from device_sdk.format import load_public_key
    from device_sdk.runtime import ElasticModel

    torch.set_num_threads(spec["threads"])
    model = ElasticModel.load(Path(spec["package"]), public_key=load_public_key(spec["public_key"]),
                              quantize=spec["format"])
    if model.tokenizer.encode(PROMPT).ids != spec["prompt_ids"]:
        raise RuntimeError("the SDK tokenizes the prompt differently from the other contenders")

    def generate(stamp):
        stream = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, stream=True, level="1.0")
        pieces = 0
        for _ in stream:
            stamp()
            pieces += 1
        if len(stream.result.tokens) != pieces:
            raise RuntimeError(f"{len(stream.result.tokens)} tokens arrived as {pieces} pieces: steps mis-stamped")

    native = model.transformer.decoder is not None
    return generate, {"decoder": "native" if native else "torch fallback"}


def hf_generator(spec: dict):
    """HF `generate` (greedy, fp32); a stamp as its streamer receives each token;
    min_new_tokens keeps end-of-sequence from ending the run (HF's own way to ignore it)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    ids = torch.tensor([spec["prompt_ids"]])

    class Stamper(BaseStreamer):
        def __init__(self, stamp):
            self.stamp, self.prompt_seen = stamp, False

        def put(self, value):
            if self.prompt_seen:  # the first put is the prompt
                self.stamp()
            self.prompt_seen = True

        def end(self):
            pass

    def generate(stamp):
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, do_sample=False, streamer=Stamper(stamp),
                           pad_token_id=model.generation_config.eos_token_id)

    return generate, {}


def llama_cpp_generator(spec: dict):
    """llama-cpp-python's `Llama.generate` (greedy); a stamp per token it yields. It never stops at
    end-of-sequence by itself (create_completion does), so every run has NEW_TOKENS tokens."""
    import llama_cpp
    from llama_cpp import Llama

    from bench.llama_kernels import plain_kernels_where_amx_crashes

    plain = plain_kernels_where_amx_crashes()
    threads = spec["threads"]
    llm = Llama(model_path=spec["gguf"], n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False)

    def generate(stamp):
        for count, _ in enumerate(llm.generate(spec["prompt_ids"], temp=0.0), start=1):
            stamp()
            if count == NEW_TOKENS:
                break

    return generate, {"llama_cpp_python": llama_cpp.__version__, "llama_cpp_plain_kernels": plain}


ENGINES = {"sdk": sdk_generator, "hf": hf_generator, "llama.cpp": llama_cpp_generator}


def levels_worker(spec: dict) -> dict:
    """SDK-only rows at spec["threads"]: per-level TPOT ratios (fp32, int8) and the level switch."""
    import torch

    from device_sdk.format import load_public_key
    from device_sdk.measure import measure_level
    from device_sdk.runtime import ElasticModel

    torch.set_num_threads(spec["threads"])
    key = load_public_key(spec["public_key"])
    models = {fmt: ElasticModel.load(Path(spec["package"]), public_key=key, quantize=fmt) for fmt in ("fp32", "int8", "int4")}
    return {"tpot_ratios": {fmt: tpot_ratios(model, measure_level) for fmt, model in models.items()},
            "switch": switch_cost(models["int8"], measure_level)}


def tpot_ratios(model, measure_level, rounds: int = 3) -> dict:
    """TPOT per level over the full level's. Each round times the full level, every smaller one,
    then the full level again, and divides by the mean of the two full ones (load drifts within a
    round cancel); the result is the median round (a burst of load spoils a round, not the row)."""
    levels = model.available_levels()
    full = levels[-1]
    ratios: dict[str, list[float]] = {level: [] for level in levels[:-1]}

    def tpot(level: str) -> float:
        model.set_level(level)
        return measure_level(model, (16,), decode_tokens=24, repeats=1).tpot_ms

    for _ in range(rounds):
        before = tpot(full)
        tpots = {level: tpot(level) for level in levels[:-1]}
        reference = (before + tpot(full)) / 2
        for level, value in tpots.items():
            ratios[level].append(value / reference)
    return {level: {"ratio": statistics.median(values), "rounds": values,
                    "active_fraction": model.manifest.elastic.level(level).active_fraction}
            for level, values in ratios.items()}


def switch_cost(model, measure_level) -> dict:
    """set_level plus what the next token pays to see it (the native decoder's refresh), against
    the TTFT of a 256-token prompt at level 1.0."""
    model.set_level("1.0")
    ttft = measure_level(model, (256,), decode_tokens=1, repeats=2).ttft_base_ms  # one length: base = TTFT(256)
    decoder = model.transformer.decoder
    switches = []
    for _ in range(50):
        for level in ("0.5", "1.0"):
            start = time.perf_counter()
            model.set_level(level)
            if decoder is not None:
                decoder.sync()
            switches.append((time.perf_counter() - start) * 1000)
    return {"switch_median_ms": statistics.median(switches), "ttft_256_ms": ttft, "switches": len(switches)}


def worker(spec: dict) -> dict:
    if spec["engine"] == "levels":
        return levels_worker(spec)
    generate, facts = ENGINES[spec["engine"]](spec)
    return time_decode(generate) | facts


# --------------------------------------------------------------------------- orchestrator side


def clean_env(engine: str) -> dict[str, str]:
    env = {name: os.environ[name] for name in ENV_KEPT if name in os.environ}
    if engine == "hf":
        env["HF_HUB_OFFLINE"] = "1"  # a local directory; never reach for the hub
    return env


def run_worker(python: str, spec: dict, timeout: float = 600) -> dict:
    """One measurement in a fresh interpreter with a clean environment; its load average around it."""
    before = os.getloadavg()
    started = time.time()
    try:
        out = subprocess.run([python, "-m", "bench.bench_device", "--worker", json.dumps(spec)], cwd=ROOT,
                             env=clean_env(spec["engine"]), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        out = None
    record = {"load_before": before, "load_after": os.getloadavg(), "started": started,
              "seconds": time.time() - started}
    if out is None:
        return record | {"error": f"timed out after {timeout:.0f} s"}
    if out.returncode != 0:
        return record | {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc {out.returncode}"}
    return record | json.loads(out.stdout.strip().splitlines()[-1])


def bench_package(home: Path) -> Path:
    """A SmolLM2 package with real (small-profile) importance, built once."""
    package = home / "bench" / "smollm2-device"
    if not (package / "manifest.json").is_file():
        from pipeline.assets import prepare_smollm2

        subprocess.run(
            [sys.executable, "-c", "from api.cli import main; main()", "elastify", "--model", str(prepare_smollm2()),
             "--out", str(package), "--levels", LEVELS, "--windows", "8", "--layer-method", "block_influence",
             "--eval-windows", "0"],
            check=True,
        )
    return package


def sign_copy(package: Path, work: Path):
    """A signed copy of the package in a registry directory, and the key to pull it with."""
    import shutil

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from device_sdk.format import MANIFEST, atomic_write_bytes, canonical_json, read_manifest, sign_manifest

    key = Ed25519PrivateKey.generate()
    target = work / "registry" / "packages" / "smollm2" / "1.0.0"
    shutil.copytree(package, target)
    manifest = read_manifest(target)
    manifest.name, manifest.version = "smollm2", "1.0.0"
    sign_manifest(manifest, key)
    atomic_write_bytes(target / MANIFEST, canonical_json(manifest.to_dict()))
    return work / "registry", key.public_key()


LLAMA_CPP_QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.allow_requantize = getattr(llama_cpp, sys.argv[3]), True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def llama_cpp_models(python: str, scratch: Path) -> dict[str, str]:
    """Contender name -> GGUF: the packaged Q4_1 and Q8_0 / F16 re-quantised from it (their speed;
    Q4_1's accuracy). A re-quantisation that fails is left out (and reported)."""
    from pipeline.assets import smollm2_gguf

    models = {}
    for label, ftype in LLAMA_CPP_TYPES:
        gguf = smollm2_gguf() if ftype is None else scratch / f"smollm2-{label}.gguf"
        if ftype is not None:
            made = subprocess.run([python, "-c", LLAMA_CPP_QUANTIZE, str(smollm2_gguf()), str(gguf), ftype],
                                  env=clean_env("llama.cpp"), capture_output=True, text=True)
            if made.returncode != 0:
                print(f"llama.cpp {label}: re-quantisation failed: {made.stderr.strip()[-300:]}", file=sys.stderr)
                continue
        models[f"llama.cpp {label}"] = str(gguf)
    return models


def spread(values: list[float]) -> dict:
    """Median, range and mean ± standard error of per-round values."""
    ordered = sorted(values)
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return {"median": statistics.median(values), "min": ordered[0], "max": ordered[-1], "n": len(values),
            "mean": statistics.fmean(values), "se": se}


def summarise(measurements: list[dict], thread_counts: list[int]) -> dict:
    """Per (contender, threads): tok/s over rounds; per pair and thread count: the ratio within each
    round; best-vs-best: each side at the thread count where its median is highest."""
    rates: dict[str, dict[int, dict[int, float]]] = {}  # contender -> threads -> round -> tok/s
    cpu: dict[str, dict[int, dict[int, float]]] = {}  # contender -> threads -> round -> CPU ms a token
    for m in measurements:
        if "tok_s" in m:
            rates.setdefault(m["contender"], {}).setdefault(m["threads"], {})[m["round"]] = m["tok_s"]
            cpu.setdefault(m["contender"], {}).setdefault(m["threads"], {})[m["round"]] = statistics.fmean(
                m["cpu_ms_per_step"])
    decode = {name: {str(t): spread(list(by_round.values())) for t, by_round in by_threads.items()}
              for name, by_threads in rates.items()}
    cpu_ms = {name: {str(t): spread(list(by_round.values())) for t, by_round in by_threads.items()}
              for name, by_threads in cpu.items()}
    ratios = {}
    for sdk, rival in PAIRS:
        if sdk not in rates or rival not in rates:
            continue
        entry = {}
        for threads in thread_counts:
            a, b = rates[sdk].get(threads, {}), rates[rival].get(threads, {})
            paired = [a[r] / b[r] for r in sorted(a.keys() & b.keys())]
            if paired:
                entry[f"{threads} threads"] = spread(paired)
                a, b = cpu[sdk][threads], cpu[rival][threads]
                entry[f"{threads} threads, CPU time"] = spread([b[r] / a[r] for r in sorted(a.keys() & b.keys())])
        best = {name: max(decode[name], key=lambda t, name=name: decode[name][t]["median"]) for name in (sdk, rival)}
        entry["best vs best"] = {"ratio": decode[sdk][best[sdk]]["median"] / decode[rival][best[rival]]["median"],
                                 "threads": {sdk: int(best[sdk]), rival: int(best[rival])}}
        ratios[f"{sdk} / {rival}"] = entry
    return {"decode_tok_s": decode, "cpu_ms_per_token": cpu_ms, "ratios": ratios}


def save(result: dict, thread_counts: list[int], out: Path) -> None:
    from bench.common import write_json  # not at the top: the workers run where rich is not installed

    result["summary"] = summarise(result["measurements"], thread_counts)
    write_json(out, result, indent=1)


def fmt_spread(s: dict, digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def print_tables(result: dict) -> None:
    from bench.common import print_table  # not at the top: the workers run where rich is not installed

    summary, threads = result["summary"], result["config"]["threads"]
    loads = [m["load_before"][0] for m in result["measurements"]] + [m["load_after"][0] for m in result["measurements"]]
    rows = []
    for name, by_threads in summary["decode_tok_s"].items():
        rows.append([name] + [fmt_spread(by_threads[str(t)]) if str(t) in by_threads else "failed" for t in threads])
    print_table(f"decode tok/s, median [range] over {result['config']['rounds']} rounds; {NEW_TOKENS} new tokens; "
                f"1-min load average {min(loads):.1f}-{max(loads):.1f}",
                ["contender"] + [f"{t} thread{'s' if t > 1 else ''}" for t in threads], rows)
    rows = []
    for pair, entry in summary["ratios"].items():
        goal = GOALS.get(tuple(pair.split(" / ")))
        best = entry["best vs best"]
        rows.append([pair] + [fmt_spread(entry[f"{t} threads"], 2) if f"{t} threads" in entry else "-" for t in threads]
                    + [f"{best['ratio']:.2f} ({'/'.join(str(v) for v in best['threads'].values())} thr)",
                       f">= {goal}x" if goal else ""])
    print_table("ratios within a round at equal threads, median [range]; best vs best of the medians",
                ["pair"] + [f"{t} thr" for t in threads] + ["best vs best", "goal"], rows)
    rows = []
    for name, by_threads in summary["cpu_ms_per_token"].items():
        rows.append([name] + [fmt_spread(by_threads[str(t)], 2) if str(t) in by_threads else "-" for t in threads])
    for pair, entry in summary["ratios"].items():
        rows.append([f"{pair} (rival CPU / SDK CPU)"]
                    + [fmt_spread(entry[f"{t} threads, CPU time"], 2) if f"{t} threads, CPU time" in entry else "-"
                       for t in threads])
    print_table("process CPU ms per token (all its threads, spinning included), median [range] over rounds",
                ["contender"] + [f"{t} thr" for t in threads], rows)
    rows = []
    levels = result.get("levels", {})
    if "tpot_ratios" in levels:
        rows = [[f"TPOT({level})/TPOT(1.0) {fmt}", f"{v['ratio']:.3f}", f"{v['active_fraction']:.3f}",
                 f"{v['ratio'] / v['active_fraction']:.2f}x (goal <= 1.1x)"]
                for fmt, per_level in levels["tpot_ratios"].items() for level, v in per_level.items()]
        switch = levels["switch"]
        rows.append(["level switch (median) vs 256-token TTFT, int8", f"{switch['switch_median_ms']:.3f} ms",
                     f"{switch['ttft_256_ms']:.1f} ms",
                     f"{100 * switch['switch_median_ms'] / switch['ttft_256_ms']:.3f}% (goal < 0.1%)"])
    pulled = result.get("pull_bytes")
    if pulled:
        rows.append(["bytes pulled, max_level=0.5 vs full", f"{pulled['half']:,}", f"{pulled['full']:,}",
                     f"{pulled['half'] / pulled['full']:.1%} of full"])
    if rows:
        print_table(f"SDK levels at {threads[0]} thread(s)", ["metric", "value", "reference", "note"], rows)


def main() -> int:
    os.environ.setdefault("COLUMNS", "150")  # one line per row, also when not printing to a terminal
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1],
                        help="thread counts for the decode comparison (default: 1 and every core)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of every contender")
    default_llama = ROOT / ".venv-llama" / "bin" / "python"
    parser.add_argument("--llama-python", default=str(default_llama) if default_llama.is_file() else None,
                        help="the interpreter with llama-cpp-python (default: .venv-llama, `make llama-cpp`)")
    parser.add_argument("--skip-levels", action="store_true", help="decode comparison only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    from tokenizers import Tokenizer

    from device_sdk.format import public_key_b64
    from device_sdk.registry import pull, read_local_state
    from pipeline.assets import prepare_smollm2

    thread_counts = sorted(set(args.threads))
    home = Path(os.environ.get("ELASTIFY_HOME", Path.home() / ".cache" / "elastify"))
    package = args.package or bench_package(home)
    hf_dir = prepare_smollm2()
    prompt_ids = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(PROMPT).ids
    result = {"config": {"prompt": PROMPT, "prompt_ids": prompt_ids, "new_tokens": NEW_TOKENS,
                         "timed_runs_per_measurement": TIMED_RUNS, "rounds": args.rounds, "threads": thread_counts,
                         "statistic": "1 / median step between per-token stamps, per measurement; median over rounds",
                         "worker_env": {engine: sorted(clean_env(engine)) for engine in ("sdk", "hf", "llama.cpp")},
                         "cpu_count": os.cpu_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    with tempfile.TemporaryDirectory() as scratch:
        registry, public_key = sign_copy(package, Path(scratch))
        key_b64 = public_key_b64(public_key)  # base64, as `load(public_key=...)` takes it
        full = pull("smollm2", "1.0.0", registry=registry, public_key=public_key, cache_dir=Path(scratch) / "full")
        half = pull("smollm2", "1.0.0", registry=registry, public_key=public_key, max_level=0.5,
                    cache_dir=Path(scratch) / "half")
        result["pull_bytes"] = {"full": read_local_state(full)["bytes"], "half": read_local_state(half)["bytes"]}

        contenders = {f"SDK {fmt}": (sys.executable, {"engine": "sdk", "format": fmt, "package": str(full),
                                                       "public_key": key_b64}) for fmt in SDK_FORMATS}
        contenders["HF fp32"] = (sys.executable, {"engine": "hf", "model": str(hf_dir)})
        if args.llama_python and Path(args.llama_python).is_file():
            for name, gguf in llama_cpp_models(args.llama_python, Path(scratch)).items():
                contenders[name] = (args.llama_python, {"engine": "llama.cpp", "gguf": gguf})
        else:
            print("llama.cpp skipped: no --llama-python (run `make llama-cpp`)", file=sys.stderr)

        names = list(contenders)
        measurements = result["measurements"] = []
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[: round_index % len(names)]
            for threads in thread_counts if round_index % 2 == 0 else thread_counts[::-1]:
                for name in order:
                    python, spec = contenders[name]
                    record = run_worker(python, spec | {"threads": threads, "prompt_ids": prompt_ids})
                    measurements.append({"round": round_index, "contender": name, "threads": threads} | record)
                    shown = f"{record['tok_s']:.1f} tok/s" if "tok_s" in record else record["error"]
                    print(f"round {round_index} {threads} thr {name:18s} {shown:>14s}  load "
                          f"{record['load_before'][0]:.2f} -> {record['load_after'][0]:.2f}", flush=True)
                    save(result, thread_counts, args.out)  # a run cut short still reports what it measured
        if not args.skip_levels:
            result["levels"] = run_worker(sys.executable, {"engine": "levels", "threads": thread_counts[0],
                                                           "package": str(full), "public_key": key_b64})

    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save(result, thread_counts, args.out)
    print_tables(result)
    print(f"raw results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
