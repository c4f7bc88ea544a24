"""Recover stage under DeepSpeed ZeRO-2 on CPU: gloo, a client torch optimizer, shm-comm disabled.

Runs in a subprocess so the process group and DeepSpeed's environment stay out of the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

SCRIPT = """
import json, sys
from pathlib import Path
from pipeline.elastilm import recover
from pipeline.stage import quiet_context
package, corpus, out = map(Path, sys.argv[1:4])
settings = recover.RecoverSettings(level="0.5", backend="deepspeed", zero_stage=2, steps=4, batch_size=2, seq_len=32,
                                   eval_windows=4, lr=1e-2, warmup_steps=1, corpus=[str(corpus)], eval_corpus=[str(corpus)])
outputs = recover.run({"package": package}, settings, quiet_context(out))
import torch.distributed as dist
print(json.dumps({"world": dist.get_world_size(), "backend": dist.get_backend()}))
"""


def test_recover_deepspeed_zero2_trains_on_cpu(tmp_path, calib_text):
    from tests.support.pipeline_packages import build_package
    from tests.support.sdk_packages import signing_key
    from tests.support.tiny import byte_tokenizer, tiny_model

    package = build_package(tiny_model("llama_gqa"), byte_tokenizer(), tmp_path / "pkg", signing_key(),
                            levels=[0.5, 1.0])
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(package), str(calib_text), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
    group = json.loads(done.stdout.strip().splitlines()[-1])
    assert group == {"world": 1, "backend": "gloo"}
    metrics = json.loads((tmp_path / "out" / "recover.json").read_text())
    assert metrics["settings"]["backend"] == "deepspeed" and metrics["steps"] == 4
    # the default loss distils from level 1.0: the teacher's level switches run inside the ZeRO engine
    assert metrics["settings"]["loss"] == "distill" and metrics["teacher_level"] == "1.0"
    assert metrics["eval_loss_after"] < metrics["eval_loss_before"]
    adapter = load_file(str(tmp_path / "out" / "0.5.safetensors"))
    # peft starts B at zero: a non-zero B means the ZeRO optimizer stepped the LoRA weights
    assert any(torch.count_nonzero(t) for k, t in adapter.items() if k.endswith("lora_B"))
