"""Embedded mode: SQLite + local store + Ray, the built-in stages on a tiny model, one writer per SQLite file."""

from __future__ import annotations

import pytest
import ray

from api.app import default_registry
from cluster.embedded import running_service
from cluster.scheduler import Scheduler, SchedulerLockError
from cluster.service import build_summary, submit_build
from cluster.settings import Settings
from cluster.spec import parse_spec
from device_sdk.trust import verify_package
from pipeline.chain import ELASTILM_STAGES
from tests.support.tiny import save_tiny

pytestmark = pytest.mark.integration


def test_embedded_service_builds_publishes_and_signs_with_a_generated_key(tmp_path, ray_cluster, calib_text):
    model = save_tiny("llama_gqa", tmp_path / "tiny")
    settings = Settings(home=tmp_path / "home", lease_seconds=5.0, poll_seconds=0.02)
    assert not settings.signing_key_path.exists()
    spec = parse_spec({
        "source": {"model": str(model)},
        "calibration": [str(calib_text)],
        "levels": [0.5, 1.0],
        "stages": {
            # On a random model, removing a KV group can lower the loss, so leave-one-out ranking can make
            # level 0.5 "better" than 1.0 and trip the publish gate; these tests are about the service.
            "profile": {"settings": {"windows": 2, "window_length": 32, "attn_method": "taylor"}},
            "elastify": {"settings": {"align": 8}},
            "evaluate": {"settings": {"corpora": [str(calib_text)], "windows": 2, "window_length": 32, "tasks": [],
                                      "measure_latency": False, "precisions": []}},
            **{name: {"enabled": False} for name in ELASTILM_STAGES},
        },
        "publish": {"name": "tiny", "version": "0.1.0"},
    })
    with running_service(settings, default_registry()) as scheduler:
        assert settings.signing_key_path.stat().st_mode & 0o777 == 0o600  # generated on first start
        with pytest.raises(SchedulerLockError, match="another scheduler"):
            Scheduler(settings, scheduler.registry).start()  # SQLite: a single writer
        build_id = submit_build(scheduler.sessions, spec, scheduler.registry)
        scheduler.run_until_done([build_id], timeout=300)
        summary = build_summary(scheduler.sessions, build_id)
    assert summary["status"] == "succeeded", summary
    assert summary["package"] == {"name": "tiny", "version": "0.1.0", "uri": "packages/tiny/0.1.0"}
    package_dir = settings.home / "store" / "packages" / "tiny" / "0.1.0"
    manifest = verify_package(package_dir, settings.public_key_b64())
    assert all(level.quality for level in manifest.elastic.levels)  # the report card folded in
    assert (settings.home / "store" / "packages" / "tiny" / "aliases" / "latest").read_text() == "0.1.0"
    for stage in summary["stages"]:
        (attempt,) = stage["attempts"]
        assert attempt["wall_seconds"] > 0 and attempt["cpu_seconds"] > 0
        # The Ray head's two fake GPUs: under `accelerator: auto` the model stages are granted (and charged) one.
        granted = stage["type"] in ("profile", "elastify", "recover", "tlm-score")
        assert (attempt["gpu_seconds"] > 0) == granted, stage["key"]


def test_a_stopped_scheduler_hands_its_stages_back_and_the_next_one_finishes(tmp_path, ray_cluster):
    from cluster.db import migrate
    from cluster.registry import Registry
    from tests.support.control_plane import FAST, spec_for
    from workers import testing

    pid_file = tmp_path / "pid"
    registry = Registry([testing.tiny_stage("first", testing.sleep, max_attempts=1)])
    settings = Settings(home=tmp_path / "home", **FAST)
    migrate(settings.database_url)
    first = Scheduler(settings, registry).start()
    spec = spec_for({"first": {"seconds": 60, "pid_file": str(pid_file), "only_first_time": True}})
    build_id = submit_build(first.sessions, spec, registry)
    first.run(until=pid_file.exists, timeout=60)
    first.close()  # a clean stop: the stage goes back to the queue without spending its only attempt

    second = Scheduler(settings, registry).start()  # the SQLite writer lock was released
    try:
        second.run_until_done([build_id], timeout=60)
        summary = build_summary(second.sessions, build_id)
    finally:
        second.close()
    assert summary["status"] == "succeeded"
    assert [(a["number"], a["exit"]) for a in summary["stages"][0]["attempts"]] == [(1, "interrupted"), (2, "ok")]


def test_recovery_chains_top_down_on_the_generated_corpus_through_the_scheduler(tmp_path, ray_cluster, calib_text):
    """corpus-generate × 2 → corpus → recover[0.75] → recover[0.5] (warm start from 0.75's adapter) →
    recover-install → evaluate → publish, on a tiny model: the scheduler runs sibling edges in order."""
    import json

    from sqlalchemy import select

    from cluster.models import Stage
    from workers.store import ArtifactRef

    model = save_tiny("llama_gqa", tmp_path / "tiny")
    settings = Settings(home=tmp_path / "home", lease_seconds=5.0, poll_seconds=0.02)
    # Short prompts (the tiny model has 256 byte positions), a few tokens each, generated text only.
    corpus = {"prompts": 6, "max_new_tokens": 8, "sources": ["jeopardy", "ptb"], "max_prompt_words": 30,
              "passages": [], "ptb_lines_per_text": 0, "heldout_fraction": 0.2, "eval_tasks": ["arc_easy"]}
    spec = parse_spec({
        "source": {"model": str(model)},
        "calibration": [str(calib_text)],
        "levels": [0.5, 0.75, 1.0],
        "stages": {
            # On a random model, removing a KV group can lower the loss, so leave-one-out ranking can make
            # level 0.5 "better" than 1.0 and trip the publish gate; these tests are about the service.
            "profile": {"settings": {"windows": 2, "window_length": 32, "attn_method": "taylor"}},
            "elastify": {"settings": {"align": 8}},
            "corpus-generate": {"settings": corpus},
            "recover": {"settings": {"steps": 2, "batch_size": 2, "seq_len": 24, "eval_windows": 2, "rank": 2,
                                     "eval_corpus": [str(calib_text)]}},
            "evaluate": {"settings": {"corpora": [str(calib_text)], "windows": 2, "window_length": 32, "tasks": [],
                                      "generation_prompts": 4, "generation_tokens": 16, "measure_latency": False}},
            **{name: {"enabled": False} for name in ("latency", "tlm-score", "label", "label-derive", "tlm-decision")},
        },
        "publish": {"name": "tiny-chained", "version": "0.1.0"},
    })
    with running_service(settings, default_registry()) as scheduler:
        build_id = submit_build(scheduler.sessions, spec, scheduler.registry)
        scheduler.run_until_done([build_id], timeout=600)
        summary = build_summary(scheduler.sessions, build_id)
        with scheduler.sessions() as session:
            times = {row.key: (row.started_at, row.finished_at)
                     for row in session.scalars(select(Stage).where(Stage.build_id == build_id))}
        store = scheduler.store
    assert ray.is_initialized()  # the session's Ray was joined before the service: leaving the service keeps it
    assert summary["status"] == "succeeded", summary
    stages = {s["key"]: s for s in summary["stages"]}
    assert {"corpus-generate[0]", "corpus-generate[1]", "corpus", "recover[0.75]", "recover[0.5]"} <= set(stages)
    assert times["recover[0.75]"][1] <= times["recover[0.5]"][0]  # the sibling edge: larger level first
    assert times["corpus"][1] <= times["recover[0.75]"][0]

    def metrics(level: str) -> dict:
        artifact = stages[f"recover[{level}]"]["artifacts"]["metrics"]
        ref = ArtifactRef(artifact["uri"], artifact["digest"], artifact["size"])
        return json.loads(store.get_artifact(ref, tmp_path / f"metrics-{level}").read_text())

    larger, smaller = metrics("0.75"), metrics("0.5")
    assert larger["warm_start_from"] is None and smaller["warm_start_from"] is not None  # the largest starts cold
    assert larger["corpus_dir"] and smaller["corpus_dir"] and smaller["settings"]["loss"] == "distill"
    published = settings.home / "store" / "packages" / "tiny-chained" / "0.1.0"
    manifest = verify_package(published, settings.public_key_b64())
    assert [level.adapter for level in manifest.elastic.levels] == [
        "adapters/recovery/0.5.safetensors", "adapters/recovery/0.75.safetensors", None]
    # The report card read how the levels were recovered: distilled, so level 1.0 is a like-with-like reference.
    artifact = stages["evaluate"]["artifacts"]["report_card"]
    card = json.loads(store.get_artifact(ArtifactRef(artifact["uri"], artifact["digest"], artifact["size"]),
                                         tmp_path / "report_card.json").read_text())
    assert "stays exactly zero" in card["in_domain_reference"]
    assert manifest.elastic.level("1.0").usable and (published / "report" / "quality.png").is_file()
    assert all({"top1_agreement", "repeat_4gram_rate", f"ppl_ratio:{calib_text}"} <= set(level.quality)
               for level in manifest.elastic.levels)
