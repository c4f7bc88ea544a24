"""One small SmolLM2 package (and its recovery adapters) shared by every ElastiLM test in a session.

Built on first use and memoised in this module, so each test module's fixture reuses it:
a cheap but real Taylor profile (4 windows × 64 tokens, block-influence layer scores),
levels 0.5 / 0.7 / 1.0, and a short LoRA per level below 1.0.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

LEVELS = [0.5, 0.7, 1.0]
RECOVER_STEPS = 12
_ROOT = Path(tempfile.mkdtemp(prefix="elastilm-tests-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@cache
def smollm2_elastic_package() -> Path:
    from pipeline.assets import prepare_smollm2
    from pipeline.elastify import ElastifySettings, elastify
    from pipeline.models import load_model
    from pipeline.profile import ProfileSettings, profile
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
def recovery_results() -> dict[str, dict]:
    """Per level below 1.0: the recover stage's outputs and metrics (short torch-loop runs)."""
    import json

    from pipeline import recover
    from pipeline.stage import quiet_context

    results = {}
    for level in ("0.5", "0.7"):
        work = _ROOT / f"recover-{level}"
        settings = {"level": level, "steps": RECOVER_STEPS, "batch_size": 2, "seq_len": 64, "eval_windows": 6,
                    "lr": 1e-3, "warmup_steps": 2}
        outputs = recover.run({"package": smollm2_elastic_package()}, settings, quiet_context(work))
        results[level] = {**{k: Path(v) for k, v in outputs.items()},
                          "metrics_data": json.loads(Path(outputs["metrics"]).read_text())}
    return results


@cache
def recovered_package() -> Path:
    """The shared package plus its level adapters, installed through the fan-in entry."""
    from pipeline import recover
    from pipeline.stage import quiet_context

    inputs = {"package": smollm2_elastic_package()}
    inputs |= {f"adapter:{level}": result["adapter"] for level, result in recovery_results().items()}
    return Path(recover.run_install(inputs, {}, quiet_context(_ROOT / "install"))["package"])


def scratch(name: str) -> Path:
    path = _ROOT / name
    path.mkdir(parents=True, exist_ok=True)
    return path
