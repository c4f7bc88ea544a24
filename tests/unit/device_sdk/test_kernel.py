"""The native ElasticLinear kernel against torch at every width, for the float weight formats
(block-quantised int8/int4 against their numpy reference: test_quant_kernels.py; int8 against fp32
on SmolLM2: test_roundtrip_sdk_runtime.py)."""

from __future__ import annotations

import pytest
import torch

from device_sdk import kernels, quant
from device_sdk.kernels import GEMM_ROWS, make_linear, native_linear, reference_linear

# The quantised formats' native kernels also quantise the activations, so torch is not their oracle.
FLOAT_FORMATS = ("fp32", "fp16")

needs_native = pytest.mark.skipif(kernels.native_module() is None, reason="no C++ compiler on this machine")


@needs_native
@pytest.mark.parametrize("weight_format", FLOAT_FORMATS)
@pytest.mark.parametrize("unit_axis", ["out", "in"])
def test_sdk_native_kernel_matches_torch_at_every_width(weight_format, unit_axis):
    generator = torch.Generator().manual_seed(0)
    unit_size, units, other = 3, 23, 70  # odd sizes: every tile and block has a remainder
    storage = torch.randn(units * unit_size, other, generator=generator)
    bias = torch.randn(units * unit_size if unit_axis == "out" else other, generator=generator)
    layer = make_linear(storage, bias, unit_axis=unit_axis, unit_size=unit_size, weight_format=weight_format)
    assert layer.kernel is native_linear
    pointer = layer.storage.data_ptr()
    for width in range(units + 1):
        layer.set_width(width)
        for rows in (1, 2, 5, 15):  # decode's one row and the native kernel's small batches
            x = torch.randn(rows, layer.in_features, generator=generator)
            got, expected = native_linear(x, layer), reference_linear(x, layer)
            assert got.shape == (rows, layer.out_features)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        if width:  # an empty view has no address
            assert layer.active_weight.data_ptr() == pointer


@needs_native
@pytest.mark.parametrize("weight_format", FLOAT_FORMATS)
def test_sdk_many_rows_run_through_torch_gemm(weight_format, monkeypatch):
    layer = make_linear(torch.randn(24, 40), None, unit_axis="out", unit_size=3, weight_format=weight_format)
    layer.set_width(5)
    rows = GEMM_ROWS[layer.storage.dtype]
    few, many = torch.randn(rows - 1, 40), torch.randn(2, rows // 2 + 1, 40)
    few_native = native_linear(few, layer)

    class NoNative:  # the many-row path must not reach the native kernel at all
        def elastic_linear(self, *args):
            raise AssertionError("the native kernel ran on a many-row input")

    monkeypatch.setattr(kernels, "native_module", lambda: NoNative())
    torch.testing.assert_close(native_linear(many, layer), reference_linear(many, layer), rtol=0, atol=0)
    with pytest.raises(AssertionError, match="native kernel ran"):
        native_linear(few, layer)
    torch.testing.assert_close(few_native, reference_linear(few, layer), rtol=1e-5, atol=1e-5)


@needs_native
def test_sdk_native_kernel_accepts_batched_input_and_checks_width():
    layer = make_linear(torch.randn(8, 16), None, unit_axis="in", unit_size=2)
    layer.set_width(3)
    x = torch.randn(2, 4, 6)
    torch.testing.assert_close(layer(x), x @ layer.storage[:6], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="features"):
        layer(torch.randn(1, 8))


def test_sdk_falls_back_to_torch_with_a_warning(monkeypatch):
    monkeypatch.setenv("ELASTIFY_NATIVE", "0")
    monkeypatch.setattr(kernels, "_native_tried", False)
    monkeypatch.setattr(kernels, "_native_module", None)
    with pytest.warns(UserWarning, match="torch fallback"):
        plain = make_linear(torch.randn(8, 4), None, unit_axis="out", unit_size=2)
    quantized = make_linear(torch.randn(8, 4), None, unit_axis="out", unit_size=2, weight_format="int8")
    assert plain.kernel is None  # plain ElasticLinear.forward
    assert quantized.kernel is reference_linear
    x = torch.randn(3, 4)
    dequantized = quant.dequantize(quantized.storage, "out", "int8", 8, 4)
    torch.testing.assert_close(quantized(x), x @ dequantized.T)


# --------------------------------------------------------------------------- int8 accuracy on SmolLM2
