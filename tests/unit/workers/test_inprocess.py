"""The in-process runner: the chain's own stages, in order, each reading what the ones before returned."""

from __future__ import annotations

import dataclasses

import pytest
from cryptography.hazmat.primitives import serialization

from device_sdk.format import public_key_b64, read_manifest
from device_sdk.trust import verify_package
from pipeline.chain import STAGES
from pipeline.contract import Stage
from pipeline.settings import ElastifySettings, ProfileSettings, ReportCardSettings
from tests.support.sdk_packages import public_bytes, signing_key
from tests.support.tiny import save_tiny
from workers.inprocess import ChainError, StageFailed, plan_chain, run_chain

SMALLEST = ("profile", "elastify", "evaluate", "publish")  # the chain with every optional stage off


def only(*names: str) -> dict[str, bool]:
    return {stage.name: stage.name in names for stage in STAGES}


def recording(stages, calls: list) -> list[Stage]:
    """The stages, each noting (its name, the inputs it was handed, what it returned) when it runs."""

    def wrap(stage: Stage):
        def run(inputs, settings, ctx):
            returned = stage.run(inputs, settings, ctx)
            calls.append((stage.name, dict(inputs), dict(returned)))
            return returned

        return dataclasses.replace(stage, run=run)

    return [wrap(stage) for stage in stages]


def tiny_settings(calib) -> dict:
    return {
        "profile": ProfileSettings(calibration=[str(calib)], windows=2, window_length=16),
        "elastify": ElastifySettings(levels=[0.5, 1.0], align=8, name="tiny", version="1.2.3"),
        "evaluate": ReportCardSettings(corpora=[str(calib)], in_domain=[], windows=2, window_length=16, tasks=[],
                                       generation_prompts=0, measure_latency=False, gate=False),
    }


def test_the_smallest_chain_runs_in_order_each_stage_reading_the_outputs_before_it(tmp_path, calib_text):
    model = save_tiny("llama_gqa", tmp_path / "model")
    key = signing_key()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    calls, progress = [], []
    outputs = run_chain(recording(STAGES, calls), enabled=only(*SMALLEST), settings=tiny_settings(calib_text),
                        sources={"model": model}, work_dir=tmp_path / "work",
                        on_progress=lambda task, done, total: progress.append(task),
                        runtime={"signing_key": pem, "build_id": "b-1"})

    assert [name for name, _, _ in calls] == list(SMALLEST)
    returned = {name: out for name, _, out in calls}
    handed = {name: inputs for name, inputs, _ in calls}
    assert handed["profile"] == {"model": model}
    assert handed["elastify"] == {"model": model, "importance": returned["profile"]["importance"]}
    # recover-install is off, so the package the later stages read is elastify's (the chain's fallback);
    # the optional inputs whose producers are off (latency, corpus, recovery, tlm, ...) are left out.
    assert handed["evaluate"] == {"package": returned["elastify"]["package"]}
    assert handed["publish"] == {"package": returned["elastify"]["package"],
                                 "report": returned["evaluate"]["report_card"],
                                 "quality_plot": returned["evaluate"]["quality_plot"]}
    assert outputs == returned
    assert all(path.is_relative_to(tmp_path / "work" / name) for name, out in outputs.items() for path in out.values())
    assert progress  # the stages' progress reached the caller

    # Runtime values reach the stages that declare them: elastify's build_id, publish's signing key.
    package = outputs["publish"]["package"]
    manifest = verify_package(package, public_key_b64(public_bytes(key)))
    assert manifest.build_id == "b-1" and (manifest.name, manifest.version) == ("tiny", "1.2.3")
    assert all(f"ppl:{calib_text}" in level.quality for level in manifest.elastic.levels)


def test_without_a_signing_key_publish_leaves_the_package_unsigned(tmp_path, calib_text):
    settings = tiny_settings(calib_text)
    del settings["evaluate"]
    outputs = run_chain(STAGES, enabled=only("profile", "elastify", "publish"), settings=settings,
                        sources={"model": save_tiny("llama_gqa", tmp_path / "model")}, work_dir=tmp_path / "work")
    manifest = read_manifest(outputs["publish"]["package"])
    assert manifest.signature is None and all(not level.quality for level in manifest.elastic.levels)


def test_planning_falls_back_as_the_chain_does_and_names_every_problem():
    planned = plan_chain(STAGES, only(*SMALLEST), {}, {"model": "/m"})
    assert [stage.name for stage, _ in planned] == list(SMALLEST)
    by_name = {stage.name: refs for stage, refs in planned}
    assert by_name["evaluate"] == {"package": "elastify.package"}
    assert by_name["publish"] == {"package": "elastify.package", "report": "evaluate.report_card",
                                  "quality_plot": "evaluate.quality_plot"}

    with pytest.raises(ChainError) as refused:
        plan_chain(STAGES, {**only("evaluate", "recover"), "bogus": True}, {}, {})
    message = str(refused.value)
    assert "stages.bogus: unknown stage" in message
    assert "stages.recover: fans out into shards" in message
    assert "input 'package' needs stage 'recover-install', which is not enabled" in message
    with pytest.raises(ChainError, match="source.model: required by stage profile"):
        plan_chain(STAGES, only("profile"), {}, {})
    with pytest.raises(ChainError, match="stages.profile.settings: a ElastifySettings; the stage takes ProfileSettings"):
        plan_chain(STAGES, only("profile"), {"profile": ElastifySettings()}, {"model": "/m"})


def test_a_failing_stage_surfaces_its_error_with_its_name(tmp_path, calib_text):
    with pytest.raises(StageFailed) as failed:
        run_chain(STAGES, enabled=only(*SMALLEST), settings=tiny_settings(calib_text),
                  sources={"model": tmp_path / "nope"}, work_dir=tmp_path / "work")
    assert failed.value.stage == "profile" and type(failed.value.error).__name__ == "ModelLoadError"
    assert str(failed.value).startswith("stage profile: model path") and failed.value.__cause__ is failed.value.error

    def forgets(inputs, settings, ctx):
        return {}

    with pytest.raises(StageFailed, match=r"stage forgetful: did not return outputs \['x'\]"):
        run_chain([Stage(name="forgetful", run=forgets, outputs=("x",))], enabled={}, settings={}, sources={},
                  work_dir=tmp_path / "work2")
