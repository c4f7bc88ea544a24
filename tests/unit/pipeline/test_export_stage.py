"""Stage `export`: planned only when enabled, its settings checked at submit, its levels loadable by
transformers and gguf, and published beside the signed package, outside its manifest."""

from __future__ import annotations

import json

import pytest
import torch
from cryptography.hazmat.primitives import serialization

from api.app import default_registry
from cluster.dag import UpstreamInput, plan
from cluster.spec import SpecError, parse_spec
from device_sdk.format import read_manifest
from device_sdk.trust import verify_package
from pipeline import publish
from pipeline.elastilm import export
from pipeline.settings import ExportSettings
from pipeline.stage import quiet_context
from tests.support.pipeline_packages import tiny_package
from tests.support.sdk_packages import sign_package, signing_key
from workers.store import artifact_index

BASE = {"source": {"model": "/models/x"}, "publish": {"name": "pkg", "version": "1.0"}, "levels": [0.5, 1.0]}


def problems(spec: dict) -> set[str]:
    registry = default_registry()
    with pytest.raises(SpecError) as caught:
        plan(parse_spec(spec, registry), registry)
    return {where for where, _ in caught.value.problems}


def test_export_is_off_by_default_and_when_enabled_feeds_publish():
    registry = default_registry()
    assert "export" not in {node.type for node in plan(parse_spec(BASE, registry), registry)}
    spec = parse_spec({**BASE, "stages": {"export": {"enabled": True, "settings": {"levels": ["0.5"]}}}}, registry)
    by_key = {node.key: node for node in plan(spec, registry)}
    node = by_key["export"]
    assert node.settings.levels == ["0.5"] and node.settings.formats == ["gguf", "hf"]
    assert node.settings.package_levels == [0.5, 1.0]  # from the spec, so a level it lacks is refused
    assert node.inputs["package"] == UpstreamInput("recover-install", "package")
    assert node.inputs["report"] == UpstreamInput("evaluate", "report_card")
    assert by_key["publish"].inputs["exports"] == UpstreamInput("export", "exports")


def test_bad_export_settings_are_named_at_submit():
    enabled = {"enabled": True}
    assert problems({**BASE, "stages": {"export": {**enabled, "settings": {"formats": ["onnx"]}}}}) == {
        "stages.export.settings.formats.0"}
    assert problems({**BASE, "stages": {"export": {**enabled, "settings": {"gguf_type": "q4_0"}}}}) == {
        "stages.export.settings.gguf_type"}
    # 0.75 is a level of the default build, but not of this one
    assert problems({**BASE, "stages": {"export": {**enabled, "settings": {"levels": [0.75]}}}}) == {
        "stages.export.settings"}
    with pytest.raises(ValueError, match="not levels of this build"):
        ExportSettings(levels=["0.3"], package_levels=[0.5, 1.0])


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """A tiny package whose byte tokenizer is a byte-level BPE (no merges), the kind GGUF export takes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    _, path = tiny_package("llama_gqa", tmp_path_factory.mktemp("export") / "pkg", signing_key())
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={char: index for index, char in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "model" / "tokenizer.json"))
    sign_package(path, signing_key())
    return path


@pytest.fixture(scope="module")
def exported(package, tmp_path_factory):
    """The stage's output for a report card that calls only levels 0.5 and 1.0 usable."""
    names = [level.name for level in read_manifest(package).elastic.levels]
    assert names == ["0.25", "0.5", "0.75", "1.0"]
    report = tmp_path_factory.mktemp("report") / "report_card.json"
    report.write_text(json.dumps({"levels": {name: {"usable": name in ("0.5", "1.0")} for name in names}}))
    ctx = quiet_context(tmp_path_factory.mktemp("work"))
    settings = ExportSettings(gguf_type="q8_0", package_levels=[0.25, 0.5, 0.75, 1.0])
    return export.run({"package": package, "report": report}, settings, ctx)["exports"]


def test_the_stage_exports_every_usable_level_in_both_formats(package, exported):
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    index = json.loads((exported / export.INDEX).read_text())
    assert {(entry["level"], entry["format"]) for entry in index["files"]} == {
        (level, fmt) for level in ("0.5", "1.0") for fmt in ("gguf", "hf")}
    for entry in index["files"]:
        assert (exported / entry["path"]).stat().st_size == entry["size"]
    manifest = read_manifest(package)
    half = manifest.elastic.level("0.5")

    hf = AutoModelForCausalLM.from_pretrained(exported / "0.5" / "hf", trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([[3, 100, 45, 7]])).logits
    assert logits.shape[-1] == manifest.architecture.vocab and torch.isfinite(logits).all()
    assert sum(p.numel() for p in hf.parameters()) < sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(exported / "1.0" / "hf").parameters())

    (gguf_file,) = (exported / "0.5" / "gguf").glob("*.gguf")
    assert gguf_file.name == f"{manifest.name}-0.5-q8_0.gguf"
    reader = GGUFReader(gguf_file)
    ffn_up = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    assert ffn_up.tensor_type.name == ("Q8_0" if manifest.architecture.hidden % 32 == 0 else "F16")  # rows of 32
    assert int(ffn_up.shape[-1]) == max(half.mlp_units[0], 1)  # the level's width, not the full model's


def test_publish_puts_the_exports_beside_the_signed_package(package, exported, tmp_path):
    pem = signing_key().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()).decode()
    ctx = quiet_context(tmp_path)
    ctx.runtime["signing_key"] = pem
    out = publish.run({"package": package, "exports": exported}, None, ctx)["package"]
    listed = {entry.path for entry in read_manifest(out).files}
    assert not any(path.startswith(export.EXPORTS_DIR) for path in listed)  # pulling the package skips them
    verify_package(out, signing_key().public_key())  # signed, every listed file intact
    index = json.loads((out / export.EXPORTS_DIR / export.INDEX).read_text())
    assert index["manifest_sha256"]
    for entry in index["files"]:
        assert (out / export.EXPORTS_DIR / entry["path"]).stat().st_size == entry["size"]
    # cluster.packages.register_package copies every file of publish's stored artifact to
    # packages/<name>/<version>/<path>: the exports land there, beside the package.
    stored = {relative for _, relative in artifact_index(out)[0]}
    assert {f"{export.EXPORTS_DIR}/{entry['path']}" for entry in index["files"]} < stored
    assert listed < stored
