"""`elastify-device` and `elastify` as a user meets them: one table of invocations and what they answer
(exit 0, 1 for a failure, 2 for a usage error, one `error:` line and no traceback), then --json, the
prompt from stdin or a file, slo_met only with an SLO, and the unusable-level warning once per level."""

from __future__ import annotations

import base64
import io
import json
import logging

import pytest

from device_sdk.cli import main as device_cli
from device_sdk.trust import TRUST_STORE_ENV
from tests.support.sdk_packages import public_bytes, signing_key

KEY = base64.b64encode(public_bytes(signing_key())).decode()


@pytest.fixture(autouse=True)
def trust_store(tmp_path, monkeypatch):
    monkeypatch.setenv(TRUST_STORE_ENV, str(tmp_path / "trust.json"))


# (invocation with PKG for the package, exit code, a substring of stdout (0) or of the error line)
TABLE = [
    (["--version"], 0, "elastify-device 0.1"),
    (["bogus"], 2, "No such command 'bogus'"),
    (["generate", "PKG", "hi", "--max-new-tokens", "0"], 2, "'--max-new-tokens'"),
    (["generate", "PKG", ""], 2, "error: the prompt is empty"),
    (["generate", "PKG", "   \n"], 2, "error: the prompt is empty"),
    (["generate", "PKG"], 2, "give a PROMPT, - to read it from stdin, or --prompt-file PATH"),
    (["generate", "PKG", "hi", "--prompt-file", "PKG/manifest.json"], 2, "give PROMPT or --prompt-file, not both"),
    (["generate", "PKG", "--prompt-file", "PKG/missing.txt"], 1, "cannot read --prompt-file"),
    (["generate", "PKG", "hi", "--level", "0.3"], 2, "--level: no level 0.3"),
    (["generate", "PKG", "hi", "--level", "big"], 2, "--level:"),
    (["generate", "PKG", "hi", "--ttft-ms", "50", "--ttft-fraction", "0.5"], 2,
     "--ttft-ms and --ttft-fraction contradict each other"),
    (["generate", "PKG", "hi", "--tpot-ms", "50", "--tpot-fraction", "0.5"], 2,
     "--tpot-ms and --tpot-fraction contradict each other"),
    (["generate", "PKG", "hi", "--ttft-ms", "50", "--tpot-fraction", "0.5"], 2, "not both"),
    (["generate", "PKG", "hi", "--level", "0.5", "--tpot-fraction", "0.5"], 2, "--level forces a level"),
    (["generate", "PKG", "hi", "--ttft-ms", "inf"], 2, "'--ttft-ms': must be a finite number >= 0"),
    (["generate", "PKG", "hi", "--ttft-fraction", "nan"], 2, "'--ttft-fraction': must be a finite number >= 0"),
    (["generate", "PKG", "hi", "--tpot-ms", "-1"], 2, "'--tpot-ms': must be a finite number >= 0"),
    (["profile", "PKG", "--prompt-lengths", "4,zero"], 2, "expected positive token counts"),
    (["export", "PKG", "--format", "hf", "--out", "PKG/../x"], 2, "give --level or --profile"),
    (["export", "PKG", "--format", "zip", "--out", "PKG/../x"], 2, "'--format'"),
    (["verify", "PKG/../nothing-here"], 1, "error:"),
]


@pytest.mark.parametrize(("invocation", "code", "says"), TABLE, ids=[" ".join(row[0]) or "''" for row in TABLE])
def test_device_cli_table(gqa_package, invocation, code, says, capsys):
    args = [arg.replace("PKG", str(gqa_package)) for arg in invocation]
    if args[:1] in (["generate"], ["profile"], ["verify"]):
        args += ["--public-key", KEY]
    assert device_cli(args) == code
    out, err = capsys.readouterr()
    if code == 0:
        assert says in out
    else:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err


def test_generate_json_reads_the_prompt_from_stdin_or_a_file_and_says_slo_met_only_with_an_slo(
        gqa_package, tmp_path, monkeypatch, capsys):
    common = ["generate", str(gqa_package), "--public-key", KEY, "--max-new-tokens", "2"]
    monkeypatch.setattr("sys.stdin", io.StringIO("abc"))
    assert device_cli([*common, "-", "--level", "0.5", "--json"]) == 0
    from_stdin = json.loads(capsys.readouterr().out)
    assert from_stdin["level"] == "0.5" and "slo_met" not in from_stdin and from_stdin["prompt_tokens"] > 0
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("abc", encoding="utf-8")
    assert device_cli([*common, "--prompt-file", str(prompt_file), "--level", "0.5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == from_stdin["text"]  # the same prompt, greedy

    assert device_cli([*common, "abc", "--level", "0.5"]) == 0
    streamed = capsys.readouterr()
    assert streamed.out.startswith(from_stdin["text"]) and "slo_met" not in streamed.err
    assert device_cli([*common, "abc", "--ttft-fraction", "100"]) == 0  # profiles the package first
    assert "slo_met=True" in capsys.readouterr().err


def test_verify_trust_list_and_export_print_json(gqa_package, tmp_path, capsys):
    assert device_cli(["verify", str(gqa_package), "--public-key", KEY, "--json"]) == 0
    verified = json.loads(capsys.readouterr().out)
    assert verified["signature_verified"] is True and verified["files_verified"] is True
    assert device_cli(["trust", "add", "tiny", KEY]) == 0 and capsys.readouterr()
    assert device_cli(["trust", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"tiny": KEY}
    out = tmp_path / "hf"
    assert device_cli(["export", str(gqa_package), "--format", "hf", "--level", "0.5", "--out", str(out),
                       "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"format": "hf", "path": str(out)}


def test_the_unusable_level_warning_comes_once_per_level(caplog):
    runtime_log = logging.getLogger("device_sdk.runtime")
    message = "level %s is marked unusable by the package's report card (%s); generating at it because it was asked for"
    with caplog.at_level(logging.WARNING, logger="device_sdk.runtime"):
        for level in ("0.125", "0.125", "0.0625", "0.125", "0.0625"):
            runtime_log.warning(message, level, "ppl_ratio 9")
        runtime_log.warning("another warning")
        runtime_log.warning("another warning")
    warned = [record.getMessage().split()[1] for record in caplog.records if "unusable" in record.getMessage()]
    assert warned == ["0.125", "0.0625"]
    assert sum(record.getMessage() == "another warning" for record in caplog.records) == 2


def test_serve_passes_its_options_to_run_server(gqa_package, monkeypatch):
    from device_sdk import serve

    served = {}
    monkeypatch.setattr(serve, "run_server", lambda model, **options: served.update(options, model=model))
    assert device_cli(["serve", str(gqa_package), "--public-key", KEY, "--port", "0", "--max-queue", "2",
                       "--model-name", "tiny-chat", "--no-log-requests", "--drift-quantile", "off"]) == 0
    assert served.pop("model").latency_profile.drift.quantile is None
    assert served == {"host": "127.0.0.1", "port": 0, "max_queue": 2, "model_name": "tiny-chat", "log_requests": False}
