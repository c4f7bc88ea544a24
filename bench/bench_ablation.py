"""Quality of the elastic sub-models on SmolLM2: Taylor order + anchors against the ablations.

    .venv/bin/python -m bench.bench_ablation [--eval-windows 16] [--levels 0.3,0.5,0.7,0.9,1.0]

Every configuration shares one importance profile (PTB train) and is scored by perplexity
on held-out PTB test windows, without LoRA recovery. Level m targets m of the elastic
parameters in every configuration, so rows compare equal budgets. Raw JSON: bench/results/ablation.json.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

from bench.common import print_table, write_results
from device_sdk.format import parse_levels
from pipeline.assets import prepare_smollm2
from pipeline.data.calibration import make_windows
from pipeline.elastilm.elastify import ElastifySettings, build_elastic
from pipeline.elastilm.profile import ProfileSettings, profile
from pipeline.models.elastic import ElasticCausalLM
from pipeline.models.loading import load_model
from pipeline.models.scoring import perplexity
from pipeline.stage import StageContext


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default="0.3,0.5,0.7,0.9,1.0")
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--eval-length", type=int, default=256)
    args = parser.parse_args()
    load_before = os.getloadavg()
    levels = [level.ratio for level in parse_levels(args.levels.split(","))]
    loaded = load_model(prepare_smollm2())
    arch = loaded.architecture
    started = time.perf_counter()
    importance = profile(loaded.model, loaded.tokenizer, arch, ProfileSettings(), StageContext(work_dir="."))
    profile_seconds = time.perf_counter() - started
    configs = {
        "taylor + anchors (ours)": ElastifySettings(levels=levels),
        "random order + anchors": ElastifySettings(levels=levels, order="random"),
        "taylor, no anchors": ElastifySettings(levels=levels, anchor_fraction=0.0),
    }
    windows = make_windows(loaded.tokenizer, "ptb:test", args.eval_windows, args.eval_length, seed=1)
    table: dict[str, dict[str, float]] = {}
    fractions = {}
    names = list(configs)
    anchors: list[int] = []
    for name, settings in configs.items():
        tensors, elastic = build_elastic(loaded.model, arch, importance, settings)
        anchors = anchors if name != names[0] else elastic.anchor_layers
        model = ElasticCausalLM(copy.deepcopy(loaded.model), arch, elastic, tensors)
        table[name] = {}
        for level in elastic.levels:
            model.set_level(level.name)
            table[name][level.name] = perplexity(model, windows)
            fractions.setdefault(name, {})[level.name] = level.active_fraction
        del model
    rows = []
    for level in table[names[0]]:
        rows.append([level, f"{fractions[names[0]][level]:.3f}"] + [f"{table[n][level]:.1f}" for n in names])
    print_table(
        f"SmolLM2 PTB-test perplexity by level ({args.eval_windows}×{args.eval_length} tokens; no LoRA; "
        f"profile {profile_seconds:.0f} s; anchors {anchors})",
        ["level", "active fraction (ours)", *names],
        rows,
    )
    write_results("ablation", args, [
        {"config": name, "level": level, "active_fraction": fractions[name][level], "perplexity": table[name][level]}
        for name in names for level in table[name]
    ], load_before, profile_seconds=profile_seconds, anchor_layers=anchors)


if __name__ == "__main__":
    main()
