"""Recover stage: per-level LoRA on the zero-copy sub-model of SmolLM2."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from device_sdk.format import read_manifest
from device_sdk.trust import verify_package
from tests.support.elastilm_fixtures import (
    recovered_package,
    recovery_results,
    single_thread,  # noqa: F401  (fixture)
    smollm2_elastic_package,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_recover_lowers_eval_loss_at_every_level_below_full():
    for level, result in recovery_results().items():
        metrics = result["metrics_data"]
        assert metrics["eval_loss_after"] < metrics["eval_loss_before"], (level, metrics)


def test_recover_saves_peft_and_unit_major_adapters():
    manifest = read_manifest(smollm2_elastic_package())
    arch = manifest.architecture
    for level_name, result in recovery_results().items():
        assert (result["peft"] / "adapter_config.json").is_file()
        assert json.loads((result["peft"] / "adapter_config.json").read_text())["r"] == 8
        level = manifest.elastic.level(level_name)
        with safe_open(str(result["adapter"]), "pt") as handle:
            assert handle.metadata()["scale"] == "2.0"
            for layer in (0, arch.layers - 1):
                q_rows = level.attn_units[layer] * arch.n_rep * arch.head_dim
                neurons = level.mlp_units[layer]
                prefix = f"model.layers.{layer}"
                assert handle.get_slice(f"{prefix}.self_attn.q_proj.lora_B").get_shape() == [q_rows, 8]
                assert handle.get_slice(f"{prefix}.self_attn.q_proj.lora_A").get_shape() == [8, arch.hidden]
                assert handle.get_slice(f"{prefix}.self_attn.o_proj.lora_A").get_shape() == [8, q_rows]
                assert handle.get_slice(f"{prefix}.mlp.down_proj.lora_A").get_shape() == [8, neurons]
                assert handle.get_slice(f"{prefix}.mlp.up_proj.lora_B").get_shape() == [neurons, 8]
            assert len(handle.keys()) == 2 * 7 * arch.layers


def test_recover_install_records_adapters_and_keeps_the_package_verifiable():
    package = recovered_package()
    manifest = verify_package(package, allow_unsigned=True)
    assert manifest.elastic.level("0.5").adapter == "adapters/recovery/0.5.safetensors"
    assert manifest.elastic.level("1.0").adapter is None
    # the source package is untouched (its manifest still lists no adapters)
    assert read_manifest(smollm2_elastic_package()).elastic.level("0.5").adapter is None


def test_recover_submodel_views_share_the_package_storage():
    from pipeline.elastilm.recover import level_submodel
    from pipeline.models.elastic import ElasticCausalLM

    elastic = ElasticCausalLM.from_package(smollm2_elastic_package())
    layer = elastic.hf.model.layers[3]
    storage_q = layer.self_attn.inner.q_proj.storage.data_ptr()
    storage_down = layer.mlp.down_proj.storage.data_ptr()
    hf = level_submodel(elastic, "0.5")
    layer = hf.model.layers[3]
    assert isinstance(layer.self_attn.inner.q_proj, torch.nn.Linear)
    assert layer.self_attn.inner.q_proj.weight.data_ptr() == storage_q
    assert layer.mlp.down_proj.weight.data_ptr() == storage_down
    assert layer.mlp.down_proj.weight.shape[1] == read_manifest(smollm2_elastic_package()).elastic.level("0.5").mlp_units[3]


def test_recover_rejects_bad_settings():
    from pydantic import ValidationError

    from pipeline.elastilm.recover import RecoverSettings

    with pytest.raises(ValidationError, match="backend"):
        RecoverSettings(level="0.5", backend="horovod")
    with pytest.raises(ValidationError, match="targets"):
        RecoverSettings(level="0.5", targets=["lm_head"])


def test_padded_batches_cycle_one_seeded_order_and_pad_labels_out_of_the_loss():
    from types import SimpleNamespace

    from pipeline.elastilm.recover import IGNORE, padded_batches

    examples = [([i] * (i + 1), [IGNORE] + [i] * i) for i in range(5)]  # example i: i + 1 tokens
    tokenizer = SimpleNamespace(pad_token_id=None)  # no pad token: 0 pads
    batches = padded_batches(examples, tokenizer, steps=4, batch_size=3, seed=7)
    assert len(batches) == 4
    seen = []
    for ids, labels in batches:
        assert ids.shape == labels.shape and ids.shape[0] == 3
        for row, label_row in zip(ids.tolist(), labels.tolist(), strict=True):
            i = row[0]
            seen.append(i)
            assert row == [i] * (i + 1) + [0] * (ids.shape[1] - i - 1)  # right-padded
            assert label_row == [IGNORE] + [i] * i + [IGNORE] * (ids.shape[1] - i - 1)
        assert ids.shape[1] == max(row[0] for row in ids.tolist()) + 1  # as wide as its longest example
    assert sorted(seen[:5]) == list(range(5))  # every example once before any repeats
    assert seen[5:] == seen[:7]  # then the same order again
    again = padded_batches(examples, tokenizer, steps=4, batch_size=3, seed=7)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    assert [r[0] for ids, _ in padded_batches(examples, tokenizer, 4, 3, seed=8) for r in ids.tolist()] != seen
