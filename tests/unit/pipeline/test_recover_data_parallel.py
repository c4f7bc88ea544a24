"""One level's recovery on two Ray Train workers (DDP over gloo) equals the one-worker run.

Same seed, same global batch (4 rows: 2 a worker), same data order: the adapters differ only by the
order of floating-point sums. Measured on this machine: 1.5e-5 at most over every LoRA entry after 4
steps (entries up to 0.22; AdamW's first steps normalise near-zero gradients, which magnifies that noise),
against 0.056 when both workers were made to train on the same rows. The workers run in a local Ray that
the stage starts and stops itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.elastilm import recover, recover_distributed
from pipeline.settings import RecoverSettings
from pipeline.stage import quiet_context
from tests.support.tiny import byte_tokenizer, tiny_model

# fp32 on both sides (bf16 autocast would round differently per row split); AdamW's first steps move each
# entry by ~lr, so 1e-4 absolute is a thousandth of a step: far above sum-order noise, far below a wrong batch.
TOLERANCE = 1e-4
SETTINGS = {"level": "0.5", "steps": 4, "batch_size": 4, "seq_len": 32, "eval_windows": 4, "lr": 1e-2,
            "warmup_steps": 1, "rank": 4, "alpha": 8.0, "precision": "float32"}


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    from tests.support.pipeline_packages import build_package
    from tests.support.sdk_packages import signing_key

    return build_package(tiny_model("llama_gqa"), byte_tokenizer(), tmp_path_factory.mktemp("pkg") / "pkg",
                         signing_key(), levels=[0.5, 1.0])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    import treebank

    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text(treebank.penn["valid"][:40000])
    return path


def _settings(corpus: Path, **extra) -> RecoverSettings:
    return RecoverSettings(**{**SETTINGS, "corpus": [str(corpus)], "eval_corpus": [str(corpus)], **extra})


def test_two_gloo_workers_train_the_same_adapter_as_one(package, corpus, tmp_path):
    import ray

    joined = ray.is_initialized()  # an earlier test of this process may have left one running
    one = recover.run({"package": package}, _settings(corpus), quiet_context(tmp_path / "one"))
    assert ray.is_initialized() == joined  # one worker trains in process: no Ray
    two = recover_distributed.run({"package": package}, _settings(corpus, workers=2), quiet_context(tmp_path / "two"))
    assert ray.is_initialized() == joined  # a local Ray it started is shut down again

    single, parallel = load_file(str(one["adapter"])), load_file(str(two["adapter"]))
    assert single.keys() == parallel.keys()
    worst = max((single[k] - parallel[k]).abs().max().item() for k in single)
    assert worst <= TOLERANCE, worst
    moved = max(t.abs().max().item() for k, t in single.items() if k.endswith("lora_B"))
    assert moved > 100 * TOLERANCE  # B starts at zero: the comparison is between trained adapters

    metrics_one = json.loads(Path(one["metrics"]).read_text())
    metrics_two = json.loads(Path(two["metrics"]).read_text())
    assert metrics_two["workers"] == 2 and metrics_two["steps"] == metrics_one["steps"] == 4
    assert metrics_two["train_tokens"] == metrics_one["train_tokens"]  # the same global batches
    for key in ("train_loss_first", "train_loss_last", "eval_loss_before", "eval_loss_after"):
        assert metrics_two[key] == pytest.approx(metrics_one[key], abs=1e-4), key
    assert (Path(two["peft"]) / "adapter_config.json").is_file()
    assert not (tmp_path / "two" / ".ray-train").exists()  # Ray Train's storage is cleaned away


def test_split_rows_weight_each_worker_by_its_labelled_tokens():
    from pipeline.elastilm.recover_distributed import labelled

    labels = torch.tensor([[1, 2, 3, recover.IGNORE], [1, recover.IGNORE, recover.IGNORE, recover.IGNORE]])
    assert labelled(labels) == 2  # the first position has no previous token; padding carries no loss
    assert labelled(labels[:1]) == 2 and labelled(labels[1:]) == 0


def test_more_workers_than_one_is_refused_in_process_and_needs_an_even_split(package, corpus, tmp_path):
    from pydantic import ValidationError

    with pytest.raises(recover.RecoverError, match="Ray Train"):
        recover.run({"package": package}, _settings(corpus, workers=2), quiet_context(tmp_path))
    with pytest.raises(ValidationError, match="multiple of workers"):
        _settings(corpus, workers=3)
    with pytest.raises(ValidationError, match="deepspeed"):
        _settings(corpus, workers=2, backend="deepspeed")
