"""From a BuildSpec and a Registry to the build's DAG: one node per stage, or per shard of a fan-out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.registry import SOURCE_PREFIX, Registry, StageRegistration, input_refs
from cluster.spec import BuildSpec, SpecError


@dataclass(frozen=True)
class UpstreamInput:
    stage_key: str
    output: str


@dataclass(frozen=True)
class ExternalPath:
    path: str


@dataclass
class PlannedStage:
    key: str
    type: str
    shard: str | None
    settings: dict[str, Any]
    resources: dict[str, Any]
    max_attempts: int
    inputs: dict[str, UpstreamInput | ExternalPath] = field(default_factory=dict)


def _source(spec: BuildSpec, name: str) -> str | None:
    value = getattr(spec.source, name, None)
    return str(value) if value is not None else None


def enabled_stages(spec: BuildSpec, registry: Registry) -> list[StageRegistration]:
    return [
        r for r in registry if (spec.stages[r.name].enabled if r.name in spec.stages else r.enabled_by_default)
    ]


def _topological(stages: list[StageRegistration], problems: list[tuple[str, str]]) -> list[StageRegistration]:
    by_name = {s.name: s for s in stages}
    ordered, state = [], {}

    def visit(stage: StageRegistration, path: tuple[str, ...]) -> None:
        if state.get(stage.name) == "done":
            return
        if state.get(stage.name) == "active":
            problems.append((f"stages.{stage.name}", f"dependency cycle: {' -> '.join(path + (stage.name,))}"))
            return
        state[stage.name] = "active"
        for refs in stage.inputs.values():
            for ref in input_refs(refs):
                upstream = ref.split(".", 1)[0]
                if not ref.startswith(SOURCE_PREFIX) and upstream in by_name:
                    visit(by_name[upstream], path + (stage.name,))
        state[stage.name] = "done"
        ordered.append(stage)

    for stage in stages:
        visit(stage, ())
    return ordered


def _first_enabled(refs: tuple[str, ...], shards_of: dict) -> str:
    """The first alternative whose producer is planned (or a source); else the first, for the error message."""
    for ref in refs:
        if ref.startswith(SOURCE_PREFIX) or ref.partition(".")[0] in shards_of:
            return ref
    return refs[0]


def plan(spec: BuildSpec, registry: Registry) -> list[PlannedStage]:
    """Validate the spec against the registry and expand it into DAG nodes in dependency order."""
    problems: list[tuple[str, str]] = []
    for name in spec.stages:
        if name not in registry:
            problems.append((f"stages.{name}", f"unknown stage; registered stages: {sorted(r.name for r in registry)}"))
    stages = _topological(enabled_stages(spec, registry), problems)
    planned: list[PlannedStage] = []
    shards_of: dict[str, list[PlannedStage]] = {}
    for registration in stages:
        own = spec.stage(registration.name)
        allowed = registration.allowed_settings()
        unknown = sorted(set(own.settings) - allowed) if allowed is not None else []
        for key in unknown:
            problems.append((f"stages.{registration.name}.settings.{key}", f"unknown setting; allowed: {sorted(allowed)}"))
        inputs: dict[str, UpstreamInput | ExternalPath] = {}
        for name, refs in registration.inputs.items():
            ref = _first_enabled(input_refs(refs), shards_of)
            producer, _, output = ref.partition(".")
            if ref.startswith(SOURCE_PREFIX):
                path = _source(spec, output)
                if path is None and name in registration.optional_inputs:
                    continue
                if path is None:
                    problems.append((f"source.{output}", f"required by stage {registration.name}"))
                else:
                    inputs[name] = ExternalPath(path)
            elif producer in shards_of:
                upstream = shards_of[producer]
                if len(upstream) == 1 and upstream[0].shard is None:
                    inputs[name] = UpstreamInput(upstream[0].key, output)
                else:
                    inputs.update({f"{name}.{u.shard}": UpstreamInput(u.key, output) for u in upstream})
            elif name not in registration.optional_inputs:
                problems.append((f"stages.{registration.name}", f"input {name!r} needs stage {producer!r}, which is not enabled"))
        if problems:
            shards_of[registration.name] = []  # keep going to report every problem, not knock-on ones
            continue
        settings = registration.pipeline_settings(spec, own.settings)
        resources = registration.resources.as_dict()
        if own.resources is not None:
            resources |= {k: v for k, v in own.resources.model_dump().items() if v is not None}
        max_attempts = own.max_attempts or registration.max_attempts
        shards = registration.fan_out(spec, own.settings) if registration.fan_out else None
        if shards == []:
            problems.append((f"stages.{registration.name}", "fans out to no shards with these settings; disable it"))
            shards_of[registration.name] = []
            continue
        nodes = (
            [PlannedStage(registration.name, registration.name, None, settings, resources, max_attempts, inputs)]
            if shards is None
            else [
                PlannedStage(
                    f"{registration.name}[{s.label}]", registration.name, s.label, {**settings, **s.settings},
                    resources, max_attempts, dict(inputs),
                )
                for s in shards
            ]
        )
        shards_of[registration.name] = nodes
        planned += nodes
    if problems:
        raise SpecError(problems)
    if not planned:
        raise SpecError([("stages", "no stage is enabled")])
    return planned
