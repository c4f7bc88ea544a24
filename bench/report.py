"""Render docs/results/ and the README's headline table from the committed JSON.

    python -m bench.report            # rewrite every generated table in place
    python -m bench.report --check    # exit 1, with a diff, when a committed page differs

A page is hand-written prose around marked regions: `<!-- table:NAME begin -->` … `<!-- table:NAME end -->`
holds a generated table, `<!-- value:NAME -->…<!-- /value -->` one generated figure inside a sentence,
and `<!-- sources begin -->…<!-- sources end -->` the line naming the JSON the page was rendered from.
Only what is inside a marker is rewritten, so the prose survives a re-render. Every number comes from
a named field of a JSON file under bench/results/ or experiments/results/ and is formatted here; a
missing field is an error that names its file and field. Plain stdlib, no torch: it runs anywhere.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m bench.report"


class ReportError(Exception):
    """A page cannot be rendered: a JSON file or field is missing, or a page lacks its markers."""


class MissingField(ReportError):
    def __init__(self, file: str, path: tuple) -> None:
        super().__init__(f"{file}: no field {'.'.join(str(p) for p in path)!r}")
        self.file, self.path = file, path


class Results:
    """The committed JSON under one root, loaded once each, remembering which files a page read."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._loaded: dict[str, object] = {}
        self.read: set[str] = set()

    def get(self, file: str, *path: str | int):
        """The value at `path` inside `file` (relative to the root); MissingField names both when absent."""
        if file not in self._loaded:
            try:
                self._loaded[file] = json.loads((self.root / file).read_text())
            except FileNotFoundError:
                raise ReportError(f"{file}: no such JSON file") from None
        self.read.add(file)
        value = self._loaded[file]
        for depth, key in enumerate(path):
            try:
                value = value[key]
            except (KeyError, IndexError, TypeError):
                raise MissingField(file, path[: depth + 1]) from None
        return value


# --- formatting ------------------------------------------------------------------------------------

MINUS = "−"


def num(x: float, digits: int = 2) -> str:
    return f"{x:,.{digits}f}".replace("-", MINUS)


def signed(x: float, digits: int = 1) -> str:
    return f"{x:+.{digits}f}".replace("-", MINUS)


def times(x: float, digits: int = 2) -> str:
    return f"{num(x, digits)}×"


def span(low: float, high: float, digits: int = 2, sign: bool = False) -> str:
    fmt = signed if sign else num
    return f"[{fmt(low, digits)}, {fmt(high, digits)}]"


def ratio_ci(r: dict, digits: int = 2) -> str:
    """A paired ratio field ({ratio, low, high}) as `1.52× [1.46, 1.59]`."""
    return f"{times(r['ratio'], digits)} {span(r['low'], r['high'], digits)}"


def points(triple: list[float]) -> str:
    """A difference in accuracy (fractions: mean, low, high) as points with its interval."""
    mean, low, high = (100 * v for v in triple)
    return f"{signed(mean)} {span(low, high, 1, sign=True)}"


def accuracy_ci(triple: list[float]) -> str:
    return f"{num(triple[0], 3)} {span(triple[1], triple[2], 3)}"


def tokens(n: int) -> str:
    return f"{n:,}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# --- elastic core ----------------------------------------------------------------------------------

SHAPES = "experiments/results/level-shapes-screen.json"
IMPORTANCE = "experiments/results/importance-screen.json"
UNRECOVERED = "experiments/results/recovery-unrecovered-screen.json"
DEVICE = "bench/results/device.json"


def level_shapes(r: Results) -> str:
    default = r.get(SHAPES, "default")
    rows = []
    for shape in r.get(SHAPES, "packages"):
        row = [shape]
        for level in ("0.7", "0.5"):
            cell = r.get(SHAPES, "rows", f"{shape} @ {level}")
            if shape == default:
                row += [num(cell["lambada_ppl"], 1), num(cell["repeat4"], 3)]
                continue
            d = cell["repeat4_minus_default"]
            row += [
                f"{num(cell['lambada_ppl'], 1)} ({ratio_ci(cell['lambada_vs_default'])})",
                f"{num(cell['repeat4'], 3)} ({signed(d['difference'], 3)} {span(d['low'], d['high'], 3, sign=True)})",
            ]
        rows.append(row + [num(r.get(SHAPES, "rows", f"{shape} @ 0.7", "active_fraction"), 3)])
    return table(
        [
            "shape",
            "0.7: LAMBADA ppl (÷ default [95%])",
            "0.7: repeat-4 (− default [95%])",
            "0.5: LAMBADA ppl (÷ default [95%])",
            "0.5: repeat-4 (− default [95%])",
            "active fraction at 0.7",
        ],
        rows,
    )


def importance(r: Results) -> str:
    rows = []
    for criterion in r.get(IMPORTANCE, "packages"):
        row = [criterion]
        for level in ("0.7", "0.5"):
            q = r.get(IMPORTANCE, "quality", criterion, level)
            row += [num(q["lambada_ppl"], 1), num(q["repeat4"], 3)]
        rows.append(row)
    return table(
        ["neurons ranked by", "0.7: LAMBADA ppl", "0.7: repeat-4", "0.5: LAMBADA ppl", "0.5: repeat-4"], rows
    )


def unrecovered(r: Results) -> str:
    rows = []
    for level in ("1.0", "0.7", "0.5"):
        q = r.get(UNRECOVERED, "quality", level)
        rows.append([level, num(q["lambada_ppl"], 1), num(q["heldout_ppl"], 1), num(q["repeat4"], 3)])
    return table(["level", "LAMBADA ppl", "held-out generated ppl", "greedy repeat-4"], rows)


def level_switch(r: Results) -> str:
    s = r.get(DEVICE, "levels", "switch")
    share = 100 * s["switch_median_ms"] / s["ttft_256_ms"]
    return table(
        ["switches timed", "`set_level` + native refresh, median", "TTFT at 256 tokens", "switch ÷ TTFT"],
        [
            [
                str(s["switches"]),
                f"{num(s['switch_median_ms'], 3)} ms",
                f"{num(s['ttft_256_ms'], 0)} ms",
                f"{num(share, 3)}%",
            ]
        ],
    )


# --- device ----------------------------------------------------------------------------------------

EXPORT = "bench/results/export.json"


def device_decode(r: Results) -> str:
    def cell(stat: dict, digits: int) -> str:
        return f"{num(stat['median'], digits)} [{num(stat['min'], digits)}–{num(stat['max'], digits)}]"

    rows = []
    for contender, by_threads in r.get(DEVICE, "summary", "decode_tok_s").items():
        cpu = r.get(DEVICE, "summary", "cpu_ms_per_token", contender, "1")
        rows.append([contender, cell(by_threads["1"], 1), cell(by_threads["2"], 1), cell(cpu, 2)])
    return table(
        [
            "decode, tokens/s (median [min–max] over rounds)",
            "1 thread",
            "2 threads",
            "CPU ms per token, 1 thread",
        ],
        rows,
    )


def device_ratios(r: Results) -> str:
    def cell(stat: dict) -> str:
        return f"{times(stat['median'])} [{num(stat['min'])}–{num(stat['max'])}]"

    rows = []
    for pair, s in r.get(DEVICE, "summary", "ratios").items():
        best = s["best vs best"]
        threads = " / ".join(str(t) for t in best["threads"].values())
        rows.append(
            [
                pair,
                cell(s["1 threads"]),
                cell(s["2 threads"]),
                cell(s["1 threads, CPU time"]),
                f"{times(best['ratio'])} ({threads} threads)",
            ]
        )
    return table(
        [
            "SDK ÷ rival, within a round",
            "1 thread",
            "2 threads",
            "CPU time, 1 thread (rival ÷ SDK)",
            "best vs best",
        ],
        rows,
    )


def device_levels(r: Results) -> str:
    tpot = r.get(DEVICE, "levels", "tpot_ratios")
    rows = []
    for level, fp32 in tpot["fp32"].items():
        int8 = tpot["int8"][level]
        rows.append([level, num(fp32["active_fraction"], 3), num(fp32["ratio"], 3), num(int8["ratio"], 3)])
    return table(["level", "active fraction", "TPOT(level) ÷ TPOT(1.0), fp32", "int8"], rows)


def device_pull(r: Results) -> str:
    full, half = r.get(DEVICE, "pull_bytes", "full"), r.get(DEVICE, "pull_bytes", "half")
    return table(
        ["pull", "bytes fetched", "share of the package"],
        [
            ["whole package", f"{num(full / 1e6, 1)} MB", "100%"],
            ["`max_level=0.5`", f"{num(half / 1e6, 1)} MB", f"{num(100 * half / full, 1)}%"],
        ],
    )


QUANT_QUALITY = "bench/results/quant_quality.json"


def quant_quality(r: Results) -> str:
    """Per format and level: perplexity ratio to the same level in full precision, both compute paths;
    llama.cpp's formats against its own F16 on the same windows."""
    summary = r.get(QUANT_QUALITY, "summary")
    rows = []
    for fmt, by_level in summary["sdk"].items():
        for level in sorted(by_level, key=float, reverse=True):
            paths = by_level[level]
            loss = summary["level_losses"][fmt][level]
            rows.append([f"SDK {fmt}", level, ratio_ci(paths["decode"], 4), ratio_ci(paths["prefill"], 4),
                         f"{signed(loss['mean_nats'], 4)} {span(loss['low_nats'], loss['high_nats'], 4, sign=True)}"])
    for label, paired in summary["llama_cpp"].items():
        rows.append([f"llama.cpp {label}", "1.0", ratio_ci(paired, 4), "–", "–"])
    return table(["format", "level", "perplexity ÷ full precision, decode path", "prefill path",
                  "increase minus level 1.0's (nats)"], rows)


def quant_versus_llama_cpp(r: Results) -> str:
    rows = []
    for fmt, d in r.get(QUANT_QUALITY, "summary", "ours_minus_llama_cpp").items():
        rows.append([fmt, d["rival"], f"{signed(d['mean_nats'], 4)} {span(d['low_nats'], d['high_nats'], 4, sign=True)}",
                     "met" if d["low_nats"] <= 0 else "missed"])
    return table(["bits", "llama.cpp rival", "our NLL increase minus llama.cpp's (nats, 95%)", "goal (≤ 0)"], rows)


def export_gguf(r: Results) -> str:
    s = r.get(EXPORT, "summary", "f16")
    level = r.get(EXPORT, "config", "level")

    def cell(stat: dict) -> str:
        return f"{num(stat['mean'], 2)} ± {num(stat['se'], 2)}"

    return table(
        [
            "GGUF F16 in llama.cpp",
            f"level {level}",
            "full model",
            "level ÷ full, tok/s",
            "file size, level ÷ full",
        ],
        [
            [
                "decode tokens/s (mean ± SE over rounds)",
                cell(s["level_tok_s"]),
                cell(s["full_tok_s"]),
                f"{times(s['speedup']['mean'])} ± {num(s['speedup']['se'])}",
                times(s["size_ratio"], 3),
            ]
        ],
    )


# --- recovery --------------------------------------------------------------------------------------

RECOVERY = "bench/results/recovery.json"
GPU = "bench/results/gpu-recovery.json"
DECODING = "experiments/results/decoding.json"
METHODS = {
    "none": "no recovery",
    "lm-ptb": "(a) LM loss, PTB",
    "lm-corpus": "(b) LM loss, corpus",
    "distill": "(c) distillation, corpus",
    "distill-warm": "(d) (c) + warm start",
}


def recovery_acceptance(r: Results) -> str:
    full = r.get(RECOVERY, "full_model")
    rows = [
        [
            "1.0",
            "full model",
            num(full["lambada_ppl"], 1),
            num(full["heldout_ppl"], 2),
            num(full["repeat4"], 3),
        ]
    ]
    for row in r.get(RECOVERY, "rows"):
        lam, held = row["lambada_interval"], row["heldout_interval"]
        repeat = (
            "–" if row["repeat4"] is None else f"{num(row['repeat4'], 3)} ({times(row['repeat4_ratio'], 1)})"
        )
        rows.append(
            [
                row["level"],
                METHODS[row["method"]],
                f"{num(row['lambada_ppl'], 1)} ({times(row['lambada_ratio'])} {span(*lam)})",
                f"{num(row['heldout_ppl'], 1)} ({times(row['heldout_ratio'])} {span(*held)})",
                repeat,
            ]
        )
    return table(
        ["level", "method", "LAMBADA ppl (÷ full [95%])", "held-out ppl (÷ full [95%])", "repeat-4 (÷ full)"],
        rows,
    )


def recovery_versus(r: Results) -> str:
    pairs = {
        "distill / lm-corpus": "(c) distillation ÷ (b) LM, corpus",
        "distill / lm-ptb": "(c) distillation ÷ (a) LM, PTB",
        "lm-corpus / lm-ptb": "(b) corpus ÷ (a) PTB, LM loss",
        "distill-warm / distill": "(d) warm start ÷ (c)",
    }
    rows = []
    for key, label in pairs.items():
        row = [label]
        for level in ("0.7", "0.5"):
            v = r.get(RECOVERY, "versus", f"{key} @ {level}")
            row += [_paired_or_same(v["lambada"]), _paired_or_same(v["heldout"])]
        rows.append(row)
    return table(
        [
            "pair (perplexity ratio, paired by window)",
            "0.7 LAMBADA",
            "0.7 held-out",
            "0.5 LAMBADA",
            "0.5 held-out",
        ],
        rows,
    )


def _paired_or_same(v: dict) -> str:
    # the largest level below 1.0 starts cold, so its warm-start run is the cold one itself
    return "same run" if v["low"] == v["high"] == 1 else ratio_ci(v)


def recovery_curve(r: Results) -> str:
    curves = r.get(RECOVERY, "curves")
    rows = []
    for i, point in enumerate(curves["distill"]["0.7"]):
        row = [tokens(point["tokens"])]
        for method in curves:
            for level in ("0.7", "0.5"):
                row.append(num(curves[method][level][i]["lambada_ppl"], 1))
        rows.append(row)
    header = ["tokens"] + [f"{METHODS[m].split(',')[0]} @ {lv}" for m in curves for lv in ("0.7", "0.5")]
    return table(header, rows)


BUDGET_RUNS = (
    "experiments/results/recovery-6k.json",
    "experiments/results/recovery-24k.json",
    "experiments/results/recovery-98k.json",
    RECOVERY,
)


def recovery_budgets(r: Results) -> str:
    rows = []
    for file in BUDGET_RUNS:
        by = {(row["level"], row["method"]): row for row in r.get(file, "rows")}
        row = [tokens(r.get(file, "tokens_per_level")), num(r.get(file, "settings", "lr"), 4)]
        for key in (("0.7", "distill"), ("0.5", "distill"), ("0.5", "distill-warm")):
            if key not in by:
                raise MissingField(file, ("rows", f"level {key[0]}, method {key[1]}"))
            cell = by[key]
            repeat = "–" if cell["repeat4"] is None else num(cell["repeat4"], 3)
            row += [times(cell["lambada_ratio"]), repeat]
        rows.append(row + [f"`{Path(file).name}`"])
    return table(
        [
            "tokens a level",
            "lr",
            "0.7 (c): LAMBADA ÷ full",
            "0.7 (c): repeat-4",
            "0.5 (c): LAMBADA ÷ full",
            "0.5 (c): repeat-4",
            "0.5 (d): LAMBADA ÷ full",
            "0.5 (d): repeat-4",
            "data",
        ],
        rows,
    )


@dataclass(frozen=True)
class Lever:
    """One screened recovery lever: the variant's row, its paired LAMBADA ratio, and its baseline's row."""

    label: str
    file: str
    variant: tuple
    ratio: str
    baseline: tuple
    tokens: tuple = ("tokens_per_level",)


def _screen(name: str) -> str:
    return f"experiments/results/recovery-{name}.json"


LEVERS = (
    Lever(
        "half the steps on the level's own greedy text (on-policy)",
        _screen("onpolicy-screen"),
        ("rows", "(e) on-policy 0.5, UL 0"),
        "lambada_vs_c",
        ("rows", "(c) distill"),
    ),
    Lever(
        "… plus unlikelihood 1 on its repeated 4-grams",
        _screen("onpolicy-screen"),
        ("rows", "(e) on-policy 0.5, UL 1"),
        "lambada_vs_c",
        ("rows", "(c) distill"),
    ),
    Lever(
        "every step on its own text, unlikelihood 2",
        _screen("onpolicy-screen"),
        ("rows", "(e) on-policy 1.0, UL 2"),
        "lambada_vs_c",
        ("rows", "(c) distill"),
    ),
    Lever(
        "the full model corrects the level's own text (speculative KD)",
        _screen("corrected-screen"),
        ("rows", "(f) (c) + corrected on-policy steps"),
        "lambada_vs_c",
        ("rows", "(c) distill"),
    ),
    Lever(
        "LoRA rank 32 instead of 8",
        _screen("rank-screen"),
        ("rows", "(c) distill, rank 32, alpha 64"),
        "lambada_vs_rank8",
        ("rows", "(c) distill, rank 8, alpha 16"),
    ),
    Lever(
        "reverse KL",
        _screen("divergence-screen"),
        ("rows", "reverse KL"),
        "lambada_vs_forward KL",
        ("rows", "forward KL"),
        ("rows", "reverse KL", "train_tokens"),
    ),
    Lever(
        "JSD, beta 0.5",
        _screen("divergence-screen"),
        ("rows", "JSD beta 0.5"),
        "lambada_vs_forward KL",
        ("rows", "forward KL"),
        ("rows", "JSD beta 0.5", "train_tokens"),
    ),
    Lever(
        "temperature 2",
        _screen("temperature-screen"),
        ("rows", "T 2"),
        "lambada_vs_T 1",
        ("rows", "T 1"),
        ("rows", "T 2", "train_tokens"),
    ),
    Lever(
        "temperature 0.5",
        _screen("temperature-screen"),
        ("rows", "T 0.5"),
        "lambada_vs_T 1",
        ("rows", "T 1"),
        ("rows", "T 0.5", "train_tokens"),
    ),
    Lever(
        "ten times the generated corpus (480 prompts, not 48)",
        _screen("corpus-screen"),
        ("rows", "480 prompts"),
        "lambada_vs_48 prompts",
        ("rows", "48 prompts"),
        ("rows", "480 prompts", "train_tokens"),
    ),
    Lever(
        "ten times the generated corpus (480 prompts, not 48)",
        _screen("corpus-screen-0.5"),
        ("rows", "480 prompts"),
        "lambada_vs_48 prompts",
        ("rows", "48 prompts"),
        ("rows", "480 prompts", "train_tokens"),
    ),
    Lever(
        "twice the tokens",
        _screen("tokens-screen-0.7"),
        ("rows", "197k tokens"),
        "lambada_vs_98k tokens",
        ("rows", "98k tokens"),
        ("rows", "197k tokens", "train_tokens"),
    ),
    Lever(
        "twice the tokens",
        _screen("tokens-screen-0.5"),
        ("rows", "197k tokens"),
        "lambada_vs_98k tokens",
        ("rows", "98k tokens"),
        ("rows", "197k tokens", "train_tokens"),
    ),
    Lever(
        "distillation plus the LM loss (`lm_weight` 1)",
        _screen("lmweight-screen-0.7"),
        ("rows", "(c) + 1.0 LM"),
        "lambada_vs_(c) rerun here",
        ("rows", "(c) rerun here"),
        ("rows", "(c) + 1.0 LM", "train_tokens"),
    ),
    Lever(
        "distillation plus the LM loss (`lm_weight` 1)",
        _screen("lmweight-screen-0.5"),
        ("rows", "(c) + 1.0 LM"),
        "lambada_vs_(c) rerun here",
        ("rows", "(c) rerun here"),
        ("rows", "(c) + 1.0 LM", "train_tokens"),
    ),
    Lever(
        "the full model's answers only (`mix generated=1`)",
        _screen("mix-screen-0.7"),
        ("rows", "distill, generated only"),
        "lambada_vs_distill, default mix",
        ("rows", "distill, default mix"),
        ("rows", "distill, generated only", "train_tokens"),
    ),
    Lever(
        "the full model's answers only (`mix generated=1`)",
        _screen("mix-screen-0.5"),
        ("rows", "distill, generated only"),
        "lambada_vs_distill, default mix",
        ("rows", "distill, default mix"),
        ("rows", "distill, generated only", "train_tokens"),
    ),
    Lever(
        "per-level RMSNorm gains",
        _screen("norms-screen-0.7"),
        ("norms",),
        "lambada_vs_baseline",
        ("baseline",),
        ("settings",),
    ),
    Lever(
        "per-level norm gains and an output-head LoRA",
        _screen("norms-head-screen-0.7"),
        ("norms+head",),
        "lambada_vs_baseline",
        ("baseline",),
        ("settings",),
    ),
    Lever(
        "four times the tokens",
        _screen("long-0.7"),
        ("rows", "786k tokens"),
        "lambada_vs_acceptance",
        ("acceptance",),
        ("rows", "786k tokens", "train_tokens"),
    ),
    Lever(
        "four times the tokens",
        _screen("long-0.5"),
        ("rows", "786k tokens"),
        "lambada_vs_acceptance",
        ("acceptance",),
        ("rows", "786k tokens", "train_tokens"),
    ),
    Lever(
        "the LM loss (b) at four times the tokens, against (c) there",
        _screen("long-lm-0.7"),
        ("rows", "(b) LM loss"),
        "lambada_vs_(c) distillation",
        ("rows", "(c) distillation"),
        ("rows", "(b) LM loss", "train_tokens"),
    ),
    Lever(
        "neurons ranked by activation, then (c)",
        _screen("importance-0.5"),
        ("rows", "activation importance"),
        "lambada_vs_acceptance",
        ("acceptance",),
        ("rows", "activation importance", "train_tokens"),
    ),
)


def _lever_tokens(r: Results, lever: Lever) -> int:
    value = r.get(lever.file, *lever.tokens)
    if isinstance(value, dict):  # a screen that records its schedule rather than its token count
        return value["steps"] * value["batch_size"] * value["seq_len"]
    return value


def recovery_levers(r: Results) -> str:
    rows = []
    for lever in LEVERS:
        variant = r.get(lever.file, *lever.variant)
        base = r.get(lever.file, *lever.baseline)
        paired = r.get(lever.file, *lever.variant, lever.ratio)
        rows.append(
            [
                lever.label,
                str(r.get(lever.file, "level")),
                tokens(_lever_tokens(r, lever)),
                num(variant["lambada_ppl"], 1),
                ratio_ci(paired, 3),
                num(variant["repeat4"], 3),
                num(base["repeat4"], 3),
                f"`{Path(lever.file).name}`",
            ]
        )
    return table(
        [
            "lever",
            "level",
            "tokens a level",
            "LAMBADA ppl",
            "÷ its baseline [95%]",
            "repeat-4",
            "baseline's repeat-4",
            "data",
        ],
        rows,
    )


def recovery_long(r: Results) -> str:
    curves = {
        level: r.get(_screen(f"long-{level}"), "rows", "786k tokens", "curve") for level in ("0.7", "0.5")
    }
    full = {level: r.get(_screen(f"long-{level}"), "full_lambada_ppl") for level in curves}
    full_repeat = {level: r.get(_screen(f"long-{level}"), "full_repeat4") for level in curves}
    lm = r.get(_screen("long-lm-0.7"), "rows", "(b) LM loss", "curve")
    rows = []
    for i, point in enumerate(curves["0.7"]):
        row = [tokens(point["tokens"])]
        for level, curve in curves.items():
            p = curve[i]
            row += [
                times(p["lambada_ppl"] / full[level]),
                f"{num(p['repeat4'], 3)} ({times(p['repeat4'] / full_repeat[level], 1)})",
            ]
        row.append(times(lm[i]["lambada_ppl"] / full["0.7"]))
        rows.append(row)
    return table(
        [
            "tokens",
            "0.7 (c): LAMBADA ÷ full",
            "0.7 (c): repeat-4 (÷ full)",
            "0.5 (c): LAMBADA ÷ full",
            "0.5 (c): repeat-4 (÷ full)",
            "0.7 (b) LM loss: LAMBADA ÷ full",
        ],
        rows,
    )


def recovery_decoding(r: Results) -> str:
    settings = list(r.get(DECODING, "settings"))
    rows = []
    for level, entry in r.get(DECODING, "levels").items():
        row = [level]
        for setting in settings:
            rep = entry["report"][setting]
            cell = f"{num(rep['repeat4']['mean'], 3)} / {num(rep['judge_nll']['mean'], 2)}"
            row.append(f"**{cell}**" if setting == entry["chosen"] else cell)
        rows.append(row)
    return table(["level (repeat-4 / judge NLL)"] + settings, rows)


LONG_BUDGET = 10_000_000  # tokens a level nearer what Minitron-style distillation uses
LOSSES = {"distill": "distillation", "lm": "LM loss"}


def recovery_gpu(r: Results) -> str:
    rows = []
    for run in r.get(GPU, "runs"):
        x = run["extrapolated_7b"]
        rows.append(
            [
                LOSSES[run["loss"]],
                f"{run['batch_size']} × {run['seq_len']}",
                num(run["tokens_per_s"], 0),
                num(run["achieved_tflops"], 1),
                num(run["peak_memory_gib"], 1),
                num(x["tokens_per_s"], 0),
                num(x["gpu_hours"], 2),
                num(x["gpu_hours"] * LONG_BUDGET / x["tokens_per_level"], 0),
            ]
        )
    x = r.get(GPU, "runs", 0, "extrapolated_7b")
    return table(
        [
            "loss",
            "batch × seq",
            "tokens/s",
            "TFLOP/s",
            "peak GiB",
            "7B tokens/s",
            f"7B GPU-hours, {x['levels']} levels × {tokens(x['tokens_per_level'])} tokens",
            f"{x['levels']} levels × {LONG_BUDGET // 1_000_000}M tokens",
        ],
        rows,
    )


# --- decision and trace ----------------------------------------------------------------------------

TRACE = "bench/results/trace.json"
SEEDS = "experiments/results/trace-seeds.json"
HEADS = "bench/results/decision_head.json"
HEADS_SCALE = "experiments/results/decision_head_scale_2task.json"
HEADS_PRIOR = "experiments/results/decision_head_prior.json"
HEADROOM = "experiments/results/drift_headroom_replay.json"
LABELLING = "bench/results/labelling.json"
LABEL_SCALE = "bench/results/label_scale.json"
TLM_STEP = "bench/results/tlm_step.json"
EARLIER_TRACES = tuple(f"experiments/results/trace-run{n}.json" for n in range(1, 6)) + (TRACE,)


def trace_policies(r: Results) -> str:
    classes, tasks = r.get(TRACE, "classes"), r.get(TRACE, "class_tasks")
    alpha = r.get(TRACE, "alphas", "0.0")
    rows = []
    for policy, p in alpha["policies"].items():
        served = "violations" in p
        violations = f"{p['violations']} ({p['violations_where_feasible']})" if served else "not served"
        rows.append(
            [policy, accuracy_ci(p["accuracy"])]
            + [num(c[0], 2) for c in p["per_class"]]
            + [f"{violations} / {p['feasible']}"]
        )
    header = ["α = 0", "overall [95%]"] + [
        f"({c[0]:g}, {c[1]:g}) {t}" for c, t in zip(classes, tasks, strict=True)
    ]
    return table(header + ["violations: all (where a cell was feasible) / requests with one"], rows)


def trace_alphas(r: Results) -> str:
    alphas = r.get(TRACE, "alphas")
    rivals = list(alphas["0.0"]["paired_vs"])
    rows = []
    for alpha, a in alphas.items():
        ours = a["policies"]["ours (utility)"]["accuracy"][0]
        rows.append(
            [signed(float(alpha), 2), num(ours, 3)]
            + [points(a["paired_vs"][x]) for x in rivals]
            + [points(a["paired_vs_slo_token"]), num(a["ours_over_oracle"], 2)]
        )
    return table(
        ["α", "ours (utility)"] + [f"− {x}" for x in rivals] + ["− SLO-token head", "ours ÷ oracle"], rows
    )


def trace_seeds(r: Results) -> str:
    tab = r.get(SEEDS, "table")
    runs = [k for k in tab if k != "pooled"]
    seeds = r.get(SEEDS, "seeds")
    rows = []
    for policy, pooled in tab["pooled"].items():
        minus = pooled["minus"]
        rows.append(
            [policy]
            + [num(tab[run][policy]["accuracy"][0], 3) for run in runs]
            + [accuracy_ci(pooled["accuracy"])]
            + [
                points(minus[head]) if head in minus else "—"
                for head in ("ours (utility)", "ours (SLO-token)")
            ]
            + [f"{pooled['violations_where_feasible']} / {pooled['feasible']}"]
        )
    header = ["served policy"] + [f"`{run}` (seed {seed})" for run, seed in zip(runs, seeds, strict=True)]
    return table(
        header
        + [
            "both runs [95%]",
            "ours (utility) − it, points",
            "ours (SLO-token) − it, points",
            "violations where feasible / requests with a cell",
        ],
        rows,
    )


def trace_earlier(r: Results) -> str:
    rows = []
    builds: list[str] = []  # packages named by order of first use: their version carries a build hash
    for file in EARLIER_TRACES:
        a = r.get(file, "alphas", "0.0")
        ours = a["policies"]["ours (utility)"]
        best = a["best_baseline"]
        package = r.get(file, "package")
        if package not in builds:
            builds.append(package)
        rows.append(
            [
                f"`{Path(file).name}`",
                f"demo build {builds.index(package) + 1}",
                str(r.get(file, "seed")),
                accuracy_ci(ours["accuracy"]),
                best,
                points(a["paired_vs_best_baseline"]),
                f"{ours['violations_where_feasible']} / {ours['feasible']}",
                num(a["ours_over_oracle"], 2),
            ]
        )
    return table(
        [
            "run",
            "package",
            "seed",
            "ours (utility) [95%]",
            "best baseline",
            "ours − it, points",
            "violations where feasible / requests with a cell",
            "ours ÷ oracle",
        ],
        rows,
    )


def _heads_table(r: Results, file: str, heads: list[str] | None = None) -> str:
    rows = []
    for head, h in r.get(file, "heads").items():
        if heads is None or head in heads:
            rows.append([head, f"{num(h['accuracy'], 3)} ± {num(h['se'], 3)}"])
    for pair, p in r.get(file, "paired").items():
        rows.append([f"paired: {pair}", f"{signed(p['mean'], 3)} ± {num(p['se'], 3)}"])
    return table(["policy (held-out items × SLO classes)", "accuracy ± SE"], rows)


def decision_heads(r: Results) -> str:
    return _heads_table(r, HEADS)


def decision_heads_scale(r: Results) -> str:
    return _heads_table(r, HEADS_SCALE)


def decision_heads_prior(r: Results) -> str:
    return _heads_table(r, HEADS_PRIOR)


def decision_stage_time(r: Results) -> str:
    full = r.get(HEADS, "decision_stage_seconds")
    short = r.get(HEADS, "decision_stage_seconds_10_steps_interleaved")
    step = r.get(TLM_STEP, "median")
    rows = [[head, num(full[head], 0), num(short[head], 1)] for head in full]
    out = table(["decision head", "stage seconds, demo's steps", "stage seconds, 10 steps interleaved"], rows)
    return (
        out
        + "\n\n"
        + table(
            ["SLO-token head training step", "seconds, median"],
            [[name, num(s, 2)] for name, s in step.items()],
        )
    )


def drift_headroom(r: Results) -> str:
    traces = r.get(HEADROOM, "traces")
    names = list(traces)
    settings = list(traces[names[0]]["all"])
    rows = []
    for setting in settings:
        row = [setting.split("×")[1] + "×"]
        for name in names:
            s = traces[name]["all"][setting]
            row += [f"{s['let_through']} of {s['violations']}", f"{s['met_but_rejected']} of {s['feasible']}"]
        rows.append(row)
    header = ["serving headroom"]
    for name in names:
        header += [f"`{name}`: violations let through", "met but given a cheaper cell"]
    return table(header, rows)


def labelling_paths(r: Results) -> str:
    labels = {
        "rematerialise": "re-materialise the sub-model per grid point (copy of the kept weights + that level's LoRA)",
        "switching": "one loaded model, zero-copy switch, one grid point per call",
        "worker": "the label worker: switch once per (item, level), that level's ratios in one batch",
    }
    rows = []
    for path, p in r.get(LABELLING, "paths").items():
        speed = (
            "1.00×"
            if "speedup_vs_rematerialise" not in p
            else (
                f"{times(p['speedup_vs_rematerialise'])} ± {num(p['speedup_se'])} {span(*p['speedup_ci95'])}"
            )
        )
        rows.append([labels[path], f"{num(p['points_per_s'])} ± {num(p['points_per_s_se'])}", speed])
    return table(["labelling path", "grid points/s ± SE over items", "vs re-materialising [95%]"], rows)


def label_reuse(r: Results) -> str:
    rows = []
    lengths = r.get(LABEL_SCALE, "prompt_lengths")
    for task, t in r.get(LABEL_SCALE, "reuse", "per_task").items():
        n = lengths[task]
        rows.append(
            [
                task,
                str(n["block_tokens"]),
                num(n["median_prompt_tokens"], 0),
                num(n["median_zero_shot_tokens"], 0),
                num(t["whole_s_per_item"], 2),
                num(t["reused_s_per_item"], 2),
                num(t["zero_shot_s_per_item"], 2),
                f"{times(t['speedup'])} ± {num(t['speedup_se'])}",
            ]
        )
    speed, se = r.get(LABEL_SCALE, "reuse", "speedup_all_tasks")
    cost, cost_se = r.get(LABEL_SCALE, "reuse", "few_shot_reused_vs_zero_shot")
    rows.append(
        [
            "all tasks",
            "",
            "",
            "",
            "",
            "",
            f"few-shot ÷ zero-shot {times(cost)} ± {num(cost_se, 3)}",
            f"{times(speed)} ± {num(se)}",
        ]
    )
    return table(
        [
            "task",
            "few-shot block tokens",
            "median prompt tokens",
            "zero-shot",
            "whole prompt, s/item",
            "prefix reused, s/item",
            "zero-shot, s/item",
            "reuse speed-up ± SE",
        ],
        rows,
    )


# --- CLONE -----------------------------------------------------------------------------------------

CLONE = "bench/results/clone.json"


def clone_budgets(r: Results) -> str:
    def stat(s: dict, digits: int = 1) -> str:
        return f"{num(s['mean'], digits)} ± {num(s['se'], digits)}"

    rows = []
    for name, spec in (("fast", 0), ("frugal", 1)):
        b = r.get(CLONE, name)
        t = r.get(CLONE, "header", "settings", "budgets", spec)
        budget = f"{name} ({t['latency']:g}, {t['energy']:g}): {num(b['budget']['latency_ms'], 0)} ms, {num(b['budget']['energy_j'], 2)} J"
        s, rnd, u, ub, c = b["searched"], b["random"], b["uniform"], b["uniform_at_budget"], b["collected"]
        rows += [
            [
                budget,
                "CLONE profile (collected + search)",
                stat(s["selection_ppl"]),
                stat(s["report_ppl"]),
                num(s["latency_ms"]["mean"], 0),
                "—",
            ],
            [
                "",
                "random search, same evaluations",
                stat(rnd["selection_ppl"]),
                stat(rnd["report_ppl"]),
                num(rnd["latency_ms"]["mean"], 0),
                stat(b["searched_over_random"], 3),
            ],
            [
                "",
                "uniform width at CLONE's latency",
                "—",
                stat(u["report_ppl"]),
                num(u["latency_ms"]["mean"], 0),
                stat(b["searched_over_uniform"], 3),
            ],
            [
                "",
                f"uniform width at the budget (keep {num(ub['ratio'], 3)})",
                "—",
                num(ub["report_ppl"], 1),
                num(ub["latency_ms"], 0),
                # one uniform configuration for every seed, so the per-seed ratio's mean and SE scale by it
                f"{num(s['report_ppl']['mean'] / ub['report_ppl'], 3)} ± {num(s['report_ppl']['se'] / ub['report_ppl'], 3)}",
            ],
            [
                "",
                f"best collected record in budget ({c['origin']})",
                num(c["selection_ppl"], 1),
                num(c["report_ppl"], 1),
                num(c["latency_ms"], 0),
                stat(b["searched_over_collected"], 3),
            ],
        ]
    return table(
        [
            "budget (T, E)",
            "configuration",
            "selection ppl (PTB valid)",
            "test ppl (PTB test)",
            "latency ms",
            "CLONE ÷ row, test ppl",
        ],
        rows,
    )


def clone_seeds(r: Results) -> str:
    rows = []
    for run in r.get(CLONE, "runs"):
        row = [str(run["seed"])]
        for name in ("fast", "frugal"):
            b = run["budgets"][name]
            row += [
                num(b["searched"]["report_ppl"], 1),
                num(b["random"]["report_ppl"], 1),
                ratio_ci(b["searched_vs_random_windows"], 3),
            ]
        rows.append(row)
    return table(
        [
            "seed",
            "fast: CLONE test ppl",
            "fast: random",
            "fast: CLONE ÷ random, by window [95%]",
            "frugal: CLONE",
            "frugal: random",
            "frugal: CLONE ÷ random [95%]",
        ],
        rows,
    )


# --- scale -----------------------------------------------------------------------------------------

SCALE = "bench/results/scale.json"
SCALE_SERVICE = "bench/results/scale-service.json"
GIB = 2 ** 30


def stage_rate(row: dict) -> str:
    """Time per unit of a stage's work, as bench_scale measures it."""
    if row.get("decode_step_ms"):
        return f"{num(row['decode_step_ms'], 0)} ms/token"
    if "bytes" in row:
        return f"{num(row['bytes'] / 2 ** 20 / row['seconds'], 0)} MiB/s"
    for unit in ("tokens", "tensors"):
        if row.get(unit):
            return f"{num(row['seconds'] / row[unit] * 1e3, 1)} ms/{unit[:-1]}"
    return "–"


def scale_stages(r: Results) -> str:
    rows = []
    for row in r.get(SCALE, "rows"):
        if "error" in row:
            rows.append([row["shape"], row["weights"], row["stage"], num(row["model_bytes"] / GIB), "failed: "
                         + "; ".join(row["error"]), "", "", "", ""])
            continue
        rows.append([row["shape"], row["weights"], row["stage"], num(row["model_bytes"] / GIB),
                     num(row["peak_rss"] / GIB), times(row["peak_ratio"]), times(row["above_baseline_ratio"]),
                     num(row["seconds"], 1), stage_rate(row)])
    return table(["shape", "weights", "stage", "model GiB", "peak GiB", "peak ÷ model", "(peak − imports) ÷ model",
                  "seconds", "per unit"], rows)


def scale_gpu_hours(r: Results) -> str:
    rows = []
    for estimate in r.get(SCALE, "gpu_hours"):
        by_stage = {stage["stage"]: stage for stage in estimate["stages"]}
        rows.append([estimate["shape"], *(num(by_stage[name]["hours_conservative"]) for name in
                                          ("profile", "recover", "corpus-generate", "tlm-score", "label", "evaluate")),
                     num(estimate["gpu_hours_conservative"]), num(estimate["gpu_hours_best"])])
    return table(["shape", "profile", "recover", "corpus-generate", "tlm-score", "label", "evaluate",
                  "total (GPU-h)", "total at the best measured rate"], rows)


def scale_service(r: Results) -> str:
    rows = [[a["stage"], a["status"], num(a["wall_seconds"] or 0, 1),
             *("–" if a.get(key) is None else num(a[key] / 2 ** 20, 1) for key in
               ("bytes_fetched", "bytes_stored", "bytes_cached"))] for a in r.get(SCALE_SERVICE, "rows")]
    return table(["stage", "status", "wall s", "fetched MiB", "stored MiB", "from the node cache MiB"], rows)


# --- service ---------------------------------------------------------------------------------------

PROBE = "bench/results/probe_service.json"


def probe_cases(r: Results) -> str:
    cases = r.get(PROBE, "cases")
    total, refused = Counter(c["group"] for c in cases), Counter(c["group"] for c in cases if c["refused"])
    rows = [[group, str(n), str(refused[group])] for group, n in total.items()]
    rows.append(["all", str(len(cases)), str(sum(refused.values()))])
    return table(["group of hostile inputs", "cases", "refused as expected"], rows)


def probe_health(r: Results) -> str:
    h = r.get(PROBE, "healthz")
    rows = [
        ["inputs not refused", str(len(r.get(PROBE, "not_refused")))],
        ["requests that hung", str(len(r.get(PROBE, "hangs")))],
        ["`/healthz` polls during the probe (failures)", f"{h['polls']} ({len(h['failures'])})"],
        ["`/healthz` latency, median / max", f"{num(h['p50_ms'], 1)} / {num(h['max_ms'], 1)} ms"],
        [
            "database rows changed, objects added or removed by refused inputs",
            str(
                len(r.get(PROBE, "rows_changed"))
                + len(r.get(PROBE, "objects_added"))
                + len(r.get(PROBE, "objects_removed"))
            ),
        ],
        ["whole probe, seconds", num(r.get(PROBE, "seconds", "total"), 1)],
    ]
    rows += [[f"control: {name}", str(value)] for name, value in r.get(PROBE, "controls").items()]
    return table(["what the probe checks", "result"], rows)


# --- the README's headline table -------------------------------------------------------------------


def headline(r: Results) -> str:
    switch = r.get(DEVICE, "levels", "switch")
    ratios = r.get(DEVICE, "summary", "ratios")
    int8, fp32 = ratios["SDK int8 / llama.cpp Q8_0"]["1 threads"], ratios["SDK fp32 / HF fp32"]["1 threads"]
    by = {(row["level"], row["method"]): row for row in r.get(RECOVERY, "rows")}
    r07, r05 = by[("0.7", "distill")], by[("0.5", "distill-warm")]
    gpu = max(r.get(GPU, "runs"), key=lambda run: run["tokens_per_s"] if run["loss"] == "distill" else 0)
    pooled = r.get(SEEDS, "table", "pooled")
    slo, utility = pooled["ours (SLO-token)"], pooled["ours (utility)"]
    worker = r.get(LABELLING, "paths", "worker")
    fast, frugal = (
        r.get(CLONE, "fast", "searched_over_random"),
        r.get(CLONE, "frugal", "searched_over_random"),
    )
    cases = r.get(PROBE, "cases")
    rows = [
        [
            "elastic core",
            f"switching levels in the device runtime: {num(switch['switch_median_ms'], 3)} ms, "
            f"{num(100 * switch['switch_median_ms'] / switch['ttft_256_ms'], 3)}% of a 256-token prefill (SmolLM2-135M, CPU)",
            "[elastic core](docs/results/elastic-core.md)",
        ],
        [
            "device",
            f"decode tokens/s at 1 thread, SDK int8 ÷ llama.cpp Q8_0: {times(int8['median'])} "
            f"(rounds {num(int8['min'])}–{num(int8['max'])}); SDK fp32 ÷ HF transformers: {times(fp32['median'])} "
            f"(SmolLM2-135M, a shared {r.get(DEVICE, 'config', 'cpu_count')}-core CPU)",
            "[device](docs/results/device.md)",
        ],
        [
            "recovery",
            f"LAMBADA perplexity ÷ the full model's after distillation, {tokens(r.get(RECOVERY, 'tokens_per_level'))} "
            f"tokens a level: level 0.7 {times(r07['lambada_ratio'])} {span(*r07['lambada_interval'])}, level 0.5 "
            f"{times(r05['lambada_ratio'])} {span(*r05['lambada_interval'])}; greedy repeats still {times(r07['repeat4_ratio'], 1)} the full model's at 0.7",
            "[recovery](docs/results/recovery.md)",
        ],
        [
            "recovery on a GPU",
            f"distillation on one {gpu['device']}: {num(gpu['tokens_per_s'], 0)} tokens/s with SmolLM2-135M's "
            "shapes (no larger model measured yet; the page's 7B columns are FLOP extrapolations)",
            "[recovery](docs/results/recovery.md#on-a-gpu)",
        ],
        [
            "decision and trace",
            f"served trace over {len(r.get(SEEDS, 'seeds'))} seeds: accuracy "
            f"{accuracy_ci(slo['accuracy'])} with ElastiLM's SLO-token head (the default), "
            f"{points(utility['minus']['ours (SLO-token)'])} points over the utility head; SLO violations where a "
            f"feasible cell existed: {slo['violations_where_feasible']} of {slo['feasible']} requests",
            "[decision and trace](docs/results/decision-and-trace.md)",
        ],
        [
            "labelling",
            f"grid points labelled per second, the label worker ÷ re-materialising each sub-model: "
            f"{times(worker['speedup_vs_rematerialise'])} {span(*worker['speedup_ci95'])}",
            "[decision and trace](docs/results/decision-and-trace.md#labelling)",
        ],
        [
            "CLONE",
            f"test perplexity, searched profile ÷ a random search with the same evaluations: "
            f"{num(fast['mean'])} ± {num(fast['se'])} (fast), {num(frugal['mean'])} ± {num(frugal['se'])} (frugal), {fast['n']} seeds",
            "[CLONE](docs/results/clone.md)",
        ],
        [
            "service",
            f"{len(cases)} hostile inputs against a live `elastify up`: {sum(c['refused'] for c in cases)} refused, "
            f"{len(r.get(PROBE, 'hangs'))} hangs",
            "[service](docs/results/service.md)",
        ],
    ]
    return table(["area", "headline figure (what, on what)", "page"], rows)


# --- pages -----------------------------------------------------------------------------------------

Render = Callable[[Results], str]


@dataclass(frozen=True)
class Page:
    path: str
    tables: dict[str, Render]
    values: dict[str, Render] = field(default_factory=dict)
    kind: str = "table"  # the README's region is named `results:headline`
    sources_line: bool = True


def _value(file: str, *path: str | int, digits: int = 2, scale: float = 1.0, suffix: str = "") -> Render:
    return lambda r: num(r.get(file, *path) * scale, digits) + suffix


def _int(file: str, *path: str | int) -> Render:
    return lambda r: tokens(r.get(file, *path))


PAGES = (
    Page(
        "docs/results/elastic-core.md",
        {
            "level-shapes": level_shapes,
            "importance": importance,
            "unrecovered": unrecovered,
            "level-switch": level_switch,
        },
        {
            "shapes-windows": _int(SHAPES, "lambada_windows"),
            "shapes-prompts": _int(SHAPES, "prompts"),
            "shapes-tokens": _int(SHAPES, "gen_tokens"),
            "full-lambada": _value(SHAPES, "full_model", "lambada_ppl", digits=1),
            "full-repeat": _value(SHAPES, "full_model", "repeat4", digits=3),
        },
    ),
    Page(
        "docs/results/device.md",
        {
            "decode": device_decode,
            "ratios": device_ratios,
            "levels": device_levels,
            "pull": device_pull,
            "export": export_gguf,
            "quant-quality": quant_quality,
            "quant-versus": quant_versus_llama_cpp,
        },
        {
            "new-tokens": _int(DEVICE, "config", "new_tokens"),
            "rounds": _int(DEVICE, "config", "rounds"),
            "export-tokens": _int(EXPORT, "config", "new_tokens"),
            "export-rounds": _int(EXPORT, "config", "rounds"),
            "quant-windows": _int(QUANT_QUALITY, "windows_total"),
            "quant-length": _int(QUANT_QUALITY, "settings", "window_length"),
        },
    ),
    Page(
        "docs/results/recovery.md",
        {
            "acceptance": recovery_acceptance,
            "versus": recovery_versus,
            "curve": recovery_curve,
            "budgets": recovery_budgets,
            "levers": recovery_levers,
            "long": recovery_long,
            "decoding": recovery_decoding,
            "gpu": recovery_gpu,
        },
        {
            "tokens": _int(RECOVERY, "tokens_per_level"),
            "steps": _int(RECOVERY, "steps"),
            "lr": _value(RECOVERY, "settings", "lr", digits=3),
            "rank": _int(RECOVERY, "settings", "rank"),
            "prompts": _int(RECOVERY, "corpus", "generation", "prompts"),
            "answer-tokens": _int(RECOVERY, "corpus", "generation", "generated_tokens"),
            "lambada-windows": _int(RECOVERY, "eval_windows", "lambada", 0),
            "gen-prompts": _int(RECOVERY, "generation", "prompts"),
            "wall-hours": _value(RECOVERY, "total_wall_s", digits=1, scale=1 / 3600),
            "decoding-prompts": _int(DECODING, "full_greedy_report", "prompts"),
        },
    ),
    Page(
        "docs/results/decision-and-trace.md",
        {
            "policies": trace_policies,
            "alphas": trace_alphas,
            "seeds": trace_seeds,
            "earlier-runs": trace_earlier,
            "heads": decision_heads,
            "heads-scale": decision_heads_scale,
            "heads-prior": decision_heads_prior,
            "decision-time": decision_stage_time,
            "headroom": drift_headroom,
            "labelling": labelling_paths,
            "label-reuse": label_reuse,
        },
        {
            "requests": _int(TRACE, "requests"),
            "held-out": _int(TRACE, "held_out_items"),
            "train-items": _int(TRACE, "train_items_per_task"),
            "steps": _int(TRACE, "decision_steps"),
            "quantile": _value(TRACE, "drift_quantile", digits=1),
            "headroom": _value(TRACE, "drift_headroom", digits=2),
            "trace-hours": _value(TRACE, "seconds", digits=1, scale=1 / 3600),
            "heads-held-out": _int(HEADS, "held_out_items"),
            "label-items": _int(LABELLING, "items"),
        },
    ),
    Page(
        "docs/results/clone.md",
        {"budgets": clone_budgets, "seeds": clone_seeds},
        {
            "full-ms": _value(CLONE, "header", "full", "latency_ms", digits=0),
            "full-j": _value(CLONE, "header", "full", "energy_j", digits=2),
            "full-ppl": _value(CLONE, "full_model_report_ppl", digits=1),
            "collected": _int(CLONE, "collected_records"),
            "report-tokens": _int(CLONE, "report_split", "tokens"),
            "minutes": _value(CLONE, "seconds", digits=0, scale=1 / 60),
        },
    ),
    Page("docs/results/service.md", {"probe": probe_cases, "probe-health": probe_health}),
    Page("README.md", {"headline": headline}, kind="results", sources_line=False),
)

SOURCES = re.compile(r"<!-- sources begin -->.*?<!-- sources end -->", re.S)
VALUE = re.compile(r"<!-- value:([\w-]+) -->.*?<!-- /value -->", re.S)


def _region(kind: str, name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- {kind}:{re.escape(name)} begin -->\n).*?(<!-- {kind}:{re.escape(name)} end -->)", re.S
    )


def render_page(root: Path, page: Page, text: str) -> str:
    """The page's text with every generated region re-rendered from the JSON under `root`."""
    results = Results(root)
    found = set(re.findall(rf"<!-- {page.kind}:([\w-]+) begin -->", text))
    if missing := sorted(set(page.tables) - found):
        raise ReportError(f"{page.path}: no marker for {', '.join(f'{page.kind}:{m}' for m in missing)}")
    if unknown := sorted(found - set(page.tables)):
        raise ReportError(f"{page.path}: no renderer for {', '.join(f'{page.kind}:{u}' for u in unknown)}")
    for name, render in page.tables.items():
        body = render(results)
        text = _region(page.kind, name).sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)

    def value(match: re.Match) -> str:
        name = match.group(1)
        if name not in page.values:
            raise ReportError(f"{page.path}: no renderer for value:{name}")
        return f"<!-- value:{name} -->{page.values[name](results)}<!-- /value -->"

    text = VALUE.sub(value, text)
    if page.sources_line:
        if not SOURCES.search(text):
            raise ReportError(f"{page.path}: no `<!-- sources begin -->…<!-- sources end -->` line")
        files = ", ".join(sorted(results.read))
        line = f"Rendered by `{COMMAND}` from {files}; do not edit the tables by hand."
        text = SOURCES.sub(lambda _: f"<!-- sources begin -->{line}<!-- sources end -->", text)
    return text


def render_all(root: Path = ROOT) -> dict[Path, tuple[str, str]]:
    """Each page's path under `root` → (its committed text, what its JSON renders it to)."""
    out = {}
    for page in PAGES:
        path = root / page.path
        try:
            current = path.read_text()
        except FileNotFoundError:
            raise ReportError(f"{page.path}: no such page") from None
        out[path] = (current, render_page(root, page, current))
    return out


def check(root: Path = ROOT) -> list[str]:
    """A unified diff per page whose committed text differs from its rendering; empty when all agree."""
    diffs = []
    for path, (current, rendered) in render_all(root).items():
        if current != rendered:
            name = str(path.relative_to(root))
            diffs.append(
                "".join(
                    difflib.unified_diff(
                        current.splitlines(keepends=True),
                        rendered.splitlines(keepends=True),
                        fromfile=f"{name} (as written)",
                        tofile=f"{name} (rendered from its JSON)",
                    )
                )
            )
    return diffs


def write(root: Path = ROOT) -> list[Path]:
    """Rewrite the pages whose rendering changed, each atomically; returns those written."""
    written = []
    for path, (current, rendered) in render_all(root).items():
        if current != rendered:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "w") as f:
                f.write(rendered)
            os.replace(tmp, path)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="render in memory; exit 1 with a diff when a page differs"
    )
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the repository root (default: this checkout)"
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            diffs = check(args.root)
            for diff in diffs:
                sys.stdout.write(diff)
            if diffs:
                print(
                    f"\n{len(diffs)} page(s) differ from their JSON; run `{COMMAND}` to re-render them.",
                    file=sys.stderr,
                )
                return 1
            return 0
        for path in write(args.root):
            print(f"rendered {path.relative_to(args.root)}")
        return 0
    except ReportError as error:
        print(f"{COMMAND}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
