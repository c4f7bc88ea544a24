"""Exported levels load in transformers (`from_pretrained`) and peft, with the SDK's logits."""

from __future__ import annotations

import json

import pytest
import torch

from device_sdk.cli import main as device_cli
from device_sdk.export import MODELING_FILE, PEFT_DIR, ExportError, export_hf, export_peft_adapters
from device_sdk.format import read_manifest, rewrite_manifest
from device_sdk.runtime import ElasticModel
from tests.support.pipeline_packages import tiny_package
from tests.support.reference import relative_logit_error
from tests.support.sdk_packages import add_recovery_adapters, sign_package, signing_key

# fp32 logits: max |Δlogit| over the logits' scale (at least 1), as tests.support.reference measures the SDK
# against transformers; the fp32 summation order alone moves SmolLM2's |z| ~ 30 logits by ~2e-4.
TOLERANCE = 1e-4
IDS = torch.tensor([[3, 100, 45, 7, 200, 9, 11, 64, 31]])
# A uniform profile (a plain config) and one with a layer of zero heads and one of zero neurons.
PROFILES = {"uniform": ([1, 1, 1, 1], [48, 48, 48, 48]), "gaps": ([0, 1, 2, 2], [40, 0, 96, 8])}


def load_hf(directory, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()


def hf_logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module", params=["llama_gqa", "qwen2_bias"])
def package(request, tmp_path_factory):
    """A tiny package with a random recovery LoRA per level and two CLONE profiles."""
    _, path = tiny_package(request.param, tmp_path_factory.mktemp(request.param) / "pkg", signing_key())
    add_recovery_adapters(path, signing_key())
    manifest = read_manifest(path)
    manifest.clone = {"profiles": {name: {"attn_units": attn, "mlp_units": mlp, "ppl": 1.0, "latency_ms": 1.0,
                                          "energy_j": 1.0} for name, (attn, mlp) in PROFILES.items()}}
    rewrite_manifest(path, manifest)
    sign_package(path, signing_key())
    return path


@pytest.fixture(scope="module")
def sdk(package):
    return ElasticModel.load(package, allow_unsigned=True)


def test_every_level_loads_with_the_sdk_logits(package, sdk, tmp_path):
    for level in sdk.manifest.elastic.levels:
        assert level.adapter is not None  # the LoRA is merged in, so the comparison includes it
        sdk.set_level(level.name)
        out = export_hf(package, tmp_path / level.name, level=level.name)
        config = json.loads((out / "config.json").read_text())
        per_layer = len(set(level.attn_units)) > 1 or len(set(level.mlp_units)) > 1
        assert (out / MODELING_FILE).is_file() == per_layer
        model = load_hf(out, trust_remote_code=per_layer)
        if per_layer:
            assert config["layer_kv_heads"] == level.attn_units and config["layer_intermediate"] == level.mlp_units
        else:
            assert type(model).__module__.startswith("transformers.models.")  # the family's own class
        err = relative_logit_error(hf_logits(model), sdk.logits(IDS))
        assert err <= TOLERANCE, (level.name, err)


def test_uniform_profile_is_a_plain_config_at_its_widths(package, sdk, tmp_path):
    sdk.set_profile("uniform")
    out = export_hf(package, tmp_path / "uniform", profile="uniform")
    config = json.loads((out / "config.json").read_text())
    arch = sdk.manifest.architecture
    assert "auto_map" not in config and not (out / MODELING_FILE).exists()
    assert (config["num_key_value_heads"], config["num_attention_heads"], config["intermediate_size"]) == (
        1, arch.n_rep, 48)
    assert relative_logit_error(hf_logits(load_hf(out)), sdk.logits(IDS)) <= TOLERANCE


def test_zero_width_layers_export_as_zeros_that_add_nothing(package, sdk, tmp_path):
    sdk.set_profile("gaps")
    out = export_hf(package, tmp_path / "gaps", profile="gaps")
    assert relative_logit_error(hf_logits(load_hf(out, trust_remote_code=True)), sdk.logits(IDS)) <= TOLERANCE


def test_per_layer_export_refuses_to_load_without_remote_code(package, tmp_path):
    """Never the silent misload a renamed package gives: the stock class cannot take it."""
    out = export_hf(package, tmp_path / "half", level="0.5")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_hf(out, trust_remote_code=False)


def test_unmerged_export_with_its_peft_adapter_equals_the_sdk(package, sdk, tmp_path):
    from peft import PeftModel

    for level in ("0.5", "1.0"):
        sdk.set_level(level)
        out = export_hf(package, tmp_path / level, level=level, merge=False)
        adapter_config = json.loads((out / PEFT_DIR / "adapter_config.json").read_text())
        assert adapter_config["base_model_name_or_path"] == str(out.resolve())  # the adapter names its base
        base = load_hf(out, trust_remote_code=True)
        without_lora = hf_logits(base)
        model = PeftModel.from_pretrained(base, out / PEFT_DIR).eval()
        assert relative_logit_error(hf_logits(model), sdk.logits(IDS)) <= TOLERANCE
        assert relative_logit_error(without_lora, hf_logits(model)) > 100 * TOLERANCE  # the adapter did load


def test_every_level_gets_a_peft_adapter(package, tmp_path):
    written = export_peft_adapters(package, tmp_path / "peft")
    manifest = read_manifest(package)
    assert sorted(written) == sorted(level.name for level in manifest.elastic.levels)
    config = json.loads((written["0.5"] / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 2 and config["lora_alpha"] == 4.0


def test_cli_exports_and_names_what_is_missing(package, tmp_path, capsys):
    out = tmp_path / "cli"
    assert device_cli(["export", str(package), "--allow-unsigned", "--format", "hf", "--level", "0.5",
                       "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file()
    assert device_cli(["export", str(package), "--allow-unsigned", "--format", "hf", "--profile", "nope",
                       "--out", str(tmp_path / "x")]) == 1
    assert "no CLONE profile 'nope'" in capsys.readouterr().err
    with pytest.raises(ExportError, match="exactly one"):
        export_hf(package, tmp_path / "y", level="0.5", profile="uniform")


@pytest.mark.slow
def test_smollm2_level_loads_with_the_sdk_logits(smollm2_package, tmp_path):
    """The real model at level 0.5 (per-layer widths: anchors keep all heads)."""
    model = ElasticModel.load(smollm2_package, allow_unsigned=True)
    model.set_level("0.5")
    ids = torch.tensor([model.tokenizer.encode("Elastic models serve every width from one set of weights.").ids])
    out = export_hf(smollm2_package, tmp_path / "half", level="0.5")
    err = relative_logit_error(hf_logits(load_hf(out, trust_remote_code=True), ids), model.logits(ids))
    assert err <= TOLERANCE, err
