"""How `elastify up` and `elastify serve` stop on SIGTERM/SIGINT, and what `up` checks of the Ray cluster it joined.

systemd and Kubernetes stop a service with SIGTERM, then SIGKILL after a grace period. Ray's driver installs a
SIGTERM handler that kills the local Ray processes and exits with 1 while the scheduler still has tasks on them,
so the scheduler's clean stop (cancel its tasks, hand their stages back to the queue) ran against a dead Ray.
Here the signal only asks the loop to stop; the stop itself runs in the main thread, in order.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from urllib.parse import urlparse

log = logging.getLogger("elastify")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
NODE_CHECK_SECONDS = 30.0  # nodes join an autoscaling cluster after start: look again this often


class StopRequest:
    """Set by the first SIGTERM or SIGINT; a second SIGINT (an impatient Ctrl-C) interrupts at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name: str | None = None

    def install(self) -> StopRequest:
        """Take over both signals (after `ray.init`, which sets its own SIGTERM handler); main thread only."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.event.is_set():
            self.signal_name = signal.Signals(signum).name
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


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
