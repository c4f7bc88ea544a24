"""The report card's like-with-like quality: ratios to the full model, accuracy with its standard error,
generation health, top-1 agreement, the usable verdict, the plot, and what publish puts in the package."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from device_sdk.format import read_manifest
from device_sdk.trust import verify_package
from pipeline.data.recovery_text import HELDOUT_FILE
from pipeline.elastilm import evaluate
from pipeline.settings import GENERATION_PROMPT_COUNT, RecoverSettings, ReportCardSettings
from pipeline.stage import quiet_context
from tests.support.pipeline_packages import build_package
from tests.support.sdk_packages import add_recovery_adapters, public_bytes, signing_key
from tests.support.tiny import byte_tokenizer, tiny_model

KEY = signing_key()


def test_repeated_4gram_rate_counts_repeats_of_earlier_4grams_in_the_same_output():
    assert evaluate.repeated_4gram_rate([[1, 2, 3, 4, 1, 2, 3, 4]]) == pytest.approx(1 / 5)
    assert evaluate.repeated_4gram_rate([[7, 7, 7, 7, 7, 7]]) == pytest.approx(2 / 3)  # (7,7,7,7) three times
    # Pooled over outputs; a 4-gram seen in another output is not a repeat; short outputs add nothing.
    assert evaluate.repeated_4gram_rate([[1, 2, 3, 4, 1, 2, 3, 4], [1, 2, 3, 4], [5, 6]]) == pytest.approx(1 / 6)
    assert evaluate.repeated_4gram_rate([[1, 2, 3]]) == 0.0


def test_accuracy_stderr_is_the_binomial_standard_error():
    assert evaluate.accuracy_stderr(0.5, 400) == pytest.approx(0.025)
    assert evaluate.accuracy_stderr(0.8, 100) == pytest.approx(math.sqrt(0.8 * 0.2 / 100))
    assert evaluate.accuracy_stderr(1.0, 10) == 0.0


def test_there_are_as_many_fixed_prompts_as_the_settings_allow():
    assert len(evaluate.GENERATION_PROMPTS) == GENERATION_PROMPT_COUNT == len(set(evaluate.GENERATION_PROMPTS))
    defaults = ReportCardSettings()
    assert len(defaults.tasks) >= 4 and len(defaults.tasks) * defaults.items >= 400
    assert (defaults.generation_prompts, defaults.generation_tokens) == (32, 64)


def test_in_domain_reference_is_the_full_model_only_when_it_had_the_same_recovery(tmp_path):
    package = build_package(tiny_model("llama_gqa"), byte_tokenizer(), tmp_path / "pkg", KEY, levels=[0.5, 1.0])
    manifest = read_manifest(package)
    assert evaluate.in_domain_reference(manifest, [])[0]  # nothing recovered: like with like
    manifest.elastic.level("0.5").adapter = "adapters/recovery/0.5.safetensors"
    def recovered(**settings) -> dict:  # a recover task's metrics, as far as the reference reads them
        return {"settings": RecoverSettings(**settings).model_dump(mode="json")}

    distilled = recovered(loss="distill")
    ok, why = evaluate.in_domain_reference(manifest, [distilled])
    assert ok and "stays exactly zero" in why
    for trained_otherwise in (recovered(loss="lm"), recovered(loss="distill", experimental={"lm_weight": 0.5}), {}):
        ok, why = evaluate.in_domain_reference(manifest, [distilled, trained_otherwise])
        assert not ok and why.startswith("not reported")
    assert not evaluate.in_domain_reference(manifest, [])[0]  # recovered, and how is unknown
    manifest.elastic.level("1.0").adapter = "adapters/recovery/1.0.safetensors"  # a level-1.0 LoRA trained alike
    assert evaluate.in_domain_reference(manifest, [{"settings": {"loss": "lm"}}])[0]


@pytest.fixture
def recovered_package(tmp_path) -> Path:
    package = build_package(tiny_model("llama_gqa"), byte_tokenizer(), tmp_path / "pkg", KEY, levels=[0.5, 1.0])
    add_recovery_adapters(package, KEY)  # every level, 1.0 too: a like-with-like in-domain reference
    return package


def heldout_corpus(tmp_path: Path, calib_text: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = calib_text.read_text()[20000:32000]
    rows = [{"id": f"h{i}", "text": text[i * 3000 : (i + 1) * 3000]} for i in range(4)]
    (corpus / HELDOUT_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return corpus


def test_report_card_measures_every_level_against_the_full_model(recovered_package, tmp_path, calib_text):
    settings = ReportCardSettings(corpora=[str(calib_text)], in_domain=[str(calib_text)], windows=2, window_length=32,
                                  tasks=["arc_easy"], items=3, generation_prompts=2, generation_tokens=8,
                                  measure_latency=False, gate=False, usable_ppl_ratio=1.0)
    inputs = {"package": recovered_package, "corpus": heldout_corpus(tmp_path, calib_text)}
    out = evaluate.run_card(inputs, settings, quiet_context(tmp_path / "card"))
    card = json.loads(out["report_card"].read_text())
    assert card["reference_level"] == "1.0" and card["out_of_domain"] == ["heldout"]
    assert card["in_domain"] == [str(calib_text)] and "own recovery LoRA" in card["in_domain_reference"]
    assert card["windows"]["heldout"] == [2, 32]
    full, half = card["levels"]["1.0"], card["levels"]["0.5"]
    assert full["top1_agreement"] == 1.0 and 0.0 <= half["top1_agreement"] <= 1.0
    for key in ("heldout", str(calib_text)):
        assert full[f"ppl_ratio:{key}"] == 1.0
        assert half[f"ppl_ratio:{key}"] == pytest.approx(half[f"ppl:{key}"] / full[f"ppl:{key}"])
    for row in (full, half):
        assert row["accuracy_stderr"] == pytest.approx(evaluate.accuracy_stderr(row["accuracy"], 3))
        assert 0.0 <= row["repeat_4gram_rate"] <= 1.0
    # The full model is usable by definition; with a 1.0× limit the narrower level is usable only if
    # it is no worse out of domain (the tiny random model's LoRA makes it worse or equal).
    assert full["usable"] and full["unusable_because"] == []
    assert half["usable"] == (half["ppl_ratio:heldout"] <= 1.0 and not half["unusable_because"])
    assert out["quality_plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each quantised format scores every level, against itself in full precision and against the full
    # model in full precision (what a device serving that format gives up), with its own verdict.
    assert set(card["precisions"]) == {"int8", "int4"}
    for precision, section in card["precisions"].items():
        assert set(section["levels"]) == set(card["levels"]), precision
        for name, row in section["levels"].items():
            floating = card["levels"][name]
            for key in ("heldout", str(calib_text)):
                assert row[f"ppl_ratio_to_float:{key}"] == pytest.approx(row[f"ppl:{key}"] / floating[f"ppl:{key}"])
                assert row[f"ppl_ratio:{key}"] == pytest.approx(row[f"ppl:{key}"] / full[f"ppl:{key}"])
            assert row["unusable_because"] == evaluate.usable_reasons(row, full, ["heldout"], settings)
            assert row["usable"] == (not row["unusable_because"])
    int8, int4 = (card["precisions"][p]["levels"]["1.0"] for p in ("int8", "int4"))
    assert abs(math.log(int8["ppl_ratio_to_float:heldout"])) < 0.01  # Q8_0 blocks: perplexity barely moves
    assert int8["top1_agreement_with_float"] > int4["top1_agreement_with_float"]  # 4 bits lose more than 8


def test_window_predictions_agree_with_the_pipelines_perplexity(recovered_package, calib_text):
    from pipeline.data.calibration import make_windows
    from pipeline.models.elastic import serving_model
    from pipeline.models.scoring import perplexity

    model = serving_model(recovered_package)
    model.set_level("0.5")
    windows = make_windows(byte_tokenizer(), str(calib_text), 3, 24, seed=2)
    nll, argmax = evaluate.window_predictions(model, windows, batch_size=2)
    assert math.exp(nll) == pytest.approx(perplexity(model, windows), rel=1e-5)
    assert argmax.shape == (3, 23)


def test_publish_puts_the_verdict_and_the_plot_in_the_signed_package(recovered_package, tmp_path):
    from pipeline.publish import publish_package

    card = {"levels": {"0.5": {"active_fraction": 0.5, "ppl:x": 40.0, "ppl_ratio:x": 4.0, "repeat_4gram_rate": 0.9,
                               "top1_agreement": 0.4, "usable": False, "unusable_because": ["x"]},
                       "1.0": {"active_fraction": 1.0, "ppl:x": 10.0, "ppl_ratio:x": 1.0, "repeat_4gram_rate": 0.1,
                               "top1_agreement": 1.0, "usable": True, "unusable_because": []}},
            "in_domain": [], "out_of_domain": ["x"], "items": 0,
            "precisions": {"int4": {"levels": {"0.5": {"active_fraction": 0.5, "ppl_ratio:x": 4.4,
                                                       "ppl_ratio_to_float:x": 1.1, "usable": False},
                                               "1.0": {"active_fraction": 1.0, "ppl_ratio:x": 1.05,
                                                       "ppl_ratio_to_float:x": 1.05, "usable": True}}}}}
    report = tmp_path / "report_card.json"
    report.write_text(json.dumps(card))
    plot = evaluate.plot_quality(card, tmp_path / "plot" / "quality.png")
    out = publish_package(recovered_package, tmp_path / "published", KEY, {"report": report, "quality_plot": plot})
    manifest = verify_package(out, public_bytes(KEY))  # the plot is in the signed file table
    assert (out / evaluate.QUALITY_PLOT).read_bytes() == plot.read_bytes()
    assert evaluate.QUALITY_PLOT in {entry.path for entry in manifest.files}
    assert [(shape.name, shape.usable) for shape in manifest.elastic.levels] == [("0.5", False), ("1.0", True)]
    assert manifest.elastic.level("0.5").quality["top1_agreement"] == 0.4
    assert manifest.elastic.level("0.5").quality["int4:ppl_ratio_to_float:x"] == 1.1


def test_window_nlls_are_each_windows_own_loss_whatever_the_batch(recovered_package, calib_text):
    from pipeline.data.calibration import make_windows
    from pipeline.models.elastic import serving_model
    from pipeline.models.scoring import nll_sum, window_nlls

    model = serving_model(recovered_package)
    model.set_level("0.5")
    windows = make_windows(byte_tokenizer(), str(calib_text), 5, 24, seed=4)
    batched = window_nlls(model, windows, batch_size=3)  # a full batch and a ragged one
    alone = [nll_sum(model, w[None])[0].item() / 23 for w in windows]
    assert batched == pytest.approx(alone, rel=1e-5)
    assert len(set(round(x, 6) for x in batched)) == 5  # five different windows, five different losses


def test_paired_ratio_interval():
    from pipeline.models.scoring import paired_ratio

    same = paired_ratio([2.0, 3.0, 4.0], [2.0, 3.0, 4.0])
    assert same["ratio"] == 1.0 and same["low"] == same["high"] == 1.0
    # every window 0.1 to 0.3 nats worse: ratio exp(0.2), interval from the spread of the differences only
    shifted = paired_ratio([5.1, 1.3, 9.2, 4.2], [5.0, 1.0, 9.0, 4.0])
    assert shifted["ratio"] == pytest.approx(math.exp(0.2))
    assert shifted["se_nats"] == pytest.approx(math.sqrt(((0.1 - 0.2) ** 2 + 0.1**2 + 0 + 0) / 3 / 4))
    assert shifted["low"] < shifted["ratio"] < shifted["high"] and shifted["low"] > 1.0
    with pytest.raises(ValueError, match="equal lists"):
        paired_ratio([1.0, 2.0], [1.0])
