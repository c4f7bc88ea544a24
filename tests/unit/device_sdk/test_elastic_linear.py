"""ElasticLinear: prefix widths equal dense layers of the reduced shape, and never copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from device_sdk.elastic import ElasticLinear


@pytest.mark.parametrize("unit_size", [1, 4])
def test_row_units_match_a_sliced_dense_layer(unit_size):
    torch.manual_seed(0)
    weight, bias = torch.randn(6 * unit_size, 10), torch.randn(6 * unit_size)
    layer = ElasticLinear(weight, bias, unit_axis="out", unit_size=unit_size)
    x = torch.randn(3, 5, 10)
    for units in range(7):
        layer.set_width(units)
        rows = units * unit_size
        expected = F.linear(x, weight[:rows].clone(), bias[:rows].clone())
        assert layer(x).shape == (3, 5, rows)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-6)


def test_column_units_match_a_sliced_dense_layer():
    torch.manual_seed(0)
    dense = torch.randn(8, 12)  # HF layout [out, in]; the unit axis is `in`
    layer = ElasticLinear(dense.t().contiguous(), torch.randn(8), unit_axis="in", unit_size=3)
    for units in range(5):
        layer.set_width(units)
        x = torch.randn(2, units * 3)
        expected = F.linear(x, dense[:, : units * 3].clone(), layer.bias)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-5)


def test_width_zero_contributes_nothing():
    layer = ElasticLinear(torch.randn(12, 8), unit_axis="in", unit_size=4)
    layer.set_width(0)
    assert torch.equal(layer(torch.randn(2, 7, 0)), torch.zeros(2, 7, 8))


def test_set_width_moves_views_only():
    storage = torch.randn(16, 32)
    layer = ElasticLinear(storage, torch.randn(16), unit_axis="out", unit_size=2)
    for units in (8, 3, 1, 0, 8):
        layer.set_width(units)
        # Compare storages, not data_ptr: an empty view reports data_ptr 0.
        assert layer.active_weight.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
        assert layer.active_bias.untyped_storage().data_ptr() == layer.bias.untyped_storage().data_ptr()


def test_bad_shapes_and_widths_are_refused():
    with pytest.raises(ValueError, match="whole number"):
        ElasticLinear(torch.randn(10, 4), unit_axis="out", unit_size=3)
    with pytest.raises(ValueError, match="unit_axis"):
        ElasticLinear(torch.randn(4, 4), unit_axis="rows", unit_size=1)
    layer = ElasticLinear(torch.randn(4, 4), unit_axis="in", unit_size=2)
    with pytest.raises(ValueError, match="outside"):
        layer.set_width(3)
    layer.set_width(1)
    with pytest.raises(ValueError, match="features"):
        layer(torch.randn(1, 4))
