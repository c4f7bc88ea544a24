"""ElasticLinear: a linear layer whose active width is a prefix of unit-major storage.

Two forms share one class:

* row units (q/k/v/gate/up): storage is `[out, in]`, a unit owns `unit_size` output rows;
  width n computes `x @ W[:n·u].T`.
* column units (o/down): storage is the transposed `[in, out]`, a unit owns `unit_size`
  input rows; width n computes `x @ Wt[:n·u]` (x already holds only the active inputs).

Either way the active weight is a contiguous leading slice, so `set_width` moves a view
and copies nothing; width 0 yields zeros of the right shape.

A whole model can also bind its layers to one `LevelCursor` with each layer's views for every
manifest level prepared up front: switching the model's level is then one integer write,
like the global level index of mllm's elastic kernels.

By default `forward` runs torch on fp32 storage. `use_kernel` routes it through a kernel
from `device_sdk.kernels` instead (native C++/OpenMP, or its torch reference), which also
accepts fp16 storage and block-quantised storage (`device_sdk.quant`: int8 and int4 blocks of 32
along the reduction). A block-quantised layer keeps the packed uint8 tensor as `storage`, its
format as `block_format` and the unpacked tensor's shape as `shape`; its widths are leading
slices of the packed tensor too (whole rows, or for column units whole 32-input block-rows).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from device_sdk.quant import QUANTIZED_FORMATS, packed_rows

UnitAxis = Literal["out", "in"]
Width = tuple  # (units, weight view, bias view), as made by ElasticLinear.prepare_width


class LevelCursor:
    """The level index a model's bound layers run at; -1 means each layer's own set_width.

    `version` counts changes to the bound layers' own widths, so that a plan made from them
    (the native decoder's) can tell when it is stale without reading every layer.
    """

    __slots__ = ("index", "version")

    def __init__(self) -> None:
        self.index = -1
        self.version = 0

    def select(self, index: int) -> None:
        self.index = index
        self.version += 1


class ElasticLinear(nn.Module):
    def __init__(
        self,
        storage: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        unit_axis: UnitAxis,
        unit_size: int,
        block_format: str | None = None,
        shape: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if unit_axis not in ("out", "in"):
            raise ValueError(f"unit_axis must be 'out' or 'in', not {unit_axis!r}")
        if block_format is not None and (block_format not in QUANTIZED_FORMATS or shape is None):
            raise ValueError(f"block-quantised storage needs a format in {QUANTIZED_FORMATS} and its unpacked shape")
        shape = tuple(storage.shape) if block_format is None else tuple(shape)
        if storage.dim() != 2 or shape[0] % unit_size:
            raise ValueError(f"storage {shape} is not a whole number of {unit_size}-row units")
        if bias is not None and unit_axis == "out" and bias.shape[0] != shape[0]:
            raise ValueError("a row-unit bias must have one entry per stored row")
        self.unit_axis: UnitAxis = unit_axis
        self.unit_size = unit_size
        self.block_format = block_format
        self.shape = shape  # the unpacked unit-major storage's [rows, cols]
        self.max_units = shape[0] // unit_size
        self.storage = nn.Parameter(storage, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernel = None  # callable(x, layer) -> y, set by use_kernel
        self.cursor: LevelCursor | None = None
        self.level_widths: list[Width] = []
        self.set_width(self.max_units)

    def use_kernel(self, kernel) -> None:
        """Run `forward` through `kernel(x, self)`."""
        self.kernel = kernel

    @property
    def in_features(self) -> int:
        return self.shape[1] if self.unit_axis == "out" else self.active_rows

    @property
    def out_features(self) -> int:
        return self.active_rows if self.unit_axis == "out" else self.shape[1]

    @property
    def active_rows(self) -> int:
        return self.units * self.unit_size

    @property
    def width(self) -> Width:
        cursor = self.cursor
        if cursor is not None and cursor.index >= 0:
            return self.level_widths[cursor.index]
        return self.own_width

    @property
    def units(self) -> int:
        return self.width[0]

    @property
    def active_weight(self) -> torch.Tensor:
        return self.width[1]

    @property
    def active_bias(self) -> torch.Tensor | None:
        return self.width[2]

    def set_width(self, units: int) -> None:
        self.apply_width(self.prepare_width(units))

    def prepare_width(self, units: int) -> Width:
        """The views for `units`, made once so that a later switch only swaps references."""
        if not 0 <= units <= self.max_units:
            raise ValueError(f"width {units} is outside 0..{self.max_units} units")
        rows = units * self.unit_size
        bias = self.bias
        # Leading slices of contiguous storage: views, never copies.
        stored = rows if self.block_format is None else packed_rows(self.unit_axis, rows)
        return units, self.storage[:stored], bias[:rows] if bias is not None and self.unit_axis == "out" else bias

    def apply_width(self, prepared: Width) -> None:
        if self.cursor is not None and self.cursor.index >= 0:
            raise ValueError("this layer follows its model's level; switch widths through the model")
        # Written to __dict__ directly: nn.Module.__setattr__'s registry checks would double
        # the cost of a whole-model switch (~200 of these calls).
        self.__dict__["own_width"] = prepared
        if self.cursor is not None:
            self.cursor.version += 1

    def bind_levels(self, cursor: LevelCursor, units_per_level: list[int]) -> None:
        """Follow `cursor`: at index i this layer runs `units_per_level[i]` units."""
        self.level_widths = [self.prepare_width(units) for units in units_per_level]
        self.cursor = cursor
        cursor.version += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self)
        if self.block_format is not None:
            raise ValueError("block-quantised storage runs through a kernel (device_sdk.kernels.make_linear)")
        units, weight, bias = self.width
        if self.unit_axis == "out":
            return F.linear(x, weight, bias)
        if x.shape[-1] != weight.shape[0]:
            raise ValueError(f"input has {x.shape[-1]} features, the active width needs {weight.shape[0]}")
        y = torch.matmul(x, weight)
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return (
            f"unit_axis={self.unit_axis}, unit_size={self.unit_size}, units={self.units}/{self.max_units}, "
            f"in={self.in_features}, out={self.out_features}"
        )
