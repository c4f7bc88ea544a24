"""Cost model: analytic per-level cost, host calibration, the manifest schema the SDK reads, feasibility."""

from __future__ import annotations

import pytest

from device_sdk.latency import SLO, LatencyProfile
from pipeline.latency import LevelCost, feasible, fit_host, predicted_profile


def costs():
    return {
        "0.5": LevelCost(50_000_000, 1e8, 4e4, 2e8, 1e4),
        "1.0": LevelCost(100_000_000, 2e8, 8e4, 4e8, 2e4),
    }


def test_latency_fit_recovers_host_constants_from_measurements():
    c = costs()
    # a synthetic host: 3 ms overhead + 1e-7 ms/FLOP for prefill; 1 ms + 2.5e-9 ms/byte per decode step
    measured = {
        name: {"ttft_ms": {str(n): 3 + cost.prefill_flops(n) * 1e-7 for n in (16, 64, 128)},
               "tpot_ms": 1 + cost.weight_bytes * 2.5e-9}
        for name, cost in c.items()
    }
    host = fit_host(c, measured)
    assert host["ttft_overhead_ms"] == pytest.approx(3, rel=1e-6)
    assert host["ms_per_flop"] == pytest.approx(1e-7, rel=1e-6)
    assert host["tpot_overhead_ms"] == pytest.approx(1, rel=1e-6)
    profile = predicted_profile(c, host, reference_tokens=0)
    assert profile.tpot_ms("0.5") == pytest.approx(1.5) and profile.tpot_ms("1.0") == pytest.approx(2.0)
    assert profile.ttft_ms("1.0", 100) == pytest.approx(3 + 100 * 2e8 * 1e-7)


def test_latency_profile_round_trips_through_the_sdk_schema(tmp_path):
    from pipeline.latency import latency_profile_dict

    profile = predicted_profile(costs(), {"ttft_overhead_ms": 2, "ms_per_flop": 1e-7, "tpot_overhead_ms": 1,
                                          "ms_per_byte": 1e-9}, reference_tokens=128)
    data = latency_profile_dict(profile)
    assert set(data["levels"]["0.5"]) == {"ttft_base_ms", "ttft_per_token_ms", "tpot_ms"}
    path = tmp_path / "profile.json"
    profile.save(path)
    assert LatencyProfile.load(path).levels == profile.levels


def test_latency_feasibility_uses_fractions_of_the_full_model():
    profile = predicted_profile(costs(), {"ttft_overhead_ms": 0, "ms_per_flop": 1e-7, "tpot_overhead_ms": 0,
                                          "ms_per_byte": 1e-9}, reference_tokens=0)
    slo = SLO.fraction(0.5, 0.6)
    assert feasible(profile, "0.5", 1.0, 100, slo)  # half the FLOPs, half the bytes
    assert not feasible(profile, "1.0", 0.5, 100, slo)  # TPOT of the full model exceeds 0.6
    assert not feasible(profile, "0.5", 1.0, 100, SLO.fraction(0.4, 0.6))
    assert feasible(profile, "0.5", 0.5, 100, SLO.fraction(0.4, 0.6))
