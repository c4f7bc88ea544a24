"""The state machine, BuildSpec validation and DAG planning (no database, no Ray)."""

from __future__ import annotations

import pytest

from cluster.dag import ExternalPath, UpstreamInput, plan
from cluster.registry import Registry, Resources, Shard, StageRegistration
from cluster.spec import SpecError, parse_spec
from cluster.stages import ELASTILM_STAGES, builtin_registry
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


def test_builtin_dag_is_the_elastilm_chain_and_checks_stage_settings():
    spec = parse_spec({**BASE, "levels": [0.5, 0.7, 1.0],
                       "stages": {"profile": {"settings": {"windows": 2}}, "label": {"settings": {"shards": 3}}}})
    nodes = plan(spec, builtin_registry())
    assert [n.key for n in nodes] == [
        "profile", "elastify", "recover[0.5]", "recover[0.7]", "recover-install", "latency", "tlm-score",
        "label[0]", "label[1]", "label[2]", "label-derive", "tlm-decision", "evaluate", "publish"]
    by_key = {n.key: n for n in nodes}
    assert by_key["profile"].inputs == {"model": ExternalPath("/models/x")}
    assert by_key["profile"].settings == {"calibration": ["ptb:train"], "windows": 2}
    assert by_key["recover[0.7]"].settings["level"] == "0.7" and by_key["recover[0.7]"].resources["num_cpus"] == 1
    assert by_key["recover-install"].inputs == {"package": UpstreamInput("elastify", "package"),
                                                "adapter.0.5": UpstreamInput("recover[0.5]", "adapter"),
                                                "adapter.0.7": UpstreamInput("recover[0.7]", "adapter")}
    assert by_key["label[2]"].settings | {"shard": 2, "shards": 3} == by_key["label[2]"].settings
    assert by_key["label-derive"].inputs["meta.1"] == UpstreamInput("label[1]", "meta")
    assert by_key["publish"].inputs == {"package": UpstreamInput("recover-install", "package"),
                                        "report": UpstreamInput("evaluate", "report_card"),
                                        "latency": UpstreamInput("latency", "latency"),
                                        "tlm": UpstreamInput("tlm-decision", "tlm")}
    assert by_key["elastify"].settings["name"] == "pkg" and by_key["elastify"].resources["num_cpus"] == 2


def test_switching_off_elastilm_stages_falls_back_to_the_alternative_inputs():
    off = {name: {"enabled": False} for name in ELASTILM_STAGES}
    nodes = plan(parse_spec({**BASE, "stages": off}), builtin_registry())
    assert [n.key for n in nodes] == ["profile", "elastify", "evaluate", "publish"]
    publish = {n.key: n for n in nodes}["publish"]
    assert publish.inputs == {"package": UpstreamInput("elastify", "package"),
                              "report": UpstreamInput("evaluate", "report_card")}

    no_decision = plan(parse_spec({**BASE, "stages": {"tlm-decision": {"enabled": False}}}), builtin_registry())
    assert {n.key: n for n in no_decision}["publish"].inputs["tlm"] == UpstreamInput("tlm-score", "tlm")

    without_eval = plan(parse_spec({**BASE, "stages": {**off, "evaluate": {"enabled": False}}}), builtin_registry())
    assert "report" not in {n.key: n for n in without_eval}["publish"].inputs  # optional input dropped


def test_builtin_dag_reports_every_bad_setting_and_missing_dependency():
    with pytest.raises(SpecError) as caught:
        plan(parse_spec({**BASE, "stages": {"profile": {"settings": {"windowz": 2}}, "elastify": {"enabled": False},
                                            "recolour": {}}}), builtin_registry())
    fields = {where for where, _ in caught.value.problems}
    # The root causes (every stage that reads elastify's package), not their knock-on effects.
    assert fields == {"stages.profile.settings.windowz", "stages.recolour", "stages.recover",
                      "stages.recover-install", "stages.latency", "stages.tlm-score"}

    with pytest.raises(SpecError, match="fans out to no shards"):  # only the full level: nothing to recover
        plan(parse_spec({**BASE, "levels": [1.0]}), builtin_registry())
    with pytest.raises(SpecError, match="label-derive"):  # labels without their consumer's input
        plan(parse_spec({**BASE, "stages": {"label": {"enabled": False}}}), builtin_registry())


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
