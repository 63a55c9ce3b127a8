"""Linear layers whose parameters know how to load checkpoint tensors.

Every parameter carries a ``weight_loader(param, loaded, shard_id=None)``
attribute.  A stacked layer (fused q/k/v, fused gate/up) owns one parameter
made of several checkpoint tensors stacked along the output dim; its loader
copies each shard (named by ``shard_id``) into its rows.  Parallel wrappers
and quantized layers can replace these loaders without touching model code.
Parameters are created with ``torch.empty`` (no init): a loader fills them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvship.engine.layers.fused_dispatch import cuda_skinny_gemm
from kvship.engine.loaders.lazy import materialize


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """Copy ``loaded`` (a tensor or a ``CheckpointSlice``) into ``param``; shapes must match exactly."""
    loaded = materialize(loaded)
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not stacked; got shard {shard_id!r}")
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


def _param(shape: Sequence[int], dtype: torch.dtype, loader=default_weight_loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W: [out, in]`` (checkpoint layout)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = _param((output_size, input_size), dtype)
        self.bias: Optional[nn.Parameter] = _param((output_size,), dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(x, self.weight, self.bias)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Finish an output computed from ``weight`` outside ``forward`` (``gated_linear``'s fused kernel):
        nothing here; a row-parallel layer sums the ranks' partial outputs."""
        return y

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x W^T + b``: on CUDA at decode batch sizes our skinny-GEMM kernels where they beat cuBLAS, else F.linear."""
    skinny = cuda_skinny_gemm(x)
    if skinny is not None:
        y = skinny.linear(x, weight, bias)
        if y is not None:
            return y
    return F.linear(x, weight, bias)


def gated_linear(layer: Linear, act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(act(x))`` for a gated activation over ``x = gate || up``; on CUDA at batch 1 the SiLU-and-mul
    is computed inside the matmul's input (one kernel, no activation tensor)."""
    skinny = cuda_skinny_gemm(x)
    if skinny is not None and getattr(act, "is_silu", False):
        y = skinny.linear(x, layer.weight, layer.bias, act=skinny.ACT_SILU_MUL)
        if y is not None:
            return layer.reduce(y)
    return layer(act(x))


class StackedLinear(Linear):
    """Several projections of the same input fused into one matmul.

    ``shards`` maps a shard id (e.g. ``"q"``, ``"k"``, ``"v"`` or ``0``, ``1``)
    to its output size, in stacking order.  The output is the concatenation;
    split it with ``output_sizes``.
    """

    def __init__(
        self, input_size: int, shards: dict[object, int], bias: bool = False, dtype: torch.dtype = torch.float32
    ):
        super().__init__(input_size, sum(shards.values()), bias=bias, dtype=dtype)
        self.output_sizes = list(shards.values())
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        off = 0
        for sid, size in shards.items():
            self.shard_offsets[sid] = (off, size)
            off += size
        self.weight.weight_loader = self._load_shard  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self._load_shard  # type: ignore[attr-defined]

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; this layer stacks {list(self.shard_offsets)}")
        off, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, off, size)
        loaded = materialize(loaded)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(
                f"shard {shard_id!r}: expected {tuple(target.shape)}, checkpoint has {tuple(loaded.shape)}"
            )
        with torch.no_grad():
            target.copy_(loaded)
