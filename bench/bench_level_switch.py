"""Whole-model level switch (views only) against copy-based re-materialisation (goal ≥ 10,000×).

    .venv/bin/python -m bench.bench_level_switch [--repeats 20]

On SmolLM2: `set_level(m)` points every ElasticLinear at its prepared view; the baseline builds the same
level by copying each elastic tensor's active prefix into fresh tensors, which is what a
runtime without unit-major storage must do on every switch. Raw JSON: bench/results/level_switch.json.
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.common import interleaved_medians, print_table, write_results
from pipeline.assets import prepare_smollm2
from pipeline.elastilm.elastify import ElastifySettings, build_elastic
from pipeline.elastilm.profile import Importance
from pipeline.models.elastic import ElasticCausalLM
from pipeline.models.loading import load_model

LEVELS = ["0.3", "0.5", "0.7", "0.9"]
SWITCHES_PER_SAMPLE = 500


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the copies")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(prepare_smollm2())
    arch = loaded.architecture
    # The switch cost does not depend on which units come first, so any order will do.
    scores = Importance(
        attn=[torch.rand(arch.kv_heads) for _ in range(arch.layers)],
        mlp=[torch.rand(arch.intermediate) for _ in range(arch.layers)],
        layers=torch.rand(arch.layers),
        meta={},
    )
    settings = ElastifySettings(levels=[0.3, 0.5, 0.7, 0.9, 1.0])
    tensors, elastic = build_elastic(loaded.model, arch, scores, settings)
    model = ElasticCausalLM(loaded.model, arch, elastic, tensors)

    def rematerialise(level_name: str) -> dict[str, torch.Tensor]:
        level = elastic.level(level_name)
        copies = {}
        for name, spec in elastic.tensors.items():
            units = (level.attn_units if spec.unit == "attn" else level.mlp_units)[spec.layer]
            copies[name] = tensors[name][: units * spec.rows_per_unit].clone()
        return copies

    def switch_back_and_forth(level_name: str) -> None:
        # A switch takes microseconds, so one sample times many to rise above the timer's cost.
        for _ in range(SWITCHES_PER_SAMPLE):
            model.set_level(level_name)
            model.set_level("1.0")

    load_before = os.getloadavg()
    rows, raw = [], []
    for level in LEVELS:
        times = interleaved_medians(
            {"switch": lambda lv=level: switch_back_and_forth(lv), "copy": lambda lv=level: rematerialise(lv)},
            args.repeats,
        )
        switch = times["switch"] / (2 * SWITCHES_PER_SAMPLE)
        rows.append([level, f"{switch * 1e6:.2f}", f"{times['copy'] * 1e3:.1f}", f"{times['copy'] / switch:,.0f}×"])
        raw.append({"level": level, "set_level_s": switch, "copy_s": times["copy"], "speedup": times["copy"] / switch})
    print_table("SmolLM2 level switch: zero-copy views vs copying the level's weights",
                ["level", "set_level µs", "copy ms", "speed-up"], rows)
    write_results("level_switch", args, raw, load_before, switches_per_sample=SWITCHES_PER_SAMPLE)


if __name__ == "__main__":
    main()
