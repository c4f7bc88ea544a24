"""Block-quantised weights (llama.cpp's Q8_0 and Q4_0 blocks), laid out so that every width is a prefix.

A block is 32 consecutive values along a matrix's reduction dimension and one fp16 scale d:

  int8  34 bytes: d, then 32 int8 q;               value = d·q,       d = amax / 127   (Q8_0)
  int4  18 bytes: d, then 16 bytes of nibbles;     value = d·(q − 8), d = max / −8     (Q4_0)

(int4 nibble j, low half, is value j; the high half is value j + 16, as Q4_0, so a GGUF export can
copy the blocks.) int4 has no min: the kernel then needs no per-block activation sum, Q4_0 is the
rival the issue measures against, and a symmetric d keeps the integer dot product one
multiply-add chain.

Layout in unit-major storage, every width a contiguous leading slice of the packed tensor:

  row units ("out", storage W [rows, in]): each row is ceil(in/32) blocks, packed [rows, nb·B];
    width n is packed[:n].
  column units ("in", storage Wt [in, out]): the inputs (= units) go in blocks of 32; block-row b
    holds, for each output n, the block Wt[32b : 32b+32, n], packed [ceil(in/32), out·B];
    width k is packed[:ceil(k/32)].

A reduction length that is not a multiple of 32 is padded with zeros. A column-unit width inside a
block (k % 32 != 0: a level keeping 24 of 96 neurons, a KV group of 16 o_proj inputs) keeps that
block's scale, the full model's, and the kernels set the activations past k to zero, so the dropped
values add nothing: level m computes exactly the full tensor's numbers, truncated.

The activations of a matrix-vector product are quantised per block too (`quantize_activations`):
int8, d = amax / 127 kept in fp32, q = round-half-even(x / d), as the native kernels do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
BLOCK_BYTES = {"int8": 2 + BLOCK, "int4": 2 + BLOCK // 2}
FORMAT_CODES = {"int8": 1, "int4": 2}  # the native kernels' names for them
QUANTIZED_FORMATS = tuple(BLOCK_BYTES)


def blocks_for(length: int) -> int:
    return -(-length // BLOCK)


def _padded_blocks(values: torch.Tensor) -> torch.Tensor:
    """[n, L] → [n, ceil(L/32), 32], zero-padded."""
    pad = blocks_for(values.shape[1]) * BLOCK - values.shape[1]
    if pad:
        values = torch.nn.functional.pad(values, (0, pad))
    return values.reshape(values.shape[0], -1, BLOCK)


def quantize_blocks(blocks: torch.Tensor, weight_format: str) -> torch.Tensor:
    """[..., 32] fp32 → [..., B] uint8 blocks, llama.cpp's reference rounding."""
    blocks = blocks.float()
    if weight_format == "int8":
        d = blocks.abs().amax(dim=-1) / 127.0
        inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        scaled = blocks * inverse[..., None]
        q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    elif weight_format == "int4":
        index = blocks.abs().argmax(dim=-1, keepdim=True)
        d = blocks.gather(-1, index).squeeze(-1) / -8.0
        inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        nibbles = torch.floor(blocks * inverse[..., None] + 8.5).clamp_(0, 15).to(torch.uint8)
        q = nibbles[..., : BLOCK // 2] | (nibbles[..., BLOCK // 2 :] << 4)
    else:
        raise ValueError(f"not a quantised format: {weight_format!r}")
    scale = d.to(torch.float16).reshape(*d.shape, 1).contiguous().view(torch.uint8)  # [..., 2]
    return torch.cat([scale, q], dim=-1)


def dequantize_blocks(packed: torch.Tensor, weight_format: str) -> torch.Tensor:
    """[..., B] uint8 blocks → [..., 32] fp32."""
    d = packed[..., :2].contiguous().view(torch.float16).float()  # [..., 1]
    body = packed[..., 2:]
    if weight_format == "int8":
        q = body.contiguous().view(torch.int8).float()
    elif weight_format == "int4":
        q = torch.cat([body & 0x0F, body >> 4], dim=-1).float() - 8.0
    else:
        raise ValueError(f"not a quantised format: {weight_format!r}")
    return q * d


def quantize(storage: torch.Tensor, unit_axis: str, weight_format: str) -> torch.Tensor:
    """Unit-major fp storage ([rows, in] or transposed [in, out]) → the packed uint8 tensor above."""
    weight = storage.float()
    if unit_axis == "out":
        rows = weight.shape[0]
        return quantize_blocks(_padded_blocks(weight), weight_format).reshape(rows, -1).contiguous()
    outputs = weight.shape[1]
    blocks = _padded_blocks(weight.t().contiguous())  # [out, nb, 32]
    return quantize_blocks(blocks.transpose(0, 1), weight_format).reshape(-1, outputs * BLOCK_BYTES[weight_format]).contiguous()


def dequantize(packed: torch.Tensor, unit_axis: str, weight_format: str, rows: int, cols: int) -> torch.Tensor:
    """The fp32 unit-major [rows, cols] tensor that `packed` (or a prefix of it holding `rows`) stands for."""
    size = BLOCK_BYTES[weight_format]
    if unit_axis == "out":
        values = dequantize_blocks(packed[:rows].reshape(rows, blocks_for(cols), size), weight_format)
        return values.reshape(rows, blocks_for(cols) * BLOCK)[:, :cols]
    block_rows = blocks_for(rows)
    values = dequantize_blocks(packed[:block_rows].reshape(block_rows, cols, size), weight_format)  # [nb, out, 32]
    return values.permute(0, 2, 1).reshape(block_rows * BLOCK, cols)[:rows]


@dataclass(frozen=True)
class Packed:
    """A matrix already in blocks (a precision file's, or one quantised at load at a format of its own, as the
    LM head of an int4 model): the packed uint8 tensor of `quantize`, its block format, its unpacked
    unit-major [rows, cols]. Row units ("out") only for `rows`, the embedding lookup."""

    blocks: torch.Tensor
    format: str
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.format not in BLOCK_BYTES or self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2:
            raise ValueError(f"packed blocks must be 2-D uint8 in one of {QUANTIZED_FORMATS}, not "
                             f"{self.blocks.dtype} {tuple(self.blocks.shape)} {self.format!r}")

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows `index` (any shape) of a row-unit matrix: [*index.shape, cols]."""
        flat = index.reshape(-1)
        values = dequantize(self.blocks[flat], "out", self.format, flat.numel(), self.shape[1])
        return values.reshape(*index.shape, self.shape[1])


def packed_rows(unit_axis: str, rows: int) -> int:
    """Leading rows of the packed tensor that hold the first `rows` stored rows."""
    return rows if unit_axis == "out" else blocks_for(rows)


# --------------------------------------------------------------------------- the numpy reference


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One vector → (int8 q [nb·32], fp32 d [nb]), zero-padded to whole blocks."""
    x = np.asarray(x, dtype=np.float32)
    blocks = np.zeros((blocks_for(len(x)), BLOCK), np.float32)
    blocks.reshape(-1)[: len(x)] = x
    d = (np.abs(blocks).max(axis=1) / np.float32(127)).astype(np.float32)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse[:, None]).astype(np.int8)
    return q.reshape(-1), d


def reference_gemv(x: np.ndarray, packed: torch.Tensor, unit_axis: str, weight_format: str, rows: int,
                   cols: int) -> np.ndarray:
    """y = x · W at width `rows` (stored rows in use) as the native kernels compute it: per block an
    exact integer dot product of the quantised activations with the stored q, times both scales."""
    size = BLOCK_BYTES[weight_format]
    if unit_axis == "out":
        blocks = packed[:rows].reshape(rows, blocks_for(cols), size)  # [outputs, nb, B]
    else:
        blocks = packed[: blocks_for(rows)].reshape(blocks_for(rows), cols, size).transpose(0, 1)
    d = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1).double().numpy()  # [outputs, nb]
    body = blocks[..., 2:]
    if weight_format == "int8":
        q = body.contiguous().view(torch.int8).numpy().astype(np.int64)
    else:
        q = torch.cat([body & 0x0F, body >> 4], dim=-1).numpy().astype(np.int64) - 8
    xq, xd = quantize_activations(x)
    sums = np.einsum("nbk,bk->nb", q, xq.reshape(-1, BLOCK).astype(np.int64))
    return (sums * d * xd.astype(np.float64)[None, :]).sum(axis=1)
