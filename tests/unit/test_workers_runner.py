"""A stage attempt without Ray: inputs fetched and verified, outputs stored, failures classified."""

from __future__ import annotations

from workers.runner import ExternalInput, StageTask, execute
from workers.store import StoreConfig


def _task(tmp_path, function, inputs=None, settings=None, outputs=("out",)):
    return StageTask(build_id="b", stage_id=1, stage_key="s", attempt=1, function=function, inputs=inputs or {},
                     outputs=outputs, settings=settings or {}, store=StoreConfig(str(tmp_path / "store")),
                     output_prefix="builds/b/s/a1")


def test_success_stores_outputs_and_reports_time_and_events(tmp_path):
    events = []
    first = execute(_task(tmp_path, "workers.testing:noop", settings={"tag": "one"}), events.append)
    assert first["ok"] and first["wall_seconds"] > 0 and first["cpu_seconds"] >= 0
    ref = first["outputs"]["out"]
    chained = execute(_task(tmp_path, "workers.testing:sleep", inputs={"x": ref},
                            settings={"tag": "two", "seconds": 0.05, "tick": 0.01}), events.append)
    store = StoreConfig(str(tmp_path / "store")).open()
    assert store.get_artifact(chained["outputs"]["out"], tmp_path / "got").read_text() == "two|one"
    assert any(e["kind"] == "progress" for e in events)


def test_failures_are_classified_as_permanent_or_retryable(tmp_path):
    missing = execute(_task(tmp_path, "workers.testing:noop", inputs={"model": ExternalInput("/no/such/model")}))
    assert not missing["ok"] and not missing["retryable"]
    assert "input 'model': /no/such/model does not exist" in missing["error"]

    transient = execute(_task(tmp_path, "workers.testing:fail", settings={"message": "flaky"}))
    assert transient == {**transient, "ok": False, "retryable": True, "error": "RuntimeError: flaky"}

    wrong_outputs = execute(_task(tmp_path, "workers.testing:noop", outputs=("out", "extra")))
    assert not wrong_outputs["ok"] and "did not return outputs ['extra']" in wrong_outputs["error"]

    bad_path = execute(_task(tmp_path, "workers.testing"))
    assert not bad_path["ok"] and not bad_path["retryable"] and "module:function" in bad_path["error"]
