"""The build's accelerator against what the cluster offers: which stage tasks ask Ray for a GPU."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from cluster.accelerator import device_for, granted_resources
from cluster.dag import plan
from cluster.registry import Registry
from cluster.spec import SpecError, parse_spec
from pipeline.chain import STAGES
from pipeline.contract import Resources
from tests.support.api import make_api, spec
from workers import testing

MODEL = {"num_cpus": 2, "num_gpus": 0.0, "memory": None, "custom": {}, "accelerated": True}
PLAIN = {**MODEL, "accelerated": False}


@pytest.mark.parametrize(("accelerator", "cluster_gpus", "expected"), [
    ("auto", 0, 0.0), ("auto", 4, 1.0), ("cuda", 0, 1.0), ("cuda", 8, 1.0), ("cpu", 8, 0.0),
])
def test_a_model_stage_asks_for_one_gpu_only_when_the_accelerator_and_the_cluster_allow(accelerator, cluster_gpus, expected):
    granted = granted_resources(MODEL, accelerator, cluster_gpus)
    assert granted["num_gpus"] == expected
    assert device_for(granted) == ("cuda" if expected else "cpu")
    assert "accelerated" not in granted and granted["num_cpus"] == 2  # what Ray is asked for, nothing more


def test_a_stage_that_runs_no_model_never_gets_a_gpu():
    assert granted_resources(PLAIN, "cuda", 8)["num_gpus"] == 0.0


def test_the_specs_num_gpus_wins_over_the_accelerator():
    pinned = {**MODEL, "num_gpus": 2.0, "gpus_set": True}
    assert granted_resources(pinned, "cpu", 8)["num_gpus"] == 2.0
    assert granted_resources({**MODEL, "num_gpus": 0.0, "gpus_set": True}, "auto", 8)["num_gpus"] == 0.0


def test_an_unknown_accelerator_is_refused():
    with pytest.raises(ValueError, match="accelerator must be one of"):
        granted_resources(MODEL, "tpu", 0)


def _spec(**extra):
    return {"source": {"model": "/models/x"}, "levels": [0.5, 1.0], "publish": {"name": "m", "version": "1"}, **extra}


def test_the_spec_checks_the_accelerator_and_the_plan_marks_model_stages():
    with pytest.raises(SpecError, match="accelerator"):
        parse_spec(_spec(accelerator="gpu"))
    registry = Registry(STAGES)
    planned = {node.type: node.resources for node in plan(parse_spec(_spec(), registry), registry)}
    # The stages that place the LLM on ctx.device; latency measures the device itself, label and evaluate
    # run the device SDK's model.
    assert {name for name, resources in planned.items() if resources["accelerated"]} == {
        "profile", "elastify", "recover", "tlm-score"}
    pinned = parse_spec(_spec(stages={"profile": {"resources": {"num_gpus": 2}}}), registry)
    profile = next(node for node in plan(pinned, registry) if node.type == "profile")
    assert profile.resources["gpus_set"] and profile.resources["num_gpus"] == 2


def test_accelerator_cuda_on_a_cluster_without_gpus_is_a_422_naming_accelerator(tmp_path):
    registry = Registry([testing.tiny_stage("first", resources=Resources(num_cpus=1, accelerated=True)),
                         testing.tiny_stage("second", inputs={"x": "first.out"})])
    api = make_api(tmp_path, registry=registry, max_task_resources="num_cpus=2,num_gpus=0")
    client, headers = TestClient(api.app), api.token("acme")
    refused = client.post("/v1/builds", json=spec(accelerator="cuda"), headers=headers)
    assert refused.status_code == 422, refused.text
    errors = {e["field"]: e["message"] for e in refused.json()["errors"]}
    assert list(errors) == ["accelerator"] and "first" in errors["accelerator"] and "num_gpus" in errors["accelerator"]
    # auto on the same cluster is accepted: its model stage will run on CPUs.
    assert client.post("/v1/builds", json=spec(), headers=headers).status_code == 201
