"""ElasticLinear at width w against a dense nn.Linear of the reduced shape (goal ≤ 1.03×).

    .venv/bin/python -m bench.bench_elastic_linear [--repeats 30] [--threads 1]

Shapes: SmolLM2's projections (q/k row units, o/down column units, gate row units) and a
4096×11008 MLP pair. Prefill is 256 tokens, decode 1 token. The dense baseline holds a
contiguous copy of exactly the active weights, i.e. what a re-materialised sub-model runs.
Raw JSON: bench/results/elastic_linear.json.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

from bench.common import interleaved_medians, print_table, write_results
from device_sdk.elastic import ElasticLinear

# name, unit axis, stored rows (units × unit size), other dim, unit size
SHAPES = [
    ("smollm2 q_proj", "out", 576, 576, 192),
    ("smollm2 k_proj", "out", 192, 576, 64),
    ("smollm2 o_proj", "in", 576, 576, 192),
    ("smollm2 gate_proj", "out", 1536, 576, 1),
    ("smollm2 down_proj", "in", 1536, 576, 1),
    ("4096x11008 up", "out", 11008, 4096, 1),
    ("4096x11008 down", "in", 11008, 4096, 1),
]
WIDTHS = (0.5, 0.75)


def cases_for(axis: str, rows: int, other: int, unit: int, fraction: float, tokens: int):
    storage = torch.randn(rows, other)
    elastic = ElasticLinear(storage, unit_axis=axis, unit_size=unit)
    units = max(1, round(fraction * rows / unit))
    elastic.set_width(units)
    active = units * unit
    if axis == "out":
        dense = nn.Linear(other, active, bias=False)
        dense.weight.data = storage[:active].clone()
        x = torch.randn(1, tokens, other)
    else:
        dense = nn.Linear(active, other, bias=False)
        dense.weight.data = storage[:active].t().contiguous()
        x = torch.randn(1, tokens, active)
    torch.testing.assert_close(elastic(x), dense(x), rtol=1e-4, atol=1e-3)
    return {"elastic": lambda: elastic(x), "dense": lambda: dense(x)}


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 1 keeps a shared machine's noise out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows, raw = [], []
    for name, axis, stored, other, unit in SHAPES:
        for fraction in WIDTHS:
            for phase, tokens in (("prefill 256", 256), ("decode 1", 1)):
                repeats = args.repeats if tokens == 1 or stored < 4096 else max(5, args.repeats // 5)
                times = interleaved_medians(cases_for(axis, stored, other, unit, fraction, tokens), repeats)
                rows.append([name, f"{fraction:.2f}", phase, f"{times['dense'] * 1e6:.0f}",
                             f"{times['elastic'] * 1e6:.0f}", f"{times['elastic'] / times['dense']:.3f}"])
                raw.append({"shape": name, "width": fraction, "phase": phase, "repeats": repeats,
                            "dense_s": times["dense"], "elastic_s": times["elastic"],
                            "elastic_over_dense": times["elastic"] / times["dense"]})
    print_table(
        f"ElasticLinear vs dense nn.Linear of the reduced shape (torch threads: {torch.get_num_threads()})",
        ["shape", "width", "phase", "dense µs", "elastic µs", "elastic / dense"],
        rows,
    )
    write_results("elastic_linear", args, raw, load_before, torch_threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
