"""Stage `clone-collect`: (per-layer keep-ratio vector, score) pairs for the CLONE search.

A vector gives every layer a keep ratio from a small grid of bins (0 skips the layer, 1 keeps it
whole). Vectors come from four heuristics: uniform width (LLM-Pruner style), dropping the least
influential layers (ShortGPT style), widths weighted by layer importance around the anchors, and
random. Each ratio is quantised to widths that exist (whole KV groups, `align`-neuron MLP steps,
as `pipeline.elastilm.elastify.layer_widths` cuts a level) and applied zero-copy through the device SDK's
`ElasticModel.set_widths`, so held-out perplexity is measured on the model a device runs; latency t
and energy e come from the cost model (`pipeline.elastilm.latency.request_cost`); the score of budget (T, E) is

    s = (1/ppl) · (E/e)^(α·1[E<e]) · (T/t)^(β·1[T<t]),  α = β = 2.

The vector list is a pure function of the settings and the seed, so a shard is a slice of it
(`shard`, `shards`): the stage fans out across Ray workers, and each worker loads the model once.

Design: docs/design.md, 'clone-collect'.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from device_sdk.format import Manifest, atomic_write_bytes
from device_sdk.latency import EnergyProfile
from pipeline.data.calibration import make_windows
from pipeline.elastilm.elastify import layer_widths
from pipeline.elastilm.latency import RequestCost, host_constants, request_cost, widths_cost
from pipeline.errors import PipelineError
from pipeline.models.elastic import serving_model
from pipeline.models.scoring import perplexity
from pipeline.settings import CollectSettings, ElastifySettings
from pipeline.stage import StageContext


class CloneError(PipelineError):
    """CLONE settings, budgets or inputs that cannot produce profiles."""


# --------------------------------------------------------------------------- the score


def score(ppl: float, latency_ms: float, energy_j: float, budget_ms: float, budget_j: float,
          alpha: float = 2.0, beta: float = 2.0) -> float:
    """CLONE's ratio score: 1/ppl, shrunk by (E/e)^α when over the energy budget and (T/t)^β when over latency."""
    s = 1.0 / ppl
    if budget_j < energy_j:
        s *= (budget_j / energy_j) ** alpha
    if budget_ms < latency_ms:
        s *= (budget_ms / latency_ms) ** beta
    return s


# --------------------------------------------------------------------------- sampling


def layer_scores(manifest: Manifest) -> list[float]:
    """Layer importance recorded by the profile stage (larger = more important); zeros if absent."""
    scores = manifest.elastic.importance.get("layer_scores")
    layers = manifest.architecture.layers
    return [float(s) for s in scores] if scores and len(scores) == layers else [0.0] * layers


def quantise(ratio: float, bins: list[float]) -> int:
    """Index of the nearest bin (ties go to the larger, never pruning more than asked)."""
    return min(range(len(bins)), key=lambda i: (abs(bins[i] - ratio), -i))


def sample_vectors(manifest: Manifest, settings: CollectSettings) -> list[tuple[str, list[int]]]:
    """All vectors of the build as (strategy, bin index per layer): unique, seeded, the same in every shard."""
    layers, bins = manifest.architecture.layers, settings.ratio_bins
    top = len(bins) - 1
    anchors = set(manifest.elastic.anchor_layers)
    elastic_layers = [i for i in range(layers) if i not in anchors] or list(range(layers))
    scores = layer_scores(manifest)
    by_influence = sorted(elastic_layers, key=lambda i: (scores[i], i))  # least important first
    rank = {layer: k / max(len(by_influence) - 1, 1) - 0.5 for k, layer in enumerate(by_influence)}
    rng = random.Random(settings.seed)

    def with_anchors(ratio_of) -> list[int]:
        return [top if layer in anchors else quantise(ratio_of(layer), bins) for layer in range(layers)]

    def uniform(k: int) -> list[int]:
        pool = [b for b in bins if b > 0]
        ratio = pool[k % len(pool)] if k < len(pool) else rng.uniform(pool[0], 1.0)
        return with_anchors(lambda layer: ratio)

    def layer_drop(k: int) -> list[int]:
        # ShortGPT: skip the least influential layers; past the first sweep the rest also shrink.
        count = k % len(by_influence) + 1 if k < len(by_influence) else rng.randint(1, len(by_influence))
        rest = 1.0 if k < len(by_influence) else rng.uniform(0.3, 1.0)
        dropped = set(by_influence[:count])
        return with_anchors(lambda layer: 0.0 if layer in dropped else rest)

    def anchor_weighted(k: int) -> list[int]:
        base, spread = rng.uniform(0.2, 1.0), rng.uniform(0.0, 1.2)
        return with_anchors(lambda layer: min(1.0, max(0.0, base + spread * rank[layer])))

    def randomly(k: int) -> list[int]:
        vector = [rng.randrange(len(bins)) for _ in range(layers)]
        if rng.random() < 0.5:
            vector = [top if layer in anchors else b for layer, b in enumerate(vector)]
        return vector

    makers = {"uniform": uniform, "layer_drop": layer_drop, "anchor_weighted": anchor_weighted, "random": randomly}
    vectors, seen = [], set()
    per_strategy = math.ceil(settings.samples / len(settings.strategies))
    for strategy in settings.strategies:
        made, attempts = 0, 0
        while made < per_strategy and attempts < 50 * per_strategy:
            vector = makers[strategy](attempts)
            attempts += 1
            if tuple(vector) not in seen:
                seen.add(tuple(vector))
                vectors.append((strategy, vector))
                made += 1
    return vectors[: settings.samples]


def shard_of(vectors: list, shard: int, shards: int, cost=None) -> list:
    """This shard's part of `vectors` ((strategy, bins) pairs), in their order. With `cost` (bins ->
    work), dearest first, each vector goes to the shard with the least work so far, so the shards
    finish together (a 2-worker run waits for its slowest shard); without, every `shards`-th one.
    Every shard computes the same split."""
    if cost is None:
        return vectors[shard::shards]
    work = [cost(bins) for _, bins in vectors]
    loads, owner = [0.0] * shards, [0] * len(vectors)
    for index in sorted(range(len(vectors)), key=lambda i: (-work[i], i)):
        owner[index] = min(range(shards), key=lambda s: (loads[s], s))
        loads[owner[index]] += work[index]
    return [vector for vector, part in zip(vectors, owner, strict=True) if part == shard]


def bins_to_widths(manifest: Manifest, bins_index: list[int], settings: CollectSettings) -> tuple[list[int], list[int]]:
    """Per-layer (KV groups, neurons) of a vector; ratio 0 skips both sub-layers."""
    arch = manifest.architecture
    if len(bins_index) != arch.layers:
        raise CloneError(f"a ratio vector needs one entry per layer ({arch.layers}), got {len(bins_index)}")
    cut = ElastifySettings(align=settings.align)
    attn, mlp = [], []
    for index in bins_index:
        if not 0 <= index < len(settings.ratio_bins):
            raise CloneError(f"bin index {index} is outside 0..{len(settings.ratio_bins) - 1}")
        ratio = settings.ratio_bins[index]
        groups, neurons = (0, 0) if ratio == 0 else layer_widths(arch, ratio, cut)
        attn.append(groups)
        mlp.append(neurons)
    return attn, mlp


# --------------------------------------------------------------------------- evaluating


@dataclass
class CostContext:
    """Everything that prices a vector: host constants, energy coefficients, the request, the budgets."""

    host: dict[str, float]
    energy: EnergyProfile
    full: RequestCost
    floor: RequestCost  # the lightest configuration of the search space
    budgets: dict[str, tuple[float, float]]  # name -> (T ms, E J)


def energy_profile(settings: CollectSettings) -> EnergyProfile:
    """The energy constants to price requests with: the settings' where given, else EnergyProfile's defaults."""
    default = EnergyProfile()
    if settings.joules_per_flop is None and settings.joules_per_byte is None:
        return default
    return EnergyProfile(settings.joules_per_flop or default.joules_per_flop,
                         settings.joules_per_byte or default.joules_per_byte, source="build settings")


def cost_context(manifest: Manifest, settings: CollectSettings, latency_report: dict | None = None,
                 element_size: int = 4) -> CostContext:
    """Resolve the budgets against the full model; refuse any that no configuration can meet."""
    arch = manifest.architecture
    host = host_constants(manifest, latency_report, element_size)
    energy = energy_profile(settings)

    def price(attn, mlp) -> RequestCost:
        cost = widths_cost(manifest, attn, mlp, element_size)
        return request_cost(cost, host, energy, settings.prompt_tokens, settings.decode_tokens)

    full = price([arch.kv_heads] * arch.layers, [arch.intermediate] * arch.layers)
    floor = price(*bins_to_widths(manifest, [0] * arch.layers, settings))
    budgets = {}
    for budget in settings.budgets:
        t, e = budget.resolve(full)
        if t < floor.latency_ms or e < floor.energy_j:
            raise CloneError(
                f"budget {budget.name!r} cannot be met by any configuration: it allows {t:.4g} ms and {e:.4g} J "
                f"per request, the lightest configuration needs {floor.latency_ms:.4g} ms and {floor.energy_j:.4g} J "
                f"(the full model: {full.latency_ms:.4g} ms, {full.energy_j:.4g} J)"
            )
        budgets[budget.name] = (t, e)
    return CostContext(host, energy, full, floor, budgets)


class Collector:
    """One loaded elastic model that measures any ratio vector: perplexity, cost, score per budget."""

    def __init__(self, package_dir: Path, settings: CollectSettings, latency_report: dict | None = None):
        from transformers import AutoTokenizer

        self.settings = settings
        self.package_dir = Path(package_dir)
        self.model = serving_model(self.package_dir)
        self.manifest = self.model.manifest
        element_size = self.model.element_size
        self.costs = cost_context(self.manifest, settings, latency_report, element_size)
        self.element_size = element_size
        tokenizer = AutoTokenizer.from_pretrained(str(self.package_dir / "model"))
        self.windows = make_windows(tokenizer, settings.corpus, settings.windows, settings.window_length, settings.seed)

    def price(self, attn: list[int], mlp: list[int]) -> RequestCost:
        cost = widths_cost(self.manifest, attn, mlp, self.element_size)
        return request_cost(cost, self.costs.host, self.costs.energy, self.settings.prompt_tokens,
                            self.settings.decode_tokens)

    def evaluate(self, bins_index: list[int], origin: str) -> dict:
        attn, mlp = bins_to_widths(self.manifest, bins_index, self.settings)
        self.model.set_widths(attn, mlp)
        ppl = perplexity(self.model, self.windows, self.settings.batch_size)
        cost = self.price(attn, mlp)
        full_params = widths_cost(self.manifest, self.manifest.elastic.attn_units,
                                  self.manifest.elastic.mlp_units).active_params
        return {
            "origin": origin,
            "bins": list(bins_index),
            "ratios": [self.settings.ratio_bins[i] for i in bins_index],
            "attn_units": attn,
            "mlp_units": mlp,
            "active_fraction": widths_cost(self.manifest, attn, mlp).active_params / full_params,
            "ppl": ppl,
            **asdict(cost),
            "scores": self.scores(ppl, cost),
        }

    def scores(self, ppl: float, cost: RequestCost) -> dict[str, float]:
        return {name: score(ppl, cost.latency_ms, cost.energy_j, t, e, self.settings.alpha, self.settings.beta)
                for name, (t, e) in self.costs.budgets.items()}

    def header(self) -> dict:
        return {"settings": self.settings.model_dump(mode="json"), "host": self.costs.host, "energy": asdict(self.costs.energy),
                "full": asdict(self.costs.full), "floor": asdict(self.costs.floor),
                "budgets": {name: {"latency_ms": _finite(t), "energy_j": _finite(e)}
                            for name, (t, e) in self.costs.budgets.items()}}


def _finite(limit: float) -> float | None:
    """JSON (and the signed manifest) has no infinity: an unbounded side is stored as null."""
    return None if math.isinf(limit) else limit


@torch.inference_mode()
def collect(package_dir: Path, settings: CollectSettings, ctx: StageContext, latency_report: dict | None = None) -> dict:
    """Measure this shard's slice of the vectors with one loaded model."""
    collector = Collector(package_dir, settings, latency_report)
    manifest = collector.manifest

    def forward_flops(bins: list[int]) -> float:
        return widths_cost(manifest, *bins_to_widths(manifest, bins, settings)).flops_per_token

    vectors = shard_of(sample_vectors(manifest, settings), settings.shard, settings.shards, forward_flops)
    records = [collector.evaluate(vector, strategy)
               for strategy, vector in ctx.track(vectors, f"clone-collect shard {settings.shard}/{settings.shards}")]
    return {**collector.header(), "records": records}


def read_records(paths: list[Path]) -> tuple[dict, list[dict]]:
    """Merge shard outputs: (the first shard's header, every record); shards must agree on the setup."""
    if not paths:
        raise CloneError("clone-search needs the records of at least one clone-collect shard")
    header, records = None, []
    for path in paths:
        data = json.loads(Path(path).read_text())
        current = {k: v for k, v in data.items() if k != "records"}
        same = {k: v for k, v in current["settings"].items() if k not in ("shard",)}
        if header is None:
            header, reference = current, same
        elif same != reference:
            raise CloneError(f"{path} was collected with other settings than the first shard")
        records += data["records"]
    return header, records


def run(inputs: dict[str, Path], options: CollectSettings, ctx: StageContext) -> dict[str, Path]:
    """Stage entry: inputs {"package", optional "latency"} -> {"records": records.json} for this shard."""
    report = json.loads(Path(inputs["latency"]).read_text()) if "latency" in inputs else None
    result = collect(Path(inputs["package"]), options, ctx, report)
    out = ctx.work_dir / "records.json"
    atomic_write_bytes(out, json.dumps(result, indent=1).encode())
    ctx.logger.info("clone-collect shard %d/%d: %d records", options.shard, options.shards, len(result["records"]))
    return {"records": out}
