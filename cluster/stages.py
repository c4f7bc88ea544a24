"""The built-in stages as registrations. The scheduler learns about stages only from here.

The default build is the whole ElastiLM chain:

    profile → elastify → recover × levels → recover-install → latency → tlm-score
            → label × shards → label-derive → tlm-decision → evaluate → publish

Any stage in `ELASTILM_STAGES` can be switched off in the spec (`stages.<name>.enabled: false`,
with the stages that need it); the chain then falls back to its other inputs, down to
profile → elastify → evaluate → publish.
"""

from __future__ import annotations

from cluster.packages import register_package
from cluster.registry import Registry, Resources, Shard, StageRegistration
from device_sdk.format import level_name

# The model-sized stages want both cores of a small machine (Ray sets OMP threads from num_cpus).
MODEL_STAGE = Resources(num_cpus=2)
# A fanned-out shard takes one core, so that two shards run side by side on one 2-core worker.
SHARD = Resources(num_cpus=1)

ELASTILM_STAGES = ("recover", "recover-install", "latency", "tlm-score", "label", "label-derive", "tlm-decision")
# The package the later stages read: with recovery adapters when recovery ran.
PACKAGE = ("recover-install.package", "elastify.package")


def _profile_settings(spec, own: dict) -> dict:
    return {"calibration": list(spec.calibration), **own}


def _elastify_settings(spec, own: dict) -> dict:
    return {"levels": list(spec.levels), "name": spec.publish.name, "version": spec.publish.version, **own}


def _recover_shards(spec, own: dict) -> list[Shard]:
    """One LoRA per level below full width (the full model needs no recovery)."""
    return [Shard(level_name(m), {"level": level_name(m)}) for m in spec.levels if m < 1.0]


def _label_shards(spec, own: dict) -> list[Shard]:
    count = int(own.get("shards", 2))
    return [Shard(str(k), {"shard": k, "shards": count}) for k in range(count)]


def _clone_shards(spec, own: dict) -> list[Shard]:
    """clone-collect: each shard measures every `shards`-th of the same seeded vector list."""
    count = int(own.get("shards", 2))
    return [Shard(str(k), {"shard": k, "shards": count}) for k in range(count)]


def builtin_registry() -> Registry:
    return Registry([
        StageRegistration(
            name="profile", function="pipeline.profile:run", inputs={"model": "source.model"},
            outputs=("importance",), resources=MODEL_STAGE, settings=_profile_settings,
            settings_schema="pipeline.profile:ProfileSettings",
        ),
        StageRegistration(
            name="elastify", function="pipeline.elastify:run",
            inputs={"model": "source.model", "importance": "profile.importance"}, outputs=("package",),
            resources=MODEL_STAGE, settings=_elastify_settings, settings_schema="pipeline.elastify:ElastifySettings",
            runtime=("build_id",),
        ),
        StageRegistration(
            name="recover", function="pipeline.recover:run", inputs={"package": "elastify.package"},
            outputs=("adapter", "peft", "metrics"), resources=SHARD, fan_out=_recover_shards,
            settings_schema="pipeline.recover:RecoverSettings",
        ),
        StageRegistration(
            name="recover-install", function="pipeline.recover:run_install",
            inputs={"package": "elastify.package", "adapter": "recover.adapter"}, outputs=("package",),
            resources=Resources(num_cpus=1),
        ),
        # latency and tlm-score read only the full-width model, so they run beside recovery.
        StageRegistration(
            name="latency", function="pipeline.latency:run", inputs={"package": "elastify.package"}, outputs=("latency",),
            resources=MODEL_STAGE, settings_schema="pipeline.latency:LatencySettings",
        ),
        StageRegistration(
            name="tlm-score", function="pipeline.tlm:run_score",
            inputs={"package": "elastify.package", "compression_data": "source.compression_data"},
            optional_inputs=frozenset({"compression_data"}), outputs=("tlm", "metrics"), resources=MODEL_STAGE,
            settings_schema="pipeline.tlm:ScoreSettings",
        ),
        StageRegistration(
            name="label", function="pipeline.label:run", inputs={"package": PACKAGE, "tlm": "tlm-score.tlm"},
            outputs=("correctness", "meta"), resources=SHARD, fan_out=_label_shards,
            settings_schema="pipeline.label:LabelSettings",
        ),
        StageRegistration(
            name="label-derive", function="pipeline.label:run_derive",
            inputs={"latency": "latency.latency", "correctness": "label.correctness", "meta": "label.meta"},
            outputs=("labels",), resources=Resources(num_cpus=1), settings_schema="pipeline.label:DeriveSettings",
        ),
        StageRegistration(
            name="tlm-decision", function="pipeline.tlm:run_decision",
            inputs={"tlm": "tlm-score.tlm", "labels": "label-derive.labels"}, outputs=("tlm", "metrics"),
            resources=MODEL_STAGE, settings_schema="pipeline.tlm:DecisionSettings",
        ),
        StageRegistration(
            name="evaluate", function="pipeline.evaluate:run_card",
            inputs={"package": PACKAGE, "latency": "latency.latency"}, optional_inputs=frozenset({"latency"}),
            outputs=("report_card",), resources=MODEL_STAGE, settings_schema="pipeline.evaluate:ReportCardSettings",
        ),
        # CLONE (issue 7), off by default: `stages.clone-collect.enabled: true` with `settings.budgets`, then
        # clone-search; `stages.experts.enabled: true` for the LoRA-MoE experts. Widths need no recovery
        # adapters, so all three read elastify's package and run beside recovery.
        StageRegistration(
            name="clone-collect", function="pipeline.clone_collect:run",
            inputs={"package": "elastify.package", "latency": "latency.latency"}, optional_inputs=frozenset({"latency"}),
            outputs=("records",), resources=SHARD, fan_out=_clone_shards, enabled_by_default=False,
            settings_schema="pipeline.clone_collect:CollectSettings",
        ),
        StageRegistration(
            name="clone-search", function="pipeline.clone_search:run",
            inputs={"package": "elastify.package", "records": "clone-collect.records", "latency": "latency.latency"},
            optional_inputs=frozenset({"latency"}), outputs=("profiles",), resources=MODEL_STAGE,
            enabled_by_default=False, settings_schema="pipeline.clone_search:SearchSettings",
        ),
        StageRegistration(
            name="experts", function="pipeline.experts:run", inputs={"package": "elastify.package"},
            outputs=("experts",), resources=MODEL_STAGE, enabled_by_default=False,
            settings_schema="pipeline.experts:ExpertSettings",
        ),
        StageRegistration(
            name="publish", function="pipeline.publish:run",
            inputs={"package": PACKAGE, "report": "evaluate.report_card", "latency": "latency.latency",
                    "tlm": ("tlm-decision.tlm", "tlm-score.tlm"), "profiles": "clone-search.profiles",
                    "experts": "experts.experts"},
            optional_inputs=frozenset({"report", "latency", "tlm", "profiles", "experts"}),
            outputs=("package",), resources=Resources(num_cpus=1), runtime=("signing_key",),
            on_success=register_package, max_attempts=3,
        ),
    ])
