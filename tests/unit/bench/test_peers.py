"""bench_peers' pure parts: every method's widths land on our level's active fraction, and the paired interval."""

import pytest
import torch

from bench.bench_peers import (
    FRACTION_TOLERANCE,
    fraction_of,
    llm_pruner_widths,
    matched,
    ours_widths,
    paired_token_ci,
    pruned_layers,
    shortgpt_widths,
)
from device_sdk.format import Architecture

# SmolLM2-135M's shape: the fractions the bench matches are this architecture's.
SMOLLM2 = Architecture(family="llama", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                       vocab=49152, norm_eps=1e-5, rope={"rope_type": "default", "rope_theta": 100000.0},
                       max_position=8192, tie_word_embeddings=True)
ANCHORS = [0, 1, 20, 23, 24, 29]
SCORES = [1.0 / (1 + abs(i - 15)) for i in range(30)]  # the middle layers matter most here


@pytest.mark.parametrize("ratio", [0.9, 0.7, 0.5])
def test_every_method_matches_our_fraction_within_one_percent(ratio):
    target = fraction_of(SMOLLM2, *ours_widths(SMOLLM2, ANCHORS, [ratio])[ratio])
    for attn, mlp in (shortgpt_widths(SMOLLM2, SCORES, target), llm_pruner_widths(SMOLLM2, target)):
        assert abs(fraction_of(SMOLLM2, attn, mlp) - target) <= FRACTION_TOLERANCE
        assert all(0 <= a <= SMOLLM2.kv_heads for a in attn) and all(0 <= m <= SMOLLM2.intermediate for m in mlp)


def test_shortgpt_drops_the_least_influential_layers_whole():
    attn, mlp = shortgpt_widths(SMOLLM2, SCORES, 0.75)
    dropped = [i for i, a in enumerate(attn) if a == 0]
    kept_scores = [SCORES[i] for i, a in enumerate(attn) if a]
    assert dropped and max(SCORES[i] for i in dropped) <= min(kept_scores)
    assert all(m == 0 for i, m in enumerate(mlp) if i in dropped)


def test_llm_pruner_keeps_first_three_and_last_two_layers_and_groups_legal():
    attn, mlp = llm_pruner_widths(SMOLLM2, 0.6)
    layers = pruned_layers(SMOLLM2.layers)
    assert layers[0] == 3 and layers[-1] == SMOLLM2.layers - 3
    for i in set(range(SMOLLM2.layers)) - set(layers):
        assert (attn[i], mlp[i]) == (SMOLLM2.kv_heads, SMOLLM2.intermediate)
    assert len({(attn[i], mlp[i]) for i in layers}) == 1 and attn[3] >= 1  # uniform, at least one KV group


def test_matched_is_within_tolerance():
    assert matched(0.605, 0.6) and not matched(0.62, 0.6)


def test_paired_interval_brackets_the_mean_difference_and_excludes_zero_for_a_clear_gap():
    generator = torch.Generator().manual_seed(0)
    peer = torch.rand(40, generator=generator) + 3.0
    ours = peer - 0.2 + 0.01 * torch.randn(40, generator=generator)
    mean, low, high = paired_token_ci(ours, peer, torch.zeros(40, 2))
    assert low <= mean <= high < 0
    assert mean == pytest.approx((ours - peer).mean().item(), abs=1e-6)
