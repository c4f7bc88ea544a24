"""From a BuildSpec and a Registry to the build's DAG: one node per stage, or per shard of a fan-out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from cluster.registry import Registry
from cluster.spec import BuildSpec, SpecError, StageSpec, validation_problems
from pipeline.contract import (
    SOURCE_PREFIX,
    Shard,
    Stage,
    StageSettings,
    dependency_order,
    enabled_stages,
    resolve_inputs,
)


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
    settings: StageSettings  # validated; stored as its JSON, rebuilt with model_validate on dispatch
    resources: dict[str, Any]
    max_attempts: int
    inputs: dict[str, UpstreamInput | ExternalPath] = field(default_factory=dict)


def _sources(spec: BuildSpec) -> dict[str, str]:
    """The spec's `source` fields that are set, as the strings a stage input is handed."""
    return {name: str(value) for name, value in spec.source if value is not None}


def _shard_key(stage: str, label: str) -> str:
    return f"{stage}[{label}]"


def _sibling_order(stage: Stage, shards: list[Shard]) -> tuple[list[Shard], list[str]]:
    """The shards, each after the siblings whose outputs it reads (otherwise in the fan-out's order),
    and what is wrong with their sibling inputs: an unknown or own label, an output the stage does
    not have, a name that shadows a stage input, a cycle."""
    labels = [s.label for s in shards]
    problems = []
    for shard in shards:
        for name, (label, output) in shard.inputs.items():
            where = f"shard {shard.label!r} input {name!r}"
            if name in stage.inputs:
                problems.append(f"{where} has the name of a stage input")
            if label == shard.label or label not in labels:
                problems.append(f"{where} names shard {label!r}, which is not a sibling; shards: {labels}")
            if output not in stage.outputs:
                problems.append(f"{where} names output {output!r}; the stage's outputs: {list(stage.outputs)}")
    if problems:
        return shards, problems
    ordered: list[Shard] = []
    placed: set[str] = set()
    pending = list(shards)
    while pending:
        ready = [s for s in pending if all(label in placed for label, _ in s.inputs.values())]
        if not ready:
            return shards, [f"shards read each other's outputs in a cycle: {[s.label for s in pending]}"]
        ordered += ready
        placed |= {s.label for s in ready}
        pending = [s for s in pending if s not in ready]
    return ordered, []


def plan(spec: BuildSpec, registry: Registry) -> list[PlannedStage]:
    """Validate the spec against the registry and expand it into DAG nodes in dependency order."""
    problems: list[tuple[str, str]] = []
    given = spec.given_stages()
    for name in given:
        if name not in registry:
            problems.append((f"stages.{name}", f"unknown stage; registered stages: {sorted(r.name for r in registry)}"))
    stages = dependency_order(enabled_stages(registry, {name: own.enabled for name, own in given.items()}), problems)
    sources = _sources(spec)
    planned: list[PlannedStage] = []
    shards_of: dict[str, list[PlannedStage]] = {}
    for stage in stages:
        own = given.get(stage.name) or StageSpec()
        try:
            settings = stage.settings_for(spec, own.settings)
        except ValidationError as err:
            problems += validation_problems(err.errors(), ("stages", stage.name, "settings"), registry)
            settings = None
        inputs: dict[str, UpstreamInput | ExternalPath] = {}
        for name, ref in resolve_inputs(stage, sources, shards_of, problems).items():
            producer, _, output = ref.partition(".")
            if ref.startswith(SOURCE_PREFIX):
                inputs[name] = ExternalPath(sources[output])
                continue
            upstream = shards_of[producer]
            if len(upstream) == 1 and upstream[0].shard is None:
                inputs[name] = UpstreamInput(upstream[0].key, output)
            else:
                inputs.update({f"{name}.{u.shard}": UpstreamInput(u.key, output) for u in upstream})
        if problems:
            shards_of[stage.name] = []  # keep going to report every problem, not knock-on ones
            continue
        resources = stage.resources.as_dict()
        if own.resources is not None:
            resources |= {k: v for k, v in own.resources.model_dump().items() if v is not None}
            if own.resources.num_gpus is not None:
                resources["gpus_set"] = True  # the spec's num_gpus wins over the build's accelerator
        max_attempts = own.max_attempts or stage.max_attempts
        shards = stage.fan_out(spec, settings) if stage.fan_out else None
        if shards == []:
            problems.append((f"stages.{stage.name}", "fans out to no shards with these settings; disable it"))
            shards_of[stage.name] = []
            continue
        if shards is not None:
            shards, sibling_problems = _sibling_order(stage, shards)
            if sibling_problems:
                problems += [(f"stages.{stage.name}", problem) for problem in sibling_problems]
                shards_of[stage.name] = []
                continue
        nodes = (
            [PlannedStage(stage.name, stage.name, None, settings, resources, max_attempts, inputs)]
            if shards is None
            else [
                PlannedStage(
                    _shard_key(stage.name, s.label), stage.name, s.label,
                    stage.shard_settings(settings, s), resources, max_attempts,
                    {**inputs, **{name: UpstreamInput(_shard_key(stage.name, label), output)
                                  for name, (label, output) in s.inputs.items()}},
                )
                for s in shards
            ]
        )
        keys = [node.key for node in nodes]
        if clashes := sorted({key for key in keys if keys.count(key) > 1}):
            # Two shards with one key would be two stage rows with one (build, key): refuse, naming them.
            problems.append((f"stages.{stage.name}", f"fans out to several shards with one key: {clashes}"))
            shards_of[stage.name] = []
            continue
        shards_of[stage.name] = nodes
        planned += nodes
    if problems:
        raise SpecError(problems)
    if not planned:
        raise SpecError([("stages", "no stage is enabled")])
    return planned
