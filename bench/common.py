"""Shared benchmark helpers: interleaved timing (so drift hits every case alike), tables, raw JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

console = Console()


def interleaved_medians(cases: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each case, running the cases round-robin."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            started = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in samples.items()}


def print_table(title: str, columns: list[str], rows: list[list[object]]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*[str(cell) for cell in row])
    console.print(table)


def command_line() -> str:
    """How this run was started, as `python -m PACKAGE.MODULE ARGS` (sys.argv[0] is the module's file)."""
    script = Path(sys.argv[0]).resolve()
    try:
        module = ".".join(script.relative_to(ROOT).with_suffix("").parts)
    except ValueError:  # not a file of this repository (an interactive session, say)
        return shlex.join(sys.argv)
    return shlex.join(["python", "-m", module, *sys.argv[1:]])


def machine(load_before: tuple[float, ...] | None = None) -> dict[str, object]:
    """The machine a run measured on; the load averages show what else ran on it meanwhile."""
    facts: dict[str, object] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                                "python": platform.python_version()}
    if load_before is not None:
        facts |= {"loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}
    return facts


def write_file(path: Path, content: bytes) -> None:
    """`content` at `path`, written to a temporary file and renamed: a run that dies half-way leaves the
    previous file whole."""
    # Imported only now: importing device_sdk sets OMP_WAIT_POLICY, which would change what a bench measures
    # if common brought it in before torch.
    from device_sdk.format import atomic_write_bytes

    atomic_write_bytes(path, content)
    path.chmod(0o644)  # the temporary file was owner-only; a result is for everyone to read


def write_json(path: Path, data: object, indent: int = 2) -> None:
    write_file(path, (json.dumps(data, indent=indent, default=str) + "\n").encode())


def write_results(name: str, args: argparse.Namespace, rows: list, load_before: tuple[float, ...] | None = None,
                  **extra: object) -> Path:
    """bench/results/<name>.json: the rows, the settings, the command line and the machine."""
    path = RESULTS / f"{name}.json"
    write_json(path, {"command": command_line(), "settings": vars(args), "machine": machine(load_before),
                      "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra, "rows": rows})
    console.print(f"raw JSON: {path}")
    return path
