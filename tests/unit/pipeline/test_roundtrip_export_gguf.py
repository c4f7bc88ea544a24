"""An exported level runs in llama.cpp (llama-cpp-python, its own venv) at its real per-layer widths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from device_sdk.export import ExportError
from device_sdk.export_gguf import export_gguf
from device_sdk.format import read_manifest
from tests.support.pipeline_packages import tiny_package
from tests.support.sdk_packages import signing_key

ROOT = Path(__file__).resolve().parents[3]
LLAMA_PYTHON = ROOT / ".venv-llama" / "bin" / "python"  # `make llama-cpp`; `make test` builds it beside the tests
LLAMA_STAMP = ROOT / ".venv-llama" / ".installed"
NEW_TOKENS = 32
PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):", "The three primary colors are",
           "Water boils at", "In 1492, Columbus", "The best way to learn a language is", "1, 2, 3, 4,"]
# Runs in llama.cpp's venv: greedy tokens from the SDK's prompt ids and llama.cpp's own tokenization;
# with "forced", the argmax at every position of the given sequences instead (teacher forcing). It runs
# with the repository as its working directory, which `python -c` puts on sys.path: bench.llama_kernels
# is stdlib only, so it imports there without the project's own venv.
LLAMA_CPP_RUNNER = """
import json, sys
import numpy as np
from llama_cpp import Llama
spec = json.loads(sys.argv[1])
from bench.llama_kernels import plain_kernels_where_amx_crashes
plain_kernels_where_amx_crashes()
llm = Llama(model_path=spec["gguf"], n_ctx=256, n_threads=1, logits_all="forced" in spec, verbose=False)
out = {"generated": [], "tokenized": [], "forced_argmax": []}
for sequence in spec.get("forced", []):
    llm.reset()
    llm.eval(sequence)
    out["forced_argmax"].append([int(i) for i in np.argmax(llm.scores[:len(sequence)], axis=-1)])
for prompt, ids in zip(spec["prompts"], spec["prompt_ids"]):
    out["tokenized"].append(llm.tokenize(prompt.encode(), add_bos=False, special=True))
    tokens = []
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        tokens.append(token)
        if token == llm.token_eos() or len(tokens) == spec["new_tokens"]:
            break
    out["generated"].append(tokens)
print(json.dumps(out))
"""


def wait_for_llama_build(limit_s: float = 1800.0) -> None:
    """`make test` builds llama.cpp's venv beside the tests (ELASTIFY_LLAMA_BUILD_PID): wait for its stamp."""
    import psutil

    build = os.environ.get("ELASTIFY_LLAMA_BUILD_PID")
    deadline = time.monotonic() + limit_s

    def building() -> bool:
        try:
            return psutil.Process(int(build)).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while build and not LLAMA_STAMP.is_file() and building() and time.monotonic() < deadline:
        time.sleep(5)
    log = os.environ.get("ELASTIFY_LLAMA_BUILD_LOG", "")
    assert LLAMA_STAMP.is_file(), f"llama.cpp's venv is missing: run `make llama-cpp`{f' (build log: {log})' * bool(log)}"


def run_llama_cpp(gguf: Path, prompt_ids: list[list[int]], forced: list[list[int]] | None = None) -> dict:
    """llama.cpp's greedy continuations of `prompt_ids` (none when `forced` is given: then its argmax
    at every position of each `forced` sequence), in its own venv with a clean environment."""
    wait_for_llama_build()
    spec = {"gguf": str(gguf), "prompts": [] if forced else PROMPTS, "prompt_ids": [] if forced else prompt_ids,
            "new_tokens": NEW_TOKENS}
    if forced:
        spec["forced"] = forced
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}  # nothing of ours
    done = subprocess.run([str(LLAMA_PYTHON), "-c", LLAMA_CPP_RUNNER, json.dumps(spec)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def metadata(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    values = {}
    for name, field in reader.fields.items():
        if name.startswith(("general.architecture", "deci.", "llama.")):
            value = field.contents()
            values[name.split(".", 1)[1] if not name.startswith("general") else name] = value
    return values


def test_a_tokenizer_llama_cpp_cannot_take_is_refused(tmp_path):
    _, package = tiny_package("llama_gqa", tmp_path / "pkg", signing_key())  # a WordLevel byte tokenizer
    with pytest.raises(ExportError, match="byte-level BPE"):
        export_gguf(package, tmp_path / "tiny.gguf", level="0.5")
    assert not list(tmp_path.glob("*.gguf*"))


def test_without_the_gguf_package_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(ExportError, match=r"elastify-device\[export\]"):
        export_gguf(tmp_path, tmp_path / "x.gguf", level="0.5")


@pytest.fixture(scope="module")
def exports(smollm2_package, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    return {name: export_gguf(smollm2_package, out / f"{name}.gguf", level=level, dtype=dtype)
            for name, level, dtype in (("half-f16", "0.5", "f16"), ("full-f16", "1.0", "f16"),
                                       ("half-q8_0", "0.5", "q8_0"))}


@pytest.fixture(scope="module")
def sdk(smollm2_package):
    from device_sdk.runtime import ElasticModel

    return ElasticModel.load(smollm2_package, allow_unsigned=True)


@pytest.mark.slow
def test_per_layer_widths_are_written_per_layer(smollm2_package, exports):
    manifest = read_manifest(smollm2_package)
    level, n_rep = manifest.elastic.level("0.5"), manifest.architecture.n_rep
    half = metadata(exports["half-f16"])
    assert half["general.architecture"] == "deci"  # llama's graph would use layer 0's counts everywhere
    assert half["attention.head_count_kv"] == level.attn_units
    assert half["attention.head_count"] == [groups * n_rep for groups in level.attn_units]
    assert half["feed_forward_length"] == level.mlp_units
    full = metadata(exports["full-f16"])
    assert full["general.architecture"] == "llama" and full["attention.head_count"] == manifest.architecture.heads


@pytest.mark.slow
def test_llama_cpp_greedy_tokens_equal_the_sdk_at_the_level(sdk, exports):
    prompt_ids = [sdk.tokenizer.encode(prompt).ids for prompt in PROMPTS]
    expected = [sdk.generate(prompt, level="0.5", max_new_tokens=NEW_TOKENS).tokens for prompt in PROMPTS]
    got = run_llama_cpp(exports["half-f16"], prompt_ids)
    assert got["tokenized"] == prompt_ids  # llama.cpp's own tokenizer agrees with the package's
    assert got["generated"] == expected
    # Q8_0 rounds every weight, which flips near-ties of this unrecovered level: measured as the
    # share of the SDK's greedy tokens that Q8_0's argmax picks too, fed the same sequence.
    sequences = [ids + tokens for ids, tokens in zip(prompt_ids, expected, strict=True)]
    forced = run_llama_cpp(exports["half-q8_0"], prompt_ids, forced=sequences)["forced_argmax"]
    agree = [pick == token for ids, tokens, picks in zip(prompt_ids, expected, forced, strict=True)
             for pick, token in zip(picks[len(ids) - 1:], tokens, strict=False)]
    assert sum(agree) / len(agree) >= 0.9, f"Q8_0 agrees on {sum(agree)} of {len(agree)} tokens"


@pytest.mark.slow
def test_file_size_follows_the_level(smollm2_package, exports):
    level = read_manifest(smollm2_package).elastic.level("0.5")
    size_ratio = exports["half-f16"].stat().st_size / exports["full-f16"].stat().st_size
    # Every stored weight of a tied-embedding model is multiplied per token, so the file shrinks
    # with the level's active parameters (the tokenizer and F32 norms are the small rest).
    assert abs(size_ratio - level.active_fraction) < 0.01, (size_ratio, level.active_fraction)
    assert exports["half-q8_0"].stat().st_size < 0.56 * exports["half-f16"].stat().st_size  # 8.5 of 16 bits
