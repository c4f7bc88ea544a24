"""The Ray side of a stage attempt: one remote function, sized per stage by `.options()`."""

from __future__ import annotations

from typing import Any

import ray

from workers.runner import StageTask, execute, use_granted_cpus


def _event_sender(events, task: StageTask):
    """Push worker events to the scheduler's queue; a gone scheduler must not fail the stage."""

    def emit(event: dict) -> None:
        if events is None:
            return
        # Fire and forget on the queue's actor. `Queue.put_nowait` would ray.get() the call, and a
        # task blocked in ray.get lends its CPU to the next queued task: two shards would then run
        # on one CPU. Events are best effort (a full queue or a gone scheduler drops them); results are not.
        try:
            events.actor.put_nowait.remote(
                {**event, "build_id": task.build_id, "stage_id": task.stage_id, "attempt": task.attempt})
        except Exception:
            pass

    return emit


@ray.remote(max_retries=0)  # the scheduler retries, with backoff and a record of every attempt
def run_stage(task: StageTask, events=None) -> dict[str, Any]:
    import os

    emit = _event_sender(events, task)
    threads = use_granted_cpus(ray.get_runtime_context().get_assigned_resources().get("CPU"))
    emit({"kind": "state", "message": f"started on pid {os.getpid()} with {threads or 'default'} threads"})
    return execute(task, emit)


def submit(task: StageTask, resources: dict[str, Any], events=None):
    """Submit one attempt with the stage's declared resources; return its ObjectRef."""
    options: dict[str, Any] = {
        "num_cpus": resources.get("num_cpus", 1),
        "num_gpus": resources.get("num_gpus", 0),
        "name": f"{task.stage_key}@{task.build_id}#{task.attempt}",
    }
    if resources.get("memory"):
        options["memory"] = int(resources["memory"])
    if resources.get("custom"):
        options["resources"] = dict(resources["custom"])
    return run_stage.options(**options).remote(task, events)
