"""CLONE through the control plane on a real local Ray: clone-collect fans out, clone-search merges the shards."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from api.app import default_registry
from cluster.db import migrate
from cluster.registry import Registry
from cluster.scheduler import Scheduler
from cluster.service import build_summary, submit_build
from cluster.settings import Settings
from cluster.spec import parse_spec
from tests.support.control_plane import FAST
from tests.support.pipeline_packages import tiny_package
from tests.support.sdk_packages import signing_key

pytestmark = pytest.mark.integration


def clone_registry() -> Registry:
    """The built-in clone stages, reading a ready package from the spec's source instead of elastify."""
    builtin = default_registry()
    return Registry([
        replace(builtin.get("clone-collect"), inputs={"package": "source.model"}, optional_inputs=frozenset()),
        replace(builtin.get("clone-search"), inputs={"package": "source.model", "records": "clone-collect.records"},
                optional_inputs=frozenset()),
    ])


def test_clone_collect_fans_out_on_ray_and_search_merges_the_shards(tmp_path, ray_cluster, calib_text):
    _, package = tiny_package("llama_gqa", tmp_path / "pkg", signing_key())
    settings = Settings(home=tmp_path / "home", database_url=f"sqlite:///{tmp_path / 'clone.db'}",
                        store_url=str(tmp_path / "store"), **FAST)
    migrate(settings.database_url)
    registry = clone_registry()
    collect = {"samples": 12, "align": 8, "corpus": [str(calib_text)], "windows": 2, "window_length": 32, "shards": 2}

    def spec(budgets):
        return parse_spec({
            "source": {"model": str(package)}, "levels": [1.0], "publish": {"name": "clone", "version": "1"},
            "stages": {"clone-collect": {"enabled": True, "settings": {**collect, "budgets": budgets}},
                       "clone-search": {"enabled": True, "settings": {"epochs": 20, "candidates": 3, "rounds": 1, "seeds": 3}}},
        })

    scheduler = Scheduler(settings, registry).start()
    try:
        good = submit_build(scheduler.sessions, spec([{"name": "fast", "latency": 0.7, "energy": 0.7}]), registry)
        bad = submit_build(scheduler.sessions, spec([{"name": "impossible", "latency_ms": 1e-9}]), registry)
        scheduler.run_until_done([good, bad], timeout=300)
        summary = build_summary(scheduler.sessions, good)
        failed = build_summary(scheduler.sessions, bad)
    finally:
        scheduler.close()

    assert summary["status"] == "succeeded", summary
    assert [s["key"] for s in summary["stages"]] == ["clone-collect[0]", "clone-collect[1]", "clone-search"]
    shard_files = sorted((tmp_path / "store").rglob("records.json"))
    shards = [json.loads(p.read_text()) for p in shard_files]
    assert sorted(s["settings"]["shard"] for s in shards) == [0, 1]
    per_shard = [{tuple(r["bins"]) for r in s["records"]} for s in shards]
    assert len(per_shard[0] | per_shard[1]) == 12 and not per_shard[0] & per_shard[1]  # a partition of the vectors
    (profiles,) = (tmp_path / "store").rglob("profiles.json")
    result = json.loads(profiles.read_text())
    assert set(result["clone"]["profiles"]) == {"fast"}
    assert len([r for r in result["records"] if r["origin"] != "search"]) == 12  # both shards merged

    assert failed["status"] == "failed"
    errors = [a["error"] for s in failed["stages"] for a in s["attempts"] if a["error"]]
    assert errors and all("cannot be met by any configuration" in e for e in errors)
    assert all(len(s["attempts"]) <= 1 for s in failed["stages"])  # a budget error is not retried
