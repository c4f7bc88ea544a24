"""Stages `evaluate-light` (perplexity per level) and `evaluate` (the report card and publish gate).

Both evaluate the device SDK's own model (`pipeline.elastic_model.serving_model`), so the report
card's numbers are what a device computes. The report is a separate file; `apply_quality` folds
it into a manifest before publishing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from device_sdk.format import Level, atomic_write_bytes, read_manifest, rewrite_manifest
from device_sdk.runtime import ElasticModel
from pipeline.calibration import make_windows
from pipeline.elastic_model import serving_model
from pipeline.lm import perplexity
from pipeline.settings import ReportCardSettings
from pipeline.stage import StageContext

REPORT_FILE = "report.json"


@dataclass
class EvaluateSettings:
    corpus: list[str] = field(default_factory=lambda: ["ptb:test"])
    windows: int = 16
    window_length: int = 256
    seed: int = 1
    batch_size: int = 4
    levels: list[str] | None = None  # None: every level of the package


def level_perplexities(model: ElasticModel, tokenizer, settings: EvaluateSettings, ctx: StageContext) -> dict:
    """Perplexity per level, each with its recovery LoRA when the package has one (as a device runs it)."""
    windows = make_windows(tokenizer, settings.corpus, settings.windows, settings.window_length, settings.seed)
    names = settings.levels or [level.name for level in model.manifest.elastic.levels]
    results = {}
    for name in ctx.track(names, "evaluate levels (perplexity)"):
        model.set_level(name)
        results[name] = perplexity(model, windows, settings.batch_size)
    return results


def evaluate_package(package_dir: Path, settings: EvaluateSettings, ctx: StageContext) -> dict:
    from transformers import AutoTokenizer

    model = serving_model(package_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(Path(package_dir) / "model"))
    key = f"ppl:{'+'.join(settings.corpus)}"
    per_level = level_perplexities(model, tokenizer, settings, ctx)
    return {"metric": key, "windows": settings.windows, "window_length": settings.window_length, "levels": per_level}


def apply_quality(package_dir: Path, report: dict) -> None:
    """Record a report's per-level quality in the manifest (file table refreshed, atomic).

    Takes either report: `evaluate-light`'s {metric, levels: {name: ppl}} or the report card's
    {levels: {name: {"ppl:<corpus>": …, "accuracy": …, …}}} (its perplexities and accuracy).
    """
    manifest = read_manifest(package_dir)
    for level in manifest.elastic.levels:
        row = report["levels"].get(level.name)
        if row is None:
            continue
        if not isinstance(row, dict):
            row = {report["metric"]: row}
        for key, value in row.items():
            if key.startswith("ppl:") or key == "accuracy":
                level.quality[key] = round(float(value), 4)
    rewrite_manifest(package_dir, manifest)


def run(inputs: dict[str, Path], settings: dict, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"package": dir} -> outputs {"report": report.json}."""
    report = evaluate_package(Path(inputs["package"]), EvaluateSettings(**settings), ctx)
    out = ctx.work_dir / REPORT_FILE
    atomic_write_bytes(out, json.dumps(report, indent=2).encode())
    return {"report": out}


# --------------------------------------------------------------------------- stage `evaluate`: the report card and the gate


class PublishGateError(ValueError):
    """A level's quality beats a wider level's by more than the noise band: do not publish.

    A ValueError so that workers treat it as permanent: the same inputs fail the same way.
    """


def report_card(package_dir: Path, settings: ReportCardSettings, ctx: StageContext, profile=None) -> dict:
    """Per level (with its recovery LoRA): perplexity per corpus, held-out accuracy, predicted and measured latency.

    `profile` is the cost model to predict latency with; by default the package's own, if it has one.
    """
    from transformers import AutoTokenizer

    from pipeline.label import answer_correct, load_items
    from pipeline.latency import measure_level, profile_from_manifest

    package_dir = Path(package_dir)
    model = serving_model(package_dir)
    manifest = model.manifest
    tokenizer = AutoTokenizer.from_pretrained(str(package_dir / "model"))
    windows = {c: make_windows(tokenizer, c, settings.windows, settings.window_length, settings.seed)
               for c in settings.corpora}
    items = [it for task in settings.tasks for it in load_items([task], settings.items_start,
                                                                 settings.items_start + settings.items)]
    if profile is None and manifest.latency_profile:
        profile = profile_from_manifest(manifest)
    levels = {}
    for level in ctx.track(manifest.elastic.levels, "evaluate: report card"):
        model.set_level(level.name)  # widths and the level's LoRA
        row: dict = {"active_fraction": level.active_fraction, "adapted": level.adapter is not None}
        for corpus, corpus_windows in windows.items():
            row[f"ppl:{corpus}"] = perplexity(model, corpus_windows)
        if items:
            row["accuracy"] = sum(answer_correct(model, tokenizer, it) for it in items) / len(items)
        if profile is not None and level.name in profile.levels:
            row["predicted_ttft_ms"] = profile.ttft_ms(level.name, settings.prompt_tokens)
            row["predicted_tpot_ms"] = profile.tpot_ms(level.name)
        if settings.measure_latency:
            ttft, tpot = measure_level(model, [settings.prompt_tokens], decode_tokens=4, repeats=1)
            row["measured_ttft_ms"], row["measured_tpot_ms"] = ttft[settings.prompt_tokens], tpot
        levels[level.name] = row
    return {"levels": levels, "items": len(items), "tasks": settings.tasks, "corpora": settings.corpora,
            "prompt_tokens": settings.prompt_tokens}


def gate_failures(card: dict, ppl_noise: float, accuracy_noise: float | None) -> list[str]:
    """Every (narrow, wide) level pair where the narrower one is better by more than the noise band.

    Levels are compared like with like: with a recovery adapter or without. A narrow level whose
    LoRA was trained on the evaluation's domain (PTB train for PTB test, by default) may well beat
    the unadapted full model; that says nothing about the level order.
    """
    names = sorted(card["levels"], key=Level)
    failures = []
    for i, narrow in enumerate(names):
        for wide in names[i + 1:]:
            a, b = card["levels"][narrow], card["levels"][wide]
            if a.get("adapted", False) != b.get("adapted", False):
                continue
            for key in (k for k in a if k.startswith("ppl:") and k in b):
                if a[key] < b[key] * (1 - ppl_noise):
                    failures.append(f"level {narrow} has {key} {a[key]:.3f}, better than wider level {wide}'s "
                                    f"{b[key]:.3f} by more than the {ppl_noise:.0%} noise band")
            if "accuracy" in a and "accuracy" in b:
                band = accuracy_noise
                if band is None:
                    p, n = b["accuracy"], max(card.get("items", 1), 1)
                    band = 2 * math.sqrt(max(p * (1 - p), 1.0 / n) / n)
                if a["accuracy"] > b["accuracy"] + band:
                    failures.append(f"level {narrow} answers {a['accuracy']:.3f} of held-out items, more than wider "
                                    f"level {wide}'s {b['accuracy']:.3f} plus the noise band {band:.3f}")
    return failures


def check_gate(card: dict, ppl_noise: float = 0.02, accuracy_noise: float | None = None) -> None:
    failures = gate_failures(card, ppl_noise, accuracy_noise)
    if failures:
        raise PublishGateError("publish gate failed: quality rises as width falls, so the level order or a "
                               "level's adapter is wrong:\n  " + "\n  ".join(failures))


def run_card(inputs: dict[str, Path], options: ReportCardSettings, ctx: StageContext) -> dict[str, Path]:
    """Stage `evaluate`: inputs {"package", optional "latency"} -> {"report_card": json}.

    Raises PublishGateError when the gate fails. The card is written before the gate is
    checked, so a failed build still shows its numbers.
    """
    from pipeline.latency import profile_from_dict

    profile = None
    if "latency" in inputs:
        profile = profile_from_dict(json.loads(Path(inputs["latency"]).read_text())["latency_profile"])
    card = report_card(Path(inputs["package"]), options, ctx, profile)
    card["gate"] = gate_failures(card, options.ppl_noise, options.accuracy_noise)
    out = ctx.work_dir / "report_card.json"
    atomic_write_bytes(out, json.dumps(card, indent=2).encode())
    if options.gate:
        check_gate(card, options.ppl_noise, options.accuracy_noise)
    return {"report_card": out}
