"""The stages a scheduler can run, by name: `pipeline.contract.Stage` objects handed in by the caller.

The control plane names no stage and imports no stage module. `api/` (the app and the CLI
commands that start a scheduler) passes in `pipeline.chain.STAGES`; tests pass tiny stages.
Everything the scheduler knows about a stage (inputs, outputs, fan-out, resources, settings
model, run function) is on its `Stage`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pipeline.contract import Stage


class Registry:
    def __init__(self, stages: Iterable[Stage] = ()):
        self._stages: dict[str, Stage] = {}
        for stage in stages:
            self.register(stage)

    def register(self, stage: Stage) -> Stage:
        if stage.name in self._stages:
            raise ValueError(f"stage {stage.name!r} is registered twice")
        self._stages[stage.name] = stage
        return stage

    def get(self, name: str) -> Stage:
        if name not in self._stages:
            raise KeyError(f"no stage {name!r} is registered; known: {sorted(self._stages)}")
        return self._stages[name]

    def __contains__(self, name: str) -> bool:
        return name in self._stages

    def __iter__(self) -> Iterator[Stage]:
        return iter(self._stages.values())
