"""Bad input to `elastify elastify` gets a clear error, a non-zero exit, and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app
from tests.support.tiny import save_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny("llama_gqa", tmp_path_factory.mktemp("tiny") / "model")


def run_cli(*args: str):
    return CliRunner().invoke(app, ["elastify", *args])


def assert_refused(result, out: Path, message: str) -> None:
    assert result.exit_code != 0, result.output
    assert message in " ".join(result.output.split()), result.output
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def common(model: Path, out: Path, calib: Path) -> list[str]:
    return ["--model", str(model), "--out", str(out), "--calib", str(calib), "--windows", "2",
            "--window-length", "16", "--eval-windows", "0", "--align", "8"]


def test_unsupported_architecture(tmp_path, calib_text):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (model / "model.safetensors").write_bytes(b"\0" * 16)
    out = tmp_path / "out"
    result = run_cli(*common(model, out, calib_text))
    assert_refused(result, out, "unsupported architecture GPT2LMHeadModel")
    assert "LlamaForCausalLM" in result.output and "Qwen2ForCausalLM" in result.output


def test_unsupported_gguf_architecture(tmp_path, calib_text):
    import gguf

    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "out"
    assert_refused(run_cli(*common(path, out, calib_text)), out, "unsupported GGUF architecture 'gemma3'")


def test_missing_weights(tmp_path, tiny_dir, calib_text):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "model.safetensors").unlink()
    out = tmp_path / "out"
    assert_refused(run_cli(*common(model, out, calib_text)), out, "has no weights")


def test_missing_tokenizer_names_the_files_it_looked_for(tmp_path, tiny_dir, calib_text):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    out = tmp_path / "out"
    result = run_cli(*common(model, out, calib_text))
    assert_refused(result, out, "has no tokenizer (looked for tokenizer.json or tokenizer.model or vocab.json + merges.txt)")
    assert "sentencepiece" not in result.output and "0 tokens" not in result.output


def test_corrupt_weights(tmp_path, tiny_dir, calib_text):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "model.safetensors").write_bytes(b"this is not a safetensors file at all")
    out = tmp_path / "out"
    assert_refused(run_cli(*common(model, out, calib_text)), out, "could not load weights")


def test_missing_model_path(tmp_path, calib_text):
    out = tmp_path / "out"
    assert_refused(run_cli(*common(tmp_path / "nope", out, calib_text)), out, "does not exist")


@pytest.mark.parametrize(
    "levels, message",
    [("0,0.5,1.0", "(0, 1]"), ("0.5,1.5", "(0, 1]"), ("0.5,0.3,1.0", "strictly increasing"), ("a,b", "comma-separated")],
)
def test_bad_levels(tmp_path, tiny_dir, calib_text, levels, message):
    out = tmp_path / "out"
    assert_refused(run_cli(*common(tiny_dir, out, calib_text), "--levels", levels), out, message)


def test_anchor_fraction_of_one(tmp_path, tiny_dir, calib_text):
    out = tmp_path / "out"
    assert_refused(run_cli(*common(tiny_dir, out, calib_text), "--anchor-fraction", "1.0"), out, "anchor_fraction")


def test_empty_calibration_data(tmp_path, tiny_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    out = tmp_path / "out"
    assert_refused(run_cli(*common(tiny_dir, out, empty)), out, "holds no text")


def test_existing_output_is_not_overwritten(tmp_path, tiny_dir, calib_text):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli(*common(tiny_dir, out, calib_text))
    assert result.exit_code != 0 and "already exists" in " ".join(result.output.split())
    assert (out / "keep.txt").read_text() == "mine"


def test_good_input_writes_a_package_and_the_console_script_exits_nonzero_on_bad_input(tmp_path, tiny_dir, calib_text):
    out = tmp_path / "out"
    result = run_cli(*common(tiny_dir, out, calib_text), "--levels", "0.5,1.0")
    assert result.exit_code == 0, result.output
    assert (out / "manifest.json").is_file() and "anchor layers:" in result.output
    script = Path(sys.executable).with_name("elastify")
    bad = subprocess.run(
        [str(script), "elastify", *common(tiny_dir, tmp_path / "out2", calib_text), "--levels", "1.0,0.5"],
        capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}, timeout=300,
    )
    assert bad.returncode != 0 and "strictly increasing" in bad.stdout + bad.stderr
    assert not (tmp_path / "out2").exists()


def test_elastify_has_a_version():
    done = CliRunner().invoke(app, ["--version"])
    assert done.exit_code == 0 and done.output.startswith("elastify 0.1")
