"""The most one stage task can be granted: a Ray task runs on one node, so a request above what the
largest node offers (`num_cpus: 1000`) would wait forever, holding its build's place in the
tenant's concurrency quota. Submit refuses such requests (422 naming the field) and the scheduler
fails a stage the live cluster can never place instead of leaving it pending.

The limits come from a server setting (ELASTIFY_MAX_TASK_RESOURCES, e.g.
`num_cpus=16,num_gpus=1,memory=64000000000,fake_gpu=2`) or, in a process joined to Ray, from
the live nodes' resources. A resource the setting does not name is not checked; on a live
cluster, a custom resource no node has can never be granted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# BuildSpec/Stage resource names -> Ray's names for them; anything else is a custom resource.
RAY_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


@dataclass(frozen=True)
class Capacity:
    """Per resource, the most any one node offers; `complete`: a resource not listed is offered nowhere."""

    largest: Mapping[str, float] = field(default_factory=dict)  # num_cpus, num_gpus, memory, custom names
    complete: bool = False
    source: str = "ELASTIFY_MAX_TASK_RESOURCES"

    def problems(self, resources: Mapping[str, Any]) -> list[tuple[str, str]]:
        """(resource, message) for every request in `resources` (a stage row's dict) above the limit."""
        requested = {name: resources.get(name) for name in RAY_NAMES} | dict(resources.get("custom") or {})
        found = []
        for name, amount in requested.items():
            if not amount:
                continue
            where = name if name in RAY_NAMES else f"custom.{name}"
            if name in self.largest:
                if amount > self.largest[name]:
                    found.append((where, f"asks for {amount:g} {name}; the most one task can get is "
                                         f"{self.largest[name]:g} ({self.source})"))
            elif self.complete:
                found.append((where, f"asks for {amount:g} {name}, a resource no node offers ({self.source})"))
        return found


def parse_capacity(text: str) -> Capacity | None:
    """`num_cpus=16,num_gpus=1,memory=64e9,fake_gpu=2` -> Capacity; empty -> None (no limit set)."""
    if not text.strip():
        return None
    largest = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            largest[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"ELASTIFY_MAX_TASK_RESOURCES: {part.strip()!r} is not name=number") from None
    return Capacity(largest)


def node_capacity(nodes: Iterable[Mapping[str, Any]]) -> Capacity:
    """The largest offer per resource over the live nodes of `ray.nodes()`."""
    from_ray = {ray_name: name for name, ray_name in RAY_NAMES.items()}
    largest: dict[str, float] = {}
    for node in nodes:
        if not node.get("Alive"):
            continue
        for ray_name, amount in (node.get("Resources") or {}).items():
            if ray_name.startswith("node:") or ray_name in ("object_store_memory",) or ray_name.startswith("accelerator_type:"):
                continue  # placement labels and the object store, never asked for by a stage
            name = from_ray.get(ray_name, ray_name)
            largest[name] = max(largest.get(name, 0.0), float(amount))
    return Capacity(largest, complete=True, source="the largest live Ray node")


def current_capacity(setting: str) -> Capacity | None:
    """The server setting if given, else the live cluster's if this process joined Ray, else None (unknown)."""
    configured = parse_capacity(setting)
    if configured is not None:
        return configured
    import ray

    if not ray.is_initialized():
        return None
    return node_capacity(ray.nodes())


def cluster_gpus(setting: str) -> float:
    """The most GPUs one node offers: the live cluster's when this process joined Ray, else the server
    setting's; 0 when neither says (a stage then runs on CPUs under `accelerator: auto`)."""
    import ray

    capacity = node_capacity(ray.nodes()) if ray.is_initialized() else parse_capacity(setting)
    return float(capacity.largest.get("num_gpus", 0.0)) if capacity is not None else 0.0
