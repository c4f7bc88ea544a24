"""Run a chain of stages in this process, one after another, without a control plane or a store.

What `elastify elastify` builds with: the same `Stage` objects the scheduler runs (pipeline.chain),
switched on and off as a build spec's `stages` would, ordered and wired by the same rules
(pipeline.contract: `enabled_stages`, `dependency_order`, `resolve_inputs`), so a disabled stage's
consumer falls back to its other input exactly as in a build. Each stage works in its own folder
under `work_dir` and hands the next stage the paths it returned. It names no stage.

What it leaves out: fan-out (a stage with shards is refused; run such a build on the cluster),
retries, the cache and the store. A stage that fails raises `StageFailed` naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from pipeline.contract import (
    SOURCE_PREFIX,
    Problem,
    Stage,
    StageSettings,
    dependency_order,
    enabled_stages,
    resolve_inputs,
)
from pipeline.stage import ProgressFn, StageContext

Outputs = dict[str, dict[str, Path]]  # stage -> output -> path


class ChainError(ValueError):
    """The stages, as switched on, do not make a chain this runner can run (the same inputs fail the same way)."""


class StageFailed(Exception):
    """Stage `stage` raised `error` (also the exception's __cause__)."""

    def __init__(self, stage: str, error: BaseException):
        super().__init__(f"stage {stage}: {error}")
        self.stage, self.error = stage, error


def plan_chain(stages: Iterable[Stage], enabled: Mapping[str, bool], settings: Mapping[str, StageSettings],
               sources: Mapping[str, str | Path]) -> list[tuple[Stage, dict[str, str]]]:
    """The enabled stages in dependency order, each with input -> the ref it reads; ChainError names every problem."""
    stages = list(stages)
    known = sorted(s.name for s in stages)
    problems: list[Problem] = [(f"stages.{name}", f"unknown stage; known: {known}")
                               for name in {**enabled, **settings} if name not in known]
    ordered = dependency_order(enabled_stages(stages, enabled), problems)
    given = {name: str(path) for name, path in sources.items() if path is not None}
    planned, produced = [], set()
    for stage in ordered:
        if stage.fan_out is not None:
            problems.append((f"stages.{stage.name}", "fans out into shards, which the in-process runner does not "
                                                     "run; disable it or build on the cluster"))
        own = settings.get(stage.name)
        if own is not None and not isinstance(own, stage.settings):
            problems.append((f"stages.{stage.name}.settings",
                             f"a {type(own).__name__}; the stage takes {stage.settings.__name__}"))
        planned.append((stage, resolve_inputs(stage, given, produced, problems)))
        produced.add(stage.name)
    if problems:
        raise ChainError("; ".join(f"{where}: {what}" for where, what in problems))
    if not planned:
        raise ChainError("no stage is enabled")
    return planned


def _inputs(refs: Mapping[str, str], sources: Mapping[str, str | Path], outputs: Outputs) -> dict[str, Path]:
    inputs = {}
    for name, ref in refs.items():
        producer, _, output = ref.partition(".")
        inputs[name] = Path(sources[output]) if ref.startswith(SOURCE_PREFIX) else outputs[producer][output]
    return inputs


def run_chain(
    stages: Iterable[Stage],
    *,
    enabled: Mapping[str, bool],
    settings: Mapping[str, StageSettings],
    sources: Mapping[str, str | Path],
    work_dir: Path,
    on_progress: ProgressFn | None = None,
    logger: logging.Logger | None = None,
    runtime: Mapping[str, str] | None = None,
) -> Outputs:
    """Run the enabled `stages` in order; return every stage's outputs.

    `enabled`: stage -> on/off, as a spec's `stages.<name>.enabled` (the others as by default);
    `settings`: stage -> its validated Settings (a stage not named runs with its defaults);
    `sources`: "model", ... for the `source.<field>` inputs; `runtime`: values a stage may declare
    (build_id, signing_key), each handed only to the stages that declare it.
    """
    logger = logger or logging.getLogger("elastify.stage")
    runtime = runtime or {}
    outputs: Outputs = {}
    for stage, refs in plan_chain(stages, enabled, settings, sources):
        inputs = _inputs(refs, sources, outputs)
        ctx = StageContext(work_dir=Path(work_dir) / stage.name, on_progress=on_progress, logger=logger,
                           runtime={key: runtime[key] for key in stage.runtime if key in runtime})
        ctx.work_dir.mkdir(parents=True)
        try:
            own = settings.get(stage.name)
            returned = stage.run(inputs, own if own is not None else stage.settings(), ctx)
            missing = set(stage.outputs) - set(returned or {})
            if missing:
                raise ValueError(f"did not return outputs {sorted(missing)}")
        except Exception as err:
            raise StageFailed(stage.name, err) from err
        outputs[stage.name] = {name: Path(returned[name]) for name in stage.outputs}
    return outputs
