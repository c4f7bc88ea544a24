"""`elastify demo`: its spec plans the whole chain at demo size, and it ends by showing what levels say."""

from __future__ import annotations

from api.app import default_registry
from api.commands.cluster import _met, demo_profile, demo_spec, level_continuations, slo_servings
from cluster.dag import UpstreamInput, plan
from cluster.spec import parse_spec
from device_sdk.format import public_key_b64
from device_sdk.latency import LatencyProfile, LevelLatency
from device_sdk.runtime import ElasticModel
from tests.support.pipeline_packages import tiny_package
from tests.support.sdk_packages import public_bytes, signing_key


def test_demo_spec_plans_a_small_corpus_and_recovery_top_down(tmp_path):
    registry = default_registry()
    nodes = {n.key: n for n in plan(parse_spec(demo_spec(tmp_path / "model"), registry), registry)}
    generate = [n for n in nodes.values() if n.type == "corpus-generate"]
    assert len(generate) == 2 and all(n.settings.prompts == 24 for n in generate)  # minutes, not the default's half hour
    recover = [n for n in nodes.values() if n.type == "recover"]
    assert [n.settings.level for n in recover] == ["0.9", "0.7", "0.5", "0.3", "0.2"]
    assert all(n.settings.loss == "distill" and n.inputs["corpus"] == UpstreamInput("corpus", "corpus") for n in recover)
    assert nodes["recover[0.5]"].inputs["init_adapter"] == UpstreamInput("recover[0.7]", "adapter")
    assert "init_adapter" not in nodes["recover[0.9]"].inputs
    # The last two stages share the two cores instead of queueing for both.
    assert nodes["tlm-decision"].resources["num_cpus"] == nodes["evaluate"].resources["num_cpus"] == 1


def test_the_demo_shows_a_greedy_continuation_per_level_from_the_signed_package(tmp_path):
    key = signing_key()
    _, package = tiny_package("llama_gqa", tmp_path / "pkg", key)
    model = ElasticModel.load(package, public_key=public_key_b64(public_bytes(key)))
    rows = level_continuations(model, prompt="The capital of France is", levels=("1.0", "0.5"), max_new_tokens=4)
    assert [(level, fraction) for level, fraction, _ in rows][0] == ("1.0", "1.00")
    assert rows[1][0] == "0.5" and 0.0 < float(rows[1][1]) < 1.0
    assert all(isinstance(text, str) for _, _, text in rows)


def test_the_demo_serves_two_prompts_under_two_slos_and_reports_what_it_chose(tmp_path):
    key = signing_key()
    _, package = tiny_package("llama_gqa", tmp_path / "pkg", key)
    model = ElasticModel.load(package, public_key=public_key_b64(public_bytes(key)))
    levels = model.available_levels()
    # latency proportional to the level's width: a TPOT of 0.6 of the full model's allows only the half
    model.latency_profile = LatencyProfile("fp32", 1, {m: LevelLatency(1.0, 0.01 * float(m), 10.0 * float(m))
                                                      for m in levels})
    requests = (("Question: why?\nAnswer:", ""), ("a passage.\nQuestion: why?\nAnswer:", "Question: why?\nAnswer:"))
    rows = slo_servings(model, requests, slos=((1.0, 1.0), (1.0, 0.6)), max_new_tokens=3)
    assert [(row["prompt"], row["slo"]) for row in rows] == [(p, s) for p, _ in requests for s in ((1.0, 1.0), (1.0, 0.6))]
    assert [row["level"] for row in rows] == [levels[-1], "0.5"] * 2
    assert all(row["ratio"] == 1.0 and row["ttft_ms"] > 0 and row["tpot_ms"] > 0 and row["text"] for row in rows)
    assert all(row["feasible"] for row in rows)
    impossible = slo_servings(model, requests[:1], slos=((1.0, 0.1),), max_new_tokens=3)[0]
    assert impossible["level"] == levels[0] and not impossible["feasible"]
    # the measured outcome decides "yes"; where it missed, the table tells a wrong prediction from no chance
    assert _met(impossible | {"slo_met": False}) == "no: no usable cell can"
    assert _met(rows[0] | {"slo_met": False}) == "no" and _met(rows[0] | {"slo_met": True}) == "yes"


def test_the_demo_profiles_the_levels_a_decision_may_pick_and_the_full_model(tmp_path):
    key = signing_key()
    _, package = tiny_package("llama_gqa", tmp_path / "pkg", key)
    model = ElasticModel.load(package, public_key=public_key_b64(public_bytes(key)))
    for shape in model.manifest.elastic.levels:
        shape.usable = shape.name == "0.5"  # as a report card might mark them
    profile = demo_profile(model)
    assert sorted(profile.levels, key=float) == ["0.5", model.available_levels()[-1]] and not profile.estimated
    assert all(entry.tpot_ms > 0 and entry.ttft_ms(32) > 0 for entry in profile.levels.values())
