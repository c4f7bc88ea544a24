"""One small SmolLM2 package (and its recovery adapters) shared by every ElastiLM test in a session.

Built on first use and memoised in this module, so each test module's fixture reuses it:
a cheap but real Taylor profile (4 windows × 64 tokens, block-influence layer scores),
levels 0.5 / 0.7 / 1.0, and a short LoRA per level below 1.0.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache, wraps
from pathlib import Path

import pytest

LEVELS = [0.5, 0.7, 1.0]
RECOVER_STEPS = 6
_ROOT = Path(tempfile.mkdtemp(prefix="elastilm-tests-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@contextmanager
def one_thread() -> Iterator[None]:
    """Two oversubscribed intra-op threads on a busy 2-core box run ~8x slower than one."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def single_thread():
    with one_thread():
        yield


def _one_thread(fn):
    @wraps(fn)
    def wrapper(*args, **kwargs):
        with one_thread():
            return fn(*args, **kwargs)

    return wrapper


@cache
@_one_thread
def smollm2_elastic_package() -> Path:
    from pipeline.assets import prepare_smollm2
    from pipeline.elastilm.elastify import ElastifySettings, elastify
    from pipeline.elastilm.profile import ProfileSettings, profile
    from pipeline.models.loading import load_model
    from pipeline.stage import quiet_context

    loaded = load_model(prepare_smollm2())
    ctx = quiet_context(_ROOT)
    importance = profile(loaded.model, loaded.tokenizer, loaded.architecture,
                         ProfileSettings(windows=4, window_length=64, layer_method="block_influence"), ctx)
    out = _ROOT / "package"
    elastify(loaded.model, loaded.tokenizer, loaded.architecture, importance, ElastifySettings(levels=LEVELS),
             out, name="smollm2-test", source=loaded.source)
    return out


@cache
@_one_thread
def recovery_results() -> dict[str, dict]:
    """Per level below 1.0: the recover stage's outputs and metrics (short torch-loop runs)."""
    import json

    from pipeline.elastilm import recover
    from pipeline.stage import quiet_context

    results = {}
    for level in ("0.5", "0.7"):
        work = _ROOT / f"recover-{level}"
        settings = recover.RecoverSettings(level=level, steps=RECOVER_STEPS, batch_size=2, seq_len=32, eval_windows=4,
                                           lr=2e-3, warmup_steps=1, corpus=["ptb:valid"], eval_corpus=["ptb:test"])
        outputs = recover.run({"package": smollm2_elastic_package()}, settings, quiet_context(work))
        results[level] = {**{k: Path(v) for k, v in outputs.items()},
                          "metrics_data": json.loads(Path(outputs["metrics"]).read_text())}
    return results


@cache
@_one_thread
def recovered_package() -> Path:
    """The shared package plus its level adapters, installed through the fan-in entry."""
    from pipeline.contract import StageSettings
    from pipeline.elastilm import recover
    from pipeline.stage import quiet_context

    inputs = {"package": smollm2_elastic_package()}
    inputs |= {f"adapter.{level}": result["adapter"] for level, result in recovery_results().items()}
    return Path(recover.run_install(inputs, StageSettings(), quiet_context(_ROOT / "install"))["package"])


def scratch(name: str) -> Path:
    path = _ROOT / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@cache
@_one_thread
def score_tlm_dir() -> Path:
    """A score-head TLM trained briefly on LLM-derived labels (LAMBADA passages, full SmolLM2)."""
    from pipeline.elastilm import tlm
    from pipeline.stage import quiet_context

    settings = tlm.ScoreSettings(texts=["lambada"], passages=24, passage_words=50, steps=40, batch_size=8, lr=1e-4,
                                 max_length=128)
    return Path(tlm.run_score({"package": smollm2_elastic_package()}, settings, quiet_context(scratch("tlm")))["tlm"])


@cache
@_one_thread
def latency_report() -> Path:
    from pipeline.elastilm import latency
    from pipeline.stage import quiet_context

    settings = latency.LatencySettings(prompt_lengths=[16, 64], decode_tokens=4, repeats=1)
    return Path(latency.run({"package": smollm2_elastic_package()}, settings, quiet_context(scratch("latency")))["latency"])
