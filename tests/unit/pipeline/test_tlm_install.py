"""The TLM goes into a package through the manifest helpers: files hashed, `tlm` field written, loadable back."""

from __future__ import annotations

import torch

from device_sdk.trust import verify_package


def test_tlm_install_into_package_and_load_back(tmp_path):
    from pipeline.elastilm.tlm import install_tlm, load_tlm, new_tlm, save_tlm, slo_embedding_rows
    from tests.support.pipeline_packages import build_package
    from tests.support.sdk_packages import signing_key
    from tests.support.tiny import byte_tokenizer, tiny_model

    package = build_package(tiny_model("llama_gqa"), byte_tokenizer(), tmp_path / "pkg", signing_key(),
                            levels=[0.5, 1.0])
    model, tokenizer = new_tlm(None, ["0.5", "1.0"], frozen_layers=3, max_length=64)
    save_tlm(model, tokenizer, tmp_path / "tlm")
    install_tlm(package, tmp_path / "tlm")
    manifest = verify_package(package, allow_unsigned=True)
    assert manifest.tlm["levels"] == ["0.5", "1.0"] and manifest.tlm["frozen_layers"] == 3
    assert "[TTFT_0.2]" in manifest.tlm["special_tokens"] and manifest.tlm["slo_bins"]["tpot"][0] == 0.5
    assert any(entry.path == "tlm/tlm.safetensors" for entry in manifest.files)
    loaded, loaded_tokenizer = load_tlm(package / "tlm")
    assert torch.equal(slo_embedding_rows(loaded), slo_embedding_rows(model))
    assert loaded_tokenizer.convert_tokens_to_ids("[TPOT_1.0]") == model.config.base_vocab + len(model.config.slo_tokens) - 1
