"""Reference models for equivalence tests: dense copies sliced from the ORIGINAL weights."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pipeline.elastilm.elastify import build_elastic, unit_orders
from pipeline.models.elastic import ElasticCausalLM


def relative_logit_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |Δlogit| over the logits' own scale (at least 1).

    fp32 summation order (which GEMM kernel the CPU picks, reordered reduction axes) moves a
    30-layer model's logits, |z| ~ 30, by 1-2e-4 on some CPUs and not others; relative to the
    scale that is ~5e-6, while any real error (a wrong unit, scale or position) is > 1e-2.
    """
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()


class ZeroAttention(nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, input_major: bool = False) -> nn.Linear:
    """nn.Linear over a copy of `weight` ([out, in]).

    `input_major` keeps the copy in [in, out] memory order (the weight is its transposed view),
    as o/down are stored in the package: fp32 GEMMs over different layouts sum in different
    orders, and over 30 layers that alone drifts logits by ~5e-5, which is not what we test.
    """
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    copy_ = weight.t().contiguous().t() if input_major else weight.clone()
    layer.weight = nn.Parameter(copy_)
    if bias is not None:
        layer.bias = nn.Parameter(bias.clone())
    return layer


def sliced_dense_copy(model, arch, importance, settings, attn_units, mlp_units):
    """A plain HF model whose layers hold copies of only the kept units, picked by original index."""
    attn_orders, mlp_orders = unit_orders(importance, settings.order, settings.seed)
    dense = copy.deepcopy(model)
    q_rows, hd = arch.n_rep * arch.head_dim, arch.head_dim
    for index, layer in enumerate(dense.model.layers):
        groups = attn_orders[index][: attn_units[index]]
        neurons = mlp_orders[index][: mlp_units[index]]
        q_idx = torch.cat([torch.arange(g * q_rows, (g + 1) * q_rows) for g in groups.tolist()] or [torch.empty(0, dtype=torch.long)])
        kv_idx = torch.cat([torch.arange(g * hd, (g + 1) * hd) for g in groups.tolist()] or [torch.empty(0, dtype=torch.long)])
        attn, mlp = layer.self_attn, layer.mlp
        if len(groups) == 0:
            layer.self_attn = ZeroAttention()
        else:
            for proj, idx in (("q_proj", q_idx), ("k_proj", kv_idx), ("v_proj", kv_idx)):
                old = getattr(attn, proj)
                setattr(attn, proj, _linear(old.weight[idx], None if old.bias is None else old.bias[idx]))
            attn.o_proj = _linear(attn.o_proj.weight[:, q_idx], attn.o_proj.bias, input_major=True)
        mlp.gate_proj = _linear(mlp.gate_proj.weight[neurons], mlp.gate_proj.bias)
        mlp.up_proj = _linear(mlp.up_proj.weight[neurons], mlp.up_proj.bias)
        mlp.down_proj = _linear(mlp.down_proj.weight[:, neurons], mlp.down_proj.bias, input_major=True)
    return dense.eval()


def elastic_in_memory(model, arch, importance, settings):
    """The elastic wrapper over freshly reordered tensors, leaving `model` untouched."""
    tensors, elastic = build_elastic(model, arch, importance, settings)
    return ElasticCausalLM(copy.deepcopy(model), arch, elastic, tensors).eval(), tensors
