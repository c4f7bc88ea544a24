"""The build DAGs as data: the ElastiLM chain and the CLONE stages, one `Stage` each.

The default build is the whole ElastiLM chain:

    profile → elastify → corpus-generate × shards → corpus → recover × levels → recover-install
            → latency → tlm-score → label × shards → label-derive → tlm-decision → evaluate → publish

Recovery distils each level from the full model on the recovery corpus, top-down: level m starts
from a larger level's LoRA (`warm_start`, a sibling shard's output): the next larger one by default, or
the top level's with `schedule: shared-top`, so that the other levels train at the same time (see
`_recover_shards`).

Any stage in `ELASTILM_STAGES` can be switched off in the spec (`stages.<name>.enabled: false`,
with the stages that need it); the chain then falls back to its other inputs, down to
profile → elastify → evaluate → publish. The CLONE stages are off by default.

This module stays torch-free (see pipeline.contract): each `run_*` below imports its algorithm
module when a worker calls it.
"""

from __future__ import annotations

from pathlib import Path

from device_sdk.format import Level
from pipeline.contract import Resources, Shard, Stage, StageSettings
from pipeline.settings import (
    CollectSettings,
    CorpusSettings,
    DecisionSettings,
    DeriveSettings,
    ElastifySettings,
    ExpertSettings,
    ExportSettings,
    LabelSettings,
    LatencySettings,
    ProfileSettings,
    RecoverSettings,
    ReportCardSettings,
    ScoreSettings,
    SearchSettings,
)
from pipeline.stage import StageContext

# The model-sized stages want both cores of a small machine (Ray sets OMP threads from num_cpus).
MODEL_STAGE = Resources(num_cpus=2)
# A fanned-out shard takes one core, so that two shards run side by side on one 2-core worker.
SHARD = Resources(num_cpus=1)
# The stages that place the LLM on `ctx.device` ask for one GPU where the build's accelerator gives one
# (cluster.accelerator): profile, elastify, recover, tlm-score. The others stay on CPUs on purpose:
# latency measures the device's own latency, and label, evaluate, corpus-generate and the CLONE
# stages run the device SDK's model, which computes on the CPU.
GPU_STAGE = Resources(num_cpus=2, accelerated=True)
GPU_SHARD = Resources(num_cpus=1, accelerated=True)
DEFAULT_SHARDS = 2  # label and clone-collect tasks, unless the spec sets `shards`

ELASTILM_STAGES = ("corpus-generate", "corpus", "recover", "recover-install", "latency", "tlm-score", "label",
                   "label-derive", "tlm-decision")
# The package the later stages read: with recovery adapters when recovery ran.
PACKAGE = ("recover-install.package", "elastify.package")

Inputs = dict[str, Path]


# --------------------------------------------------------------------------- what the spec supplies, fan-out


def _profile_from_spec(spec) -> dict:
    return {"calibration": list(spec.calibration)}


def _elastify_from_spec(spec) -> dict:
    return {"levels": list(spec.levels), "name": spec.publish.name, "version": spec.publish.version}


def _export_from_spec(spec) -> dict:
    return {"package_levels": list(spec.levels)}


def _default_shards(spec) -> dict:
    return {"shards": DEFAULT_SHARDS}


def _recover_shards(spec, settings: RecoverSettings) -> list[Shard]:
    """One LoRA per level below full width (the full model needs no recovery), in the order of `schedule`.

    "chain": the levels recover top-down, largest first; each level's task reads the next larger level's
    adapter (a sibling shard's output) and starts from its prefix slices: a line, as deep as there are levels.
    "shared-top": the largest level below 1.0 starts cold and every other level starts from its adapter,
    so after the first level all the others run at the same time (depth 2). "independent": no warm start;
    every level starts cold and all run side by side (depth 1).
    """
    levels = sorted((level for level in map(Level, spec.levels) if level.ratio < 1.0),
                    key=lambda level: level.ratio, reverse=True)
    if settings.schedule == "independent":
        return [Shard(level.name, {"level": level.name}) for level in reversed(levels)]
    if settings.schedule == "shared-top":
        return [Shard(level.name, {"level": level.name},
                      {"init_adapter": (levels[0].name, "adapter")} if k else {})
                for k, level in enumerate(levels)]
    return [Shard(level.name, {"level": level.name},
                  {"init_adapter": (levels[k - 1].name, "adapter")} if k else {})
            for k, level in enumerate(levels)]


def _count_shards(spec, settings: LabelSettings | CollectSettings | CorpusSettings) -> list[Shard]:
    """label, clone-collect, corpus-generate: shard k of n works on every n-th item (vector, prompt) of the same seeded list."""
    return [Shard(str(k), {"shard": k, "shards": settings.shards}) for k in range(settings.shards)]


# --------------------------------------------------------------------------- runs (imported on the worker)


def run_profile(inputs: Inputs, settings: ProfileSettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import profile  # lazy: keeps chain importable without torch

    return profile.run(inputs, settings, ctx)


def run_elastify(inputs: Inputs, settings: ElastifySettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import elastify  # lazy: keeps chain importable without torch

    return elastify.run(inputs, settings, ctx)


def run_recover(inputs: Inputs, settings: RecoverSettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import recover, recover_distributed  # lazy: keeps chain importable without torch

    # workers > 1: the level trains on that many data-parallel Ray Train workers
    return (recover_distributed.run if settings.workers > 1 else recover.run)(inputs, settings, ctx)


def run_recover_install(inputs: Inputs, settings: StageSettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import recover  # lazy: keeps chain importable without torch

    return recover.run_install(inputs, settings, ctx)


def run_latency(inputs: Inputs, settings: LatencySettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import latency  # lazy: keeps chain importable without torch

    return latency.run(inputs, settings, ctx)


def run_tlm_score(inputs: Inputs, settings: ScoreSettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import tlm  # lazy: keeps chain importable without torch

    return tlm.run_score(inputs, settings, ctx)


def run_label(inputs: Inputs, settings: LabelSettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import label  # lazy: keeps chain importable without torch

    return label.run(inputs, settings, ctx)


def run_label_derive(inputs: Inputs, settings: DeriveSettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import slo_labels  # lazy: keeps chain importable without torch

    return slo_labels.run_derive(inputs, settings, ctx)


def run_tlm_decision(inputs: Inputs, settings: DecisionSettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import tlm  # lazy: keeps chain importable without torch

    return tlm.run_decision(inputs, settings, ctx)


def run_evaluate(inputs: Inputs, settings: ReportCardSettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import evaluate  # lazy: keeps chain importable without torch

    return evaluate.run_card(inputs, settings, ctx)


def run_clone_collect(inputs: Inputs, settings: CollectSettings, ctx: StageContext) -> Inputs:
    from pipeline.clone import collect  # lazy: keeps chain importable without torch

    return collect.run(inputs, settings, ctx)


def run_clone_search(inputs: Inputs, settings: SearchSettings, ctx: StageContext) -> Inputs:
    from pipeline.clone import search  # lazy: keeps chain importable without torch

    return search.run(inputs, settings, ctx)


def run_experts(inputs: Inputs, settings: ExpertSettings, ctx: StageContext) -> Inputs:
    from pipeline.clone import experts  # lazy: keeps chain importable without torch

    return experts.run(inputs, settings, ctx)


def run_export(inputs: Inputs, settings: ExportSettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import export  # lazy: keeps chain importable without torch

    return export.run(inputs, settings, ctx)


def run_corpus_generate(inputs: Inputs, settings: CorpusSettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import corpus  # lazy: keeps chain importable without torch

    return corpus.run_generate(inputs, settings, ctx)


def run_corpus(inputs: Inputs, settings: StageSettings, ctx: StageContext) -> Inputs:
    from pipeline.elastilm import corpus  # lazy: keeps chain importable without torch

    return corpus.run_merge(inputs, settings, ctx)


def run_publish(inputs: Inputs, settings: StageSettings, ctx: StageContext) -> Inputs:
    from pipeline import publish  # lazy: keeps chain importable without torch

    return publish.run(inputs, settings, ctx)


# --------------------------------------------------------------------------- the stages

STAGES: tuple[Stage, ...] = (
    Stage(
        name="profile", run=run_profile, settings=ProfileSettings, inputs={"model": "source.model"},
        outputs=("importance",), resources=GPU_STAGE, from_spec=_profile_from_spec,
    ),
    Stage(
        name="elastify", run=run_elastify, settings=ElastifySettings,
        inputs={"model": "source.model", "importance": "profile.importance"}, outputs=("package",),
        resources=GPU_STAGE, from_spec=_elastify_from_spec, runtime=("build_id",),
    ),
    Stage(
        name="recover", run=run_recover, settings=RecoverSettings,
        inputs={"package": "elastify.package", "corpus": "corpus.corpus"}, optional_inputs=frozenset({"corpus"}),
        outputs=("adapter", "peft", "metrics"), resources=GPU_SHARD, fan_out=_recover_shards,
    ),
    Stage(
        name="recover-install", run=run_recover_install,
        inputs={"package": "elastify.package", "adapter": "recover.adapter"}, outputs=("package",),
        resources=Resources(num_cpus=1),
    ),
    # latency and tlm-score read only the full-width model, so they run beside recovery.
    Stage(
        name="latency", run=run_latency, settings=LatencySettings, inputs={"package": "elastify.package"},
        outputs=("latency",), resources=MODEL_STAGE,
    ),
    Stage(
        name="tlm-score", run=run_tlm_score, settings=ScoreSettings,
        inputs={"package": "elastify.package", "compression_data": "source.compression_data"},
        optional_inputs=frozenset({"compression_data"}), outputs=("tlm", "metrics"), resources=GPU_STAGE,
    ),
    Stage(
        name="label", run=run_label, settings=LabelSettings, inputs={"package": PACKAGE, "tlm": "tlm-score.tlm"},
        outputs=("correctness", "meta"), resources=SHARD, from_spec=_default_shards, fan_out=_count_shards,
    ),
    Stage(
        name="label-derive", run=run_label_derive, settings=DeriveSettings,
        inputs={"latency": "latency.latency", "correctness": "label.correctness", "meta": "label.meta"},
        outputs=("labels",), resources=Resources(num_cpus=1),
    ),
    Stage(
        name="tlm-decision", run=run_tlm_decision, settings=DecisionSettings,
        inputs={"tlm": "tlm-score.tlm", "labels": "label-derive.labels"}, outputs=("tlm", "metrics"),
        resources=MODEL_STAGE,
    ),
    Stage(
        name="evaluate", run=run_evaluate, settings=ReportCardSettings,
        # corpus: its held-out generated slice is out-of-domain text; recovery: how each level was
        # recovered, which says whether the full model is a like-with-like in-domain reference.
        inputs={"package": PACKAGE, "latency": "latency.latency", "corpus": "corpus.corpus",
                "recovery": "recover.metrics"},
        optional_inputs=frozenset({"latency", "corpus", "recovery"}),
        outputs=("report_card", "quality_plot"), resources=MODEL_STAGE,
    ),
    # CLONE (issue 7), off by default: `stages.clone-collect.enabled: true` with `settings.budgets`, then
    # clone-search; `stages.experts.enabled: true` for the LoRA-MoE experts. Widths need no recovery
    # adapters, so all three read elastify's package and run beside recovery.
    Stage(
        name="clone-collect", run=run_clone_collect, settings=CollectSettings,
        inputs={"package": "elastify.package", "latency": "latency.latency"}, optional_inputs=frozenset({"latency"}),
        outputs=("records",), resources=SHARD, from_spec=_default_shards, fan_out=_count_shards,
        enabled_by_default=False,
    ),
    Stage(
        name="clone-search", run=run_clone_search, settings=SearchSettings,
        inputs={"package": "elastify.package", "records": "clone-collect.records", "latency": "latency.latency"},
        optional_inputs=frozenset({"latency"}), outputs=("profiles",), resources=MODEL_STAGE,
        enabled_by_default=False,
    ),
    Stage(
        name="experts", run=run_experts, settings=ExpertSettings, inputs={"package": "elastify.package"},
        outputs=("experts",), resources=MODEL_STAGE, enabled_by_default=False,
    ),
    # Export (issue 15), off by default: `stages.export.enabled: true` writes the finished package's usable
    # levels (or `settings.levels`) as GGUF and/or a transformers directory; publish puts them beside the package.
    Stage(
        name="export", run=run_export, settings=ExportSettings,
        inputs={"package": PACKAGE, "report": "evaluate.report_card"}, optional_inputs=frozenset({"report"}),
        outputs=("exports",), resources=MODEL_STAGE, from_spec=_export_from_spec, enabled_by_default=False,
    ),
    # The recovery corpus (issue 13), what `recover` trains on: the full model answers packaged prompts
    # on shards, then `corpus` merges them with packaged text, disjoint from every evaluation set.
    # The merge has no settings: it takes those the shards were generated with. On by default: the
    # default 256 prompts × 128 tokens take ~25 min on two cores (~11 tokens/s a core for SmolLM2),
    # a small share of the recovery they feed (8 levels × 200 steps × 4 × 256 tokens, distilled).
    Stage(
        name="corpus-generate", run=run_corpus_generate, settings=CorpusSettings,
        inputs={"package": "elastify.package"}, outputs=("generated",), resources=SHARD,
        from_spec=_default_shards, fan_out=_count_shards,
    ),
    Stage(
        name="corpus", run=run_corpus, inputs={"package": "elastify.package", "generated": "corpus-generate.generated"},
        outputs=("corpus",), resources=Resources(num_cpus=1),
    ),
    Stage(
        name="publish", run=run_publish,
        inputs={"package": PACKAGE, "report": "evaluate.report_card", "quality_plot": "evaluate.quality_plot",
                "latency": "latency.latency", "tlm": ("tlm-decision.tlm", "tlm-score.tlm"),
                "profiles": "clone-search.profiles", "experts": "experts.experts", "exports": "export.exports"},
        optional_inputs=frozenset({"report", "quality_plot", "latency", "tlm", "profiles", "experts", "exports"}),
        outputs=("package",), resources=Resources(num_cpus=1), runtime=("signing_key",), max_attempts=3,
        publishes="package",
    ),
)
