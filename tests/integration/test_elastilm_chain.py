"""The whole ElastiLM chain as one build on Ray, PostgreSQL and SeaweedFS, then served by the SDK.

The build's one real run on the cluster: it also checks the package rows, aliases and the cached resubmission.

profile → elastify → corpus-generate × shards → corpus → recover × levels (top-down, warm-started)
→ recover-install → latency → tlm-score → label × shards → label-derive → tlm-decision → evaluate
→ publish, on SmolLM2 with small grids. The published
package is pulled and `generate` follows the package's TLM decision.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select

from api.app import default_registry
from cluster.models import Alias, Package
from cluster.packages import package_prefix
from cluster.service import build_summary, submit_build
from cluster.spec import parse_spec
from device_sdk.latency import SLO
from device_sdk.runtime import ElasticModel
from device_sdk.tlm import TLM
from tests.support.control_plane import make_settings, started
from workers.store import ArtifactRef

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The build example: the whole chain at smoke settings (four short corpus answers on two shards,
# level 0.5 warm-started from level 0.7's adapter, small grids).
SMOKE = yaml.safe_load((Path(__file__).parents[2] / "examples" / "builds" / "smoke.yaml").read_text())
SMALL = {name: stage["settings"] for name, stage in SMOKE["stages"].items()}


def test_elastilm_chain_builds_on_ray_and_serves_tlm_decisions(tmp_path, smollm2_dir, pg_url, s3_store,
                                                                ray_cluster):
    settings = make_settings(tmp_path, pg_url, s3_store, lease_seconds=60.0)
    registry = default_registry()
    spec = parse_spec({
        "source": {"model": str(smollm2_dir)},
        "levels": [0.5, 0.7, 1.0],
        "stages": {name: {"settings": own} for name, own in SMALL.items()},
        "publish": {"name": "smollm2-elastilm", "version": "0.0.1", "aliases": ["latest", "stable"]},
    })
    prefix = package_prefix("smollm2-elastilm", "0.0.1")
    scheduler = started(settings, registry)
    try:
        build_id = submit_build(scheduler.sessions, spec, registry)
        scheduler.run_until_done([build_id], timeout=1500)
        summary = build_summary(scheduler.sessions, build_id)
        assert summary["status"] == "succeeded", summary
        store = scheduler.store
        with scheduler.sessions() as session:
            package = session.scalar(select(Package).where(Package.name == "smollm2-elastilm"))
            aliases = {a.alias: a.package_id for a in session.scalars(select(Alias))}
        assert package.uri == prefix and aliases == {"latest": package.id, "stable": package.id}

        # An identical resubmission is served from the cache, and publishing it again is a no-op.
        again = submit_build(scheduler.sessions, spec, registry)
        scheduler.run_until_done([again], timeout=300)
        repeat = build_summary(scheduler.sessions, again)
    finally:
        scheduler.close()
    assert repeat["status"] == "succeeded" and repeat["cache_hits"] == len(summary["stages"]), repeat
    assert all(s["attempts"] == [] for s in repeat["stages"]) and repeat["package"]["uri"] == prefix
    stages = {s["key"]: s for s in summary["stages"]}
    assert set(stages) == {"profile", "elastify", "corpus-generate[0]", "corpus-generate[1]", "corpus",
                           "recover[0.5]", "recover[0.7]", "recover-install", "latency",
                           "tlm-score", "label[0]", "label[1]", "label-derive", "tlm-decision", "evaluate",
                           "publish"}
    assert all(len(s["attempts"]) == 1 and s["attempts"][0]["status"] == "succeeded" for s in stages.values())

    # Recovery lowered the eval loss at both reduced levels.
    for level in ("0.5", "0.7"):
        artifact = stages[f"recover[{level}]"]["artifacts"]["metrics"]
        ref = ArtifactRef(artifact["uri"], artifact["digest"], artifact["size"])
        metrics = json.loads(store.get_artifact(ref, tmp_path / f"recover-{level}").read_text())
        assert metrics["eval_loss_after"] < metrics["eval_loss_before"], metrics
        assert metrics["corpus_dir"] and (metrics["warm_start_from"] is not None) == (level == "0.5"), metrics

    # Pull the published package, verify every file and the signature, and check every part the chain put in.
    local = tmp_path / "pulled"
    for key in store.list(prefix):
        store.get_file(key, local / key[len(prefix) + 1:])
    model = ElasticModel.load(local, public_key=settings.public_key_b64())
    manifest = model.manifest
    assert manifest.build_id == build_id
    assert [level.adapter for level in manifest.elastic.levels] == [
        "adapters/recovery/0.5.safetensors", "adapters/recovery/0.7.safetensors", None]
    assert set(manifest.latency_profile["levels"]) == {"0.5", "0.7", "1.0"}
    assert manifest.tlm["levels"] == ["0.5", "0.7", "1.0"]
    assert all("ppl:ptb:test" in level.quality and "accuracy" in level.quality for level in manifest.elastic.levels)
    # The report card's verdict and plot: the full model is usable by definition.
    usable = [level.name for level in manifest.elastic.levels if level.usable]
    assert "1.0" in usable and (local / "report" / "quality.png").is_file()
    assert all("repeat_4gram_rate" in level.quality and "accuracy_stderr" in level.quality
               for level in manifest.elastic.levels)

    # The SDK serves with the TLM's decision, judged by the device's profile (the build host's here).
    assert model.tlm is not None
    model.latency_profile = _profile_from(manifest)
    prompt = "Question: Which gas do plants take in from the air to make food?\nAnswer:"
    # keep="": all of the prompt compresses, as the brute force below assumes (by default its question stays)
    out = model.generate(prompt, slo=SLO.fraction(ttft=0.6, tpot=0.8), max_new_tokens=3, keep="")
    assert (out.decision.prompt_ratio, out.level, out.decision.feasible) == _brute_force_decision(
        local, manifest, usable, len(model.tokenizer.encode(prompt).ids), prompt, ttft=0.6, tpot=0.8)
    assert out.tokens and out.level in {"0.5", "0.7", "1.0"}


def _profile_from(manifest):
    from pipeline.elastilm.latency import profile_from_manifest

    return profile_from_manifest(manifest)


def _brute_force_decision(package, manifest, usable, prompt_tokens, prompt, ttft, tpot):
    """(prompt ratio, level, feasible) worked out without the SDK's decision code. A pair is eligible
    when its level is usable and its latency, read from the manifest's raw profile numbers (the TLM's
    own time in TTFT where measured), meets the SLO. An SLO-token head takes the eligible pair with the
    highest joint log-probability of its two heads; a utility head the most likely right, ties within
    1e-6 to the cheapest (TTFT + TPOT). None eligible: the smallest ratio and the lightest usable level."""
    tlm = TLM.load(package / "tlm")
    profile = manifest.latency_profile
    latency, overhead = profile["levels"], profile.get("tlm")
    full = latency[max(latency, key=float)]
    ttft_limit = ttft * (full["ttft_base_ms"] + full["ttft_per_token_ms"] * prompt_tokens)
    tpot_limit = tpot * full["tpot_ms"]

    def cost(ratio, level):  # (TTFT, TPOT) in ms
        kept = max(1, round(ratio * prompt_tokens))
        first = latency[level]["ttft_base_ms"] + latency[level]["ttft_per_token_ms"] * kept
        if overhead:
            first += overhead["decide_base_ms"] + overhead["decide_per_token_ms"] * prompt_tokens
            if ratio < 1.0:
                first += overhead["compress_base_ms"] + overhead["compress_per_token_ms"] * prompt_tokens
        return first, latency[level]["tpot_ms"]

    cells = [(i, j, ratio, level) for i, ratio in enumerate(tlm.ratios) for j, level in enumerate(tlm.levels)
             if level in usable and cost(ratio, level)[0] <= ttft_limit and cost(ratio, level)[1] <= tpot_limit]
    if not cells:
        return min(tlm.ratios), min(usable, key=float), False
    if tlm.config.get("decision_head", "slo_token") == "utility":
        utility = tlm.utility(prompt)
        top = max(float(utility[i, j]) for i, j, _, _ in cells)
        tied = [(sum(cost(ratio, level)), ratio, level) for i, j, ratio, level in cells
                if float(utility[i, j]) >= top - 1e-6]
        _, ratio, level = min(tied)
    else:
        ratio_log_probs, level_log_probs = tlm.decision_log_probs(prompt, ttft, tpot)
        _, ratio, level = max((float(ratio_log_probs[i] + level_log_probs[j]), ratio, level)
                              for i, j, ratio, level in cells)
    return ratio, level, True
