"""Resource requests no node can grant: refused at submit (422 naming the field), and a stage the
live cluster cannot place fails at dispatch instead of holding its tenant's quota while pending."""

from __future__ import annotations

import pytest
import ray
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from cluster.capacity import Capacity, node_capacity, parse_capacity
from cluster.models import Build, Stage
from cluster.scheduler import Scheduler
from cluster.service import submit
from cluster.settings import Settings, SettingsError
from tests.support.api import make_api, spec
from tests.support.control_plane import chain_registry

NODES = [  # what ray.nodes() reports: one small CPU node, one GPU node, one dead big node
    {"Alive": True, "Resources": {"CPU": 4.0, "memory": 8e9, "object_store_memory": 2e9, "node:10.0.0.1": 1.0}},
    {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0, "memory": 32e9, "fake_gpu": 2.0,
                                  "accelerator_type:H100": 1.0}},
    {"Alive": False, "Resources": {"CPU": 1000.0, "GPU": 8.0}},
]


def _builds(api) -> int:
    with api.sessions() as session:
        return session.scalar(select(func.count()).select_from(Build))


def test_a_request_above_the_configured_maximum_is_a_422_naming_the_field(tmp_path):
    api = make_api(tmp_path, max_task_resources="num_cpus=16,num_gpus=1,memory=64e9")
    client = TestClient(api.app)
    headers = api.token("acme")
    too_big = spec(stages={"first": {"resources": {"num_cpus": 1000}}, "second": {"resources": {"num_gpus": 2}}})
    response = client.post("/v1/builds", json=too_big, headers=headers)
    assert response.status_code == 422, response.text
    errors = {e["field"]: e["message"] for e in response.json()["errors"]}
    assert set(errors) == {"stages.first.resources.num_cpus", "stages.second.resources.num_gpus"}
    assert "asks for 1000 num_cpus; the most one task can get is 16" in errors["stages.first.resources.num_cpus"]
    assert _builds(api) == 0
    # Within the maximum, and a custom resource the setting does not name, are accepted.
    fits = spec(stages={"first": {"resources": {"num_cpus": 16, "custom": {"fake_gpu": 4}}}})
    assert client.post("/v1/builds", json=fits, headers=headers).status_code == 201


def test_an_api_joined_to_ray_takes_the_maximum_from_the_largest_live_node(api, monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: NODES)
    client, headers = TestClient(api.app), api.token("acme")
    response = client.post("/v1/builds", json=spec(stages={"first": {"resources": {"num_cpus": 9}},
                                                           "third": {"resources": {"custom": {"tpu": 1}}}}),
                           headers=headers)
    assert response.status_code == 422, response.text
    errors = {e["field"]: e["message"] for e in response.json()["errors"]}
    assert set(errors) == {"stages.first.resources.num_cpus", "stages.third.resources.custom.tpu"}
    assert "the largest live Ray node" in errors["stages.first.resources.num_cpus"]
    assert "no node offers" in errors["stages.third.resources.custom.tpu"]
    fits = spec(stages={"first": {"resources": {"num_cpus": 8, "num_gpus": 1, "custom": {"fake_gpu": 2}}}})
    assert client.post("/v1/builds", json=fits, headers=headers).status_code == 201


def test_capacity_from_nodes_and_from_the_setting():
    capacity = node_capacity(NODES)
    assert capacity.largest == {"num_cpus": 8.0, "memory": 32e9, "num_gpus": 1.0, "fake_gpu": 2.0}
    assert capacity.problems({"num_cpus": 8, "num_gpus": 0, "memory": None, "custom": {}}) == []
    assert [name for name, _ in capacity.problems({"memory": 33e9, "custom": {"fake_gpu": 3}})] == [
        "memory", "custom.fake_gpu"]
    assert parse_capacity("") is None
    assert parse_capacity("num_cpus=2, fake_gpu=0.5") == Capacity({"num_cpus": 2.0, "fake_gpu": 0.5})
    for bad in ("num_cpus", "num_cpus=many", "=3"):
        with pytest.raises(SettingsError, match="ELASTIFY_MAX_TASK_RESOURCES"):
            Settings(max_task_resources=bad)


def test_a_stage_no_node_can_place_fails_at_dispatch_instead_of_pending(tmp_path):
    api = make_api(tmp_path, max_task_resources="num_cpus=4")
    registry = chain_registry()
    from cluster.spec import parse_spec

    # Queued before the limit was known (no capacity at submit), as a build from before a cluster shrank.
    build_id = submit(api.sessions, parse_spec(spec(stages={"first": {"resources": {"num_cpus": 1000}}})), registry,
                      tenant="acme").build_id
    with api.sessions.begin() as session:
        first = session.scalar(select(Stage).where(Stage.build_id == build_id, Stage.key == "first"))
        first.status, first_id = "running", first.id
    Scheduler(api.settings, registry)._dispatch(first_id)
    with api.sessions() as session:
        first = session.get(Stage, first_id)
        assert first.status == "failed" and "asks for 1000 num_cpus" in first.error
        assert session.get(Build, build_id).status == "failed"
