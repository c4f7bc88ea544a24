"""Peak resident memory of one stage, run alone in a fresh process, against the bytes of the model it reads.

    python -m tests.support.stage_memory STAGE MODEL_DIR WORK_DIR [IMPORTANCE]

Each measurement is its own process: it imports everything the stage needs, notes its resident memory
(the baseline: interpreter, torch, transformers), resets the kernel's peak-RSS mark to it, runs the stage,
and prints one JSON line with the peak above that baseline. The peak is /proc's VmHWM, not ru_maxrss:
Linux carries ru_maxrss across exec from the forking parent, so a child of a large pytest process would
report the parent's size. A random Llama-shaped source for it
is `write_random_llama` (random weights: these measure memory, never quality).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def resident_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    """This process's peak resident memory since exec, or since the last `reset_peak`."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("/proc/self/status has no VmHWM")


def reset_peak() -> None:
    """Set the peak-RSS mark to the current RSS (proc(5): clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def write_random_llama(out_dir: Path, *, hidden: int = 1024, intermediate: int = 2816, layers: int = 8,
                       heads: int = 16, kv_heads: int = 4, vocab: int = 8192, dtype: str = "bfloat16",
                       seed: int = 0) -> Path:
    """A randomly initialised Llama (~97M parameters by default, ~195 MB in bf16) saved as an HF directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.tiny import byte_tokenizer

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=512, tie_word_embeddings=True)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(str(out_dir))
    byte_tokenizer().save_pretrained(str(out_dir))
    return out_dir


def model_bytes(model_dir: Path) -> int:
    from pipeline.models.loading import safetensors_files

    return sum(path.stat().st_size for path in safetensors_files(Path(model_dir)))


def measure(stage: str, model_dir: Path, work_dir: Path, importance: Path | None = None,
            settings: dict | None = None) -> dict:
    """Run `stage` ("elastify" or "profile") in a fresh process; its JSON result plus the model's bytes."""
    args = [sys.executable, "-m", "tests.support.stage_memory", stage, str(model_dir), str(work_dir),
            str(importance or ""), json.dumps(settings or {})]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(args, check=True, capture_output=True, text=True, cwd=REPO, env=env).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["model_mb"] = model_bytes(model_dir) / 2**20
    result["ratio"] = result["above_baseline_mb"] / result["model_mb"]
    return result


def warm_libraries() -> None:
    """Load the library code a stage's first model touches (transformers' Llama modules, a fast tokenizer), so
    that the baseline holds code and the measurement data: ~110 MB of RSS that does not grow with the model."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.support.tiny import byte_tokenizer

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)
    byte_tokenizer()


def _child(stage: str, model_dir: str, work_dir: str, importance: str, settings: str) -> None:
    from pipeline.elastilm import elastify, profile
    from pipeline.settings import ElastifySettings, ProfileSettings
    from pipeline.stage import quiet_context

    ctx = quiet_context(Path(work_dir))
    options = json.loads(settings)
    imported = resident_mb()
    warm_libraries()
    baseline = resident_mb()
    reset_peak()
    if stage == "elastify":
        outputs = elastify.run({"model": Path(model_dir), "importance": Path(importance)},
                               ElastifySettings(**options), ctx)
    else:
        outputs = profile.run({"model": Path(model_dir)}, ProfileSettings(**options), ctx)
    print(json.dumps({"stage": stage, "imports_mb": imported, "baseline_mb": baseline, "peak_mb": peak_mb(),
                      "above_baseline_mb": peak_mb() - baseline, "outputs": {k: str(v) for k, v in outputs.items()}}))


if __name__ == "__main__":
    _child(*sys.argv[1:6])
