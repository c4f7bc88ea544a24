"""A stage attempt without Ray: inputs fetched and verified, outputs stored, failures classified."""

from __future__ import annotations

import os
import pickle

import torch

from pipeline.stage import StageContext
from workers import testing
from workers.runner import ExternalInput, StageTask, execute, use_granted_cpus
from workers.store import StoreConfig


def _task(tmp_path, run, inputs=None, settings=None, outputs=("out",), runtime=None):
    return StageTask(build_id="b", stage_id=1, stage_key="s", attempt=1, run=run, inputs=inputs or {},
                     outputs=outputs, settings=testing.TinySettings(**(settings or {})),
                     store=StoreConfig(str(tmp_path / "store")), output_prefix="builds/b/s/a1", runtime=runtime or {})


def test_success_stores_outputs_and_reports_time_and_events(tmp_path):
    events = []
    first = execute(_task(tmp_path, testing.noop, settings={"tag": "one"}), events.append)
    assert first["ok"] and first["wall_seconds"] > 0 and first["cpu_seconds"] >= 0
    ref = first["outputs"]["out"]
    chained = execute(_task(tmp_path, testing.sleep, inputs={"x": ref},
                            settings={"tag": "two", "seconds": 0.05, "tick": 0.01}), events.append)
    store = StoreConfig(str(tmp_path / "store")).open()
    assert store.get_artifact(chained["outputs"]["out"], tmp_path / "got").read_text() == "two|one"
    assert any(e["kind"] == "progress" for e in events)


def test_failures_are_classified_as_permanent_or_retryable(tmp_path):
    missing = execute(_task(tmp_path, testing.noop, inputs={"model": ExternalInput("/no/such/model")}))
    assert not missing["ok"] and not missing["retryable"]
    assert "input 'model': /no/such/model does not exist" in missing["error"]

    transient = execute(_task(tmp_path, testing.fail, settings={"message": "flaky"}))
    assert transient == {**transient, "ok": False, "retryable": True, "error": "RuntimeError: flaky"}

    wrong_outputs = execute(_task(tmp_path, testing.noop, outputs=("out", "extra")))
    assert not wrong_outputs["ok"] and "did not return outputs ['extra']" in wrong_outputs["error"]


def _record_runtime(inputs, settings: testing.TinySettings, ctx: StageContext):
    out = ctx.work_dir / "out.txt"
    out.write_text(f"{type(settings).__name__} {settings.tag} {sorted(ctx.runtime.items())}")
    return {"out": out}


def test_the_stage_gets_its_settings_object_and_runtime_values_apart(tmp_path):
    result = execute(_task(tmp_path, _record_runtime, settings={"tag": "t"}, runtime={"build_id": "b1"}))
    store = StoreConfig(str(tmp_path / "store")).open()
    assert store.get_artifact(result["outputs"]["out"], tmp_path / "got").read_text() == "TinySettings t [('build_id', 'b1')]"


def test_a_task_of_the_chain_pickles_its_run_function_by_reference():
    from pipeline.chain import STAGES

    profile = next(stage for stage in STAGES if stage.name == "profile")
    task = StageTask(build_id="b", stage_id=1, stage_key="profile", attempt=1, run=profile.run, inputs={},
                     outputs=profile.outputs, settings=profile.settings(windows=3), store=StoreConfig("/tmp/s"),
                     output_prefix="p")
    data = pickle.dumps(task)
    assert b"pipeline.chain" in data and b"run_profile" in data and len(data) < 4096
    again = pickle.loads(data)
    assert again.run is profile.run and again.settings == task.settings


def test_a_task_computes_on_the_threads_it_was_granted(monkeypatch):
    """A reused worker process must not keep the thread count its first task's grant gave torch."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert use_granted_cpus(1) == 1 and torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
        assert use_granted_cpus(2) == 2 and torch.get_num_threads() == 2
        assert use_granted_cpus(0.5) == 1 and torch.get_num_threads() == 1  # a fractional grant still computes
        assert use_granted_cpus(None) is None and torch.get_num_threads() == 1  # nothing granted: unchanged
    finally:
        torch.set_num_threads(before)


def _reports_progress(inputs, settings: testing.TinySettings, ctx: StageContext):
    ctx.logger.info("loading")
    for _ in ctx.track(range(3), "layers"):
        sum(i * i for i in range(20_000))  # some CPU time for the usage readings to measure
    out = ctx.work_dir / "out"
    out.write_text("done")
    return {"out": out}


def test_each_progress_report_is_one_event_carrying_the_usage_so_far_never_above_the_final_charge(tmp_path):
    events = []
    result = execute(_task(tmp_path, _reports_progress), events.append)
    assert result["ok"]
    assert [e["message"] for e in events if e["kind"] == "log"] == ["loading"]  # no "layers: 3/3" line beside them
    progress = [e["data"] for e in events if e["kind"] == "progress"]
    assert [(p["done"], p["total"]) for p in progress][-1] == (3, 3) and progress[0]["done"] == 0
    cpu = [p["cpu_seconds"] for p in progress]
    wall = [p["wall_seconds"] for p in progress]
    assert cpu == sorted(cpu) and wall == sorted(wall) and cpu[-1] > 0
    assert cpu[-1] <= result["cpu_seconds"] and wall[-1] <= result["wall_seconds"]
