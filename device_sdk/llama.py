"""The Llama-family decoder (Llama, Mistral, Qwen2) in one file, over unit-major weights.

No transformers import: this file is the whole model. Every projection is an ElasticLinear
over the package's (memory-mapped) storage, so each layer runs at any prefix width:
`g` KV groups keep the first g·n_rep query heads and g KV heads (a legal GQA shape), `n`
neurons keep the first n SwiGLU neurons. A sub-layer of width 0 adds nothing to the residual
stream. Computation is fp32; weights may be stored fp32, fp16 or in int8/int4 blocks (see kernels.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from device_sdk.elastic import ElasticLinear, LevelCursor
from device_sdk.format import Architecture
from device_sdk.lora import PROJECTIONS, LoRA, lora_delta
from device_sdk.quant import Packed

LinearFactory = Callable[..., ElasticLinear]  # (storage, bias, *, unit_axis, unit_size) -> ElasticLinear

# Attention scores are [B, groups, n_rep·T, S] fp32. Computed at once for a long prompt they grow with
# T²: 2.4 GB per layer for 8k tokens of SmolLM2-135M (9 heads), and the softmax doubles it. Attention
# takes its queries a chunk at a time so that one chunk's scores hold at most this many elements
# (64 MiB); a prompt whose scores fit runs in one chunk, exactly as before.
SCORE_ELEMENTS = 1 << 24


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


# --------------------------------------------------------------------------- rotary embeddings


def rope_inv_freq(arch: Architecture) -> torch.Tensor:
    """Inverse frequencies, with the `linear` and `llama3` scalings that configs carry."""
    rope = arch.rope
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    dim = arch.head_dim
    inv_freq = 1.0 / (rope.get("rope_theta", 10000.0) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        context = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= context / high) & (wavelen <= context / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"RoPE type {kind!r} is not supported (default, linear, llama3)")


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for positions [T]; [B, 1, T, head_dim] (one row per sequence) for [B, T]."""
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    if positions.dim() == 2:
        angles = angles[:, None]  # broadcast over the heads of [B, heads, T, head_dim]
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------- KV cache


class KVCache:
    """Keys and values of every layer for one batch of sequences, preallocated to `max_len`:
    one [layers, batch, kv_heads, max_len, head_dim] tensor each, shared with the native decoder."""

    def __init__(self, layers: int, max_len: int, kv_heads: int, head_dim: int):
        self.shape = (layers, kv_heads, max_len, head_dim)
        self.max_len = max_len
        self.length = 0  # tokens already cached (the same for every layer)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def buffers(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            layers, heads, max_len, head_dim = self.shape
            self.keys = torch.zeros(layers, batch, heads, max_len, head_dim)
            self.values = torch.zeros_like(self.keys)
        if self.keys.shape[1] != batch:
            raise ValueError(f"the cache holds a batch of {self.keys.shape[1]}, not {batch}")
        return self.keys, self.values

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v [B, groups, T, hd]; return everything cached so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache ({self.max_len})")
        keys, values = self.buffers(k.shape[0])
        groups = k.shape[1]
        keys[layer, :, :groups, self.length : end] = k
        values[layer, :, :groups, self.length : end] = v
        return keys[layer, :, :groups, :end], values[layer, :, :groups, :end]

    def truncate(self, length: int) -> None:
        """Forget every token after the first `length`: a shared prefix stays, the continuation that
        ran on it goes (the next update overwrites its slots)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def select_rows(self, rows: torch.Tensor) -> KVCache:
        """A new cache whose row i continues row `rows[i]` of this one (a shared prompt, many continuations)."""
        picked = KVCache(self.shape[0], self.max_len, self.shape[1], self.shape[3])
        picked.length = self.length
        if self.keys is not None:
            picked.keys = self.keys.index_select(1, rows)
            picked.values = self.values.index_select(1, rows)
        return picked


# --------------------------------------------------------------------------- the model


class Projection(nn.Module):
    """An ElasticLinear plus, when the active level has one, its LoRA (see device_sdk.lora)."""

    def __init__(self, linear: ElasticLinear):
        super().__init__()
        self.linear = linear
        self.lora: LoRA | None = None

    def forward(self, x):
        y = self.linear(x)
        if self.lora is not None:
            y = y + lora_delta(x, self.lora)
        return y


class Attention(nn.Module):
    def __init__(self, arch: Architecture, weights: Mapping[str, torch.Tensor], prefix: str, make: LinearFactory):
        super().__init__()
        self.head_dim = arch.head_dim
        group_rows = arch.n_rep * arch.head_dim  # q rows (and o_proj inputs) of one KV group
        self.q_proj = projection(weights, f"{prefix}.q_proj", group_rows, make)
        self.k_proj = projection(weights, f"{prefix}.k_proj", arch.head_dim, make)
        self.v_proj = projection(weights, f"{prefix}.v_proj", arch.head_dim, make)
        self.o_proj = projection(weights, f"{prefix}.o_proj", group_rows, make)

    @property
    def groups(self) -> int:
        return self.k_proj.linear.units

    def forward(self, x, cos, sin, mask, cache: KVCache, layer: int):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, groups·n_rep, T, hd]
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, groups, T, hd]
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = cache.update(layer, k, v)
        # GQA without repeating K/V: a group's query heads are adjacent, so fold them into the
        # query axis. (Plain matmuls: torch's fused CPU attention is far slower for one token.)
        groups, n_rep, S = k.shape[1], q.shape[1] // k.shape[1], k.shape[2]
        step = max(1, SCORE_ELEMENTS // (B * groups * n_rep * S))
        keys_t, scale = k.transpose(-1, -2), self.head_dim**-0.5
        chunks = []
        for start in range(0, T, step):
            end = min(T, start + step)
            q_chunk = q[:, :, start:end].reshape(B, groups, n_rep * (end - start), self.head_dim)
            scores = (q_chunk @ keys_t) * scale  # [B, groups, n_rep·C, S]
            allowed = mask.rows(start, end) if mask is not None else None
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            chunks.append((scores.softmax(dim=-1) @ v).reshape(B, groups * n_rep, end - start, self.head_dim))
        y = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class AttentionMask:
    """Which cached keys each new query may attend to: causal, within Mistral's sliding window, and
    within a batch row's `key_mask` [B, S]. Built for one chunk of queries at a time (`rows`), as bool,
    so a long prompt never holds a T×S mask, let alone an int64 one."""

    def __init__(self, slots: torch.Tensor, total: int, window: int | None, n_rep: int,
                 key_mask: torch.Tensor | None = None):
        self.slots, self.total, self.window, self.n_rep = slots, total, window, n_rep
        self.key_mask = None if key_mask is None else key_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
        # one new token sees everything cached (unless a window hides the oldest)
        self.causal = not (len(slots) == 1 and (window is None or total <= window))
        self._whole = None  # the mask of every query, kept when one chunk holds them all (every layer reuses it)

    def rows(self, start: int, end: int) -> torch.Tensor | None:
        """The mask of queries start:end of this call: [n_rep·C, S] (or [B, 1, n_rep·C, S] with a key
        mask), rows in the folded (query head, position) order; None when every key is allowed."""
        whole = start == 0 and end == len(self.slots)
        if whole and self._whole is not None:
            return self._whole
        mask = None
        if self.causal:
            queries, keys = self.slots[start:end, None], torch.arange(self.total)
            mask = keys <= queries
            if self.window is not None:
                mask &= keys > queries - self.window
            mask = mask.repeat(self.n_rep, 1)
        if self.key_mask is not None:
            mask = self.key_mask if mask is None else mask & self.key_mask
        if whole:
            self._whole = mask
        return mask


class MLP(nn.Module):
    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str, make: LinearFactory):
        super().__init__()
        self.gate_proj = projection(weights, f"{prefix}.gate_proj", 1, make)
        self.up_proj = projection(weights, f"{prefix}.up_proj", 1, make)
        self.down_proj = projection(weights, f"{prefix}.down_proj", 1, make)

    @property
    def neurons(self) -> int:
        return self.up_proj.linear.units

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, arch: Architecture, weights: Mapping[str, torch.Tensor], index: int, make: LinearFactory):
        super().__init__()
        prefix = f"model.layers.{index}"
        self.index = index
        self.input_layernorm = RMSNorm(weights[f"{prefix}.input_layernorm.weight"], arch.norm_eps)
        self.self_attn = Attention(arch, weights, f"{prefix}.self_attn", make)
        self.post_attention_layernorm = RMSNorm(weights[f"{prefix}.post_attention_layernorm.weight"], arch.norm_eps)
        self.mlp = MLP(weights, f"{prefix}.mlp", make)

    def projection(self, name: str) -> Projection:
        """`q_proj` … `down_proj` of this block."""
        return getattr(self.self_attn if name in PROJECTIONS[:4] else self.mlp, name)

    def forward(self, x, cos, sin, mask, cache: KVCache):
        if self.self_attn.groups:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, self.index)
        if self.mlp.neurons:
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class Transformer(nn.Module):
    def __init__(self, arch: Architecture, weights: Mapping[str, torch.Tensor], make: LinearFactory):
        super().__init__()
        self.arch = arch
        # Rows are read, never multiplied; a tensor, or quant.Packed blocks (a quantised model's tied LM head).
        self.embed_tokens = weights["model.embed_tokens.weight"]
        self.layers = nn.ModuleList(Block(arch, weights, i, make) for i in range(arch.layers))
        self.norm = RMSNorm(weights["model.norm.weight"], arch.norm_eps)
        head = weights["model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"]
        self.lm_head = make(head, None, unit_axis="out", unit_size=head.shape[0])
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)
        # Every projection follows one cursor, whose version tells the native decoder when a
        # width changed.
        self.cursor = LevelCursor()
        for block in self.layers:
            for name in PROJECTIONS:
                block.projection(name).linear.bind_levels(self.cursor, [])
        self.decoder = None  # a kernels.NativeDecoder runs single-token steps when set

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.arch.layers, max_len, self.arch.kv_heads, self.arch.head_dim)

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits for `ids` [B, T] after whatever `cache` already holds (a fresh one if None)."""
        B, T = ids.shape
        cache = cache if cache is not None else self.new_cache(T)
        if self.decoder is not None and B == 1 and T == 1:
            return self.decoder.step(int(ids[0, 0]), cache).view(1, 1, -1)
        x = self._blocks(ids, cache, None, None)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))

    def hidden_states(self, ids: torch.Tensor, cache: KVCache | None = None, *, positions: torch.Tensor | None = None,
                      key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm hidden states [B, T, hidden] of `ids` [B, T]; `lm_head` of any of them is its logits.

        For batches of unequal sequences: `positions` [B, T] are each row's token positions (default:
        the cache slots the tokens fill), `key_mask` [B, S] marks which of the S = cache.length + T
        slots each row may attend to (e.g. not a shorter prompt's padding); causality applies on top.
        """
        cache = cache if cache is not None else self.new_cache(ids.shape[1])
        return self.norm(self._blocks(ids, cache, positions, key_mask))

    def _blocks(self, ids, cache: KVCache, positions, key_mask) -> torch.Tensor:
        T = ids.shape[1]
        start = cache.length
        slots = torch.arange(start, start + T)
        if positions is not None and self.arch.sliding_window is not None and start + T > self.arch.sliding_window:
            raise ValueError("per-row positions beyond the sliding window are not supported")
        cos, sin = rope_tables(self.inv_freq, slots if positions is None else positions)
        table = self.embed_tokens
        x = table.rows(ids) if isinstance(table, Packed) else table[ids].float()
        mask = AttentionMask(slots, start + T, self.arch.sliding_window, self.arch.n_rep, key_mask)
        for block in self.layers:
            x = block(x, cos, sin, mask, cache)
        cache.length = start + T
        return x


def projection(weights: Mapping[str, torch.Tensor], base: str, rows_per_unit: int, make: LinearFactory) -> Projection:
    """o_proj/down_proj are stored transposed (`weight_t`, unit axis = inputs); the rest HF-style."""
    bias = weights.get(f"{base}.bias")
    if f"{base}.weight_t" in weights:
        return Projection(make(weights[f"{base}.weight_t"], bias, unit_axis="in", unit_size=rows_per_unit))
    return Projection(make(weights[f"{base}.weight"], bias, unit_axis="out", unit_size=rows_per_unit))
