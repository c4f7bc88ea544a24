"""Stage `latency`: the cost model of every level (docs/design.md, 'latency').

Analytic part, per level, from the units it keeps:
  * `flops_per_token`   = 2 · active parameters (every kept weight is one multiply-add);
  * `attn_flops_per_pair` = 4 · kept query rows summed over layers (QKᵀ and AV per (query, key) pair);
  * `weight_bytes`      = bytes of the kept weights, all read once per decode step;
  * `kv_bytes_per_token` = bytes of the K and V rows a token adds to the cache.
Calibration: prefill and decode of the device SDK's own model (native kernels and decoder where
they build, timed by `device_sdk.measure.measure_points` as a device times itself) are measured
on the build host for the measured levels, and two host constants are fitted by least squares:
  TTFT(n) = ttft_overhead + prefill_flops(n) / flops_per_ms
  TPOT    = tpot_overhead + weight_bytes / bytes_per_ms
The manifest's `latency_profile` is then exactly `device_sdk.latency.LatencyProfile` (per level
`ttft_base_ms`, `ttft_per_token_ms`, `tpot_ms`; TTFT(n) = base + per_token · n), so the SDK reads
the same fields and replaces them with its own measurements. The quadratic attention term is
folded into the per-token slope at `reference_tokens`.

The name is device_sdk.latency's on purpose: this module is the build-host half of the same cost
model (it fits and writes the profile; the SDK reads, re-measures and serves by it).
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from device_sdk.format import LevelShape, Manifest, atomic_write_bytes, read_manifest, rewrite_manifest
from device_sdk.latency import (  # noqa: F401 (EnergyProfile, LevelLatency, feasible: re-exported)
    EnergyProfile,
    LatencyProfile,
    LevelLatency,
    feasible,
    predicted_ttft_ms,
)
from device_sdk.measure import measure_points
from device_sdk.runtime import ElasticModel
from pipeline.elastilm.elastify import active_params
from pipeline.errors import PipelineError
from pipeline.models.elastic import serving_model
from pipeline.settings import LatencySettings
from pipeline.stage import StageContext


class LatencyError(PipelineError):
    """Settings or measurements the cost model cannot use."""


@dataclass
class LevelCost:
    active_params: int
    flops_per_token: float
    attn_flops_per_pair: float
    weight_bytes: float
    kv_bytes_per_token: float

    def prefill_flops(self, tokens: int) -> float:
        # causal attention: token i attends to i keys, Σ i ≈ n² / 2
        return self.flops_per_token * tokens + self.attn_flops_per_pair * tokens * tokens / 2


def level_cost(manifest: Manifest, level: LevelShape, element_size: int = 4) -> LevelCost:
    return widths_cost(manifest, level.attn_units, level.mlp_units, element_size, level.active_params)


def widths_cost(manifest: Manifest, attn_units: list[int], mlp_units: list[int], element_size: int = 4,
                active: int | None = None) -> LevelCost:
    """The cost of any per-layer widths (a level, or a CLONE ratio vector; width 0 skips a sub-layer)."""
    arch = manifest.architecture
    active = active_params(arch, attn_units, mlp_units) if active is None else active
    q_rows = sum(attn_units) * arch.n_rep * arch.head_dim
    kv_rows = sum(attn_units) * arch.head_dim
    return LevelCost(
        active_params=active,
        flops_per_token=2.0 * active,
        attn_flops_per_pair=4.0 * q_rows,
        weight_bytes=float(active * element_size),
        kv_bytes_per_token=float(2 * kv_rows * element_size),
    )


def level_costs(manifest: Manifest, element_size: int = 4) -> dict[str, LevelCost]:
    return {level.name: level_cost(manifest, level, element_size) for level in manifest.elastic.levels}


# --------------------------------------------------------------------------- measuring on the build host


def measure_level_points(model: ElasticModel, prompt_lengths: list[int], decode_tokens: int,
                         repeats: int) -> tuple[dict[int, float], float]:
    """({prompt length: TTFT ms}, TPOT ms) of the SDK model's current level, timed as the device times it.

    The measured points themselves; device_sdk.measure.measure_level fits a LevelLatency line to them."""
    ttfts, tpot = measure_points(model, prompt_lengths, decode_tokens, repeats)
    return dict(zip(prompt_lengths, ttfts, strict=True)), tpot


def measure_host(model, levels: list[str], settings: LatencySettings, ctx: StageContext) -> dict[str, dict]:
    measured = {}
    for name in ctx.track(levels, "latency: measure levels"):
        model.set_level(name)
        ttft, tpot = measure_level_points(model, settings.prompt_lengths, settings.decode_tokens, settings.repeats)
        measured[name] = {"ttft_ms": {str(n): ms for n, ms in ttft.items()}, "tpot_ms": tpot}
    return measured


# --------------------------------------------------------------------------- fitting


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) with both kept non-negative (time never runs backwards)."""
    x, y = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    if len(set(xs)) < 2:
        return 0.0, float((y / x).mean())
    design = torch.stack([torch.ones_like(x), x], 1)
    intercept, slope = torch.linalg.lstsq(design, y[:, None]).solution[:, 0].tolist()
    if slope <= 0:
        return float(y.mean()), 0.0
    if intercept < 0:
        return 0.0, float((x * y).sum() / (x * x).sum())
    return intercept, slope


def fit_host(costs: dict[str, LevelCost], measured: dict[str, dict]) -> dict[str, float]:
    """Host constants: TTFT overhead and ms per FLOP; TPOT overhead and ms per weight byte."""
    flops, ttfts, weight_bytes, tpots = [], [], [], []
    for name, point in measured.items():
        for length, ms in point["ttft_ms"].items():
            flops.append(costs[name].prefill_flops(int(length)))
            ttfts.append(ms)
        weight_bytes.append(costs[name].weight_bytes)
        tpots.append(point["tpot_ms"])
    ttft_overhead, ms_per_flop = _fit_line(flops, ttfts)
    tpot_overhead, ms_per_byte = _fit_line(weight_bytes, tpots)
    return {"ttft_overhead_ms": ttft_overhead, "ms_per_flop": ms_per_flop,
            "tpot_overhead_ms": tpot_overhead, "ms_per_byte": ms_per_byte}


def predicted_profile(costs: dict[str, LevelCost], host: dict[str, float], reference_tokens: int,
                      weight_format: str = "fp32", threads: int | None = None, estimated: bool = False) -> LatencyProfile:
    levels = {}
    for name, cost in costs.items():
        per_token_flops = cost.flops_per_token + cost.attn_flops_per_pair * reference_tokens / 2
        levels[name] = LevelLatency(
            ttft_base_ms=host["ttft_overhead_ms"],
            ttft_per_token_ms=per_token_flops * host["ms_per_flop"],
            tpot_ms=host["tpot_overhead_ms"] + cost.weight_bytes * host["ms_per_byte"],
        )
    return LatencyProfile(weight_format, threads or torch.get_num_threads(), levels,
                          device=f"build-host:{platform.machine()}", estimated=estimated)


def latency_profile_dict(profile: LatencyProfile) -> dict:
    """The manifest's `latency_profile`: `LatencyProfile`'s fields, nothing else (the SDK loads it as is)."""
    return profile.to_dict()


def profile_from_dict(data: dict) -> LatencyProfile:
    data = dict(data)
    data["levels"] = {name: LevelLatency(**entry) for name, entry in data["levels"].items()}
    return LatencyProfile(**data)


def profile_from_manifest(manifest: Manifest) -> LatencyProfile:
    if not manifest.latency_profile:
        raise LatencyError("the package has no latency_profile; run the latency stage first")
    return profile_from_dict(manifest.latency_profile)


# --------------------------------------------------------------------------- one request at any widths (CLONE)

# Host constants when neither a latency report nor the manifest's profile is at hand: ~20 GFLOP/s
# of fp32 matmul and ~10 GB/s of weight streaming, what one core of the 2-core build host reaches.
DEFAULT_HOST = {"ttft_overhead_ms": 0.0, "ms_per_flop": 5e-8, "tpot_overhead_ms": 0.0, "ms_per_byte": 1e-7}


@dataclass
class RequestCost:
    ttft_ms: float
    tpot_ms: float
    latency_ms: float  # TTFT + decode_tokens · TPOT
    energy_j: float


def host_constants(manifest: Manifest, report: dict | None = None, element_size: int = 4) -> dict[str, float]:
    """The latency stage's fitted constants: from its report, else refitted from the manifest's
    per-level profile (two prompt lengths per level), else `DEFAULT_HOST`."""
    if report is not None:
        return dict(report["host"])
    if not manifest.latency_profile:
        return dict(DEFAULT_HOST)
    profile = profile_from_manifest(manifest)
    costs = {name: cost for name, cost in level_costs(manifest, element_size).items() if name in profile.levels}
    measured = {name: {"ttft_ms": {str(n): profile.ttft_ms(name, n) for n in (32, 256)},
                       "tpot_ms": profile.tpot_ms(name)} for name in costs}
    return fit_host(costs, measured)


def request_cost(cost: LevelCost, host: dict[str, float], energy: EnergyProfile, prompt_tokens: int,
                 decode_tokens: int) -> RequestCost:
    """Predicted latency and energy of one request: prefill `prompt_tokens`, then decode `decode_tokens`.

    Energy counts every FLOP of prefill and decode, and the weights (plus the KV cache read so
    far) streamed from memory once for the prefill and once per decoded token.
    """
    ttft = host["ttft_overhead_ms"] + cost.prefill_flops(prompt_tokens) * host["ms_per_flop"]
    tpot = host["tpot_overhead_ms"] + cost.weight_bytes * host["ms_per_byte"]
    context = prompt_tokens + decode_tokens / 2  # mean cache length during decode
    decode_flops = decode_tokens * (cost.flops_per_token + cost.attn_flops_per_pair * context)
    moved = cost.weight_bytes * (1 + decode_tokens) + cost.kv_bytes_per_token * context * decode_tokens
    joules = energy.joules(cost.prefill_flops(prompt_tokens) + decode_flops, moved)
    return RequestCost(ttft, tpot, ttft + decode_tokens * tpot, joules)


# --------------------------------------------------------------------------- feasibility (used by label, bench)


def cost_rank(profile: LatencyProfile, level: str, prompt_ratio: float, prompt_tokens: int,
              kept_tokens: int = 0) -> float:
    """A scalar for 'lighter': predicted TTFT (the kept end served whole) plus one TPOT."""
    return predicted_ttft_ms(profile, level, prompt_ratio, prompt_tokens, kept_tokens) + profile.tpot_ms(level)


# --------------------------------------------------------------------------- the stage


def build_cost_model(package_dir: Path, settings: LatencySettings, ctx: StageContext) -> dict:
    """Costs per level, and the host constants fitted to the device SDK's own model timed on this host."""
    model = serving_model(package_dir)
    manifest = model.manifest
    element_size = model.element_size
    costs = level_costs(manifest, element_size)
    names = settings.measure_levels or list(costs)
    previous_threads = torch.get_num_threads()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        measured = measure_host(model, names, settings, ctx)
    finally:
        torch.set_num_threads(previous_threads)
    host = fit_host(costs, measured)
    profile = predicted_profile(costs, host, settings.reference_tokens, model.weight_format, settings.threads,
                                estimated=set(names) != set(costs))
    return {"costs": {k: asdict(v) for k, v in costs.items()}, "measured": measured, "host": host,
            "latency_profile": latency_profile_dict(profile)}


def apply_latency(package_dir: Path, report: dict) -> None:
    manifest = read_manifest(package_dir)
    manifest.latency_profile = report["latency_profile"]
    rewrite_manifest(package_dir, manifest)


def run(inputs: dict[str, Path], settings: LatencySettings, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"package": dir} -> {"latency": latency.json}; `apply_latency` puts it in a manifest."""
    report = build_cost_model(Path(inputs["package"]), settings, ctx)
    out = ctx.work_dir / "latency.json"
    atomic_write_bytes(out, json.dumps(report, indent=2).encode())
    return {"latency": out}
