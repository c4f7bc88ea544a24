"""Helpers for control-plane tests: settings, test registries of tiny stages, specs, schedulers."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.registry import Registry
from cluster.scheduler import Scheduler
from cluster.settings import Settings
from cluster.spec import parse_spec
from pipeline.contract import Resources, Shard
from workers import testing

FAST = dict(lease_seconds=3.0, retry_base_seconds=0.2, retry_max_seconds=1.0, poll_seconds=0.02)


def make_settings(tmp_path: Path, database_url: str, store, **overrides) -> Settings:
    settings = Settings(home=tmp_path / "home", database_url=database_url, store_url=store.url,
                        store_endpoint=store.endpoint_url, store_access_key=store.access_key,
                        store_secret_key=store.secret_key, **{**FAST, **overrides})
    settings.ensure_signing_key()
    return settings


def chain_registry(run=testing.noop, resources: Resources = Resources(num_cpus=1),
                   max_attempts: int = 3, fan_out: bool = False) -> Registry:
    """first -> second (optionally fanned out per level) -> third, all running `run` (a workers.testing stage)."""
    shards = (lambda spec, settings: [Shard(str(m), {"level": m}) for m in spec.levels]) if fan_out else None
    return Registry([
        testing.tiny_stage("first", run, resources=resources, max_attempts=max_attempts),
        testing.tiny_stage("second", run, inputs={"x": "first.out"}, resources=resources, max_attempts=max_attempts,
                           fan_out=shards),
        testing.tiny_stage("third", run, inputs={"y": "second.out"}, resources=resources, max_attempts=max_attempts),
    ])


def spec_for(settings_by_stage: dict | None = None, cache: bool = True, levels=(1.0,), name="test"):
    stages = {stage: {"settings": own} for stage, own in (settings_by_stage or {}).items()}
    return parse_spec({"source": {"model": "unused"}, "levels": list(levels), "stages": stages, "cache": cache,
                       "publish": {"name": name, "version": "1"}})


def small_elastic_spec(model_dir: Path, name: str, aliases: list[str]) -> dict:
    """A cheap real build of `model_dir`: profile → elastify → evaluate → publish, levels 0.5 and 1.0.

    The ElastiLM stages are off; tests/integration/test_elastilm_chain.py runs them.
    """
    from pipeline.chain import ELASTILM_STAGES

    return {
        "source": {"model": str(model_dir)},
        "levels": [0.5, 1.0],
        "stages": {
            "profile": {"settings": {"windows": 2, "window_length": 32, "layer_method": "block_influence"}},
            "evaluate": {"settings": {"windows": 2, "window_length": 32, "corpora": ["ptb:test"], "tasks": [],
                                      "generation_prompts": 2, "generation_tokens": 8, "measure_latency": False,
                                      "precisions": []}},
            **{stage: {"enabled": False} for stage in ELASTILM_STAGES},
        },
        "publish": {"name": name, "version": "0.0.1", "aliases": aliases},
    }


def started(settings: Settings, registry: Registry) -> Scheduler:
    return Scheduler(settings, registry).start()


def journal_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
