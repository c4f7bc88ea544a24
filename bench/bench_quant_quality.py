"""What the quantised formats cost in quality on SmolLM2-135M: the SDK's int8 / int4 against llama.cpp's
Q8_0 / Q4_0 on the same weights and the same tokens.

    .venv/bin/python -m bench.bench_quant_quality [--package DIR] [--windows 24] [--window-length 128]

Text: windows of LAMBADA and of PTB's test split, cut with the package's tokenizer; every engine gets the
same token ids. Per window, the mean next-token NLL.

SDK (`ElasticModel`, fp32 / int8 / int4 at load, every level of the package; at int4 the LM head, here the
tied embedding, stays Q8_0 as in llama.cpp's Q4_0 and in the package's int4 file), two ways:
  decode:  one token per step, the windows as rows of a batch under 16 (device_sdk.kernels.GEMM_ROWS):
           the integer kernels with each token's activations quantised per block of 32, as a device's
           decode computes;
  prefill: the whole window in one pass: the active prefix dequantised into torch's GEMM, float
           activations (what the report card measures; the weights' rounding only).
llama.cpp (llama-cpp-python in its own venv, `make llama-cpp`): level 1.0 written at F16 by our GGUF
exporter, then quantised by llama.cpp itself to Q8_0 and Q4_0 with its default tensor choices; NLLs from
its batched eval with logits for every position.

Reported: each format's perplexity ratio to its own engine's full precision, paired by window (mean of
per-window NLL differences, normal 95% interval); the difference between our increase and llama.cpp's
at equal bits, paired the same way (goal: ours ≤ theirs); per level, the ratio to the same level in full
precision (goal: no level loses more at a format than the full model does, within the interval).
Quality, not speed: nothing here is timed. Raw results: bench/results/quant_quality.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, print_table, write_results

FORMATS = ("int8", "int4")
LLAMA_CPP_OF = {"int8": ("Q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0"), "int4": ("Q4_0", "LLAMA_FTYPE_MOSTLY_Q4_0")}
CORPORA = ("lambada", "ptb:test")
DECODE_ROWS = 8  # windows per decode batch: under GEMM_ROWS, so each step takes the integer GEMV

# Runs in llama.cpp's venv (stdlib, numpy and llama_cpp only): argv = gguf, windows JSON, threads.
LLAMA_CPP_NLLS = """
import json, sys
import numpy as np
from llama_cpp import Llama
gguf, windows, threads = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
length = len(windows[0])
llm = Llama(model_path=gguf, n_ctx=length, n_batch=length, n_ubatch=length, logits_all=True,
            n_threads=threads, n_threads_batch=threads, verbose=False)
nlls = []
for window in windows:
    llm.reset()
    llm.eval(window)
    logits = np.asarray(llm.scores[: length - 1], dtype=np.float64)
    top = logits.max(axis=1, keepdims=True)
    logz = (top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True)))[:, 0]
    nlls.append(float(np.mean(logz - logits[np.arange(length - 1), window[1:]])))
print(json.dumps(nlls))
"""


def paired_difference(a: list[float], b: list[float], z: float = 1.96) -> dict:
    """Mean of a - b over paired windows (nats), its standard error and normal interval."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"need two equal lists of at least 2 windows, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean = sum(diffs) / len(diffs)
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
    return {"mean_nats": mean, "se_nats": se, "low_nats": mean - z * se, "high_nats": mean + z * se,
            "windows": len(diffs)}


def decode_nlls(model, windows) -> list[float]:
    """Per-window mean next-token NLL, feeding one token per step through the KV cache."""
    import torch
    import torch.nn.functional as F

    nlls = []
    with torch.inference_mode():
        for start in range(0, windows.shape[0], DECODE_ROWS):
            batch = windows[start : start + DECODE_ROWS]
            cache = model.transformer.new_cache(batch.shape[1])
            total = torch.zeros(batch.shape[0], dtype=torch.float64)
            for t in range(batch.shape[1] - 1):
                logits = model.transformer(batch[:, t : t + 1], cache)[:, -1].float()
                total += F.cross_entropy(logits, batch[:, t + 1], reduction="none").double()
            nlls += (total / (batch.shape[1] - 1)).tolist()
    return nlls


def sdk_nlls(package: Path, windows, levels: list[str]) -> dict:
    """{format: {level: {"decode": [...], "prefill": [...]}}} for fp32 and every quantised format."""
    from rich.progress import track

    from device_sdk.runtime import ElasticModel
    from pipeline.models.scoring import window_nlls

    out: dict = {}
    for fmt in ("fp32", *FORMATS):
        model = ElasticModel.load(package, verify=False, allow_unsigned=True, quantize=fmt)
        out[fmt] = {}
        for level in track(levels, description=f"SDK {fmt}: levels"):
            model.set_level(level)
            out[fmt][level] = {"decode": decode_nlls(model, windows), "prefill": window_nlls(model, windows)}
    return out


def llama_cpp_nlls(package: Path, windows, python: str, threads: int) -> dict:
    """{"F16": [...], "Q8_0": [...], "Q4_0": [...]} on level 1.0 exported by our GGUF exporter."""
    from bench.bench_device import LLAMA_CPP_QUANTIZE, clean_env
    from device_sdk.export_gguf import export_gguf

    out = {}
    with tempfile.TemporaryDirectory(prefix="quant-quality-") as scratch:
        scratch = Path(scratch)
        f16 = export_gguf(package, scratch / "full-f16.gguf", level="1.0", dtype="f16")
        tokens = scratch / "windows.json"
        tokens.write_text(json.dumps(windows.tolist()))
        files = {"F16": f16}
        for label, ftype in LLAMA_CPP_OF.values():
            files[label] = scratch / f"full-{label}.gguf"
            subprocess.run([python, "-c", LLAMA_CPP_QUANTIZE, str(f16), str(files[label]), ftype],
                           env=clean_env("llama.cpp"), check=True, capture_output=True, cwd=ROOT)
        for label, gguf in files.items():
            run = subprocess.run([python, "-c", LLAMA_CPP_NLLS, str(gguf), str(tokens), str(threads)],
                                 env=clean_env("llama.cpp"), check=True, capture_output=True, text=True, cwd=ROOT)
            out[label] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def llama_cpp_version(python: str) -> str:
    from bench.bench_device import clean_env

    run = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], env=clean_env("llama.cpp"),
                         capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


def ratio(nlls: list[float], reference: list[float]) -> dict:
    from pipeline.models.scoring import paired_ratio

    return paired_ratio(nlls, reference)


def summarise(sdk: dict, llama: dict | None, levels: list[str]) -> dict:
    full = max(levels, key=float)
    summary: dict = {"sdk": {}, "llama_cpp": {}, "ours_minus_llama_cpp": {}, "level_losses": {}}
    for fmt in FORMATS:
        summary["sdk"][fmt] = {level: {path: ratio(sdk[fmt][level][path], sdk["fp32"][level][path])
                                       for path in ("decode", "prefill")} for level in levels}
        # A level loses "more than the full model" when its increase exceeds the full model's beyond the interval.
        summary["level_losses"][fmt] = {
            level: paired_difference(
                [q - f for q, f in zip(sdk[fmt][level]["decode"], sdk["fp32"][level]["decode"], strict=True)],
                [q - f for q, f in zip(sdk[fmt][full]["decode"], sdk["fp32"][full]["decode"], strict=True)])
            for level in levels}
        if llama is not None:
            label = LLAMA_CPP_OF[fmt][0]
            summary["llama_cpp"][label] = ratio(llama[label], llama["F16"])
            ours = [q - f for q, f in zip(sdk[fmt][full]["decode"], sdk["fp32"][full]["decode"], strict=True)]
            theirs = [q - f for q, f in zip(llama[label], llama["F16"], strict=True)]
            summary["ours_minus_llama_cpp"][fmt] = paired_difference(ours, theirs) | {"rival": f"llama.cpp {label}"}
    if llama is not None:
        summary["llama_cpp_f16_vs_sdk_fp32"] = ratio(llama["F16"], sdk["fp32"][full]["decode"])
    return summary


def print_summary(summary: dict, levels: list[str]) -> None:
    def fmt_ratio(r: dict) -> str:
        return f"{r['ratio']:.4f} [{r['low']:.4f}, {r['high']:.4f}]"

    rows = []
    for fmt in FORMATS:
        for level in sorted(levels, key=float, reverse=True):
            r = summary["sdk"][fmt][level]
            loss = summary["level_losses"][fmt][level]
            rows.append([f"SDK {fmt}", level, fmt_ratio(r["decode"]), fmt_ratio(r["prefill"]),
                         f"{loss['mean_nats']:+.4f} ± {1.96 * loss['se_nats']:.4f}"])
        label = LLAMA_CPP_OF[fmt][0]
        if label in summary["llama_cpp"]:
            rows.append([f"llama.cpp {label}", "1.0", fmt_ratio(summary["llama_cpp"][label]), "-", "-"])
    print_table("Perplexity ratio to the same engine and level in full precision [95% paired interval]",
                ["format", "level", "decode path", "prefill path", "Δ increase vs level 1.0 (nats)"], rows)
    if summary["ours_minus_llama_cpp"]:
        print_table("Our increase minus llama.cpp's at equal bits, level 1.0 (nats; goal ≤ 0)",
                    ["bits", "ours − llama.cpp", "95% interval", "goal met"],
                    [[fmt, f"{d['mean_nats']:+.4f}", f"[{d['low_nats']:+.4f}, {d['high_nats']:+.4f}]",
                      "yes" if d["low_nats"] <= 0 else "no"] for fmt, d in summary["ours_minus_llama_cpp"].items()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path, help="an elastic SmolLM2 package (default: bench_device's, built once)")
    parser.add_argument("--windows", type=int, default=24, help="windows per corpus")
    parser.add_argument("--window-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--llama-python", default=str(ROOT / ".venv-llama" / "bin" / "python"),
                        help="llama.cpp's interpreter; '' skips llama.cpp")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (quality does not depend on it)")
    args = parser.parse_args(argv)
    if args.windows < 2 or args.window_length < 8:
        parser.error("need at least 2 windows of at least 8 tokens")
    load_before = os.getloadavg()

    import torch
    from transformers import AutoTokenizer

    from bench.bench_device import bench_package
    from device_sdk.format import read_manifest
    from pipeline.data.calibration import make_windows

    package = args.package or bench_package(Path(os.environ.get("ELASTIFY_HOME", Path.home() / ".cache" / "elastify")))
    tokenizer = AutoTokenizer.from_pretrained(str(package / "model"))
    windows = torch.cat([make_windows(tokenizer, corpus, args.windows, args.window_length, args.seed)
                         for corpus in CORPORA])
    levels = [shape.name for shape in read_manifest(package).elastic.levels]
    sdk = sdk_nlls(package, windows, levels)
    llama = None
    if args.llama_python:
        if not Path(args.llama_python).is_file():
            parser.error(f"{args.llama_python} is missing: run `make llama-cpp`, or pass --llama-python ''")
        llama = llama_cpp_nlls(package, windows, args.llama_python, args.threads)
    summary = summarise(sdk, llama, levels)
    print_summary(summary, levels)
    write_results("quant_quality", args, [], load_before, package=str(package), corpora=list(CORPORA),
                  windows_total=int(windows.shape[0]), levels=levels,
                  versions={"torch": torch.__version__,
                            "llama_cpp": llama_cpp_version(args.llama_python) if args.llama_python else None},
                  summary=summary, nlls={"sdk": sdk, "llama_cpp": llama})
    return 0


if __name__ == "__main__":
    sys.exit(main())
