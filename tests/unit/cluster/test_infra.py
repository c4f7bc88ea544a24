"""The deployment files parse and agree with the settings the code reads."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import yaml

from cluster.settings import Settings

INFRA = Path(__file__).resolve().parents[3] / "infra"


def test_kuberay_manifest_runs_the_scheduler_beside_the_head_and_has_gpu_workers():
    cluster = yaml.safe_load((INFRA / "k8s" / "raycluster.yaml").read_text())
    assert cluster["kind"] == "RayCluster" and cluster["apiVersion"] == "ray.io/v1"
    head = {c["name"]: c for c in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]}
    assert head["scheduler"]["command"][:2] == ["elastify", "up"]
    shared = {m["mountPath"] for m in head["scheduler"]["volumeMounts"]} & {m["mountPath"] for m in head["ray-head"]["volumeMounts"]}
    assert shared == {"/tmp/ray"}  # the sidecar joins the head's Ray session
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert groups["gpu"]["rayStartParams"]["num-gpus"] == "1"


def test_ray_cluster_yaml_starts_the_scheduler_on_the_head():
    config = yaml.safe_load((INFRA / "ray" / "cluster.yaml").read_text())
    assert any("elastify up" in command for command in config["head_start_ray_commands"])
    assert config["provider"]["type"] == "local"


def test_env_example_names_only_settings_the_code_reads():
    read = set(re.findall(r'env\("([A-Z_]+)"', inspect.getsource(Settings.from_env)))
    example = {line.split("=", 1)[0] for line in (INFRA / "elastify.env.example").read_text().splitlines()
               if line and not line.startswith("#")}
    assert example == read


def test_the_embedded_service_leaves_only_the_ray_it_started(tmp_path, monkeypatch):
    """Ray that `running_service` started is shut down with it; a Ray the process had joined before is kept."""
    import ray

    from cluster import embedded
    from cluster.settings import Settings

    class Idle:  # a scheduler that only starts and closes
        def __init__(self, settings, registry):
            self.owner = "test"

        def start(self):
            return self

        def close(self):
            pass

    shutdowns = []
    monkeypatch.setattr(embedded, "Scheduler", Idle)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(True))
    settings = Settings(home=tmp_path / "home", database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    for started_here in (True, False):
        monkeypatch.setattr(embedded, "connect_ray", lambda settings, num_cpus=None, joined=started_here: joined)
        with embedded.running_service(settings, registry=None):
            pass
    assert shutdowns == [True]
