"""The headline claims of the elastic core, on the real SmolLM2-135M."""

from __future__ import annotations

import pytest
import torch

from pipeline.data.calibration import make_windows
from pipeline.elastilm.elastify import ElastifySettings
from pipeline.elastilm.profile import ProfileSettings, profile
from pipeline.models.scoring import perplexity
from pipeline.stage import quiet_context
from tests.support.reference import elastic_in_memory, relative_logit_error, sliced_dense_copy

TAYLOR_ANCHORS = ElastifySettings(levels=[0.5, 0.7, 1.0])
ABLATIONS = {
    "random order": ElastifySettings(levels=[0.5, 0.7, 1.0], order="random", seed=0),
    "no anchors": ElastifySettings(levels=[0.5, 0.7, 1.0], anchor_fraction=0.0),
}


@pytest.fixture(scope="module")
def importance(smollm2):
    settings = ProfileSettings(calibration=["ptb:train"], windows=8, window_length=128, layer_windows=4)
    return profile(smollm2.model, smollm2.tokenizer, smollm2.architecture, settings, quiet_context())


@pytest.fixture(scope="module")
def elastic(smollm2, importance):
    model, _ = elastic_in_memory(smollm2.model, smollm2.architecture, importance, TAYLOR_ANCHORS)
    return model


def test_anchors_are_the_most_important_layers(smollm2, elastic, importance):
    anchors = elastic.elastic.anchor_layers
    assert len(anchors) == 6  # 20% of 30 layers
    weakest_anchor = min(importance.layers[a] for a in anchors)
    others = [importance.layers[i] for i in range(30) if i not in anchors]
    assert all(weakest_anchor >= score for score in others)


def test_level_one_reproduces_smollm2_logits(smollm2, elastic):
    ids = smollm2.tokenizer("Elastic models serve every width from one set of weights.", return_tensors="pt").input_ids
    elastic.set_level(1.0)
    with torch.no_grad():
        assert relative_logit_error(elastic(ids).logits, smollm2.model(ids).logits) <= 1e-5


def test_each_level_equals_sliced_dense_copies(smollm2, elastic, importance):
    ids = smollm2.tokenizer("A short probe of the sub-models.", return_tensors="pt").input_ids
    for level in elastic.elastic.levels:
        elastic.set_level(level.name)
        dense = sliced_dense_copy(smollm2.model, smollm2.architecture, importance, TAYLOR_ANCHORS,
                                  level.attn_units, level.mlp_units)
        with torch.no_grad():
            assert (elastic(ids).logits - dense(ids).logits).abs().max().item() <= 1e-5, level.name
        for groups in level.attn_units:  # SmolLM2 has 3 KV groups of 3 query heads
            assert 1 <= groups <= 3


def test_taylor_order_with_anchors_beats_random_order_and_no_anchors(smollm2, elastic, importance):
    windows = make_windows(smollm2.tokenizer, "ptb:test", count=8, length=128, seed=1)
    ours = {}
    for level in ("0.5", "0.7"):
        elastic.set_level(level)
        ours[level] = perplexity(elastic, windows)
    for name, settings in ABLATIONS.items():
        ablated, _ = elastic_in_memory(smollm2.model, smollm2.architecture, importance, settings)
        for level in ("0.5", "0.7"):
            ablated.set_level(level)
            theirs = perplexity(ablated, windows)
            assert ours[level] < theirs, f"level {level}: taylor+anchors {ours[level]:.1f} vs {name} {theirs:.1f}"
        del ablated
