"""One elastic model: the training view (HF + peft, as recover trains) and the serving view (the
device SDK's ElasticModel) compute the same function at every level with LoRA, and the stages
that only run the model (evaluate, latency, label) run the SDK's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from device_sdk.format import read_manifest
from device_sdk.lora import AdapterError, adapter_scale, read_adapter
from device_sdk.runtime import ElasticModel
from pipeline.models.elastic import ElasticCausalLM, serving_model
from pipeline.settings import ReportCardSettings
from pipeline.stage import quiet_context
from tests.support.pipeline_packages import tiny_package
from tests.support.sdk_packages import signing_key
from tests.support.tiny import byte_tokenizer

KEY = signing_key()
RANK, ALPHA = 4, 8.0  # scale 2


def trained_looking_adapters(package: Path, tmp_path: Path, seed: int = 0) -> dict[str, torch.nn.Module]:
    """Per level: recover's own training view (HF sub-model + peft) with random non-zero A and B,
    saved and installed through recover's own code. Returns the peft models."""
    from pipeline.elastilm.recover import (
        RecoverSettings,
        add_lora,
        install_adapters,
        level_submodel,
        save_adapter,
        unit_major_adapter,
    )

    generator = torch.Generator().manual_seed(seed)
    views, files = {}, {}
    for level in read_manifest(package).elastic.levels:
        settings = RecoverSettings(level=level.name, rank=RANK, alpha=ALPHA, dropout=0.0)
        peft_model = add_lora(level_submodel(ElasticCausalLM.from_package(package), level.name), settings)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
        peft_model.eval()
        files[level.name] = tmp_path / "adapters" / f"{level.name}.safetensors"
        save_adapter(unit_major_adapter(peft_model), files[level.name], settings)
        views[level.name] = peft_model
    install_adapters(package, files)
    return views


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_bias"])
def test_training_and_serving_views_agree_at_every_level_with_lora(kind, tmp_path):
    _, package = tiny_package(kind, tmp_path / "pkg", KEY)
    training = trained_looking_adapters(package, tmp_path)
    serving = serving_model(package)
    assert set(serving.adapters) == set(training)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    for level, peft_model in training.items():
        serving.set_level(level)
        assert all(scale == ALPHA / RANK for _, _, scale in serving.adapters[level].values())
        with torch.no_grad():
            expected = peft_model(input_ids=ids).logits
            with peft_model.disable_adapter():
                plain = peft_model(input_ids=ids).logits
        got = serving.logits(ids)
        assert (got - expected).abs().max().item() <= 1e-5, level
        assert (got - plain).abs().max().item() > 1e-3, level  # the adapter really changes the output


def test_adapter_scale_is_one_clear_error_when_missing_or_garbled(tmp_path):
    assert adapter_scale({"scale": "0.5"}, "x") == 0.5
    assert adapter_scale({"alpha": "16", "rank": "8"}, "x") == 2.0
    for meta in ({}, {"alpha": "16"}, {"scale": "two"}, {"alpha": "16", "rank": "0"}, {"scale": "nan"}):
        with pytest.raises(AdapterError, match="x"):
            adapter_scale(meta, "x")
    _, package = tiny_package("llama_gqa", tmp_path / "pkg", KEY)
    manifest = read_manifest(package)
    level = manifest.elastic.levels[0]
    tensors = {"model.layers.0.mlp.up_proj.lora_A": torch.ones(2, 64),
               "model.layers.0.mlp.up_proj.lora_B": torch.ones(level.mlp_units[0], 2)}
    path = tmp_path / "no-scale.safetensors"
    save_file(tensors, str(path), metadata={"level": level.name})
    with pytest.raises(AdapterError, match="no-scale.safetensors has neither"):
        read_adapter(path)
    from pipeline.elastilm.recover import install_adapters

    install_adapters(package, {level.name: path})
    with pytest.raises(AdapterError):  # the device refuses it too: no silent default scale
        serving_model(package)


def test_choice_scores_over_a_shared_prompt_cache_equal_one_sdk_forward_per_row(tmp_path):
    from pipeline.elastilm import label

    _, package = tiny_package("qwen2_bias", tmp_path / "pkg", KEY)
    trained_looking_adapters(package, tmp_path)
    model, tokenizer = serving_model(package), byte_tokenizer()
    prompts = ["Question: what is it?\nAnswer:", "Q: x\nA:", "A rather longer question about nothing at all?"]
    choices = ["a", "bc", "a much longer choice"]  # one-token and several-token choices
    for level in model.available_levels():
        model.set_level(level)
        batched = label.choice_scores(model, tokenizer, prompts, choices)
        expected = torch.zeros(len(prompts), len(choices))
        for p, prompt in enumerate(prompts):
            context = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            for c, choice in enumerate(choices):
                tokens = tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
                logits = model.logits(torch.tensor([context + tokens]))[0].log_softmax(-1)
                positions = torch.arange(len(context) - 1, len(context) - 1 + len(tokens))
                expected[p, c] = logits[positions, torch.tensor(tokens)].mean()
        assert (batched - expected).abs().max().item() < 1e-5, level


def test_evaluate_latency_and_label_run_the_sdk_model(tmp_path, calib_text, monkeypatch):
    from pipeline.data.calibration import make_windows
    from pipeline.elastilm import evaluate, label, latency
    from pipeline.models.scoring import nll_from_hidden

    _, package = tiny_package("llama_gqa", tmp_path / "pkg", KEY)
    trained_looking_adapters(package, tmp_path)
    loaded = []

    def spy(package_dir):
        loaded.append(serving_model(package_dir))
        return loaded[-1]

    for stage in (evaluate, latency, label):
        monkeypatch.setattr(stage, "serving_model", spy)

    # evaluate: each level's perplexity is the SDK model's, with that level's LoRA
    settings = ReportCardSettings(corpora=[str(calib_text)], windows=2, window_length=24, tasks=[],
                                  generation_prompts=0, measure_latency=False)
    card = evaluate.report_card(package, settings, quiet_context(tmp_path))
    assert len(loaded) == 1 and isinstance(loaded[0], ElasticModel)
    windows = make_windows(byte_tokenizer(), str(calib_text), 2, 24, settings.seed)
    reference = serving_model(package)
    for level, row in card["levels"].items():
        ppl = row[f"ppl:{calib_text}"]
        reference.set_level(level)
        with torch.no_grad():
            hidden = reference.transformer.hidden_states(windows)
            total, count = nll_from_hidden(reference.transformer.lm_head, hidden, windows)
        assert ppl == pytest.approx(math.exp(total.item() / count), rel=1e-6), level

    # latency: the SDK's own timing of the SDK model, per level
    timed = []

    def measure_points(model, prompt_lengths, decode_tokens, repeats):
        timed.append((type(model), model.level, list(prompt_lengths)))
        return [1.0 + n / 100 for n in prompt_lengths], 0.5

    monkeypatch.setattr(latency, "measure_points", measure_points)
    cost = latency.build_cost_model(package, latency.LatencySettings(prompt_lengths=[4, 8], decode_tokens=2,
                                                                      repeats=1), quiet_context(tmp_path))
    levels = [level.name for level in read_manifest(package).elastic.levels]
    assert timed == [(ElasticModel, level, [4, 8]) for level in levels]
    assert cost["measured"][levels[0]] == {"ttft_ms": {"4": 1.04, "8": 1.08}, "tpot_ms": 0.5}
    assert cost["latency_profile"]["weight_format"] == "fp32"

    # label: the worker holds the SDK model with every level's LoRA
    worker = label.LabelWorker(package, None)
    assert worker.model is loaded[-1] and isinstance(worker.model, ElasticModel)
    assert sorted(worker.adapted_levels) == sorted(levels)
    worker.set_level(levels[0])
    assert worker.model.level == levels[0]
    assert worker.model.transformer.layers[0].mlp.up_proj.lora is not None
