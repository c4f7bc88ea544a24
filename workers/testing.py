"""Tiny stages for tests and benchmarks of the control plane; they follow the stage contract.

Every stage writes a small output file so that artifacts, digests and the cache are real. A
`journal` setting names a file to which each execution appends one line (pid, key, times),
so tests can count executions and check that no stage ever ran twice at the same time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pipeline.stage import StageContext


def _journal(settings: dict, event: str, **extra) -> None:
    if settings.get("journal"):
        key = "|".join(str(settings.get(name, "")) for name in ("tag", "level"))  # one key per DAG node
        line = json.dumps({"key": key, "pid": os.getpid(), "event": event, "t": time.time(), **extra})
        with open(settings["journal"], "a") as handle:  # O_APPEND: one small write is atomic
            handle.write(line + "\n")


def _output(inputs: dict[str, Path], settings: dict, ctx: StageContext) -> dict[str, Path]:
    parts = [settings.get("tag", "")] + [Path(p).read_text() if Path(p).is_file() else str(p) for p in sorted(inputs.values())]
    out = ctx.work_dir / "out.txt"
    out.write_text("|".join(parts))
    return {"out": out}


def noop(inputs: dict[str, Path], settings: dict, ctx: StageContext) -> dict[str, Path]:
    _journal(settings, "run")
    return _output(inputs, settings, ctx)


def sleep(inputs: dict[str, Path], settings: dict, ctx: StageContext) -> dict[str, Path]:
    """Sleep `seconds`, ticking the journal every `tick` s; records its pid in `pid_file` first.

    With `only_first_time`, a run that finds `pid_file` already there returns at once (used to
    let a killed attempt's retry finish quickly). With `chatty`, it logs every tick.
    """
    pid_file = Path(settings["pid_file"]) if settings.get("pid_file") else None
    quick = settings.get("only_first_time") and pid_file is not None and pid_file.exists()
    if pid_file is not None and not quick:
        (ctx.work_dir / "partial.bin").write_bytes(b"half-written")
        pid_file.write_text(str(os.getpid()))
    seconds = 0.0 if quick else float(settings.get("seconds", 1.0))
    deadline = time.monotonic() + seconds
    total = max(1, int(seconds / float(settings.get("tick", 0.1))))
    step = 0
    while True:
        _journal(settings, "tick")
        ctx.report("sleep", min(step, total), total)
        if settings.get("chatty"):  # a log event every tick (progress events are throttled)
            ctx.logger.info("tick %d", step)
        if time.monotonic() >= deadline:
            break
        time.sleep(min(float(settings.get("tick", 0.1)), max(0.0, deadline - time.monotonic())))
        step += 1
    return _output(inputs, settings, ctx)


def burn(inputs: dict[str, Path], settings: dict, ctx: StageContext) -> dict[str, Path]:
    """A CPU-bound stage: `iterations` rounds of sha256 (single-threaded, deterministic)."""
    import hashlib

    value = str(settings.get("tag", "")).encode()
    for _ in range(int(settings.get("iterations", 200_000))):
        value = hashlib.sha256(value).digest()
    out = ctx.work_dir / "out.txt"
    out.write_text(value.hex())
    return {"out": out}


def fail(inputs: dict[str, Path], settings: dict, ctx: StageContext) -> dict[str, Path]:
    raise RuntimeError(settings.get("message", "this stage always fails"))
