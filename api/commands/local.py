"""Commands that run pipeline stages in this process: `assets prepare`, and `elastify` (the chain, in-process)."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path

import typer
from rich.table import Table

from api.progress import configure_logging, console, fail, progress_bars
from device_sdk.format import DEFAULT_LEVELS, read_manifest, swap_into_place
from pipeline.chain import STAGES
from pipeline.contract import StageSettings
from pipeline.settings import ElastifySettings, ProfileSettings, ReportCardSettings
from workers.inprocess import ChainError, StageFailed, run_chain

assets_app = typer.Typer(no_args_is_help=True, help="Real models and data that ship as packages.")
log = logging.getLogger("elastify")
EVAL_WINDOW_LENGTH = 256  # tokens per evaluation window, as the command has always measured perplexity


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
    """Profile importance, pick anchors, reorder unit-major and write an elastic package.

    Runs the chain's smallest build (pipeline.chain: profile → elastify → evaluate → publish) in this
    process through workers.inprocess, without a signing key: the package is unsigned. Evaluation is
    the chain's report card at its cheapest, perplexity per level written into the manifest.
    """
    configure_logging()
    try:  # a bad setting is a pydantic ValidationError (a ValueError) naming the field
        settings: dict[str, StageSettings] = {
            "profile": ProfileSettings(calibration=calib, windows=windows, window_length=window_length, seed=seed,
                                       taylor=taylor, layer_method=layer_method),
            "elastify": ElastifySettings(levels=_float_list(levels, "--levels"), anchor_fraction=anchor_fraction,
                                         align=align, order=order, seed=seed, name=name, version=version),
        }
        if eval_windows > 0:
            settings["evaluate"] = ReportCardSettings(
                corpora=eval_corpus, windows=eval_windows, window_length=EVAL_WINDOW_LENGTH, tasks=[],
                generation_prompts=0, measure_latency=False, gate=False,
            )
    except ValueError as err:
        fail(str(err))
    if out.exists() and not overwrite:
        fail(f"{out} already exists (use --overwrite to replace it)")
    enabled = {stage.name: stage.name in settings or stage.name == "publish" for stage in STAGES}
    started = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    # The stages work beside `out` (one filesystem), and the finished package is renamed into place.
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as work:
        try:
            with progress_bars() as on_progress:
                outputs = run_chain(STAGES, enabled=enabled, settings=settings, sources={"model": model},
                                    work_dir=Path(work), on_progress=on_progress, logger=log)
        except StageFailed as err:
            if not isinstance(err.error, ValueError):  # not bad input: a bug or the machine, with its traceback
                raise
            fail(str(err))
        except ChainError as err:
            fail(str(err))
        card = outputs.get("evaluate", {}).get("report_card")
        quality = json.loads(card.read_text())["levels"] if card else {}
        swap_into_place(outputs["publish"]["package"], out)
    _summary(read_manifest(out), quality, time.perf_counter() - started, out)


def _summary(manifest, quality: dict, seconds: float, out: Path) -> None:
    """`quality`: the report card's rows by level ({} when evaluation was skipped)."""
    el = manifest.elastic
    console.print(f"anchor layers: {el.anchor_layers}  (by {el.importance['settings']['layer_method']})")
    corpora = list(dict.fromkeys(key for row in quality.values() for key in row if key.startswith("ppl:")))
    table = Table(title=f"{manifest.name} {manifest.version}: levels")
    for column in ("level", "active params", "active fraction", "attn groups (min..max)", "mlp neurons (min..max)"):
        table.add_column(column, justify="right")
    for key in corpora or ["ppl"]:
        table.add_column("ppl" if len(corpora) <= 1 else key.replace(":", " ", 1), justify="right")
    for level in el.levels:
        row = quality.get(level.name, {})
        table.add_row(
            level.name,
            f"{level.active_params / 1e6:.1f}M",
            f"{level.active_fraction:.3f}",
            f"{min(level.attn_units)}..{max(level.attn_units)}",
            f"{min(level.mlp_units)}..{max(level.mlp_units)}",
            *("-" if row.get(key) is None else f"{row[key]:.2f}" for key in corpora or ["ppl"]),
        )
    console.print(table)
    console.print(f"package written to {out} in {seconds:.1f} s")
