"""Commands that run pipeline stages in this process: `assets prepare` and `elastify`."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import typer
from rich.table import Table

from api.progress import configure_logging, console, fail, progress_bars
from device_sdk.format import DEFAULT_LEVELS

assets_app = typer.Typer(no_args_is_help=True, help="Real models and data that ship as packages.")
log = logging.getLogger("elastify")


@assets_app.command("prepare")
def assets_prepare() -> None:
    """Convert the packaged SmolLM2 GGUF into a cached fp32 safetensors directory (idempotent)."""
    # lazy: torch and the pipeline load only when this command runs (api imports without torch)
    from pipeline.assets import prepare_smollm2

    configure_logging()
    started = time.perf_counter()
    path = prepare_smollm2(progress=log.info)
    console.print(f"SmolLM2-135M ready at {path} ({time.perf_counter() - started:.1f} s)")


def _float_list(text: str, option: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"{option} must be comma-separated numbers, got {text!r}")


def elastify_command(
    model: str = typer.Option(..., "--model", help="HF model directory or .gguf file"),
    out: Path = typer.Option(..., "--out", help="package directory to create"),
    levels: str = typer.Option(",".join(level.name for level in DEFAULT_LEVELS), help="comma-separated, increasing, in (0, 1]"),
    anchor_fraction: float = typer.Option(0.2, help="share of layers kept whole"),
    calib: list[str] = typer.Option(["ptb:train"], help="calibration text: ptb:<split>, lambada, or .txt/.jsonl"),
    windows: int = typer.Option(16, help="calibration windows"),
    window_length: int = typer.Option(128, help="tokens per calibration window"),
    taylor: str = typer.Option("param_first", help="param_first (Σ|w·g|) or vectorize (|Σ w·g|)"),
    layer_method: str = typer.Option("loo", help="loo (leave one layer out) or block_influence"),
    order: str = typer.Option("taylor", help="unit order: taylor, or random (ablation)"),
    align: int = typer.Option(32, help="MLP widths are multiples of this"),
    eval_corpus: list[str] = typer.Option(["ptb:test"], "--eval", help="held-out text for per-level perplexity"),
    eval_windows: int = typer.Option(8, help="evaluation windows (0 skips evaluation)"),
    name: str = typer.Option("model", help="package name"),
    version: str = typer.Option("0.1.0", help="package version"),
    seed: int = typer.Option(0),
    overwrite: bool = typer.Option(False, help="replace an existing package directory"),
) -> None:
    """Profile importance, pick anchors, reorder unit-major and write an elastic package."""
    # lazy: torch and the pipeline load only when this command runs (api imports without torch)
    from pipeline.data.calibration import CalibrationError
    from pipeline.elastilm.elastify import ElastifyError, ElastifySettings, elastify
    from pipeline.elastilm.evaluate import EvaluateSettings, apply_quality, evaluate_package
    from pipeline.elastilm.profile import ProfileSettings, profile
    from pipeline.models.loading import ModelLoadError, load_model
    from pipeline.stage import StageContext

    configure_logging()
    try:  # a bad setting is a pydantic ValidationError (a ValueError) naming the field
        elastic_settings = ElastifySettings(
            levels=_float_list(levels, "--levels"), anchor_fraction=anchor_fraction, align=align, order=order, seed=seed
        )
        profile_settings = ProfileSettings(
            calibration=calib, windows=windows, window_length=window_length, seed=seed, taylor=taylor,
            layer_method=layer_method,
        )
        if out.exists() and not overwrite:
            fail(f"{out} already exists (use --overwrite to replace it)")
        started = time.perf_counter()
        with progress_bars() as on_progress:
            ctx = StageContext(work_dir=out.parent, on_progress=on_progress, logger=log)
            ctx.report("load model", 0, 1)
            loaded = load_model(model)
            ctx.report("load model", 1, 1)
            importance = profile(loaded.model, loaded.tokenizer, loaded.architecture, profile_settings, ctx)
            manifest = elastify(
                loaded.model, loaded.tokenizer, loaded.architecture, importance, elastic_settings, out,
                name=name, version=version, source=loaded.source, ctx=ctx, overwrite=overwrite,
            )
            quality = {}
            if eval_windows > 0:
                report = evaluate_package(out, EvaluateSettings(corpus=eval_corpus, windows=eval_windows), ctx)
                apply_quality(out, report)
                quality = report["levels"]
    except (ModelLoadError, CalibrationError, ElastifyError, ValueError) as err:
        fail(str(err))
    _summary(manifest, quality, time.perf_counter() - started, out)


def _summary(manifest, quality: dict, seconds: float, out: Path) -> None:
    el = manifest.elastic
    console.print(f"anchor layers: {el.anchor_layers}  (by {el.importance['settings']['layer_method']})")
    table = Table(title=f"{manifest.name} {manifest.version}: levels")
    for column in ("level", "active params", "active fraction", "attn groups (min..max)", "mlp neurons (min..max)", "ppl"):
        table.add_column(column, justify="right")
    for level in el.levels:
        ppl = quality.get(level.name)
        table.add_row(
            level.name,
            f"{level.active_params / 1e6:.1f}M",
            f"{level.active_fraction:.3f}",
            f"{min(level.attn_units)}..{max(level.attn_units)}",
            f"{min(level.mlp_units)}..{max(level.mlp_units)}",
            "-" if ppl is None else f"{ppl:.2f}",
        )
    console.print(table)
    console.print(f"package written to {out} in {seconds:.1f} s")

