"""Block-quantised int8/int4 weights: the layout keeps every width a prefix, each native kernel (scalar
and every instruction set this machine has) equals quant.reference_gemv, the numpy reference of the
same quantisation, and the native whole-step decode equals the Python forward on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from device_sdk import kernels, quant
from device_sdk.elastic import ElasticLinear
from device_sdk.kernels import GEMM_ROWS, make_linear, native_linear, reference_linear
from device_sdk.runtime import ElasticModel
from tests.support.sdk_packages import (
    add_recovery_adapters,
    decode_both_ways,
    random_package,
    signing_key,
    token_ids,
)

KEY = signing_key()
FORMATS = quant.QUANTIZED_FORMATS
needs_native = pytest.mark.skipif(kernels.native_module() is None, reason="no C++ compiler on this machine")
ISAS = kernels.kernel_isas() or ["scalar"]


@pytest.fixture(params=ISAS)
def isa(request):
    """Every quantised kernel runs on one instruction set for the test, then back to the best."""
    if kernels.native_module() is None:
        pytest.skip("no C++ compiler on this machine")
    assert kernels.set_kernel_isa(request.param) == request.param
    yield request.param
    kernels.set_kernel_isa("auto")


def expected_output(x: torch.Tensor, layer: ElasticLinear) -> np.ndarray:
    """quant.reference_gemv per input row, plus the bias, in float64."""
    rows = [quant.reference_gemv(row.numpy(), layer.storage, layer.unit_axis, layer.block_format, layer.active_rows,
                                 layer.shape[1]) for row in x]
    y = np.stack(rows) if rows else np.zeros((0, layer.out_features))
    if layer.active_bias is not None:
        y = y + layer.active_bias.double().numpy()
    return y


def assert_matches(got: torch.Tensor, expected: np.ndarray) -> None:
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=0, atol=2e-5 * scale)


# --------------------------------------------------------------------------- layout


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("unit_axis", ["out", "in"])
def test_every_width_is_a_prefix_of_the_packed_bytes(weight_format, unit_axis):
    generator = torch.Generator().manual_seed(0)
    unit_size, units, other = 3, 32, 70  # 96 stored rows; 70 is not a whole number of blocks
    storage = torch.randn(units * unit_size, other, generator=generator)
    packed = quant.quantize(storage, unit_axis, weight_format)
    size = quant.BLOCK_BYTES[weight_format]
    assert packed.dtype == torch.uint8
    assert packed.shape == ((96, 3 * size) if unit_axis == "out" else (3, other * size))
    full = quant.dequantize(packed, unit_axis, weight_format, 96, other)
    assert full.shape == storage.shape
    # Each value within half a quantisation step of its block's scale.
    step = storage.abs().max() / (127 if weight_format == "int8" else 7)
    assert (full - storage).abs().max() <= step
    layer = make_linear(storage, None, unit_axis=unit_axis, unit_size=unit_size, weight_format=weight_format)
    assert torch.equal(layer.storage, packed)
    for width in range(1, units + 1):
        rows = width * unit_size
        layer.set_width(width)
        prefix = layer.active_weight
        assert prefix.data_ptr() == layer.storage.data_ptr()
        assert prefix.shape[0] == quant.packed_rows(unit_axis, rows)
        # The level's bytes are the full tensor's leading bytes, and they hold its first `rows` rows.
        assert torch.equal(quant.dequantize(prefix, unit_axis, weight_format, rows, other), full[:rows])
        if unit_axis == "out" or rows % quant.BLOCK == 0:  # whole blocks: the prefix quantised alone is the same
            assert torch.equal(quant.quantize(storage[:rows], unit_axis, weight_format), prefix)


@pytest.mark.parametrize("weight_format", FORMATS)
def test_blocks_are_llama_cpp_blocks(weight_format):
    """34-byte Q8_0 / 18-byte Q4_0 blocks: fp16 scale, then values (int4: low nibbles first)."""
    values = torch.linspace(-1.0, 0.5, 32)
    block = quant.quantize_blocks(values, weight_format)
    d = block[:2].view(torch.float16).item()
    if weight_format == "int8":
        assert block.numel() == 34 and d == pytest.approx(1.0 / 127, rel=1e-3)
        assert block[2:].view(torch.int8)[0].item() == -127
    else:
        assert block.numel() == 18 and d == pytest.approx(1.0 / 8, rel=1e-3)  # max magnitude is -1 → d = -1/-8
        assert (block[2] & 0x0F).item() == 0 and (block[2] >> 4).item() == round(values[16].item() / d + 8)
    torch.testing.assert_close(quant.dequantize_blocks(block, weight_format), values, atol=d / 2 + 1e-6, rtol=0)


def test_activation_quantisation_rounds_half_to_even_and_pads_with_zeros():
    q, d = quant.quantize_activations(np.array([127.0, 0.5, 1.5, -2.5] + [0.0] * 30, np.float32))
    assert d.tolist() == [1.0, 0.0] and q[:4].tolist() == [127, 0, 2, -2] and not q[34:].any()
    assert len(q) == 64


@needs_native
@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("unit_axis", ["out", "in"])
def test_native_dequantize_equals_the_reference(weight_format, unit_axis):
    storage = torch.randn(96, 37)
    layer = make_linear(storage, None, unit_axis=unit_axis, unit_size=3, weight_format=weight_format)
    code = quant.FORMAT_CODES[weight_format]
    for rows in (0, 3, 30, 33, 96):
        reference = quant.dequantize(layer.storage, unit_axis, weight_format, rows, 37)
        got = kernels.native_module().dequantize(layer.storage, code, rows, 37, unit_axis == "out")
        assert torch.equal(got, reference if unit_axis == "out" else reference.t())


# --------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize(("unit_axis", "shape", "unit_size"),
                         [("out", (37, 96), 1), ("out", (39, 70), 3), ("in", (96, 37), 3), ("in", (100, 37), 5)])
def test_kernel_equals_the_numpy_reference_on_odd_shapes(isa, weight_format, unit_axis, shape, unit_size):
    """Every width, 1 to 15 rows (the native GEMV; from GEMM_ROWS on, the dequantised GEMM)."""
    generator = torch.Generator().manual_seed(1)
    storage = torch.randn(*shape, generator=generator)
    bias = torch.randn(shape[0] if unit_axis == "out" else shape[1], generator=generator)
    layer = make_linear(storage, bias, unit_axis=unit_axis, unit_size=unit_size, weight_format=weight_format)
    assert layer.kernel is native_linear
    for width in range(layer.max_units + 1):
        layer.set_width(width)
        for rows in (1, 2, 5):
            x = torch.randn(rows, layer.in_features, generator=generator) * 3
            got = native_linear(x, layer)
            assert got.shape == (rows, layer.out_features)
            assert_matches(got, expected_output(x, layer))
    layer.set_width(layer.max_units - 1)
    many = torch.randn(GEMM_ROWS[torch.uint8] + 3, layer.in_features, generator=generator)
    torch.testing.assert_close(native_linear(many, layer), reference_linear(many, layer), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("weight_format", FORMATS)
def test_kernel_equals_the_numpy_reference_at_every_level_of_a_package(isa, weight_format, tmp_path):
    """Every projection of a random package (100 neurons: partial blocks in down_proj at every level)."""
    package = random_package("llama_gqa", tmp_path / "pkg", KEY, intermediate=100)
    model = ElasticModel.load(package, quantize=weight_format, allow_unsigned=True)
    linears = [m for m in model.transformer.modules() if isinstance(m, ElasticLinear)]
    head = model.transformer.lm_head
    assert {m.block_format for m in linears if m is not head} == {weight_format}
    assert head.block_format == "int8"  # at int4 too, as llama.cpp's Q4_0 keeps its output tensor
    generator = torch.Generator().manual_seed(2)
    for level in model.available_levels():
        model.set_level(level)
        for linear in linears:
            x = torch.randn(1, linear.in_features, generator=generator)
            assert_matches(linear(x), expected_output(x, linear))


def test_isa_choice_is_checked():
    if kernels.native_module() is None:
        pytest.skip("no C++ compiler on this machine")
    assert kernels.kernel_isas()[0] == "scalar"
    with pytest.raises(RuntimeError, match="not available"):
        kernels.set_kernel_isa("avx1024")
    assert kernels.set_kernel_isa("auto") == kernels.kernel_isas()[-1]


def test_torch_fallback_runs_quantised_storage(monkeypatch):
    monkeypatch.setenv("ELASTIFY_NATIVE", "0")
    monkeypatch.setattr(kernels, "_native_tried", False)
    monkeypatch.setattr(kernels, "_native_module", None)
    storage = torch.randn(40, 64)
    with pytest.warns(UserWarning, match="torch fallback"):
        layer = make_linear(storage, None, unit_axis="in", unit_size=4, weight_format="int4")
    assert layer.kernel is reference_linear
    layer.set_width(7)
    x = torch.randn(3, 28)
    weight = quant.dequantize(quant.quantize(storage, "in", "int4"), "in", "int4", 40, 64)[:28]
    torch.testing.assert_close(layer(x), x @ weight)


# --------------------------------------------------------------------------- the native decode step


def assert_same_decode(steps: torch.Tensor, reference: torch.Tensor, label) -> None:
    """The native step and the Python forward agree to float rounding, except that a quantised
    activation one ulp from a rounding boundary can round either way in the two (torch's silu and
    the decoder's differ in the last bit); the step then moves every later logit a little (seen:
    0.6% of their norm, on the scalar path of one configuration here; others agree to ~1e-7).
    A wrong layout, scale or LoRA term moves them by far more (cf. the LoRA check below)."""
    relative = ((steps - reference).norm() / reference.norm()).item()
    assert relative <= 1e-2, (label, relative)
    assert torch.equal(steps.argmax(-1), reference.argmax(-1)), label


@needs_native
@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_bias"])
def test_native_decode_equals_the_python_forward(isa, weight_format, lora, kind, tmp_path):
    package = random_package(kind, tmp_path / "pkg", KEY, intermediate=100)
    if lora:
        add_recovery_adapters(package, KEY)
    model = ElasticModel.load(package, quantize=weight_format, allow_unsigned=True)
    assert model.transformer.decoder is not None
    ids = token_ids(256, length=12, batch=1)
    for level in model.available_levels():
        model.set_level(level)
        steps, reference = decode_both_ways(model, ids, prefill=5)
        assert_same_decode(steps, reference, level)
    if lora:  # the adapters take part
        for block in model.transformer.layers:
            for name in kernels.PROJECTIONS:
                block.projection(name).lora = None
        without = decode_both_ways(model, ids, prefill=5)[1]
        assert ((without - reference).norm() / reference.norm()).item() > 5e-2
    # Per-layer widths with whole sub-layers off, and partial blocks of o/down inputs.
    full_attn, full_mlp = model.manifest.elastic.attn_units, model.manifest.elastic.mlp_units
    model.set_widths([full_attn[0], 0, 1, full_attn[3]], [0, 37, full_mlp[2] // 2, full_mlp[3]])
    steps, reference = decode_both_ways(model, ids, prefill=5)
    assert_same_decode(steps, reference, "per-layer widths")


@needs_native
@pytest.mark.parametrize("weight_format", FORMATS)
def test_quantised_decode_stays_close_to_fp32(weight_format, tmp_path):
    """Quantisation changes the logits by a little, not by a lot (a wrong layout would not)."""
    package = random_package("llama_gqa", tmp_path / "pkg", KEY)
    ids = token_ids(256, length=10, batch=1)
    exact = decode_both_ways(ElasticModel.load(package, allow_unsigned=True), ids, prefill=4)[0]
    steps = decode_both_ways(ElasticModel.load(package, quantize=weight_format, allow_unsigned=True), ids, prefill=4)[0]
    error = ((steps - exact).norm() / exact.norm()).item()
    assert error < (0.02 if weight_format == "int8" else 0.2)
