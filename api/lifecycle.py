"""How `elastify up` and `elastify serve` stop on SIGTERM/SIGINT, and what `up` checks of the Ray cluster it joined.

systemd and Kubernetes stop a service with SIGTERM, then SIGKILL after a grace period. Ray's driver installs a
SIGTERM handler that kills the local Ray processes and exits with 1 while the scheduler still has tasks on them,
so the scheduler's clean stop (cancel its tasks, hand their stages back to the queue) ran against a dead Ray.
Here the signal only asks the loop to stop; the stop itself runs in the main thread, in order, unless Ray
went down with the same signal and blocks it (then StopWatch hands the stages back through the database).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from urllib.parse import urlparse

log = logging.getLogger("elastify")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
NODE_CHECK_SECONDS = 30.0  # nodes join an autoscaling cluster after start: look again this often
# How long the clean stop may take before the stages are handed back through the database alone: well inside
# Kubernetes' default grace period (30 s), and before Ray's driver gives up on a dead GCS (60 s) and exits 1.
STOP_GRACE_SECONDS = 15.0


class StopRequest:
    """Set by the first SIGTERM or SIGINT; a second SIGINT (an impatient Ctrl-C) interrupts at once.

    Python runs a signal handler only when the main thread gets back to Python code, and a Ray call waiting on a
    GCS that the same signal stopped never does. So the signal also reaches a thread, through the byte that
    Python's C-level handler writes to the wakeup fd at once, and that thread sets the request.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name: str | None = None
        self._interrupts = 0
        self._wakeup: int | None = None

    def install(self) -> StopRequest:
        """Take over both signals (after `ray.init`, which sets its own SIGTERM handler); main thread only."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        if self._wakeup is None:
            read, self._wakeup = os.pipe()
            os.set_blocking(self._wakeup, False)
            threading.Thread(target=self._read_wakeups, args=(read,), name="elastify-signals", daemon=True).start()
        signal.set_wakeup_fd(self._wakeup, warn_on_full_buffer=False)
        return self

    def _request(self, signum: int) -> None:
        if not self.event.is_set():
            self.signal_name = signal.Signals(signum).name
            self.event.set()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt
        self._request(signum)

    def _read_wakeups(self, read: int) -> None:
        while received := os.read(read, 64):
            for signum in received:
                if signum in STOP_SIGNALS:
                    self._request(signum)

    def is_set(self) -> bool:
        return self.event.is_set()


class StopWatch:
    """Announces the stop when the signal comes, and makes sure it ends within `grace` seconds with the stages
    handed back, even when the same signal stopped Ray too (systemd's default KillMode=control-group signals
    every process of the service; a Kubernetes pod stops the Ray head's container beside `elastify up`'s): a Ray
    call of the scheduler may then block until Ray's driver aborts the process.

    Call `stopped()` once the scheduler has closed; if that has not happened within `grace`, a thread releases
    the scheduler's leases through the database and exits the process with 0.
    """

    def __init__(self, stop: StopRequest, scheduler, grace: float = STOP_GRACE_SECONDS) -> None:
        self.stop, self.scheduler, self.grace = stop, scheduler, grace
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="elastify-stop", daemon=True).start()

    def stopped(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        self.stop.event.wait()
        log.info("%s: stopping; running stages go back to the queue", self.stop.signal_name)
        if self._closed.wait(self.grace):
            return
        log.warning("the stop is stuck on Ray after %.0f s (was Ray stopped too?): handing running stages back "
                    "through the database", self.grace)
        try:
            released = self.scheduler.release_leases()
            log.info("%d stage(s) back in the queue", released)
        except Exception as err:  # their leases expire instead, and another scheduler requeues them
            log.error("could not release the leases (%s); they expire in %.0f s", err, self.scheduler.settings.lease_seconds)
        logging.shutdown()
        os._exit(0)


def is_local_store(store_url: str) -> bool:
    return urlparse(store_url).scheme in ("", "file")


def multi_node_store_warning(store_url: str, alive_nodes: int) -> str | None:
    """Why a local-directory store breaks on a cluster of several nodes, or None if it does not apply."""
    if alive_nodes < 2 or not is_local_store(store_url):
        return None
    return (f"the Ray cluster has {alive_nodes} nodes but the artifact store is the local directory {store_url}: "
            "a stage that runs on another node cannot read what this one wrote (\"no object … in the store\"). "
            "Set ELASTIFY_STORE_URL=s3://bucket/prefix (with ELASTIFY_STORE_ENDPOINT and credentials) on every "
            "node, or mount this directory at the same path on every node.")


class MultiNodeStoreCheck:
    """Warns once when the Ray cluster has (or later gains) a second node while the store is a local directory.

    Callable as the scheduler loop's `until`: it never asks the loop to stop, and asks Ray at most every
    NODE_CHECK_SECONDS.
    """

    def __init__(self, store_url: str, alive_nodes=None) -> None:
        self.store_url = store_url
        self.alive_nodes = alive_nodes or _alive_ray_nodes
        self.warned = not is_local_store(store_url)
        self._last = float("-inf")

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self.warned and now - self._last >= NODE_CHECK_SECONDS:
            self._last = now
            warning = multi_node_store_warning(self.store_url, self.alive_nodes())
            if warning:
                log.warning("%s", warning)
                self.warned = True
        return False


def _alive_ray_nodes() -> int:
    import ray

    try:
        return sum(1 for node in ray.nodes() if node.get("Alive"))
    except Exception as err:  # the GCS is briefly unreachable: look again next time
        log.debug("could not list Ray nodes: %s", err)
        return 0
