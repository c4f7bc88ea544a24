"""The state machine, BuildSpec validation and DAG planning (no database, no Ray)."""

from __future__ import annotations

import pytest

from cluster.dag import ExternalPath, UpstreamInput, plan
from cluster.registry import Registry, Resources, Shard, StageRegistration
from cluster.spec import SpecError, parse_spec
from cluster.stages import builtin_registry
from cluster.states import IllegalTransition, Status, check

BASE = {"source": {"model": "/models/x"}, "publish": {"name": "pkg", "version": "1.0"}}


def test_state_machine_allows_the_documented_paths_and_nothing_else():
    assert check("stage", "queued", "running") is Status.RUNNING
    assert check("stage", "running", "queued") is Status.QUEUED  # retry / expired lease
    assert check("stage", "queued", "succeeded") is Status.SUCCEEDED  # cache hit
    for kind, current, new in [("build", "succeeded", "running"), ("build", "queued", "succeeded"),
                               ("stage", "failed", "queued"), ("attempt", "failed", "running"),
                               ("stage", "cancelled", "running")]:
        with pytest.raises(IllegalTransition, match=f"{kind} cannot go from {current} to {new}"):
            check(kind, current, new)


def test_invalid_spec_lists_every_offending_field():
    bad = {"source": {}, "levels": [0.5, 0.4], "publish": {"name": "Bad Name!", "version": "1"}, "colour": "red"}
    with pytest.raises(SpecError) as caught:
        parse_spec(bad)
    fields = {where for where, _ in caught.value.problems}
    assert fields == {"source.model", "levels", "publish.name", "colour"}
    assert "source.model" in str(caught.value) and "colour" in str(caught.value)


def test_spec_reads_yaml_and_json_and_hashes_content():
    yaml_spec = parse_spec("source: {model: /models/x}\npublish: {name: pkg, version: '1.0'}\nlevels: [0.5, 1.0]\n")
    json_spec = parse_spec('{"source": {"model": "/models/x"}, "publish": {"name": "pkg", "version": "1.0"}, "levels": [0.5, 1.0]}')
    assert yaml_spec == json_spec and yaml_spec.content_hash() == json_spec.content_hash()
    assert parse_spec({**BASE, "levels": [0.5]}).content_hash() != yaml_spec.content_hash()
    with pytest.raises(SpecError, match="not valid YAML"):
        parse_spec("source: [unclosed")


def test_builtin_dag_follows_registrations_and_checks_stage_settings():
    nodes = plan(parse_spec({**BASE, "stages": {"profile": {"settings": {"windows": 2}}}}), builtin_registry())
    assert [n.key for n in nodes] == ["profile", "elastify", "evaluate", "publish"]
    by_key = {n.key: n for n in nodes}
    assert by_key["profile"].inputs == {"model": ExternalPath("/models/x")}
    assert by_key["profile"].settings == {"calibration": ["ptb:train"], "windows": 2}
    assert by_key["publish"].inputs == {"package": UpstreamInput("elastify", "package"),
                                        "report": UpstreamInput("evaluate", "report")}
    assert by_key["elastify"].settings["name"] == "pkg" and by_key["elastify"].resources["num_cpus"] == 2

    without_eval = plan(parse_spec({**BASE, "stages": {"evaluate": {"enabled": False}}}), builtin_registry())
    assert "report" not in {n.key: n for n in without_eval}["publish"].inputs  # optional input dropped

    with pytest.raises(SpecError) as caught:
        plan(parse_spec({**BASE, "stages": {"profile": {"settings": {"windowz": 2}}, "elastify": {"enabled": False},
                                            "recolour": {}}}), builtin_registry())
    fields = {where for where, _ in caught.value.problems}
    assert fields == {"stages.profile.settings.windowz", "stages.recolour", "stages.evaluate", "stages.publish"}


def test_fan_out_is_declared_by_the_registration():
    registry = Registry([
        StageRegistration(name="prep", function="m:f", outputs=("out",)),
        StageRegistration(name="per_level", function="m:f", inputs={"x": "prep.out"}, outputs=("out",),
                          resources=Resources(num_gpus=0.5),
                          fan_out=lambda spec, own: [Shard(str(m), {"level": m}) for m in spec.levels]),
        StageRegistration(name="collect", function="m:f", inputs={"parts": "per_level.out"}, outputs=("out",)),
    ])
    nodes = plan(parse_spec({**BASE, "levels": [0.25, 0.5, 1.0], "stages": {"per_level": {"max_attempts": 5}}}), registry)
    assert [n.key for n in nodes] == ["prep", "per_level[0.25]", "per_level[0.5]", "per_level[1.0]", "collect"]
    assert nodes[2].settings == {"level": 0.5} and nodes[2].max_attempts == 5 and nodes[2].resources["num_gpus"] == 0.5
    assert nodes[-1].inputs == {f"parts.{m}": UpstreamInput(f"per_level[{m}]", "out") for m in ("0.25", "0.5", "1.0")}


def test_registry_refuses_duplicates_and_cycles():
    registry = Registry([StageRegistration(name="a", function="m:f", outputs=("o",))])
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(StageRegistration(name="a", function="m:f", outputs=("o",)))
    cyclic = Registry([
        StageRegistration(name="a", function="m:f", inputs={"x": "b.o"}, outputs=("o",)),
        StageRegistration(name="b", function="m:f", inputs={"x": "a.o"}, outputs=("o",)),
    ])
    with pytest.raises(SpecError, match="dependency cycle"):
        plan(parse_spec(BASE), cyclic)
