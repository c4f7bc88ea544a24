"""Stage registrations: everything the scheduler knows about a stage is in one of these.

The scheduler never names a stage. To add one, register a `StageRegistration` with its pipeline
function, inputs and outputs, resources and (optionally) a fan-out rule, e.g. recovery per level:

    registry.register(StageRegistration(
        name="recover", function="pipeline.recover:run",
        inputs={"package": "elastify.package"}, outputs=("adapter",),
        resources=Resources(num_gpus=1),
        fan_out=lambda spec, own: [Shard(str(m), {"level": m}) for m in spec.levels],
    ))

A consumer of a fanned-out stage receives one input per shard, named `<input>.<shard label>`.
An input may name alternatives, `("recover-install.package", "elastify.package")`: the first
whose producer is enabled in the build is used, so optional stages can sit in the middle of a chain.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

SOURCE_PREFIX = "source."


def input_refs(refs: str | tuple[str, ...]) -> tuple[str, ...]:
    return (refs,) if isinstance(refs, str) else tuple(refs)


@dataclass(frozen=True)
class Resources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: int | None = None  # bytes
    custom: Mapping[str, float] = field(default_factory=dict)  # e.g. {"fake_gpu": 0.5}

    def as_dict(self) -> dict[str, Any]:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "memory": self.memory, "custom": dict(self.custom)}


@dataclass(frozen=True)
class Shard:
    label: str
    settings: Mapping[str, Any]


@dataclass(frozen=True)
class StageRegistration:
    name: str
    function: str  # "module:function" following the stage contract run(inputs, settings, ctx)
    outputs: tuple[str, ...]
    # input -> "source.<field>" or "<stage>.<output>", or a tuple of alternatives (first enabled wins)
    inputs: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    optional_inputs: frozenset[str] = frozenset()  # dropped when their producing stage is disabled
    resources: Resources = Resources()
    settings: Callable[[Any, dict], dict] | None = None  # (spec, own settings) -> pipeline settings
    settings_schema: str | None = None  # "module:Dataclass" whose fields are the allowed own settings
    fan_out: Callable[[Any, dict], list[Shard]] | None = None
    runtime: tuple[str, ...] = ()  # values supplied at dispatch (build_id, signing_key); never cached or stored
    max_attempts: int = 3
    enabled_by_default: bool = True
    version: str = "1"  # bump when the stage's output changes for the same inputs: invalidates the cache
    on_success: Callable | None = None  # run by the scheduler in-process after success (e.g. publish)

    def pipeline_settings(self, spec, own: dict) -> dict:
        return self.settings(spec, dict(own)) if self.settings else dict(own)

    def allowed_settings(self) -> set[str] | None:
        if self.settings_schema is None:
            return None
        module, _, name = self.settings_schema.partition(":")
        schema = getattr(importlib.import_module(module), name)
        return set(schema.__dataclass_fields__)


class Registry:
    def __init__(self, registrations: list[StageRegistration] = ()):
        self._stages: dict[str, StageRegistration] = {}
        for registration in registrations:
            self.register(registration)

    def register(self, registration: StageRegistration) -> StageRegistration:
        if registration.name in self._stages:
            raise ValueError(f"stage {registration.name!r} is registered twice")
        if "." in registration.name or "[" in registration.name:
            raise ValueError(f"stage name {registration.name!r} may not contain '.' or '['")
        self._stages[registration.name] = registration
        return registration

    def get(self, name: str) -> StageRegistration:
        if name not in self._stages:
            raise KeyError(f"no stage {name!r} is registered; known: {sorted(self._stages)}")
        return self._stages[name]

    def __contains__(self, name: str) -> bool:
        return name in self._stages

    def __iter__(self) -> Iterator[StageRegistration]:
        return iter(self._stages.values())
