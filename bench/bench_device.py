"""Device SDK benchmark on SmolLM2-135M: one table.

    .venv/bin/python bench/bench_device.py [--package DIR] [--threads N ...] [--llama-python /path/to/venv/bin/python]

Rows: decode tokens/s of the SDK (fp32, fp16, int8) against HF transformers `generate`
(fp32) and llama.cpp (llama-cpp-python, run from a separate interpreter since it is not a
service dependency; skipped when absent) on the packaged Q4_1 GGUF and on Q8_0 and F16
re-quantisations of it; TPOT(m)/TPOT(1.0) against the active-parameter fraction per level;
a level switch against a 256-token TTFT; bytes of a max_level=0.5 pull vs a full one.
Decode is compared at each --threads count (default: 1 and every core), every contender
alike. Without --package it elastifies SmolLM2 once (small Taylor profile) into the cache.
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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as device_sdk sets it, for every contender alike
os.environ.setdefault("COLUMNS", "150")  # one line per row, also when not printing to a terminal

import torch  # noqa: E402
from common import print_table  # noqa: E402

from device_sdk.latency import measure_level  # noqa: E402
from device_sdk.registry import pull, read_local_state  # noqa: E402
from device_sdk.runtime import ElasticModel  # noqa: E402

PROMPT = "The history of the city begins in the early middle ages, when"
NEW_TOKENS = 48
LEVELS = "0.25,0.5,0.75,1.0"

LLAMA_CPP_SCRIPT = """
import json, sys, time
from llama_cpp import Llama
path, prompt, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
def run(tokens):
    start = time.perf_counter()
    llm.create_completion(prompt, max_tokens=tokens, temperature=0.0)
    return time.perf_counter() - start
run(4)
one, full = min(run(1) for _ in range(3)), min(run(n) for _ in range(3))
print(json.dumps({"decode_tok_s": (n - 1) / (full - one)}))
"""

LLAMA_CPP_QUANTIZE_SCRIPT = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.allow_requantize = getattr(llama_cpp, sys.argv[3]), True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


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


def trimmed_mean(values: list[float]) -> float:
    """Mean of the fastest three quarters: a shared machine's stalls are not the code's cost."""
    kept = sorted(values)[: max(1, len(values) * 3 // 4)]
    return sum(kept) / len(kept)


def sdk_decode_tok_s(model: ElasticModel) -> float:
    model.set_level("1.0")
    best = min(measure_level(model, (16,), decode_tokens=NEW_TOKENS, repeats=1).tpot_ms for _ in range(3))
    return 1000.0 / best


def hf_decode(model_dir: Path):
    """A function measuring HF generate's decode tok/s (greedy; a logits processor stamps every
    step, so prefill is excluded), best of three runs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    class Stamps(LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    inputs = tokenizer(PROMPT, return_tensors="pt")

    def tok_s() -> float:
        best = float("inf")
        for _ in range(3):
            stamps = Stamps()
            with torch.inference_mode():
                model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                               logits_processor=LogitsProcessorList([stamps]))
            steps = [b - a for a, b in zip(stamps.times, stamps.times[1:], strict=False)]
            best = min(best, trimmed_mean(steps))
        return 1.0 / best

    return tok_s


def llama_cpp_decode_tok_s(python: str, gguf: Path) -> float | None:
    try:
        out = subprocess.run(
            [python, "-c", LLAMA_CPP_SCRIPT, str(gguf), PROMPT, str(NEW_TOKENS), str(torch.get_num_threads())],
            check=True, capture_output=True, text=True, timeout=600,
        )
    except (subprocess.SubprocessError, OSError):
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"]


def llama_cpp_models(python: str, scratch: Path) -> list[tuple[str, Path | None, str]]:
    """(label, GGUF or None where it could not be made, the SDK format of comparable precision):
    the packaged Q4_1, and Q8_0 and F16 re-quantised from it (their speed; Q4_1's accuracy)."""
    from pipeline.assets import smollm2_gguf

    models = [("Q4_1 (packaged)", smollm2_gguf(), "int8")]
    for label, ftype, peer in (("Q8_0 (from Q4_1)", "LLAMA_FTYPE_MOSTLY_Q8_0", "int8"),
                               ("F16 (from Q4_1)", "LLAMA_FTYPE_MOSTLY_F16", "fp16")):
        gguf = scratch / f"smollm2-{ftype}.gguf"
        made = subprocess.run([python, "-c", LLAMA_CPP_QUANTIZE_SCRIPT, str(smollm2_gguf()), str(gguf), ftype],
                              capture_output=True)
        models.append((label, gguf if made.returncode == 0 else None, peer))
    return models


def decode_rates(hf_tok_s, models: dict[str, ElasticModel], llama_models, llama_python) -> dict:
    """Decode tok/s of HF, the SDK and llama.cpp at the current thread count. Two rounds alternate
    the contenders and each keeps its best: a burst of load on a shared machine must not decide
    the comparison for any of them."""
    rates = {"HF generate fp32": 0.0} | {f"SDK {fmt}": 0.0 for fmt in models}
    rates |= {f"llama.cpp {label}": 0.0 for label, _, _ in llama_models}
    for _ in range(2):
        rates["HF generate fp32"] = max(rates["HF generate fp32"], hf_tok_s())
        for fmt, model in models.items():
            rates[f"SDK {fmt}"] = max(rates[f"SDK {fmt}"], sdk_decode_tok_s(model))
        for label, gguf, _ in llama_models:
            rate = (llama_cpp_decode_tok_s(llama_python, gguf) if gguf else None) or 0.0
            rates[f"llama.cpp {label}"] = max(rates[f"llama.cpp {label}"], rate)
    return rates


def decode_rows(by_threads: dict[int, dict], llama_models) -> list[list[str]]:
    """One row per contender and thread count. Ratios are against each rival at its own best
    thread count (HF gains nothing from a second thread; llama.cpp may lose)."""
    best = {name: max(rates[name] for rates in by_threads.values()) for name in next(iter(by_threads.values()))}
    peers = {f"llama.cpp {label}": f"SDK {peer}" for label, _, peer in llama_models}
    rows = []
    for threads, rates in by_threads.items():
        tag = f"{threads} thread{'s' if threads > 1 else ''}"
        for name, rate in rates.items():
            if not rate:
                rows.append([f"decode tok/s, {name}, {tag}", "failed", ""])
            elif name.startswith("HF"):
                rows.append([f"decode tok/s, {name}, {tag}", f"{rate:.1f}", "baseline (its best of all thread counts)"])
            elif name.startswith("SDK"):
                rows.append([f"decode tok/s, {name}, {tag}", f"{rate:.1f}  ({rate / best['HF generate fp32']:.2f}x HF)",
                             "goal >= 3x HF"])
            else:
                goal = "; goal >= 1.0x at comparable precision" if "Q8_0" in name or "F16" in name else ""
                rows.append([f"decode tok/s, {name}, {tag}", f"{rate:.1f}",
                             f"{peers[name]} at {tag} = {rates[peers[name]] / best[name]:.2f}x its best{goal}"])
    return rows


def tpot_rows(models: dict[str, ElasticModel], rounds: int = 5) -> list[list[str]]:
    """TPOT per level over the full level's. Each round times the full level, every smaller one,
    then the full level again, and divides by the mean of the two full ones (load drifts within a
    round cancel); the row is the median round (a burst of load spoils a round, not the row)."""
    rows = []
    for name, model in models.items():
        levels = model.available_levels()
        full = levels[-1]
        ratios: dict[str, list[float]] = {level: [] for level in levels}

        def tpot(level: str, model: ElasticModel = model) -> float:
            model.set_level(level)
            return measure_level(model, (16,), decode_tokens=24, repeats=1).tpot_ms

        for _ in range(rounds):
            before = tpot(full)
            tpots = {level: tpot(level) for level in levels[:-1]}
            reference = (before + tpot(full)) / 2
            for level, value in tpots.items():
                ratios[level].append(value / reference)
        for level in levels[:-1]:
            fraction = model.manifest.elastic.level(level).active_fraction
            ratio = statistics.median(ratios[level])
            rows.append([f"TPOT({level})/TPOT({full}) {name}", f"{ratio:.3f} vs active fraction {fraction:.3f}",
                         f"{ratio / fraction:.2f}x of fraction; goal <= 1.1x"])
    return rows


def switch_row(model: ElasticModel) -> list[str]:
    """set_level plus what the next token pays to see it (the native decoder's refresh)."""
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
    switch = statistics.median(switches)
    return ["level switch (median) vs 256-token TTFT, int8", f"{switch:.3f} ms vs {ttft:.1f} ms",
            f"{100 * switch / ttft:.3f}%; goal < 0.1%"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path)
    # Decode is compared at every thread count given, each contender alike: 1 thread (the
    # repeatable number on a shared machine) and every core (what a device would run).
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1],
                        help="thread counts for the decode comparison (default: 1 and every core)")
    parser.add_argument("--llama-python", default=os.environ.get("ELASTIFY_LLAMA_PYTHON"))
    args = parser.parse_args()
    thread_counts = sorted(set(args.threads))
    home = Path(os.environ.get("ELASTIFY_HOME", Path.home() / ".cache" / "elastify"))
    package = args.package or bench_package(home)
    load_before = os.getloadavg()[0]
    rows: list[list[str]] = []

    with tempfile.TemporaryDirectory() as scratch:
        registry, public_key = sign_copy(package, Path(scratch))
        full = pull("smollm2", "1.0.0", registry=registry, public_key=public_key, cache_dir=Path(scratch) / "full")
        half = pull("smollm2", "1.0.0", registry=registry, public_key=public_key, max_level=0.5,
                    cache_dir=Path(scratch) / "half")
        full_bytes, half_bytes = read_local_state(full)["bytes"], read_local_state(half)["bytes"]

        models = {fmt: ElasticModel.load(full, public_key=public_key, quantize=fmt) for fmt in ("fp32", "fp16", "int8")}
        from pipeline.assets import prepare_smollm2

        hf_tok_s = hf_decode(prepare_smollm2())
        have_llama = bool(args.llama_python) and Path(args.llama_python).is_file()
        llama_models = llama_cpp_models(args.llama_python, Path(scratch)) if have_llama else []
        if not have_llama:
            rows.append(["decode tok/s, llama.cpp", "skipped", "llama-cpp-python not installed (give --llama-python)"])
        by_threads = {}
        for threads in thread_counts:
            torch.set_num_threads(threads)
            by_threads[threads] = decode_rates(hf_tok_s, models, llama_models, args.llama_python)
        torch.set_num_threads(thread_counts[0])
        rows += decode_rows(by_threads, llama_models)
        rows += tpot_rows({"fp32": models["fp32"], "int8": models["int8"]})
        rows.append(switch_row(models["int8"]))
        rows.append(["bytes pulled, max_level=0.5 vs full", f"{half_bytes:,} vs {full_bytes:,}",
                     f"{half_bytes / full_bytes:.1%} of full"])

    native = "native decoder" if models["int8"].transformer.decoder is not None else "torch fallback"
    print_table(f"SmolLM2-135M device SDK ({native}), decode at {thread_counts} threads, the rest at "
                f"{thread_counts[0]}, load average "
                f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}, {NEW_TOKENS} new tokens",
                ["metric", "value", "note"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
