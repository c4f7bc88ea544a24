"""Console output for the CLI: rich progress bars for stage progress, logging, and error exits."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import NoReturn

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)


def fail(message: str) -> NoReturn:
    """Print a clear error and exit non-zero (2: bad input)."""
    console.print(f"[bold red]error:[/] {escape(message)}")  # a message is text: `[a-z]` in it is no markup
    raise typer.Exit(code=2)


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False, rich_tracebacks=False)],
        force=True,
    )
    for noisy in ("httpx", "urllib3", "transformers", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextlib.contextmanager
def progress_bars() -> Iterator:
    """Yield an `on_progress(task, done, total)` callback drawing one bar per task."""
    bars = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    tasks: dict[str, int] = {}

    def on_progress(task: str, done: int, total: int) -> None:
        if task not in tasks:
            tasks[task] = bars.add_task(task, total=total)
        bars.update(tasks[task], completed=done, total=total)

    with bars:
        yield on_progress
