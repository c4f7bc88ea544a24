"""`elastify demo`: its spec plans the whole chain at demo size, and it ends by showing what levels say."""

from __future__ import annotations

from api.app import default_registry
from api.commands.cluster import demo_spec, level_continuations
from cluster.dag import UpstreamInput, plan
from cluster.spec import parse_spec
from device_sdk.format import public_key_b64
from tests.unit.sdk_packages import public_bytes, signing_key, tiny_package


def test_demo_spec_plans_a_small_corpus_and_recovery_top_down(tmp_path):
    registry = default_registry()
    nodes = {n.key: n for n in plan(parse_spec(demo_spec(tmp_path / "model"), registry), registry)}
    generate = [n for n in nodes.values() if n.type == "corpus-generate"]
    assert len(generate) == 2 and all(n.settings.prompts == 24 for n in generate)  # minutes, not the default's half hour
    recover = [n for n in nodes.values() if n.type == "recover"]
    assert [n.settings.level for n in recover] == ["0.9", "0.8", "0.7", "0.6", "0.5", "0.4", "0.3", "0.2"]
    assert all(n.settings.loss == "distill" and n.inputs["corpus"] == UpstreamInput("corpus", "corpus") for n in recover)
    assert nodes["recover[0.5]"].inputs["init_adapter"] == UpstreamInput("recover[0.6]", "adapter")
    assert "init_adapter" not in nodes["recover[0.9]"].inputs


def test_the_demo_shows_a_greedy_continuation_per_level_from_the_signed_package(tmp_path):
    key = signing_key()
    _, package = tiny_package("llama_gqa", tmp_path / "pkg", key)
    rows = level_continuations(package, public_key_b64(public_bytes(key)), prompt="The capital of France is",
                               levels=("1.0", "0.5"), max_new_tokens=4)
    assert [(level, fraction) for level, fraction, _ in rows][0] == ("1.0", "1.00")
    assert rows[1][0] == "0.5" and 0.0 < float(rows[1][1]) < 1.0
    assert all(isinstance(text, str) for _, _, text in rows)
