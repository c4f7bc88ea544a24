"""The accelerator on a real Ray head with (fake) GPUs: model stages are granted one, the ledger
charges it, and a node whose torch sees no CUDA still runs the stage, on the CPU, with a warning."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from cluster.models import Attempt, Event, Stage
from cluster.registry import Registry
from cluster.service import build_summary, submit_build
from cluster.spec import parse_spec
from pipeline.contract import Resources
from tests.support.control_plane import journal_lines, make_settings, started
from workers import testing

pytestmark = pytest.mark.integration


def _registry() -> Registry:
    return Registry([
        testing.tiny_stage("model", testing.noop, resources=Resources(num_cpus=1, accelerated=True)),
        testing.tiny_stage("bookkeeping", testing.noop, inputs={"x": "model.out"}, resources=Resources(num_cpus=1)),
    ])


def _build(scheduler, registry, journal, accelerator: str) -> dict[str, tuple[float, str]]:
    """(GPUs granted, ctx.device) per stage of one build."""
    spec = parse_spec({"source": {"model": "unused"}, "levels": [1.0], "accelerator": accelerator, "cache": False,
                       "stages": {name: {"settings": {"journal": str(journal), "tag": name + accelerator}}
                                  for name in ("model", "bookkeeping")},
                       "publish": {"name": "acc", "version": "1"}}, registry)
    build_id = submit_build(scheduler.sessions, spec, registry)
    scheduler.run_until_done([build_id], timeout=120)
    assert build_summary(scheduler.sessions, build_id)["status"] == "succeeded"
    devices = {line["key"].split("|")[0].removesuffix(accelerator): line["device"] for line in journal_lines(journal)
               if line["key"].endswith(f"{accelerator}|")}
    with scheduler.sessions() as session:
        rows = session.execute(select(Stage.key, Attempt.num_gpus).join(Attempt, Attempt.stage_id == Stage.id)
                               .where(Stage.build_id == build_id)).all()
        warnings = session.scalars(select(Event.message).where(Event.build_id == build_id, Event.kind == "log")).all()
    return {key: (gpus, devices[key]) for key, gpus in rows}, warnings


def test_auto_gives_model_stages_one_gpu_and_cpu_gives_none(tmp_path, pg_url, s3_store, ray_cluster):
    registry = _registry()
    scheduler = started(make_settings(tmp_path, pg_url, s3_store), registry)
    try:
        auto, warnings = _build(scheduler, registry, tmp_path / "journal", "auto")
        # The head has 2 fake GPUs and this machine no CUDA: the GPU is granted and charged, and the
        # stage computes on the CPU after saying why.
        assert auto == {"model": (1.0, "cpu"), "bookkeeping": (0.0, "cpu")}
        assert any("granted a GPU, but torch sees no CUDA" in message for message in warnings)
        cpu, warnings = _build(scheduler, registry, tmp_path / "journal", "cpu")
        assert cpu == {"model": (0.0, "cpu"), "bookkeeping": (0.0, "cpu")}
        assert not any("granted a GPU" in message for message in warnings)
    finally:
        scheduler.close()
