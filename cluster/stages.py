"""The built-in stages as registrations. The scheduler learns about stages only from here."""

from __future__ import annotations

from cluster.packages import register_package
from cluster.registry import Registry, Resources, StageRegistration

# The model-sized stages want both cores of a small machine (Ray sets OMP threads from num_cpus).
MODEL_STAGE = Resources(num_cpus=2)


def _profile_settings(spec, own: dict) -> dict:
    return {"calibration": list(spec.calibration), **own}


def _elastify_settings(spec, own: dict) -> dict:
    return {"levels": list(spec.levels), "name": spec.publish.name, "version": spec.publish.version, **own}


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
            name="evaluate", function="pipeline.evaluate:run", inputs={"package": "elastify.package"},
            outputs=("report",), resources=MODEL_STAGE, settings_schema="pipeline.evaluate:EvaluateSettings",
        ),
        StageRegistration(
            name="publish", function="pipeline.publish:run",
            inputs={"package": "elastify.package", "report": "evaluate.report"}, optional_inputs=frozenset({"report"}),
            outputs=("package",), resources=Resources(num_cpus=1), runtime=("signing_key",),
            on_success=register_package, max_attempts=3,
        ),
    ])
