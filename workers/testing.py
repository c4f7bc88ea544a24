"""Tiny stages for tests and benchmarks of the control plane; they follow the stage contract.

Every stage writes a small output file so that artifacts, digests and the cache are real. A
`journal` setting names a file to which each execution appends one line (pid, key, times),
so tests can count executions and check that no stage ever ran twice at the same time.
`tiny_stage("first", sleep)` declares one of them as a `Stage` with `TinySettings`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pipeline.contract import Stage, StageSettings
from pipeline.stage import StageContext


class TinySettings(StageSettings):
    tag: str = ""  # joins the output, so that stages with different tags have different outputs
    level: float | None = None  # set per shard by a fan-out
    journal: str | None = None
    seconds: float = 1.0  # sleep
    tick: float = 0.1  # sleep
    pid_file: str | None = None  # sleep
    only_first_time: bool = False  # sleep
    chatty: bool = False  # sleep
    iterations: int = 200_000  # burn
    message: str = "this stage always fails"  # fail


def tiny_stage(name: str, run=None, **fields) -> Stage:
    """A Stage running one of the functions below (default `noop`), with output `out` and TinySettings."""
    return Stage(name=name, run=run or noop, settings=TinySettings, outputs=("out",), **fields)


def _journal(settings: TinySettings, event: str, **extra) -> None:
    if settings.journal:
        level = "" if settings.level is None else settings.level
        key = f"{settings.tag}|{level}"  # one key per DAG node
        line = json.dumps({"key": key, "pid": os.getpid(), "event": event, "t": time.time(), **extra})
        with open(settings.journal, "a") as handle:  # O_APPEND: one small write is atomic
            handle.write(line + "\n")


def _output(inputs: dict[str, Path], settings: TinySettings, ctx: StageContext) -> dict[str, Path]:
    parts = [settings.tag] + [Path(p).read_text() if Path(p).is_file() else str(p) for p in sorted(inputs.values())]
    out = ctx.work_dir / "out.txt"
    out.write_text("|".join(parts))
    return {"out": out}


def noop(inputs: dict[str, Path], settings: TinySettings, ctx: StageContext) -> dict[str, Path]:
    _journal(settings, "run", device=ctx.device)
    return _output(inputs, settings, ctx)


def sleep(inputs: dict[str, Path], settings: TinySettings, ctx: StageContext) -> dict[str, Path]:
    """Sleep `seconds`, ticking the journal every `tick` s; records its pid in `pid_file` first.

    With `only_first_time`, a run that finds `pid_file` already there returns at once (used to
    let a killed attempt's retry finish quickly). With `chatty`, it logs every tick.
    """
    pid_file = Path(settings.pid_file) if settings.pid_file else None
    quick = settings.only_first_time and pid_file is not None and pid_file.exists()
    if pid_file is not None and not quick:
        (ctx.work_dir / "partial.bin").write_bytes(b"half-written")
        pid_file.write_text(str(os.getpid()))
    seconds = 0.0 if quick else settings.seconds
    deadline = time.monotonic() + seconds
    total = max(1, int(seconds / settings.tick))
    step = 0
    while True:
        _journal(settings, "tick")
        ctx.report("sleep", min(step, total), total)
        if settings.chatty:  # a log event every tick (progress events are throttled)
            ctx.logger.info("tick %d", step)
        if time.monotonic() >= deadline:
            break
        time.sleep(min(settings.tick, max(0.0, deadline - time.monotonic())))
        step += 1
    return _output(inputs, settings, ctx)


def burn(inputs: dict[str, Path], settings: TinySettings, ctx: StageContext) -> dict[str, Path]:
    """A CPU-bound stage: `iterations` rounds of sha256 (single-threaded, deterministic)."""
    import hashlib

    value = settings.tag.encode()
    for _ in range(settings.iterations):
        value = hashlib.sha256(value).digest()
    out = ctx.work_dir / "out.txt"
    out.write_text(value.hex())
    return {"out": out}


def threads(inputs: dict[str, Path], settings: TinySettings, ctx: StageContext) -> dict[str, Path]:
    """Journal the number of threads torch computes with in this task (`threads`), beside the pid."""
    import torch

    _journal(settings, "run", threads=torch.get_num_threads())
    return _output(inputs, settings, ctx)


def fail(inputs: dict[str, Path], settings: TinySettings, ctx: StageContext) -> dict[str, Path]:
    raise RuntimeError(settings.message)
