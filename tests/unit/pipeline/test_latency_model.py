"""Cost model: analytic per-level cost, host calibration, the manifest schema the SDK reads, feasibility,
and the recalibration from served requests."""

from __future__ import annotations

import dataclasses
import json

import pytest

from device_sdk.latency import SLO, Drift, LatencyProfile, LevelLatency
from device_sdk.latency import feasible as sdk_feasible
from pipeline.elastilm.latency import LevelCost, feasible, fit_host, predicted_profile


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
    from pipeline.elastilm.latency import latency_profile_dict

    profile = predicted_profile(costs(), {"ttft_overhead_ms": 2, "ms_per_flop": 1e-7, "tpot_overhead_ms": 1,
                                          "ms_per_byte": 1e-9}, reference_tokens=128)
    data = latency_profile_dict(profile)
    assert set(data["levels"]["0.5"]) == {"ttft_base_ms", "ttft_per_token_ms", "tpot_ms", "ttft_points"}
    assert data["levels"]["0.5"]["ttft_points"] is None  # the build host predicts a line
    path = tmp_path / "profile.json"
    profile.save(path)
    assert LatencyProfile.load(path).levels == profile.levels
    measured = LatencyProfile("fp32", 1, {"1.0": LevelLatency(10.0, 1.0, 5.0, ttft_points=[(32, 40.0), (512, 700.0),
                                                                                       (1024, 2700.0)])})
    measured.save(path)
    assert LatencyProfile.load(path).levels == measured.levels


def test_ttft_follows_the_measured_points_where_the_line_would_not():
    """Prefill grows faster than a line beyond a few hundred tokens: TTFT interpolates the measured points
    and extends the last segment; with two points or none it is the line."""
    entry = LevelLatency(10.0, 1.0, 5.0, ttft_points=[(32, 40.0), (512, 700.0), (1024, 2700.0)])
    assert entry.ttft_ms(32) == 40.0 and entry.ttft_ms(1024) == 2700.0
    assert entry.ttft_ms(272) == pytest.approx(370.0)  # half way from 32 to 512
    assert entry.ttft_ms(768) == pytest.approx(1700.0)
    assert entry.ttft_ms(2048) == pytest.approx(2700.0 + 2000.0 * 2)  # the last segment's slope, extended
    assert entry.ttft_ms(16) == pytest.approx(40.0 - 660.0 / 480 * 16)
    assert LevelLatency(10.0, 1.0, 5.0).ttft_ms(100) == 110.0


def test_the_tlm_decision_costs_no_more_than_its_window():
    from device_sdk.latency import TLMLatency

    windowed, unbounded = TLMLatency(2.0, 0.5, 1.0, 0.25, decide_window=256), TLMLatency(2.0, 0.5, 1.0, 0.25)
    assert windowed.ms(100, False) == unbounded.ms(100, False) == 52.0
    assert windowed.ms(1000, False) == 2.0 + 0.5 * 256 and unbounded.ms(1000, False) == 502.0
    assert windowed.ms(1000, True) == 2.0 + 0.5 * 256 + 1.0 + 0.25 * 1000  # compression reads it all


def test_latency_feasibility_uses_fractions_of_the_full_model():
    profile = predicted_profile(costs(), {"ttft_overhead_ms": 0, "ms_per_flop": 1e-7, "tpot_overhead_ms": 0,
                                          "ms_per_byte": 1e-9}, reference_tokens=0)
    slo = SLO.fraction(0.5, 0.6)
    assert feasible(profile, "0.5", 1.0, 100, slo)  # half the FLOPs, half the bytes
    assert not feasible(profile, "1.0", 0.5, 100, slo)  # TPOT of the full model exceeds 0.6
    assert not feasible(profile, "0.5", 1.0, 100, SLO.fraction(0.4, 0.6))
    assert feasible(profile, "0.5", 0.5, 100, SLO.fraction(0.4, 0.6))


def test_drift_scales_by_an_upper_quantile_of_a_levels_recent_ratios():
    drift = Drift(quantile=0.9, window=10, min_samples=4)
    assert drift.factor("ttft", "0.5") == 1.0  # nothing served yet: the profile as measured
    for ratio in (1.0, 1.1, 1.2):
        drift.observe("ttft", "0.5", 100.0 * ratio, 100.0)
    assert drift.factor("ttft", "0.5") == 1.0  # too few to say
    drift.observe("ttft", "0.5", 130.0, 100.0)
    assert drift.factor("ttft", "0.5") == pytest.approx(1.27)  # torch's linear quantile of 1.0, 1.1, 1.2, 1.3
    assert drift.factor("ttft", "1.0") == pytest.approx(1.27)  # a level not yet served takes the pooled ratios
    assert drift.factor("tpot", "0.5") == 1.0  # TTFT and TPOT drift apart
    for _ in range(10):  # the window forgets: the device got quieter
        drift.observe("ttft", "0.5", 80.0, 100.0)
    assert drift.factor("ttft", "0.5") == pytest.approx(0.8)
    drift.observe("ttft", "0.5", 1e6, 100.0)  # a stalled request counts as 4x, not 10000x
    assert max(drift.ratios[("ttft", "0.5")]) == 4.0
    assert Drift(quantile=None, min_samples=1).factor("ttft", "0.5") == 1.0


def test_drift_headroom_keeps_boundary_cells_out_from_the_first_request_on():
    drift = Drift(quantile=0.9, window=10, min_samples=4, headroom=1.04)
    assert drift.factor("ttft", "0.5") == pytest.approx(1.04)  # before any request
    for ratio in (1.0, 1.1, 1.2, 1.3):
        drift.observe("ttft", "0.5", 100.0 * ratio, 100.0)
    assert drift.factor("ttft", "0.5") == pytest.approx(1.27 * 1.04)  # on top of the quantile
    assert Drift(quantile=None, headroom=1.04).factor("ttft", "0.5") == 1.0  # off is the profile as measured
    profile = LatencyProfile("fp32", 1, {"0.5": LevelLatency(10.0, 1.0, 5.0), "1.0": LevelLatency(20.0, 2.0, 10.0)},
                             drift=Drift(headroom=1.04))
    assert sdk_feasible(profile, "0.5", 1.0, 100, SLO(ttft_ms=115.0, tpot_ms=6.0))  # predicted 110 × 1.04
    assert not sdk_feasible(profile, "0.5", 1.0, 100, SLO(ttft_ms=112.0, tpot_ms=6.0))  # 2% is too close
    for bad in (0.99, 0.0, float("nan")):
        with pytest.raises(ValueError, match="at least 1.0"):
            Drift(headroom=bad)


def test_a_profile_that_served_slow_requests_stops_promising_the_cells_that_missed():
    profile = LatencyProfile("fp32", 1, {"0.5": LevelLatency(10.0, 1.0, 5.0), "1.0": LevelLatency(20.0, 2.0, 10.0)})
    slo = SLO(ttft_ms=115.0, tpot_ms=6.0)
    assert sdk_feasible(profile, "0.5", 1.0, 100, slo)  # predicted 110 ms, 5 ms
    for _ in range(4):  # served at 0.5 on 100 tokens: prefill 10% slower than profiled, TPOT as profiled
        profile.observe("0.5", 100, 121.0, 5.0)
    assert profile.ttft_ms("0.5", 100) == pytest.approx(121.0) and profile.tpot_ms("0.5") == pytest.approx(5.0)
    assert not sdk_feasible(profile, "0.5", 1.0, 100, slo)
    assert profile.ttft_ms("0.5", 100, calibrated=False) == 110.0
    # A relative target is a fraction of the full model as profiled, whatever the drift.
    assert SLO.fraction(0.5, 0.5).absolute(profile, 100) == SLO(110.0, 5.0)
    # Policies' views of the profile (dataclasses.replace) learn from the same requests; the file never holds them.
    assert dataclasses.replace(profile, tlm=None).ttft_ms("0.5", 100) == pytest.approx(121.0)
    assert "drift" not in profile.to_dict()
    assert "drift" not in json.dumps(profile.to_dict())
