"""What every stage function receives besides its inputs and settings: a place to work, progress, a
logger, and the runtime values its Stage declares (build_id, signing_key: handed over at dispatch,
never stored or cached)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
ProgressFn = Callable[[str, int, int], None]  # (task, done, total)


@dataclass
class StageContext:
    work_dir: Path
    on_progress: ProgressFn | None = None
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("elastify.stage"))
    log_every_s: float = 5.0
    runtime: dict[str, str] = field(default_factory=dict)
    # Where the stage runs its model: "cuda" when its task was granted a GPU, else "cpu" (workers.runner).
    device: str = "cpu"
    _last_log: dict[str, float] = field(default_factory=dict)

    def report(self, task: str, done: int, total: int) -> None:
        """Forward progress to the caller's bar and, at most every few seconds, to the log."""
        if self.on_progress is not None:
            self.on_progress(task, done, total)
        now = time.monotonic()
        if done >= total or now - self._last_log.get(task, 0.0) >= self.log_every_s:
            self._last_log[task] = now
            self.logger.info("%s: %d/%d (%.0f%%)", task, done, total, 100.0 * done / max(total, 1))

    def track(self, items: Iterable[T], task: str, total: int | None = None) -> Iterator[T]:
        items = list(items) if total is None else items
        total = len(items) if total is None else total
        self.report(task, 0, total)
        for index, item in enumerate(items, 1):
            yield item
            self.report(task, index, total)


def quiet_context(work_dir: Path | None = None) -> StageContext:
    return StageContext(work_dir=Path(work_dir or "."))
