"""Level shapes without recovery (a screen): how a level spends its parameter budget, at equal budget.

A level keeps m of the decoder's elastic parameters; its shape is where they go: how many layers stay
whole (`anchor_fraction`) and whether attention shrinks at all (`attn_rounding`; "whole" keeps every
KV group and makes the MLP alone elastic). Importance is profiled as bench_recovery's package is, once
per distinct set of `profile.` overrides (which units a level keeps: e.g. `profile.mlp_method=activation`
ranks neurons by Minitron's activation criterion), and each shape elastifies it into its own package.
Every shape's levels are read through the device SDK on bench_recovery's LAMBADA windows and its 32
prompts x 64 greedy tokens (sdk_quality), LAMBADA paired by window against the build's default shape,
greedy repeats per prompt with a bootstrap over prompts.
The JSON's `quality` has bench_recovery's reference layout, so a shape's package can be recovered by
`python -m bench.bench_recovery --worker distill --package ...` and assembled by
experiments.recovery_screen against it.

  .venv/bin/python -m experiments.level_shape_screen --out /tmp/shapes \\
      --shape default= --shape "no anchors=anchor_fraction=0" --shape "attention whole=attn_rounding=whole" \\
      --shape "activation=profile.mlp_method=activation"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.bench_recovery import EVERYDAY_PROMPTS, rate_ratio, sdk_quality
from bench.common import command_line, print_table, write_json
from device_sdk.format import read_manifest
from pipeline.data.calibration import make_windows
from pipeline.elastilm.evaluate import repeated_ngram_starts
from pipeline.models.scoring import paired_ratio
from pipeline.stage import StageContext

LEVELS = [0.5, 0.7, 1.0]


# bench_elastilm.build_package's profile: what every shape's importance starts from
BENCH_PROFILE = {"windows": 8, "window_length": 128, "layer_method": "block_influence"}


def split_overrides(overrides: dict) -> tuple[dict, dict]:
    """A shape's overrides -> (ProfileSettings overrides, from `profile.` keys; ElastifySettings overrides)."""
    profile = {key.removeprefix("profile."): value for key, value in overrides.items() if key.startswith("profile.")}
    return profile, {key: value for key, value in overrides.items() if not key.startswith("profile.")}


def parse_shape(spec: str) -> tuple[str, dict]:
    """`NAME=key=value,key=value` (or `NAME=` for the defaults) -> (NAME, overrides): ElastifySettings keys,
    and ProfileSettings keys prefixed `profile.`."""
    from pipeline.settings import ElastifySettings, ProfileSettings

    name, _, rest = spec.partition("=")
    overrides = dict(part.split("=", 1) for part in rest.split(",") if part) if rest else {}
    if not name or any(not key for key in overrides):
        raise SystemExit(f"error: --shape takes NAME=key=value,..., got {spec!r}")
    profile, elastify = split_overrides(overrides)
    ProfileSettings(**BENCH_PROFILE | profile)  # refuse a bad shape before profiling
    ElastifySettings(levels=LEVELS, **elastify)
    return name, overrides


def build_shapes(out: Path, shapes: dict[str, dict]) -> dict[str, Path]:
    """One profile per distinct set of profile overrides, one package per shape."""
    from pipeline.assets import prepare_smollm2
    from pipeline.elastilm.elastify import ElastifySettings, elastify
    from pipeline.elastilm.profile import ProfileSettings, profile
    from pipeline.models.loading import load_model

    loaded = load_model(prepare_smollm2())
    importances = {}
    packages = {}
    for index, (name, overrides) in enumerate(shapes.items()):
        path = out / f"package-{index}"
        profile_overrides, elastify_overrides = split_overrides(overrides)
        if not (path / "manifest.json").is_file():
            key = tuple(sorted(profile_overrides.items()))
            if key not in importances:
                importances[key] = profile(loaded.model, loaded.tokenizer, loaded.architecture,
                                           ProfileSettings(**BENCH_PROFILE | profile_overrides),
                                           StageContext(work_dir=out))
            elastify(loaded.model, loaded.tokenizer, loaded.architecture, importances[key],
                     ElastifySettings(levels=LEVELS, **elastify_overrides), path, name="smollm2-bench",
                     source=loaded.source, overwrite=True)
        packages[name] = path
    return packages


def read_shape(package: Path, args) -> dict:
    """The package's levels (with --full, the full model too) as bench_recovery reads them, with each prompt's output."""
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(package / "model"))
    sets = SimpleNamespace(windows={"lambada": make_windows(tokenizer, "lambada", args.lambada_windows, 128, seed=1)})
    levels = [str(level) for level in LEVELS if level < 1.0 or args.full]
    return sdk_quality(package, levels, sets, args.gen_tokens, set(levels), per_prompt=True)


def per_prompt_counts(outputs: list[list[int]]) -> list[tuple[int, int]]:
    return [(len(repeated_ngram_starts(tokens)), max(len(tokens) - 3, 0)) for tokens in outputs]


def repeat_difference(a: list[tuple[int, int]], b: list[tuple[int, int]], resamples: int = 4000) -> dict:
    """Pooled repeat-4 rate, ours minus theirs from per-prompt (repeats, 4-grams) on the same prompts,
    with a 95% bootstrap over prompts."""

    def rate(counts, picked):
        return sum(counts[i][0] for i in picked) / max(1, sum(counts[i][1] for i in picked))

    everything = range(len(a))
    generator = random.Random(0)
    draws = sorted(rate(a, p) - rate(b, p) for p in
                   ([generator.randrange(len(a)) for _ in everything] for _ in range(resamples)))
    return {"difference": rate(a, everything) - rate(b, everything),
            "low": draws[int(0.025 * (resamples - 1))], "high": draws[round(0.975 * (resamples - 1))]}


def assemble(shapes: dict[str, dict], packages: dict[str, Path], reads: dict[str, dict]) -> dict:
    for read in reads.values():  # per prompt, the counts are all the bootstrap needs
        for row in read.values():
            row["repeat_counts"] = per_prompt_counts(row.pop("outputs"))
    default = next(iter(shapes))
    full = reads[default]["1.0"]
    rows = {}
    for name, read in reads.items():
        manifest = read_manifest(packages[name])
        for level in ("0.7", "0.5"):
            shape = manifest.elastic.level(level)
            row = read[level]
            rows[f"{name} @ {level}"] = {
                "shape": name, "level": level, "elastify": shapes[name],
                "active_fraction": shape.active_fraction,
                "attn_units": shape.attn_units, "mlp_units": shape.mlp_units,
                "lambada_ppl": row["lambada_ppl"],
                "lambada_vs_full": paired_ratio(row["lambada_nlls"], full["lambada_nlls"]),
                "lambada_vs_default": paired_ratio(row["lambada_nlls"], reads[default][level]["lambada_nlls"]),
                "repeat4": row["repeat4"], "repeat4_vs_full": rate_ratio(row["repeat4"], full["repeat4"]),
                "repeat4_minus_default": repeat_difference(row["repeat_counts"],
                                                           reads[default][level]["repeat_counts"]),
                "sample": row["sample"],
            }
    return {"default": default, "full_model": {"lambada_ppl": full["lambada_ppl"], "repeat4": full["repeat4"]},
            "packages": {name: str(path) for name, path in packages.items()}, "rows": rows,
            "quality": {name: read for name, read in reads.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/level-shapes"))
    parser.add_argument("--shape", action="append", default=[],
                        help="NAME=key=value,... ElastifySettings overrides, ProfileSettings ones as profile.key=value; "
                             "the first is the default shape")
    parser.add_argument("--lambada-windows", type=int, default=48)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="read processes side by side, one thread each")
    parser.add_argument("--results", type=Path, help="also write the JSON here (e.g. experiments/results/...)")
    parser.add_argument("--read", type=Path, help=argparse.SUPPRESS)  # internal: one package's read
    parser.add_argument("--read-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--full", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.read:
        return args.read_out.write_text(json.dumps(read_shape(args.read, args)))
    if not args.shape:
        raise SystemExit("error: give at least one --shape (the first is the default shape)")
    shapes = dict(parse_shape(spec) for spec in args.shape)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    packages = build_shapes(args.out, shapes)
    reads, pending = {}, list(packages.items())
    running: dict[str, tuple[subprocess.Popen, Path]] = {}
    while pending or running:
        while pending and len(running) < args.workers:
            name, package = pending.pop(0)
            target = package / "shape-read.json"
            running[name] = (subprocess.Popen(
                [sys.executable, "-m", "experiments.level_shape_screen", "--read", str(package), "--read-out", str(target),
                 f"--lambada-windows={args.lambada_windows}", f"--gen-tokens={args.gen_tokens}",
                 *(["--full"] if name == next(iter(shapes)) else [])],
                env={**os.environ, "OMP_NUM_THREADS": "1"}), target)
        time.sleep(2)
        for name, (proc, target) in list(running.items()):
            if proc.poll() is not None:
                if proc.returncode:
                    raise SystemExit(f"error: reading shape {name!r} failed")
                reads[name] = json.loads(target.read_text())
                del running[name]
    result = {"what": "level shapes (and the importance they keep units by) at equal parameter budget, without recovery",
              "command": command_line(), "levels": LEVELS,
              "prompts": len(EVERYDAY_PROMPTS), "gen_tokens": args.gen_tokens,
              "lambada_windows": args.lambada_windows, "wall_s": round(time.perf_counter() - started, 1),
              **assemble(shapes, packages, {name: reads[name] for name in shapes})}
    for target in [args.out / "shapes.json", *([args.results] if args.results else [])]:
        write_json(target, result)
    print_table("level shapes without recovery (LAMBADA paired by window; repeat-4 bootstrapped over prompts)",
                ["shape @ level", "active", "LAMBADA ppl", "x full", "x default [95%]", "repeat-4",
                 "x full", "- default [95%]"],
                [[name, f"{r['active_fraction']:.3f}", f"{r['lambada_ppl']:.1f}",
                  f"{r['lambada_vs_full']['ratio']:.2f}",
                  "{ratio:.3f} [{low:.3f}, {high:.3f}]".format(**r["lambada_vs_default"]),
                  f"{r['repeat4']:.3f}", f"{r['repeat4_vs_full']:.1f}",
                  "{difference:+.3f} [{low:+.3f}, {high:+.3f}]".format(**r["repeat4_minus_default"])]
                 for name, r in result["rows"].items()])


if __name__ == "__main__":
    main()
