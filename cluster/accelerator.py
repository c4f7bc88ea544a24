"""Which stage tasks get a GPU: the build's `accelerator` against what the cluster offers.

A stage that runs a model declares `Resources(accelerated=True)` (pipeline.chain). Under
`accelerator: auto` such a task asks Ray for one GPU when some live node offers GPUs, and for CPUs
only otherwise; `cuda` always asks for one (a cluster without GPUs then fails the stage as
unschedulable, naming the resource); `cpu` never does. A `num_gpus` the spec sets for a stage wins
over all three. The choice is made at dispatch, so a cluster that gains GPU nodes mid-build uses
them for the stages not yet started, and the attempt's ledger row charges what was granted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

Accelerator = Literal["auto", "cpu", "cuda"]
ACCELERATORS: tuple[str, ...] = ("auto", "cpu", "cuda")


def granted_resources(resources: Mapping[str, Any], accelerator: Accelerator, cluster_gpus: float) -> dict[str, Any]:
    """The resources one task of a stage asks Ray for.

    `resources`: the stage row's (Stage.resources merged with the spec's overrides; `gpus_set` marks
    a spec that named num_gpus); `cluster_gpus`: the most GPUs one live node offers (0 when none or unknown).
    """
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, not {accelerator!r}")
    granted = {key: value for key, value in resources.items() if key not in ("accelerated", "gpus_set")}
    if resources.get("gpus_set") or not resources.get("accelerated"):
        return granted
    wants_gpu = accelerator == "cuda" or (accelerator == "auto" and cluster_gpus >= 1)
    granted["num_gpus"] = max(float(granted.get("num_gpus") or 0.0), 1.0) if wants_gpu else float(granted.get("num_gpus") or 0.0)
    return granted


def device_for(resources: Mapping[str, Any]) -> str:
    """Where the task computes: on CUDA when it was granted a GPU."""
    return "cuda" if float(resources.get("num_gpus") or 0.0) > 0 else "cpu"
