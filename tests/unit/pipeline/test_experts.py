"""CLONE LoRA-MoE: the router, LoRA mixing, routing accuracy with the real MiniLM, experts in a package."""

from __future__ import annotations

import shutil

import pytest
import torch
from pydantic import ValidationError

from device_sdk.experts import ExpertRouter, fit_to_width, mix
from pipeline.clone.experts import ExpertSettings, build_experts, install_experts
from pipeline.stage import quiet_context
from tests.support.pipeline_packages import tiny_package
from tests.support.sdk_packages import signing_key


def test_router_modes_and_empty_set():
    centroids = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    router = ExpertRouter(["a", "b", "c"], centroids, temperature=0.1)
    embedding = torch.tensor([0.9, 0.3])
    soft = router.weights(embedding, "soft")
    cos = torch.nn.functional.normalize(embedding, dim=0) @ centroids.T
    torch.testing.assert_close(soft, torch.softmax(cos / 0.1, dim=0))
    assert router.weights(embedding, "top1").tolist() == [1.0, 0.0, 0.0]
    torch.testing.assert_close(router.weights(embedding, "uniform"), torch.full((3,), 1 / 3))
    assert router.route(torch.stack([embedding, -embedding])) == ["a", "c"]
    with pytest.raises(ValueError, match="routing mode"):
        router.weights(embedding, "best")
    with pytest.raises(ValueError, match="expert set is empty"):
        ExpertRouter([], torch.empty(0, 2))
    with pytest.raises(ValidationError, match="tasks\n  List should have at least 1 item"):
        ExpertSettings(tasks=[])


def test_stacked_mixture_equals_the_weighted_sum_of_experts():
    generator = torch.Generator().manual_seed(0)
    loras = [(torch.randn(r, 6, generator=generator), torch.randn(5, r, generator=generator), s)
             for r, s in ((2, 2.0), (3, 0.5), (2, 1.0))]
    weights = [0.6, 0.0, 0.4]
    x = torch.randn(4, 6, generator=generator)
    a, b, scale = mix(loras, weights)
    expected = sum(w * s * (x @ a_i.T) @ b_i.T for (a_i, b_i, s), w in zip(loras, weights, strict=True))
    torch.testing.assert_close((x @ a.T) @ b.T * scale, expected)
    assert a.shape[0] == 4  # the zero-weight expert is left out
    assert mix(loras, [0.0, 0.0, 0.0]) is None
    # A full-width expert at a smaller width: outputs of a row-unit layer, inputs of a column-unit one.
    assert fit_to_width(loras[0], "out", 3)[1].shape == (3, 2)
    assert fit_to_width(loras[0], "in", 4)[0].shape == (2, 4)


def test_router_sends_held_out_prompts_to_their_task():
    """Headline: MiniLM centroids of 64 training prompts per task, 32 held-out prompts per task."""
    from device_sdk.encoder import MiniLMEncoder
    from pipeline.clone.experts import centroids, expert_name, router_accuracy, split_task

    settings = ExpertSettings()
    encoder = MiniLMEncoder.load(settings.encoder_dir())
    splits = {expert_name(task): split_task(task, settings) for task in settings.tasks}
    centres = centroids(encoder, {name: [i.prompt() for i in train] for name, (train, _) in splits.items()})
    router = ExpertRouter(list(centres), torch.stack(list(centres.values())), settings.temperature)
    accuracy = router_accuracy(router, encoder, {name: [i.prompt() for i in held] for name, (_, held) in splits.items()})
    assert accuracy["overall"] >= 0.8, accuracy


def test_experts_train_install_and_mix_in_the_sdk(tmp_path):
    from device_sdk.format import read_manifest
    from device_sdk.runtime import ElasticModel

    _, package = tiny_package("llama_gqa", tmp_path / "pkg", signing_key())
    settings = ExpertSettings(tasks=["arc_easy", "piqa"], train_items=8, held_out=4, steps=3, batch_size=2,
                              seq_len=64, rank=2, lr=1e-2)
    report = build_experts(package, settings, tmp_path / "experts", quiet_context())
    assert [e["name"] for e in report["experts"]] == ["arc_easy", "piqa"]
    assert all(len(e["centroid"]) == 384 for e in report["experts"])
    copy = tmp_path / "with_experts"
    shutil.copytree(package, copy)
    install_experts(copy, tmp_path / "experts")
    manifest = read_manifest(copy)
    assert [e["adapter"] for e in manifest.experts["experts"]] == [
        "adapters/experts/arc_easy.safetensors", "adapters/experts/piqa.safetensors"]

    model = ElasticModel.load(copy, allow_unsigned=True)
    ids = torch.tensor([list(b"Question: which is warmer?\nAnswer:")])
    plain = model.logits(ids)
    weights = model.mix_experts("Question: How do you open a jar?\nAnswer:", "soft")
    assert set(weights) == {"arc_easy", "piqa"} and sum(weights.values()) == pytest.approx(1.0)
    mixed = model.logits(ids)
    assert not torch.allclose(plain, mixed)  # the trained LoRAs change the output
    top1 = model.mix_experts("Question: How do you open a jar?\nAnswer:", "top1")
    assert sorted(top1.values()) == [0.0, 1.0]
    model.set_level(0.5)  # experts are cut to a smaller width like the base weights
    model.mix_experts("Question: which is warmer?\nAnswer:", "uniform")
    assert model.logits(ids).shape == plain.shape
    out = model.generate("Question: which is warmer?\nAnswer:", max_new_tokens=2, experts="soft")
    assert len(out.tokens) == 2
    model.generate("Question: which is warmer?\nAnswer:", max_new_tokens=1)  # no experts: back to plain
    torch.testing.assert_close(model.logits(ids), plain)
