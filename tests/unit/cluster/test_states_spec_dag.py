"""The state machine, BuildSpec validation and DAG planning (no database, no Ray)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from api.app import default_registry
from cluster.dag import ExternalPath, UpstreamInput, plan
from cluster.registry import Registry
from cluster.spec import SpecError, parse_spec
from cluster.states import IllegalTransition, Status, check
from pipeline.chain import ELASTILM_STAGES
from pipeline.contract import Resources, Shard
from workers.testing import tiny_stage

ROOT = Path(__file__).resolve().parents[3]

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
    nodes = plan(spec, default_registry())
    assert [n.key for n in nodes] == [
        "profile", "elastify", "corpus-generate[0]", "corpus-generate[1]", "corpus", "recover[0.7]", "recover[0.5]",
        "recover-install", "latency", "tlm-score", "label[0]", "label[1]", "label[2]", "label-derive",
        "tlm-decision", "evaluate", "publish"]
    by_key = {n.key: n for n in nodes}
    assert by_key["profile"].inputs == {"model": ExternalPath("/models/x")}
    assert by_key["profile"].settings.calibration == ["ptb:train"] and by_key["profile"].settings.windows == 2
    assert by_key["recover[0.7]"].settings.level == "0.7" and by_key["recover[0.7]"].resources["num_cpus"] == 1
    assert by_key["recover-install"].inputs == {"package": UpstreamInput("elastify", "package"),
                                                "adapter.0.5": UpstreamInput("recover[0.5]", "adapter"),
                                                "adapter.0.7": UpstreamInput("recover[0.7]", "adapter")}
    assert (by_key["label[2]"].settings.shard, by_key["label[2]"].settings.shards) == (2, 3)
    assert by_key["label-derive"].inputs["meta.1"] == UpstreamInput("label[1]", "meta")
    assert by_key["publish"].inputs == {"package": UpstreamInput("recover-install", "package"),
                                        "report": UpstreamInput("evaluate", "report_card"),
                                        "quality_plot": UpstreamInput("evaluate", "quality_plot"),
                                        "latency": UpstreamInput("latency", "latency"),
                                        "tlm": UpstreamInput("tlm-decision", "tlm")}
    # The report card reads the corpus's held-out slice and how each level was recovered.
    assert by_key["evaluate"].inputs == {"package": UpstreamInput("recover-install", "package"),
                                         "latency": UpstreamInput("latency", "latency"),
                                         "corpus": UpstreamInput("corpus", "corpus"),
                                         "recovery.0.5": UpstreamInput("recover[0.5]", "metrics"),
                                         "recovery.0.7": UpstreamInput("recover[0.7]", "metrics")}
    assert by_key["elastify"].settings.name == "pkg" and by_key["elastify"].resources["num_cpus"] == 2
    assert by_key["elastify"].settings.levels == [0.5, 0.7, 1.0]


def test_switching_off_elastilm_stages_falls_back_to_the_alternative_inputs():
    off = {name: {"enabled": False} for name in ELASTILM_STAGES}
    nodes = plan(parse_spec({**BASE, "stages": off}), default_registry())
    assert [n.key for n in nodes] == ["profile", "elastify", "evaluate", "publish"]
    publish = {n.key: n for n in nodes}["publish"]
    assert publish.inputs == {"package": UpstreamInput("elastify", "package"),
                              "report": UpstreamInput("evaluate", "report_card"),
                              "quality_plot": UpstreamInput("evaluate", "quality_plot")}

    no_decision = plan(parse_spec({**BASE, "stages": {"tlm-decision": {"enabled": False}}}), default_registry())
    assert {n.key: n for n in no_decision}["publish"].inputs["tlm"] == UpstreamInput("tlm-score", "tlm")

    without_eval = plan(parse_spec({**BASE, "stages": {**off, "evaluate": {"enabled": False}}}), default_registry())
    assert not {"report", "quality_plot"} & set({n.key: n for n in without_eval}["publish"].inputs)  # optional inputs dropped


@pytest.mark.parametrize("registry", [None, default_registry()], ids=["plain", "typed"])
def test_a_preset_expands_to_its_stage_set_and_the_specs_own_stage_entries_override_it(registry):
    def keys(extra: dict) -> list[str]:
        return [n.key for n in plan(parse_spec({**BASE, "levels": [0.5, 1.0], **extra}, registry), default_registry())]

    assert keys({"preset": "quick"}) == ["profile", "elastify", "recover[0.5]", "recover-install", "evaluate", "publish"]
    quick = {n.key: n for n in plan(parse_spec({**BASE, "preset": "quick",
                                                "stages": {"recover": {"settings": {"lr": 0.01}}}}, registry),
                                    default_registry())}
    recover = next(node for key, node in quick.items() if key.startswith("recover["))
    assert (recover.settings.steps, recover.settings.lr) == (24, 0.01)  # the preset's steps, the spec's lr
    assert "recover" not in parse_spec({**BASE, "preset": "quick"}, registry).model_dump()["stages"]  # as submitted
    steps = parse_spec({**BASE, "preset": "quick", "stages": {"recover": {"settings": {"steps": 3}}}}, registry)
    assert next(n for n in plan(steps, default_registry()) if n.type == "recover").settings.steps == 3
    with_latency = keys({"preset": "quick", "stages": {"latency": {"enabled": True}}})
    assert "latency" in with_latency and "tlm-score" not in with_latency
    assert keys({}) == keys({"preset": "default"}) and "experts" not in keys({})
    full = keys({"preset": "full", "stages": {"experts": {"settings": {"steps": 2}}}})
    assert {"experts", "export", "tlm-decision"} <= set(full)
    assert "export" not in keys({"preset": "full", "stages": {"export": {"enabled": False}}})
    with pytest.raises(SpecError, match="preset"):
        parse_spec({**BASE, "preset": "fastest"}, registry)


def test_builtin_dag_reports_every_bad_setting_and_missing_dependency():
    with pytest.raises(SpecError) as caught:
        plan(parse_spec({**BASE, "stages": {"profile": {"settings": {"windowz": 2}}, "elastify": {"enabled": False},
                                            "recolour": {}}}), default_registry())
    fields = {where for where, _ in caught.value.problems}
    # The root causes (every stage that reads elastify's package), not their knock-on effects.
    assert fields == {"stages.profile.settings.windowz", "stages.recolour", "stages.corpus-generate",
                      "stages.corpus", "stages.recover",
                      "stages.recover-install", "stages.latency", "stages.tlm-score"}

    with pytest.raises(SpecError, match="fans out to no shards"):  # only the full level: nothing to recover
        plan(parse_spec({**BASE, "levels": [1.0]}), default_registry())
    with pytest.raises(SpecError, match="label-derive"):  # labels without their consumer's input
        plan(parse_spec({**BASE, "stages": {"label": {"enabled": False}}}), default_registry())


def test_fan_out_is_declared_by_the_stage():
    registry = Registry([
        tiny_stage("prep"),
        tiny_stage("per_level", inputs={"x": "prep.out"}, resources=Resources(num_gpus=0.5),
                   fan_out=lambda spec, settings: [Shard(str(m), {"level": m}) for m in spec.levels]),
        tiny_stage("collect", inputs={"parts": "per_level.out"}),
    ])
    nodes = plan(parse_spec({**BASE, "levels": [0.25, 0.5, 1.0], "stages": {"per_level": {"max_attempts": 5}}}), registry)
    assert [n.key for n in nodes] == ["prep", "per_level[0.25]", "per_level[0.5]", "per_level[1.0]", "collect"]
    assert nodes[2].settings.level == 0.5 and nodes[2].max_attempts == 5 and nodes[2].resources["num_gpus"] == 0.5
    assert nodes[-1].inputs == {f"parts.{m}": UpstreamInput(f"per_level[{m}]", "out") for m in ("0.25", "0.5", "1.0")}


def test_registry_refuses_duplicates_and_cycles():
    registry = Registry([tiny_stage("a")])
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(tiny_stage("a"))
    with pytest.raises(ValueError, match="may not contain"):
        tiny_stage("a.b")
    cyclic = Registry([tiny_stage("a", inputs={"x": "b.out"}), tiny_stage("b", inputs={"x": "a.out"})])
    with pytest.raises(SpecError, match="dependency cycle"):
        plan(parse_spec(BASE), cyclic)


# One bad value per stage that has settings, and the field each must be reported under.
BAD_SETTINGS = {
    "profile": ({"windows": 0, "layer_method": "zzz"}, ["windows", "layer_method"]),
    "elastify": ({"align": 0, "anchor_fraction": 1.0, "levels": [0.5, 0.4]}, ["align", "anchor_fraction", "levels"]),
    "recover": ({"steps": 0, "targets": ["x_proj"], "zero_stage": 3}, ["steps", "targets.0", "zero_stage"]),
    "latency": ({"decode_tokens": 1, "prompt_lengths": []}, ["decode_tokens", "prompt_lengths"]),
    "tlm-score": ({"keep_rate": 1.5}, ["keep_rate"]),
    "label": ({"ratios": [0.5, 1.5], "shards": 0}, ["ratios", "shards"]),
    "label-derive": ({"slos": [[0.5, -1.0]]}, ["slos.0.1"]),
    "tlm-decision": ({"rule": "heaviest"}, ["rule"]),
    "evaluate": ({"windows": 0, "ppl_noise": -0.1}, ["windows", "ppl_noise"]),
    "clone-collect": ({"budgets": [], "ratio_bins": [0.5, 0.2], "shards": 10_000}, ["budgets", "ratio_bins", "shards"]),
    "clone-search": ({"rounds": 0}, ["rounds"]),
    "experts": ({"tasks": ["arc_easy", "arc_easy"], "temperature": 0}, ["tasks", "temperature"]),
    "corpus-generate": ({"prompts": 0, "sources": ["wikipedia"], "heldout_fraction": 0.5},
                        ["prompts", "sources", "heldout_fraction"]),
    "export": ({"formats": ["onnx"], "gguf_type": "q4_0"}, ["formats.0", "gguf_type"]),
}


def test_every_stage_setting_is_typed_and_every_bad_value_is_named_at_parse():
    registry = default_registry()
    stages = {name: {"settings": bad} for name, (bad, _) in BAD_SETTINGS.items()}
    stages["elastify"]["settings"]["seed"] = "x"  # a wrong type
    stages["nope"] = {}
    with pytest.raises(SpecError) as caught:
        parse_spec({**BASE, "levels": [0.5, 1.2], "stages": stages}, registry)
    fields = {where for where, _ in caught.value.problems}
    expected = {f"stages.{name}.settings.{field}" for name, (_, names) in BAD_SETTINGS.items() for field in names}
    assert fields == expected | {"stages.elastify.settings.seed", "stages.nope", "levels"}
    messages = dict(caught.value.problems)
    assert "registered stages" in messages["stages.nope"] and "(0, 1]" in messages["levels"]
    assert "increasing" in messages["stages.elastify.settings.levels"]
    assert {name for name in BAD_SETTINGS} == {s.name for s in registry if s.settings.model_fields}


def test_unknown_settings_are_named_with_what_is_allowed():
    with pytest.raises(SpecError) as caught:
        parse_spec({**BASE, "stages": {"elastify": {"settings": {"alignment": 16}}}}, default_registry())
    (field, message), = caught.value.problems
    assert field == "stages.elastify.settings.alignment" and "align" in message


def test_settings_the_spec_supplies_are_checked_when_planning_and_user_values_win():
    registry = default_registry()
    with pytest.raises(SpecError) as caught:  # clone-collect has no default budgets
        plan(parse_spec({**BASE, "stages": {"clone-collect": {"enabled": True}}}, registry), registry)
    assert {where for where, _ in caught.value.problems} == {"stages.clone-collect.settings.budgets"}
    spec = parse_spec({**BASE, "levels": [0.5, 1.0], "stages": {"elastify": {"settings": {"name": "other"}},
                                                                 "profile": {"settings": {"calibration": ["wiki"]}}}},
                      registry)
    by_key = {n.key: n for n in plan(spec, registry)}
    assert by_key["elastify"].settings.name == "other" and by_key["elastify"].settings.version == "1.0"
    assert by_key["profile"].settings.calibration == ["wiki"]
    assert [n.key for n in plan(spec, registry) if n.type == "label"] == ["label[0]", "label[1]"]  # chain default


def test_a_typed_spec_dumps_what_was_submitted():
    registry = default_registry()
    data = {**BASE, "stages": {"elastify": {"settings": {"align": 16}}, "latency": {"enabled": False}}}
    typed = parse_spec(data, registry)
    dumped = typed.model_dump(mode="json")["stages"]
    assert dumped["elastify"]["settings"] == {"align": 16} and set(dumped) == {"elastify", "latency"}
    assert typed.content_hash() == parse_spec(data).content_hash()  # the same with or without a registry


def test_planning_the_default_spec_imports_no_torch_and_no_algorithm_module():
    code = (
        "import json, sys\n"
        "from api.app import default_registry\n"
        "from cluster.dag import plan\n"
        "from cluster.spec import parse_spec\n"
        "registry = default_registry()\n"
        "spec = parse_spec({'source': {'model': 'x'}, 'publish': {'name': 'p', 'version': '1'}}, registry)\n"
        "nodes = plan(spec, registry)\n"
        "print(json.dumps({'nodes': len(nodes), 'modules': sorted(sys.modules)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    assert report["nodes"] == 22
    pipeline = {m for m in report["modules"] if m.startswith("pipeline.")}
    assert pipeline == {"pipeline.chain", "pipeline.contract", "pipeline.settings", "pipeline.stage"}
    assert not {m for m in report["modules"] if m.split(".")[0] in ("torch", "transformers", "safetensors")}


def test_a_fan_out_whose_shards_share_a_key_is_a_spec_error_naming_the_stage():
    registry = Registry([
        tiny_stage("prep"),
        tiny_stage("per_level", inputs={"x": "prep.out"},
                   fan_out=lambda spec, settings: [Shard("same", {"level": m}) for m in spec.levels]),
    ])
    with pytest.raises(SpecError) as caught:
        plan(parse_spec({**BASE, "levels": [0.5, 1.0]}), registry)
    assert caught.value.problems == [("stages.per_level", "fans out to several shards with one key: ['per_level[same]']")]


def test_recovery_distils_on_the_corpus_top_down_each_level_from_the_next_larger_ones_adapter():
    nodes = plan(parse_spec({**BASE, "levels": [0.3, 0.5, 0.7, 1.0]}), default_registry())
    recover = [n for n in nodes if n.type == "recover"]
    assert [n.key for n in recover] == ["recover[0.7]", "recover[0.5]", "recover[0.3]"]  # each after its source
    assert all(n.settings.loss == "distill" and n.settings.warm_start for n in recover)
    assert recover[0].inputs == {"package": UpstreamInput("elastify", "package"),
                                 "corpus": UpstreamInput("corpus", "corpus")}  # the largest starts cold
    assert recover[1].inputs["init_adapter"] == UpstreamInput("recover[0.7]", "adapter")
    assert recover[2].inputs["init_adapter"] == UpstreamInput("recover[0.5]", "adapter")
    assert {n.key: n for n in nodes}["corpus"].inputs == {
        "package": UpstreamInput("elastify", "package"),
        "generated.0": UpstreamInput("corpus-generate[0]", "generated"),
        "generated.1": UpstreamInput("corpus-generate[1]", "generated")}

    cold = plan(parse_spec({**BASE, "levels": [0.3, 0.5, 1.0], "stages": {
        "recover": {"settings": {"warm_start": False}}, "corpus": {"enabled": False}}}), default_registry())
    recover = [n for n in cold if n.type == "recover"]
    assert [n.key for n in recover] == ["recover[0.3]", "recover[0.5]"]  # independent, side by side
    assert all(n.inputs == {"package": UpstreamInput("elastify", "package")} for n in recover)  # corpus optional


def _chained(shard_inputs: dict[str, dict[str, tuple[str, str]]]) -> Registry:
    return Registry([
        tiny_stage("prep"),
        tiny_stage("per_level", inputs={"x": "prep.out"},
                   fan_out=lambda spec, settings: [Shard(label, {"tag": label}, inputs)
                                                   for label, inputs in shard_inputs.items()]),
    ])


def test_a_shard_reading_a_sibling_is_planned_after_it_with_an_edge_to_its_output():
    registry = _chained({"a": {"seed": ("c", "out")}, "b": {}, "c": {"seed": ("b", "out")}})
    nodes = plan(parse_spec(BASE), registry)
    assert [n.key for n in nodes] == ["prep", "per_level[b]", "per_level[c]", "per_level[a]"]
    by_key = {n.key: n for n in nodes}
    assert by_key["per_level[a]"].inputs == {"x": UpstreamInput("prep", "out"), "seed": UpstreamInput("per_level[c]", "out")}
    assert by_key["per_level[b]"].inputs == {"x": UpstreamInput("prep", "out")}


@pytest.mark.parametrize(("shard_inputs", "message"), [
    ({"a": {"seed": ("z", "out")}, "b": {}}, "shard 'a' input 'seed' names shard 'z', which is not a sibling; shards: ['a', 'b']"),
    ({"a": {"seed": ("a", "out")}}, "shard 'a' input 'seed' names shard 'a', which is not a sibling; shards: ['a']"),
    ({"a": {"seed": ("b", "weights")}, "b": {}}, "shard 'a' input 'seed' names output 'weights'; the stage's outputs: ['out']"),
    ({"a": {"x": ("b", "out")}, "b": {}}, "shard 'a' input 'x' has the name of a stage input"),
    ({"a": {"seed": ("b", "out")}, "b": {"seed": ("a", "out")}}, "shards read each other's outputs in a cycle: ['a', 'b']"),
])
def test_a_bad_sibling_input_is_a_spec_error_naming_the_stage_and_the_shard(shard_inputs, message):
    with pytest.raises(SpecError) as caught:
        plan(parse_spec(BASE), _chained(shard_inputs))
    assert caught.value.problems == [("stages.per_level", message)]


@pytest.mark.parametrize("example", sorted((Path(__file__).parents[3] / "examples" / "builds").glob("*.yaml")),
                         ids=lambda path: path.stem)
def test_every_example_spec_parses_typed_and_plans(example):
    spec = parse_spec(example, default_registry())
    stages = {node.type for node in plan(spec, default_registry())}
    assert {"profile", "elastify", "publish"} <= stages
    if spec.preset == "quick":
        assert "corpus-generate" not in stages and "recover" in stages
    if spec.preset == "full":
        assert {"experts", "export"} <= stages
