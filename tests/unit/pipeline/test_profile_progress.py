"""The profile stage says it is alive at once: progress before the model loads and through the one long backward."""

from __future__ import annotations

from pipeline.elastilm import profile
from pipeline.stage import StageContext
from tests.support.tiny import save_tiny


def test_profile_reports_progress_before_loading_the_model_and_during_the_taylor_backward(tmp_path):
    model_dir = save_tiny("llama_gqa", tmp_path / "model")
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    reports: list[tuple[str, int, int]] = []
    ctx = StageContext(work_dir=tmp_path / "work", on_progress=lambda *report: reports.append(report))
    ctx.work_dir.mkdir()
    settings = profile.ProfileSettings(calibration=[str(calib)], windows=2, window_length=16, layer_windows=1)

    profile.run({"model": model_dir}, settings, ctx)

    assert reports[:4] == [(profile.LOAD_MODEL, 0, 1), (profile.LOAD_MODEL, 1, 1),
                           (profile.CALIBRATION_WINDOWS, 0, 1), (profile.CALIBRATION_WINDOWS, 1, 1)]
    taylor = [done for task, done, _ in reports if task == profile.UNIT_TAYLOR]
    [total] = {total for task, _, total in reports if task == profile.UNIT_TAYLOR}
    # one report per weight folded in, in order: a bar that moves while the backward runs, not 0/1 then 1/1
    assert taylor == list(range(total + 1)) and total > 4
    assert reports[-1][0] == "layer importance (leave one out)" and reports[-1][1] == reports[-1][2]
