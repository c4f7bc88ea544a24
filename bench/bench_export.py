"""An exported level in llama.cpp against the full model in llama.cpp: decode tok/s, file size.

    .venv/bin/python -m bench.bench_export [--package DIR] [--level 0.5] [--threads 2] [--rounds 5]

Both sides are `elastify-device export --format gguf` files of one SmolLM2 package (the level's
and level 1.0's), at F16 and Q8_0, run by llama-cpp-python from its own venv (`make llama-cpp`)
in a fresh subprocess with a clean environment (PATH, HOME, locale) and the same thread count.
Each measurement: one warm-up run, then RUNS runs of NEW_TOKENS greedy tokens from the same
prompt ids; the statistic is 1 / the median step between per-token stamps (prefill excluded).
Rounds alternate the order of the files; the level/full ratio is taken within each round and
reported as mean ± standard error over rounds. Raw results: bench/results/export.json.
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

from bench.bench_device import bench_package
from bench.common import ROOT, print_table, write_json

RESULTS = ROOT / "bench" / "results" / "export.json"
PROMPT = "The history of the city begins in the early middle ages, when"
NEW_TOKENS = 64
RUNS = 2
TYPES = ("f16", "q8_0")
ENV_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")  # what a process needs to start, nothing that tunes it

# Runs in llama.cpp's venv: stdlib and llama_cpp only. Its working directory is the repository, which
# `python -c` puts on sys.path, so the stdlib-only bench.llama_kernels imports there too.
LLAMA_CPP_DECODE = """
import json, statistics, sys, time
from llama_cpp import Llama
spec = json.loads(sys.argv[1])
from bench.llama_kernels import plain_kernels_where_amx_crashes
plain = plain_kernels_where_amx_crashes()
threads = spec["threads"]
llm = Llama(model_path=spec["gguf"], n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False)
def steps():
    stamps = []
    for count, _ in enumerate(llm.generate(spec["prompt_ids"], temp=0.0, reset=True), start=1):
        stamps.append(time.perf_counter())
        if count == spec["new_tokens"]:
            break
    return [b - a for a, b in zip(stamps, stamps[1:])]
steps()
measured = [step for _ in range(spec["runs"]) for step in steps()]
step = statistics.median(measured)
print(json.dumps({"tok_s": 1 / step, "step_median_ms": step * 1000, "steps": len(measured),
                  "llama_cpp_python": __import__("llama_cpp").__version__, "llama_cpp_plain_kernels": plain}))
"""


def decode(python: str, gguf: Path, prompt_ids: list[int], threads: int) -> dict:
    spec = {"gguf": str(gguf), "prompt_ids": prompt_ids, "threads": threads, "new_tokens": NEW_TOKENS, "runs": RUNS}
    env = {name: os.environ[name] for name in ENV_KEPT if name in os.environ}
    before = os.getloadavg()
    done = subprocess.run([python, "-c", LLAMA_CPP_DECODE, json.dumps(spec)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp on {gguf.name} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"load_before": before, "load_after": os.getloadavg()}


def mean_se(values: list[float]) -> dict:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return {"mean": statistics.fmean(values), "se": se, "n": len(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, help="default: bench_device's SmolLM2 package, built once")
    parser.add_argument("--level", default="0.5")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="for both sides")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--types", nargs="+", choices=TYPES, default=list(TYPES), help="GGUF weight types")
    parser.add_argument("--llama-python", default=str(ROOT / ".venv-llama" / "bin" / "python"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not Path(args.llama_python).is_file():
        print(f"no llama.cpp interpreter at {args.llama_python}: run `make llama-cpp`", file=sys.stderr)
        return 1

    from tokenizers import Tokenizer

    from device_sdk.export_gguf import export_gguf
    from device_sdk.format import read_manifest

    home = Path(os.environ.get("ELASTIFY_HOME", Path.home() / ".cache" / "elastify"))
    package = args.package or bench_package(home)
    manifest = read_manifest(package)
    level = manifest.elastic.level(args.level)
    prompt_ids = Tokenizer.from_file(str(package / "model" / "tokenizer.json")).encode(PROMPT).ids
    result = {"config": {"package": f"{manifest.name} {manifest.version}", "level": level.name,
                         "active_fraction": level.active_fraction, "threads": args.threads, "rounds": args.rounds,
                         "prompt": PROMPT, "new_tokens": NEW_TOKENS, "runs_per_measurement": RUNS,
                         "statistic": "1 / median step between per-token stamps; ratio within a round",
                         "worker_env": list(ENV_KEPT), "cpu_count": os.cpu_count(),
                         "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    with tempfile.TemporaryDirectory() as scratch:
        files = {}
        for dtype in args.types:
            for side, name in (("level", level.name), ("full", "1.0")):
                files[(dtype, side)] = export_gguf(package, Path(scratch) / f"{name}-{dtype}.gguf", level=name,
                                                   dtype=dtype)
        result["file_bytes"] = {f"{dtype} {side}": path.stat().st_size for (dtype, side), path in files.items()}
        measurements = []
        for round_index in range(args.rounds):
            order = list(files) if round_index % 2 == 0 else list(files)[::-1]
            for dtype, side in order:
                record = decode(args.llama_python, files[(dtype, side)], prompt_ids, args.threads)
                measurements.append({"round": round_index, "type": dtype, "side": side} | record)
                print(f"round {round_index} {dtype:5s} {side:5s} {record['tok_s']:7.1f} tok/s  load "
                      f"{record['load_before'][0]:.2f} -> {record['load_after'][0]:.2f}", flush=True)
    result["measurements"] = measurements
    summary = {}
    for dtype in args.types:
        rate = {side: {m["round"]: m["tok_s"] for m in measurements if m["type"] == dtype and m["side"] == side}
                for side in ("level", "full")}
        summary[dtype] = {"level_tok_s": mean_se(list(rate["level"].values())),
                          "full_tok_s": mean_se(list(rate["full"].values())),
                          "speedup": mean_se([rate["level"][r] / rate["full"][r] for r in rate["level"]]),
                          "size_ratio": result["file_bytes"][f"{dtype} level"] / result["file_bytes"][f"{dtype} full"]}
    result["summary"] = summary
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json(args.out, result, indent=1)
    rows = [[dtype.upper(), f"{s['full_tok_s']['mean']:.1f} ± {s['full_tok_s']['se']:.1f}",
             f"{s['level_tok_s']['mean']:.1f} ± {s['level_tok_s']['se']:.1f}",
             f"{s['speedup']['mean']:.2f} ± {s['speedup']['se']:.2f}",
             f"{result['file_bytes'][f'{dtype} full'] / 2**20:.0f} MiB",
             f"{result['file_bytes'][f'{dtype} level'] / 2**20:.0f} MiB ({s['size_ratio']:.2f})"]
            for dtype, s in summary.items()]
    print_table(f"llama.cpp decode, level {level.name} (active fraction {level.active_fraction:.2f}) vs 1.0, "
                f"{args.threads} threads, {args.rounds} rounds (mean ± SE)",
                ["type", "full tok/s", f"level {level.name} tok/s", "speedup", "full file", "level file"], rows)
    print(f"raw results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
