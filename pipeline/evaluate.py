"""Stage `evaluate-light`: perplexity of every level of a package on held-out text.

The report is a separate file; `apply_quality` folds it into a manifest before publishing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from device_sdk.package import atomic_write_bytes, read_manifest, rewrite_manifest
from pipeline.calibration import make_windows
from pipeline.elastic_model import ElasticCausalLM
from pipeline.lm import perplexity
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


def level_perplexities(model: ElasticCausalLM, tokenizer, settings: EvaluateSettings, ctx: StageContext) -> dict:
    windows = make_windows(tokenizer, settings.corpus, settings.windows, settings.window_length, settings.seed)
    names = settings.levels or [level.name for level in model.elastic.levels]
    results = {}
    for name in ctx.track(names, "evaluate levels (perplexity)"):
        model.set_level(name)
        results[name] = perplexity(model, windows, settings.batch_size)
    return results


def evaluate_package(package_dir: Path, settings: EvaluateSettings, ctx: StageContext) -> dict:
    from transformers import AutoTokenizer

    model = ElasticCausalLM.from_package(package_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(Path(package_dir) / "model"))
    key = f"ppl:{'+'.join(settings.corpus)}"
    per_level = level_perplexities(model, tokenizer, settings, ctx)
    return {"metric": key, "windows": settings.windows, "window_length": settings.window_length, "levels": per_level}


def apply_quality(package_dir: Path, report: dict) -> None:
    """Record a report's per-level numbers in the manifest (file table refreshed, atomic)."""
    manifest = read_manifest(package_dir)
    for level in manifest.elastic.levels:
        if level.name in report["levels"]:
            level.quality[report["metric"]] = round(float(report["levels"][level.name]), 4)
    rewrite_manifest(package_dir, manifest)


def run(inputs: dict[str, Path], settings: dict, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"package": dir} -> outputs {"report": report.json}."""
    report = evaluate_package(Path(inputs["package"]), EvaluateSettings(**settings), ctx)
    out = ctx.work_dir / REPORT_FILE
    atomic_write_bytes(out, json.dumps(report, indent=2).encode())
    return {"report": out}
