"""Stage cache keys: what a stage reads goes into its key, including files its settings name."""

from __future__ import annotations

from api.app import default_registry
from cluster.models import Stage
from cluster.scheduler import Scheduler
from cluster.settings import Settings
from workers.runner import ExternalInput


def _key(scheduler: Scheduler, stage_type: str, settings: dict, inputs=None) -> str:
    registration = scheduler.registry.get(stage_type)
    row = Stage(key=stage_type, type=stage_type, settings=registration.settings(**settings).model_dump(mode="json"))
    return scheduler._cache_key(row, registration, inputs or {}, {}, "acme")


def test_rewriting_a_file_named_in_the_settings_changes_the_cache_key(tmp_path):
    scheduler = Scheduler(Settings(home=tmp_path / "home", database_url=f"sqlite:///{tmp_path / 'jobs.db'}"),
                          default_registry())
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("the first calibration text")
    first = _key(scheduler, "profile", {"calibration": [str(calibration), "ptb:train"]})
    assert _key(scheduler, "profile", {"calibration": [str(calibration), "ptb:train"]}) == first
    calibration.write_text("another calibration text, same path")
    assert _key(scheduler, "profile", {"calibration": [str(calibration), "ptb:train"]}) != first

    instructions, encoder = tmp_path / "chat.jsonl", tmp_path / "encoder"
    instructions.write_text('{"text": "a"}\n')
    encoder.mkdir()
    (encoder / "config.json").write_text("{}")
    recover = _key(scheduler, "recover", {"instructions": str(instructions)})
    instructions.write_text('{"text": "b"}\n')
    assert _key(scheduler, "recover", {"instructions": str(instructions)}) != recover
    experts = _key(scheduler, "experts", {"encoder": str(encoder)})
    (encoder / "config.json").write_text('{"hidden": 1}')  # a directory's content counts too
    assert _key(scheduler, "experts", {"encoder": str(encoder)}) != experts


def test_the_source_model_is_keyed_by_content_as_before(tmp_path):
    scheduler = Scheduler(Settings(home=tmp_path / "home", database_url=f"sqlite:///{tmp_path / 'jobs.db'}"),
                          default_registry())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    first = _key(scheduler, "profile", {}, {"model": ExternalInput(str(model))})
    (model / "config.json").write_text('{"layers": 2}')
    assert _key(scheduler, "profile", {}, {"model": ExternalInput(str(model))}) != first
