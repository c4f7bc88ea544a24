"""Profile → reorder → elastic wrapper on tiny random Llama MHA/GQA, Mistral and Qwen2-with-bias."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from device_sdk.elastic import ElasticLinear
from pipeline.data.calibration import make_windows
from pipeline.elastilm.elastify import (
    ElastifySettings,
    choose_anchors,
    elastify,
    kept_units,
    level_table,
)
from pipeline.elastilm.profile import ProfileSettings, profile
from pipeline.models.elastic import ElasticCausalLM
from pipeline.models.loading import describe_architecture
from pipeline.stage import quiet_context
from tests.support.reference import elastic_in_memory, sliced_dense_copy
from tests.support.tiny import TINY_CONFIGS, byte_tokenizer, tiny_model

FAMILIES = list(TINY_CONFIGS)
SETTINGS = ElastifySettings(levels=[0.2, 0.4, 0.5, 0.7, 1.0], anchor_fraction=0.25, align=8)


@pytest.fixture(scope="module", params=FAMILIES)
def profiled(request, tmp_path_factory):
    calib = tmp_path_factory.mktemp("calib") / "calib.txt"
    import treebank

    calib.write_text(treebank.penn["valid"][:20000])
    model = tiny_model(request.param)
    arch = describe_architecture(model.config)
    settings = ProfileSettings(calibration=[str(calib)], windows=4, window_length=32, layer_windows=2)
    importance = profile(model, byte_tokenizer(), arch, settings, quiet_context())
    return request.param, model, arch, importance


def test_level_one_reproduces_the_source_logits(profiled):
    _, model, arch, importance = profiled
    elastic, _ = elastic_in_memory(model, arch, importance, SETTINGS)
    elastic.set_level(1.0)
    ids = torch.randint(0, arch.vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        error = (elastic(ids).logits - model(ids).logits).abs().max().item()
    assert error <= 1e-4


def test_every_level_equals_a_dense_model_of_sliced_copies(profiled):
    _, model, arch, importance = profiled
    elastic, _ = elastic_in_memory(model, arch, importance, SETTINGS)
    ids = torch.randint(0, arch.vocab, (2, 24), generator=torch.Generator().manual_seed(2))
    for level in elastic.elastic.levels:
        elastic.set_level(level.name)
        dense = sliced_dense_copy(model, arch, importance, SETTINGS, level.attn_units, level.mlp_units)
        with torch.no_grad():
            error = (elastic(ids).logits - dense(ids).logits).abs().max().item()
        assert error <= 1e-5, f"level {level.name}: max abs error {error}"


def test_every_level_is_a_legal_gqa_shape(profiled):
    _, model, arch, importance = profiled
    elastic, _ = elastic_in_memory(model, arch, importance, SETTINGS)
    for level in elastic.elastic.levels:
        elastic.set_level(level.name)
        for groups, layer in zip(level.attn_units, elastic.hf.model.layers, strict=True):
            attn = layer.self_attn.inner
            assert 1 <= groups <= arch.kv_heads
            assert attn.q_proj.out_features == groups * arch.n_rep * arch.head_dim
            assert attn.k_proj.out_features == attn.v_proj.out_features == groups * arch.head_dim
            assert attn.o_proj.in_features == attn.q_proj.out_features


def test_level_switches_copy_no_weight_data(profiled):
    _, model, arch, importance = profiled
    elastic, tensors = elastic_in_memory(model, arch, importance, SETTINGS)
    storage_ptrs = {t.data_ptr() for t in tensors.values()}
    linears = elastic.elastic_linears()
    assert len(linears) == 7 * arch.layers
    for level in ["0.2", "1.0", "0.5", "0.4", "0.7"]:
        elastic.set_level(level)
        for linear in linears:
            assert linear.active_weight.data_ptr() == linear.storage.data_ptr()
            assert linear.storage.data_ptr() in storage_ptrs


def test_width_zero_skips_the_sublayer(profiled):
    _, model, arch, importance = profiled
    elastic, _ = elastic_in_memory(model, arch, importance, SETTINGS)
    attn = [arch.kv_heads] * arch.layers
    mlp = [arch.intermediate] * arch.layers
    attn[1], mlp[2] = 0, 0
    elastic.set_widths(attn, mlp)
    dense = sliced_dense_copy(model, arch, importance, SETTINGS, attn, mlp)
    ids = torch.randint(0, arch.vocab, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (elastic(ids).logits - dense(ids).logits).abs().max().item() <= 1e-5
        elastic.set_widths([arch.kv_heads] * arch.layers, [arch.intermediate] * arch.layers)
        assert (elastic(ids).logits - dense(ids).logits).abs().max().item() > 1e-3


def test_package_round_trip_loads_the_same_model(profiled, tmp_path):
    _, model, arch, importance = profiled
    out = tmp_path / "pkg"
    manifest = elastify(model, byte_tokenizer(), arch, importance, SETTINGS, out)
    loaded = ElasticCausalLM.from_package(out)
    in_memory, _ = elastic_in_memory(model, arch, importance, SETTINGS)
    ids = torch.randint(0, arch.vocab, (1, 16), generator=torch.Generator().manual_seed(4))
    for level in manifest.elastic.levels:
        loaded.set_level(level.name)
        in_memory.set_level(level.name)
        with torch.no_grad():
            assert torch.allclose(loaded(ids).logits, in_memory(ids).logits, atol=1e-6)
    assert all(isinstance(m, ElasticLinear) for m in loaded.elastic_linears())


def test_vectorize_and_block_influence_options(profiled, calib_text):
    kind, _, _, _ = profiled
    model = tiny_model(kind)
    arch = describe_architecture(model.config)
    settings = ProfileSettings(
        calibration=[str(calib_text)], windows=2, window_length=32, taylor="vectorize", layer_method="block_influence",
        attn_method="taylor",
    )
    result = profile(model, byte_tokenizer(), arch, settings, quiet_context())
    assert len(result.layers) == arch.layers and bool((result.layers > 0).all())
    assert all(s.shape == (arch.kv_heads,) and bool((s >= 0).all()) for s in result.attn)
    assert all(s.shape == (arch.intermediate,) and bool((s >= 0).all()) for s in result.mlp)


def test_taylor_scores_equal_a_full_gradient_computation(calib_text):
    """The hook-and-free reduction gives exactly Σ|w·g| from a plain full backward."""
    from pipeline.data.calibration import make_windows
    from pipeline.elastilm.profile import unit_importance
    from pipeline.models.scoring import nll_sum

    model = tiny_model("qwen2_bias")
    arch = describe_architecture(model.config)
    windows = make_windows(byte_tokenizer(), [str(calib_text)], 3, 32, seed=0)
    attn, mlp, _ = unit_importance(model, arch, windows, "param_first")
    loss, count = nll_sum(model, windows)
    (loss / count).backward()
    layer = model.model.layers[1]
    g = layer.mlp
    expected_mlp = (
        (g.gate_proj.weight * g.gate_proj.weight.grad).abs().sum(1)
        + (g.up_proj.weight * g.up_proj.weight.grad).abs().sum(1)
        + (g.down_proj.weight * g.down_proj.weight.grad).abs().sum(0)
    )
    torch.testing.assert_close(mlp[1], expected_mlp, rtol=1e-4, atol=1e-7)
    a = layer.self_attn
    q_rows = arch.n_rep * arch.head_dim

    def rows(p, group_rows):
        return (p * p.grad).abs().reshape(p.shape[0], -1).sum(1).reshape(arch.kv_heads, group_rows).sum(1)

    expected_attn = (
        rows(a.q_proj.weight, q_rows) + rows(a.q_proj.bias, q_rows)
        + rows(a.k_proj.weight, arch.head_dim) + rows(a.k_proj.bias, arch.head_dim)
        + rows(a.v_proj.weight, arch.head_dim) + rows(a.v_proj.bias, arch.head_dim)
        + (a.o_proj.weight * a.o_proj.weight.grad).abs().sum(0).reshape(arch.kv_heads, q_rows).sum(1)
    )
    torch.testing.assert_close(attn[1], expected_attn, rtol=1e-4, atol=1e-7)


def test_level_table_rules():
    model = tiny_model("llama_gqa", layers=4)
    arch = describe_architecture(model.config)
    anchors = choose_anchors(torch.tensor([0.1, 0.9, 0.3, 0.5]), 0.25)
    assert anchors == [1]
    levels = level_table(arch, anchors, ElastifySettings(levels=[0.2, 0.5, 0.8, 1.0], align=8))
    for level in levels:
        assert level.attn_units[1] == arch.kv_heads and level.mlp_units[1] == arch.intermediate
        assert all(m % 8 == 0 and m >= 8 for m in level.mlp_units)
        assert all(a >= 1 for a in level.attn_units)
    assert [lv.active_fraction for lv in levels] == sorted(lv.active_fraction for lv in levels)
    assert levels[-1].active_fraction == 1.0
    assert kept_units(1536, 0.5, 1, 32) == 768 and kept_units(3, 0.5, 1) == 2 and kept_units(96, 0.0, 1, 32) == 32


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(levels=[0.0, 1.0]), "(0, 1]"),
        (dict(levels=[0.5, 1.2]), "(0, 1]"),
        (dict(levels=[0.5, 0.4, 1.0]), "increasing"),
        (dict(anchor_fraction=1.0), "anchor_fraction"),
        (dict(order="alphabetical"), "order"),
    ],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace("]", r"\]")):
        ElastifySettings(**settings)


def test_levels_hit_their_parameter_budget_with_or_without_anchors():
    """On SmolLM2's shape (3 KV groups: coarse attention steps) the MLP absorbs the rounding."""
    from device_sdk.format import Architecture
    from pipeline.elastilm.elastify import unit_params

    arch = Architecture(family="llama", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64,
                        intermediate=1536, vocab=49152, norm_eps=1e-5, rope={"rope_theta": 1e5})
    per_group, per_neuron = unit_params(arch)
    layer_params = 3 * per_group + 1536 * per_neuron
    for anchors, rounding in (([], "up"), ([0, 1, 2, 11, 28, 29], "up"), ([0, 1, 2, 11, 28, 29], "nearest")):
        levels = level_table(arch, anchors, ElastifySettings(attn_rounding=rounding))
        half = next(level for level in levels if level.name == "0.5")
        groups = {layer: half.attn_units[layer] for layer in range(30) if layer not in anchors}
        # the non-anchor layers keep (15 - A) / (30 - A) of a layer: 1.125 groups' worth with anchors
        assert set(groups.values()) == ({2} if rounding == "up" else {1}) if anchors else {2}, (anchors, rounding)
        for level in levels[2:]:  # from 0.4 up; below that min_units floors dominate
            elastic = sum(a * per_group + m * per_neuron for a, m in zip(level.attn_units, level.mlp_units, strict=True))
            assert abs(elastic / (30 * layer_params) - level.ratio) < 0.02, (anchors, level.name)
        for below, above in zip(levels, levels[1:], strict=False):
            assert all(b <= a for b, a in zip(below.mlp_units + below.attn_units, above.mlp_units + above.attn_units, strict=True))


def test_whole_attention_makes_the_mlp_alone_elastic_at_the_same_budget():
    """attn_rounding="whole" (MatFormer's shape): every KV group at every level, the MLP pays for the level."""
    from device_sdk.format import Architecture
    from pipeline.elastilm.elastify import unit_params

    arch = Architecture(family="llama", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64,
                        intermediate=1536, vocab=49152, norm_eps=1e-5, rope={"rope_theta": 1e5})
    per_group, per_neuron = unit_params(arch)
    anchors = [0, 1, 2, 11, 28, 29]
    whole = {lv.name: lv for lv in level_table(arch, anchors, ElastifySettings(attn_rounding="whole"))}
    up = {lv.name: lv for lv in level_table(arch, anchors, ElastifySettings(attn_rounding="up"))}
    for name in ("0.5", "0.7"):
        assert set(whole[name].attn_units) == {3}
        assert sum(whole[name].mlp_units) < sum(up[name].mlp_units)
        elastic = sum(a * per_group + m * per_neuron
                      for a, m in zip(whole[name].attn_units, whole[name].mlp_units, strict=True))
        assert abs(elastic / (30 * (3 * per_group + 1536 * per_neuron)) - float(name)) < 0.02, name
    # at level 0.5 the non-anchor layers keep 0.375 of a layer: 256 of 1536 neurons once attention is paid
    assert {whole["0.5"].mlp_units[layer] for layer in range(30) if layer not in anchors} == {256}


def test_level_switch_is_one_write_and_per_layer_widths_still_work(profiled):
    _, model, arch, importance = profiled
    elastic, _ = elastic_in_memory(model, arch, importance, SETTINGS)
    level = elastic.elastic.level("0.5")
    elastic.set_level("0.5")
    linears = elastic.elastic_linears()
    assert {lin.cursor for lin in linears} == {elastic.cursor}
    assert [lin.units for lin in linears[:7]] == [level.attn_units[0]] * 4 + [level.mlp_units[0]] * 3
    with pytest.raises(ValueError, match="follows its model's level"):
        linears[0].set_width(1)
    elastic.set_widths([1] * arch.layers, [8] * arch.layers)
    assert elastic.level is None and all(lin.units in (1, 8) for lin in linears)
    elastic.set_level("1.0")
    assert all(lin.units == lin.max_units for lin in linears)


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_bias"])
def test_group_loo_equals_removing_the_group_in_a_full_forward(kind, calib_text):
    """Each KV group's score is the loss increase of the whole model with that group's o_proj
    columns zeroed (which is what pruning it does), though only later layers are re-run."""
    from pipeline.data.calibration import make_windows
    from pipeline.elastilm.profile import group_importance_loo
    from pipeline.models.scoring import nll_sum

    model = tiny_model(kind)
    arch = describe_architecture(model.config)
    windows = make_windows(byte_tokenizer(), [str(calib_text)], 4, 32, seed=0)
    scores = group_importance_loo(model, arch, windows, 2, quiet_context())
    assert [s.shape for s in scores] == [(arch.kv_heads,)] * arch.layers
    with torch.no_grad():
        base_loss, count = nll_sum(model, windows)
        cols = arch.n_rep * arch.head_dim
        for layer_index in (0, arch.layers - 1):
            o_proj = model.model.layers[layer_index].self_attn.o_proj.weight
            for group in range(arch.kv_heads):
                saved = o_proj.clone()
                o_proj[:, group * cols : (group + 1) * cols] = 0
                loss, _ = nll_sum(model, windows)
                o_proj.copy_(saved)
                expected = (loss - base_loss).item() / count
                assert scores[layer_index][group].item() == pytest.approx(expected, abs=1e-5, rel=1e-3)


def test_profile_ranks_groups_by_loo_when_asked(calib_text):
    kind = "llama_gqa"
    model = tiny_model(kind)
    arch = describe_architecture(model.config)
    common = dict(calibration=[str(calib_text)], windows=4, window_length=32, layer_windows=2,
                  layer_method="block_influence")
    taylor = profile(model, byte_tokenizer(), arch, ProfileSettings(**common, attn_method="taylor"), quiet_context())
    loo = profile(model, byte_tokenizer(), arch, ProfileSettings(**common, attn_method="loo"), quiet_context())
    torch.testing.assert_close(torch.stack(loo.mlp), torch.stack(taylor.mlp))  # neurons keep Taylor
    assert not torch.allclose(torch.stack(loo.attn), torch.stack(taylor.attn))
    assert loo.meta["settings"]["attn_method"] == "loo"


def test_activation_importance_is_minitrons_criterion_from_forward_passes(calib_text):
    model = tiny_model("llama_gqa")
    arch = describe_architecture(model.config)
    settings = dict(calibration=[str(calib_text)], windows=4, window_length=32, layer_windows=2,
                    layer_method="block_influence", batch_size=3)
    taylor = profile(model, byte_tokenizer(), arch, ProfileSettings(**settings), quiet_context())
    active = profile(model, byte_tokenizer(), arch, ProfileSettings(**settings, mlp_method="activation"),
                     quiet_context())
    # By hand: every window's down_proj input, L2 over its tokens, averaged over the windows.
    windows = make_windows(byte_tokenizer(), [str(calib_text)], 4, 32, 0)
    for index in (0, arch.layers - 1):
        mlp = model.model.layers[index].mlp
        captured = []
        handle = mlp.down_proj.register_forward_pre_hook(lambda module, args, seen=captured: seen.append(args[0]))
        with torch.no_grad():
            model(windows)
        handle.remove()
        expected = captured[0].norm(dim=1).mean(0)
        torch.testing.assert_close(active.mlp[index], expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.stack(active.attn), torch.stack(taylor.attn))  # KV groups: leave-one-out still
    assert not torch.allclose(torch.stack(active.mlp), torch.stack(taylor.mlp))
    assert active.meta["settings"]["mlp_method"] == "activation" and active.meta["calibration_loss"] > 0
