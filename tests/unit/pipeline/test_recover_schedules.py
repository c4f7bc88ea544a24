"""Recovery schedules: which level's shard reads which level's adapter, and how deep the DAG is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from pipeline.chain import _recover_shards
from pipeline.settings import RecoverSettings

LEVELS = [0.2, 0.3, 0.5, 0.7, 0.9, 1.0]


def _sources(schedule: str | None = None, **settings) -> dict[str, str | None]:
    """level -> the level whose adapter its shard starts from (None: cold)."""
    if schedule is not None:
        settings["schedule"] = schedule
    shards = _recover_shards(SimpleNamespace(levels=LEVELS), RecoverSettings(**settings))
    sources = {}
    for shard in shards:
        assert shard.settings == {"level": shard.label}
        assert set(shard.inputs) <= {"init_adapter"}
        init = shard.inputs.get("init_adapter")
        if init is not None:
            assert init[1] == "adapter"
            assert [s.label for s in shards].index(init[0]) < [s.label for s in shards].index(shard.label)  # source first
        sources[shard.label] = init[0] if init else None
    return sources


def _depth(sources: dict[str, str | None]) -> int:
    """Rounds of training when every shard whose source is done runs at once."""
    def depth(level):
        return 1 if sources[level] is None else 1 + depth(sources[level])

    return max(map(depth, sources))


def test_chain_is_a_line_each_level_from_the_next_larger():
    sources = _sources()  # the default
    assert sources == {"0.9": None, "0.7": "0.9", "0.5": "0.7", "0.3": "0.5", "0.2": "0.3"}
    assert _depth(sources) == 5


def test_shared_top_trains_the_top_cold_and_every_other_level_from_it_at_once():
    sources = _sources("shared-top")
    assert sources == {"0.9": None, "0.7": "0.9", "0.5": "0.9", "0.3": "0.9", "0.2": "0.9"}
    assert _depth(sources) == 2


def test_independent_levels_start_cold_side_by_side():
    assert _sources("independent") == dict.fromkeys(["0.2", "0.3", "0.5", "0.7", "0.9"])
    assert _sources(warm_start=False) == _sources("independent")  # the older switch says the same


def test_one_level_below_full_has_nothing_to_share():
    for schedule in ("chain", "shared-top", "independent"):
        shards = _recover_shards(SimpleNamespace(levels=[0.5, 1.0]), RecoverSettings(schedule=schedule))
        assert [(s.label, s.inputs) for s in shards] == [("0.5", {})]


def test_warm_start_and_schedule_agree_or_are_refused():
    assert RecoverSettings().schedule == "chain" and RecoverSettings().warm_start
    assert not RecoverSettings(schedule="independent").warm_start
    assert RecoverSettings(warm_start=False).schedule == "independent"
    assert RecoverSettings(schedule="shared-top", warm_start=True).schedule == "shared-top"
    for contradiction in ({"schedule": "shared-top", "warm_start": False},
                          {"schedule": "chain", "warm_start": False},
                          {"schedule": "independent", "warm_start": True}):
        with pytest.raises(ValidationError, match="contradicts schedule"):
            RecoverSettings(**contradiction)
    # a settings dump (what the fan-out and the cache key see) reads back the same
    shared = RecoverSettings(schedule="shared-top")
    assert RecoverSettings.model_validate(shared.model_dump()) == shared


def test_the_planner_runs_shared_top_levels_beside_each_other():
    from api.app import default_registry
    from cluster.dag import UpstreamInput, plan
    from cluster.spec import parse_spec

    spec = parse_spec({"source": {"model": "/models/x"}, "publish": {"name": "pkg", "version": "1.0"},
                       "levels": [0.3, 0.5, 0.7, 1.0], "stages": {"recover": {"settings": {"schedule": "shared-top"}}}})
    recover = {n.key: n for n in plan(spec, default_registry()) if n.type == "recover"}
    assert "init_adapter" not in recover["recover[0.7]"].inputs
    assert recover["recover[0.5]"].inputs["init_adapter"] == UpstreamInput("recover[0.7]", "adapter")
    assert recover["recover[0.3]"].inputs["init_adapter"] == UpstreamInput("recover[0.7]", "adapter")
