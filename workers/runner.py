"""One stage attempt on a worker: fetch inputs, call the stage's run function, store outputs.

Plain Python with no Ray in it, so it is testable alone; `workers.ray_tasks` wraps it. The
result is a small dict (artifact refs, wall and CPU seconds, or a classified error) — never
an exception for a stage-level failure, so that time spent on failed attempts is reported.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.contract import StageRun, StageSettings
from pipeline.settings import names_a_corpus
from pipeline.stage import StageContext
from workers.store import ArtifactRef, StoreConfig, StoreError

# Errors that retrying cannot fix: bad settings, a missing or unsupported model, tampered data. ValueError
# covers every pipeline.errors.PipelineError (the convention is in its docstring and in docs/design.md,
# 'Errors: permanent and retried'); anything else is retried.
PERMANENT_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, NotImplementedError, ImportError,
                    PermissionError)
PROGRESS_EVERY_S = 1.0


def under_roots(path: str | Path, roots) -> bool:
    """Whether `path`, every symlink resolved, lies inside one of `roots` (directories, also resolved)."""
    real = os.path.realpath(path)
    for root in roots:
        root = os.path.realpath(root)
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return True
    return False


def use_granted_cpus(cpus: float | None) -> int | None:
    """Size this process's compute threads to the CPUs its task was granted; returns the thread count.

    A Ray worker process runs one task after another, and torch fixes its thread pool when it is
    first used, from the OMP_NUM_THREADS that Ray set for the process's *first* task. Without this a
    2-CPU stage on a worker that began with a 1-CPU shard computes on one thread, and a 1-CPU shard on
    a worker that began with a 2-CPU stage runs two, oversubscribing the node beside its neighbour.
    Fractional grants get one thread; None (nothing granted, e.g. run in-process) changes nothing.
    """
    if not cpus:
        return None
    threads = max(1, int(cpus))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # what torch reads when this task imports it first
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    return threads


@dataclass(frozen=True)
class ExternalInput:
    """An input that is not an artifact, e.g. the source model directory named in the spec."""

    path: str


@dataclass
class StageTask:
    build_id: str
    stage_id: int
    stage_key: str
    attempt: int
    run: StageRun  # the Stage's module-level run(inputs, settings, ctx): Ray pickles it by reference
    inputs: dict[str, ArtifactRef | ExternalInput]
    outputs: tuple[str, ...]
    settings: StageSettings  # the stage's validated Settings instance
    store: StoreConfig
    output_prefix: str  # builds/<build>/<stage>/a<attempt>
    runtime: dict[str, str] = field(default_factory=dict)  # ctx.runtime: never cached or stored
    # `upload:<digest>` values in the settings (calibration, corpora, …) -> their store artifacts; the
    # worker fetches each and hands the stage its local path instead.
    uploads: dict[str, ArtifactRef] = field(default_factory=dict)
    # The deployment's source roots, when it configured them: every path the stage is handed is checked
    # again here, as the worker resolves it, so a symlink changed after submit cannot lead out.
    source_roots: tuple[str, ...] = ()
    device: str = "cpu"  # "cuda" when the scheduler granted the task a GPU (cluster.accelerator): ctx.device


class _EventLogHandler(logging.Handler):
    def __init__(self, emit_event: Callable[[dict], None]):
        super().__init__(logging.INFO)
        self.emit_event = emit_event

    def emit(self, record: logging.LogRecord) -> None:
        self.emit_event({"kind": "log", "level": record.levelname.lower(), "message": record.getMessage()})


def usable_device(device: str, emit: Callable[[dict], None]) -> str:
    """`device`, or "cpu" with a warning event when a GPU was granted on a node whose torch sees no CUDA
    (a cluster declaring GPUs it has not got, as tests' fake GPUs do): the stage runs, slowly, not never."""
    if device != "cuda":
        return device
    import torch  # lazy: a CPU task need not import torch here

    if torch.cuda.is_available():
        return device
    emit({"kind": "log", "level": "warning",
          "message": "granted a GPU, but torch sees no CUDA device on this node: computing on the CPU"})
    return "cpu"


class _WorkerContext(StageContext):
    """A StageContext whose progress goes to the build's events once, as progress events: the plain
    context also logs each report as a line, which the event log would then hold twice."""

    def report(self, task: str, done: int, total: int) -> None:
        if self.on_progress is not None:
            self.on_progress(task, done, total)


@dataclass
class AttemptUsage:
    """The attempt's compute so far, measured as the final result measures it (same clocks, same
    starting points), so a reading taken while it runs never exceeds the final charge."""

    started_wall: float = field(default_factory=time.monotonic)
    started_cpu: float = field(default_factory=time.process_time)

    def now(self) -> dict[str, float]:
        return {"wall_seconds": time.monotonic() - self.started_wall,
                "cpu_seconds": time.process_time() - self.started_cpu}


def _context(task: StageTask, work_dir: Path, emit: Callable[[dict], None],
             usage: AttemptUsage | None = None) -> StageContext:
    logger = logging.getLogger(f"elastify.stage.{task.build_id}.{task.stage_key}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.handlers = [_EventLogHandler(emit)]
    usage = usage or AttemptUsage()
    last: dict[str, float] = {}

    def on_progress(name: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total or now - last.get(name, 0.0) >= PROGRESS_EVERY_S:
            last[name] = now
            # The usage so far rides along: api.metrics charges running attempts from it, so the CPU- and
            # GPU-seconds counters advance while a stage runs instead of jumping when it ends.
            emit({"kind": "progress", "message": name, "data": {"done": done, "total": total, **usage.now()}})

    return _WorkerContext(work_dir=work_dir, on_progress=on_progress, logger=logger,
                          runtime=dict(task.runtime), device=usable_device(task.device, emit))


def _fetch(task: StageTask, store, scratch: Path) -> dict[str, Path]:
    inputs = {}
    for name, ref in task.inputs.items():
        if isinstance(ref, ExternalInput):
            path = Path(ref.path).expanduser()
            if task.source_roots and not under_roots(path, task.source_roots):
                raise PermissionError(f"input {name!r}: {ref.path} resolves outside the allowed source roots")
            if not path.exists():
                raise FileNotFoundError(f"input {name!r}: {ref.path} does not exist")
            inputs[name] = path
        else:
            inputs[name] = store.get_artifact(ref, scratch / "inputs" / name)
    return inputs


def _check_setting_paths(task: StageTask) -> None:
    """With source roots, the files the settings name must resolve inside them too (uploads and packaged
    corpus names are no paths; the path checks at submit are in cluster.sources)."""
    if not task.source_roots:
        return

    for setting, value, corpus in task.settings.named_path_fields():
        if value in task.uploads or (corpus and names_a_corpus(value)):
            continue
        if not under_roots(Path(value).expanduser(), task.source_roots):
            raise PermissionError(f"setting {setting}: {value} resolves outside the allowed source roots")


def execute(task: StageTask, emit: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Run one attempt; return {"ok", "outputs" | "error"+"retryable", "wall_seconds", "cpu_seconds"}."""
    emit = emit or (lambda event: None)
    usage = AttemptUsage()
    result: dict[str, Any]
    try:
        store = task.store.open()
        with tempfile.TemporaryDirectory(prefix=f"elastify-{task.stage_key}-") as scratch:
            scratch = Path(scratch)
            _check_setting_paths(task)
            inputs = _fetch(task, store, scratch)
            local = {value: str(store.get_artifact(ref, scratch / "uploads" / ref.digest))
                     for value, ref in task.uploads.items()}
            ctx = _context(task, scratch / "work", emit, usage)
            ctx.work_dir.mkdir()
            outputs = task.run(inputs, task.settings.with_paths(local), ctx)
            missing = set(task.outputs) - set(outputs or {})
            if missing:
                raise ValueError(f"stage {task.stage_key} did not return outputs {sorted(missing)}")
            refs = {name: store.put_artifact(f"{task.output_prefix}/{name}", Path(outputs[name])) for name in task.outputs}
        result = {"ok": True, "outputs": refs}
    except StoreError as err:
        result = {"ok": False, "error": f"{type(err).__name__}: {err}", "retryable": True}
    except PERMANENT_ERRORS as err:
        result = {"ok": False, "error": f"{type(err).__name__}: {err}", "retryable": False}
    except Exception as err:  # anything else may be transient (OOM, a flaky filesystem): retry
        result = {"ok": False, "error": f"{type(err).__name__}: {err}", "retryable": True}
    result.update(usage.now())
    return result
