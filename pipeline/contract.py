"""The stage contract: what a pipeline stage is, as one typed `Stage` object.

A `Stage` carries everything the control plane needs to run it and nothing it has to look up
by name: its pydantic `Settings` model (checked when a build is submitted, so a bad value is a
422 naming the field), its named inputs and outputs, its fan-out rule, the resources it asks
Ray for, and `run(inputs, settings, ctx)`, which receives the validated Settings instance.

Why the declarations live apart from the algorithms: the API validates build specs and plans
DAGs, and it must not import torch to do so. So every stage's Settings model is in
`pipeline.settings` and every `Stage` in `pipeline.chain`, both torch-free; each stage's `run`
there is a module-level function that imports its algorithm module (`from pipeline import
recover`) only when a worker calls it. The import is a plain statement, so the import-direction
test and a reader see the edge, and the function pickles by reference through Ray.

`cluster/` runs any `Stage` it is given (cluster.registry) and names none: `api/` hands it
`pipeline.chain.STAGES`. The rules that make stages a chain (which are on, in what order, what each
input reads) are here too, so that the DAG planner (cluster.dag) and the in-process runner
(workers.inprocess) wire a chain the same way. This module, like `pipeline.settings` and
`pipeline.chain`, imports only pydantic and the standard library.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

SOURCE_PREFIX = "source."  # an input read from the spec's `source` (e.g. "source.model"), not from a stage


class NamesFiles:
    """Marks a setting (`Annotated[..., NAMES_FILES]`) whose value, or each entry of it, may be a path the
    stage reads (a corpus file, a model directory). The content of what it names joins the stage's
    cache key, so rewriting the file is a cache miss, not a hit with the old output; and the control
    plane admits only paths under the deployment's source roots or the tenant's uploads
    (cluster.sources). `corpus_names`: an entry may instead name a packaged corpus (`ptb:train`)."""

    def __init__(self, corpus_names: bool = False):
        self.corpus_names = corpus_names


NAMES_FILES = NamesFiles()
NAMES_CORPORA = NamesFiles(corpus_names=True)  # a corpus file, or a packaged corpus's name


class StageSettings(BaseModel):
    """Base of every stage's Settings: an unknown setting is an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid")

    def named_paths(self) -> list[str]:
        """The values of the settings marked NAMES_FILES, lists flattened; some may be corpus names, not paths."""
        return [value for _, value, _ in self.named_path_fields()]

    def named_path_fields(self) -> list[tuple[str, str, bool]]:
        """(setting, value, may be a corpus name) per value of the settings marked NAMES_FILES (each list
        entry on its own, named `setting.index`)."""
        fields: list[tuple[str, str, bool]] = []
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            marks = [meta for meta in info.metadata if isinstance(meta, NamesFiles)]
            if value is None or not marks:
                continue
            corpus = any(mark.corpus_names for mark in marks)
            if isinstance(value, str):
                fields.append((name, value, corpus))
            else:
                fields += [(f"{name}.{index}", entry, corpus) for index, entry in enumerate(value)]
        return fields

    def with_paths(self, replaced: Mapping[str, str]) -> StageSettings:
        """A copy whose NAMES_FILES values found in `replaced` are swapped for their replacements (e.g. an
        `upload:<digest>` for where the worker fetched it); the other settings unchanged."""
        update = {}
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            if value is None or not any(isinstance(meta, NamesFiles) for meta in info.metadata):
                continue
            if isinstance(value, str):
                if value in replaced:
                    update[name] = replaced[value]
            elif any(entry in replaced for entry in value):
                update[name] = [replaced.get(entry, entry) for entry in value]
        return self.model_copy(update=update) if update else self


@dataclass(frozen=True)
class Resources:
    """What one task of the stage asks Ray for."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: int | None = None  # bytes
    custom: Mapping[str, float] = field(default_factory=dict)  # e.g. {"fake_gpu": 0.5}
    # A stage that runs a model: under the build's `accelerator` (auto with GPUs in the cluster, or cuda)
    # its tasks ask for one GPU unless the spec sets num_gpus (cluster.accelerator).
    accelerated: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "memory": self.memory, "custom": dict(self.custom),
                "accelerated": self.accelerated}


@dataclass(frozen=True)
class Shard:
    """One node of a fanned-out stage: its label (the `[…]` of the node key) and the settings it sets.

    `inputs` names outputs of sibling shards, input name -> (sibling label, output): e.g. recovery
    warm-started top-down gives shard "0.5" `{"init_adapter": ("0.7", "adapter")}`, so level 0.5
    runs after level 0.7 and starts from its adapter. Planning checks the labels and refuses cycles.
    """

    label: str
    settings: Mapping[str, Any]
    inputs: Mapping[str, tuple[str, str]] = field(default_factory=dict)


def input_refs(refs: str | tuple[str, ...]) -> tuple[str, ...]:
    return (refs,) if isinstance(refs, str) else tuple(refs)


StageRun = Callable[[dict[str, Path], Any, Any], dict[str, Path]]  # (inputs, Settings instance, StageContext)


@dataclass(frozen=True)
class Stage:
    """One stage of a build DAG. Example, one LoRA per level as a fan-out:

        Stage(name="recover", run=run_recover, settings=RecoverSettings,
              inputs={"package": "elastify.package"}, outputs=("adapter",), resources=Resources(num_gpus=1),
              fan_out=lambda spec, settings: [Shard(name, {"level": name}) for name in ...])

    A consumer of a fanned-out stage receives one input per shard, named `<input>.<shard label>`.
    An input may name alternatives, `("recover-install.package", "elastify.package")`: the first
    whose producer is enabled in the build is used, so optional stages can sit in a chain.
    """

    name: str
    run: StageRun  # a module-level function, so that it pickles by reference
    outputs: tuple[str, ...]
    settings: type[StageSettings] = StageSettings
    # input -> "source.<field>" or "<stage>.<output>", or a tuple of alternatives (first enabled wins)
    inputs: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    optional_inputs: frozenset[str] = frozenset()  # dropped when their producer is disabled or the source unset
    resources: Resources = Resources()
    # Settings the build spec supplies (e.g. calibration, levels); a value the user sets for the stage wins.
    from_spec: Callable[[Any], dict[str, Any]] | None = None
    fan_out: Callable[[Any, StageSettings], list[Shard]] | None = None  # (spec, settings) -> shards
    runtime: tuple[str, ...] = ()  # values handed over at dispatch in ctx.runtime (build_id, signing_key); never stored
    max_attempts: int = 3
    enabled_by_default: bool = True
    version: str = "1"  # bump when the stage's output changes for the same inputs: invalidates the cache
    publishes: str | None = None  # the output that is a finished package, registered under the spec's `publish`

    def __post_init__(self) -> None:
        if "." in self.name or "[" in self.name:
            raise ValueError(f"stage name {self.name!r} may not contain '.' or '['")
        if self.publishes is not None and self.publishes not in self.outputs:
            raise ValueError(f"stage {self.name}: publishes {self.publishes!r}, which is not one of its outputs")

    def settings_for(self, spec, own: StageSettings | Mapping[str, Any] | None) -> StageSettings:
        """This build's settings: what the spec supplies, overridden by the values the user set
        (a validated Settings instance, or a dict from a spec parsed without a registry).

        Raises pydantic.ValidationError when the combination is invalid (e.g. a required setting unset).
        """
        derived = self.from_spec(spec) if self.from_spec else {}
        given = own.model_dump(include=own.model_fields_set) if isinstance(own, BaseModel) else dict(own or {})
        return self.settings.model_validate({**derived, **given})

    def shard_settings(self, settings: StageSettings, shard: Shard) -> StageSettings:
        return self.settings.model_validate({**settings.model_dump(), **shard.settings})


# --------------------------------------------------------------------------- which stages run, in what order, reading what

Problem = tuple[str, str]  # (the spec field at fault, e.g. "stages.recover", what is wrong)


def enabled_stages(stages: Iterable[Stage], given: Mapping[str, bool]) -> list[Stage]:
    """The stages a build runs: those `given` switches on, and the others that are on by default."""
    return [s for s in stages if given.get(s.name, s.enabled_by_default)]


def dependency_order(stages: list[Stage], problems: list[Problem]) -> list[Stage]:
    """`stages`, each after every one of them whose outputs it reads; a cycle is added to `problems`."""
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


def resolve_inputs(stage: Stage, sources: Mapping[str, str], produced: Container[str],
                   problems: list[Problem]) -> dict[str, str]:
    """Input -> the ref it reads: "source.<field>" (a field set in `sources`) or "<stage>.<output>" (a stage
    in `produced`, i.e. enabled and before this one). Of alternatives, the first that is a source or
    produced wins. An optional input with nothing to read is left out; a required one is a problem."""
    chosen = {}
    for name, refs in stage.inputs.items():
        alternatives = input_refs(refs)
        ref = next((r for r in alternatives if r.startswith(SOURCE_PREFIX) or r.partition(".")[0] in produced),
                   alternatives[0])
        producer, _, output = ref.partition(".")
        from_source = ref.startswith(SOURCE_PREFIX)
        if sources.get(output) is not None if from_source else producer in produced:
            chosen[name] = ref
        elif name in stage.optional_inputs:
            continue
        elif from_source:
            problems.append((f"source.{output}", f"required by stage {stage.name}"))
        else:
            problems.append((f"stages.{stage.name}", f"input {name!r} needs stage {producer!r}, which is not enabled"))
    return chosen
