"""From a BuildSpec and a Registry to the build's DAG: one node per stage, or per shard of a fan-out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from cluster.registry import Registry
from cluster.spec import BuildSpec, SpecError, StageSpec, validation_problems
from pipeline.contract import SOURCE_PREFIX, Shard, Stage, StageSettings, input_refs


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


def _source(spec: BuildSpec, name: str) -> str | None:
    value = getattr(spec.source, name, None)
    return str(value) if value is not None else None


def enabled_stages(spec: BuildSpec, registry: Registry) -> list[Stage]:
    given = spec.given_stages()
    return [s for s in registry if (given[s.name].enabled if s.name in given else s.enabled_by_default)]


def _topological(stages: list[Stage], problems: list[tuple[str, str]]) -> list[Stage]:
    by_name = {s.name: s for s in stages}
    ordered, state = [], {}

    def visit(stage: Stage, path: tuple[str, ...]) -> None:
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
    for name in spec.given_stages():
        if name not in registry:
            problems.append((f"stages.{name}", f"unknown stage; registered stages: {sorted(r.name for r in registry)}"))
    stages = _topological(enabled_stages(spec, registry), problems)
    planned: list[PlannedStage] = []
    shards_of: dict[str, list[PlannedStage]] = {}
    for stage in stages:
        own = spec.given_stages().get(stage.name) or StageSpec()
        try:
            settings = stage.settings_for(spec, own.settings)
        except ValidationError as err:
            problems += validation_problems(err.errors(), ("stages", stage.name, "settings"), registry)
            settings = None
        inputs: dict[str, UpstreamInput | ExternalPath] = {}
        for name, refs in stage.inputs.items():
            ref = _first_enabled(input_refs(refs), shards_of)
            producer, _, output = ref.partition(".")
            if ref.startswith(SOURCE_PREFIX):
                path = _source(spec, output)
                if path is None and name in stage.optional_inputs:
                    continue
                if path is None:
                    problems.append((f"source.{output}", f"required by stage {stage.name}"))
                else:
                    inputs[name] = ExternalPath(path)
            elif producer in shards_of:
                upstream = shards_of[producer]
                if len(upstream) == 1 and upstream[0].shard is None:
                    inputs[name] = UpstreamInput(upstream[0].key, output)
                else:
                    inputs.update({f"{name}.{u.shard}": UpstreamInput(u.key, output) for u in upstream})
            elif name not in stage.optional_inputs:
                problems.append((f"stages.{stage.name}", f"input {name!r} needs stage {producer!r}, which is not enabled"))
        if problems:
            shards_of[stage.name] = []  # keep going to report every problem, not knock-on ones
            continue
        resources = stage.resources.as_dict()
        if own.resources is not None:
            resources |= {k: v for k, v in own.resources.model_dump().items() if v is not None}
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
