"""Publish gate of the report card: quality must not rise as width falls beyond the noise band."""

from __future__ import annotations

import pytest

from pipeline.elastilm.evaluate import PublishGateError, check_gate, gate_failures


def card(ppl_half, ppl_full, acc_half=0.40, acc_full=0.45, items=100):
    return {"items": items, "levels": {
        "0.5": {"ppl:ptb:test": ppl_half, "accuracy": acc_half},
        "1.0": {"ppl:ptb:test": ppl_full, "accuracy": acc_full},
    }}


def test_evaluate_gate_passes_monotone_quality_and_noise():
    check_gate(card(30.0, 20.0))
    check_gate(card(19.8, 20.0))  # 1% better: inside the 2% band
    check_gate(card(30.0, 20.0, acc_half=0.50, acc_full=0.45))  # 5 points on 100 items is noise


def test_evaluate_gate_fails_a_narrow_level_that_beats_a_wide_one_with_a_clear_message():
    with pytest.raises(PublishGateError, match=r"level 0.5 has ppl:ptb:test 15.000, better than wider level 1.0"):
        check_gate(card(15.0, 20.0))
    failures = gate_failures(card(30.0, 20.0, acc_half=0.70, acc_full=0.45), 0.02, None)
    assert len(failures) == 1 and "answers 0.700" in failures[0]
    assert gate_failures(card(30.0, 20.0, acc_half=0.50), 0.02, accuracy_noise=0.01)


def test_evaluate_gate_compares_adapted_levels_with_adapted_levels_only():
    adapted = card(15.0, 20.0)
    adapted["levels"]["0.5"]["adapted"] = True  # recovered on the evaluation's domain; 1.0 is the source model
    check_gate(adapted)
    adapted["levels"]["0.7"] = {"ppl:ptb:test": 18.0, "accuracy": 0.45, "adapted": True}
    with pytest.raises(PublishGateError, match=r"level 0.5 has ppl:ptb:test 15.000, better than wider level 0.7"):
        check_gate(adapted)
    assert issubclass(PublishGateError, ValueError)  # permanent: workers do not retry it


def test_evaluate_report_card_runs_every_level_and_gates(tmp_path, calib_text):
    import json

    from pipeline.elastilm import evaluate
    from pipeline.stage import quiet_context
    from tests.support.pipeline_packages import build_package
    from tests.support.sdk_packages import add_recovery_adapters, signing_key
    from tests.support.tiny import byte_tokenizer, tiny_model

    package = build_package(tiny_model("llama_gqa"), byte_tokenizer(), tmp_path / "pkg", signing_key(),
                            levels=[0.5, 1.0])
    add_recovery_adapters(package, signing_key())
    settings = evaluate.ReportCardSettings(corpora=[str(calib_text)], windows=2, window_length=32, tasks=["arc_easy"],
                                           items=3, prompt_tokens=16, gate=False, precisions=[])
    out = evaluate.run_card({"package": package}, settings, quiet_context(tmp_path / "card"))
    card = json.loads(out["report_card"].read_text())
    assert set(card["levels"]) == {"0.5", "1.0"}
    assert all(row["adapted"] for row in card["levels"].values())  # the helper adapts every level
    for row in card["levels"].values():
        assert row[f"ppl:{calib_text}"] > 1 and 0 <= row["accuracy"] <= 1
        assert row["measured_ttft_ms"] > 0 and row["measured_tpot_ms"] > 0
    # The verdict the card records, worked out here from its own numbers and the documented rule (a
    # narrower level fails when its perplexity is more than 2% below the wider one's, or its accuracy
    # more than two binomial standard errors above), then held against what the stage enforces.
    half, full = card["levels"]["0.5"], card["levels"]["1.0"]
    assert card["items"] == 3
    p = full["accuracy"]
    band = 2 * (max(p * (1 - p), 1 / 3) / 3) ** 0.5
    expected = [key for key in half if key.startswith("ppl:") and half[key] < 0.98 * full[key]]
    expected += ["accuracy"] * (half["accuracy"] > p + band)

    def failed(line):  # "level 0.5 has <key> …, better than …" or "level 0.5 answers … of held-out items …"
        words = line.split()
        return words[3] if words[2] == "has" else "accuracy"

    assert sorted(map(failed, card["gate"])) == sorted(expected)
    gated = settings.model_copy(update={"gate": True})
    if expected:
        with pytest.raises(PublishGateError, match="level 0.5"):
            evaluate.run_card({"package": package}, gated, quiet_context(tmp_path / "gated"))
        assert (tmp_path / "gated" / "report_card.json").is_file()  # written before the gate refuses
    else:
        evaluate.run_card({"package": package}, gated, quiet_context(tmp_path / "gated"))
