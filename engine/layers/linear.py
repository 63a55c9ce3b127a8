"""Linear layers whose parameters know how to load checkpoint tensors.

Every parameter carries a ``weight_loader(param, loaded, shard_id=None)``
attribute.  A stacked layer (fused q/k/v, fused gate/up) owns one parameter
made of several checkpoint tensors stacked along the output dim; its loader
copies each shard (named by ``shard_id``) into its rows.  Parallel wrappers
replace these loaders without touching model code.

Each layer owns a quantization method (``quant_method``, fixed when it is
built; unquantized unless given): the method creates the parameters, writes
checkpoint tensors into them and runs the matmul (``QuantMethod``'s contract,
``kvship.engine.layers.quantization``).  The layer keeps the geometry (which
rows a shard fills).  Parameters are created with ``torch.empty`` (no init):
a loader fills them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from kvship.engine.layers.quantization import QuantMethod, get_quant_method
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
    """A parameter outside any quantization method (norm weights)."""
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def unquantized_or(method: Optional[QuantMethod]) -> QuantMethod:
    """``method``, or the unquantized one for a layer built without one."""
    return method if method is not None else get_quant_method("unquantized")


def load_checked(layer: nn.Module, name: str, target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """``layer.quant_method.load`` of ``loaded`` into ``target`` once their shapes agree (ValueError naming
    ``what`` otherwise)."""
    loaded = materialize(loaded)
    shapes = tuple(target.shape), tuple(loaded.shape)
    if shapes[0] != shapes[1] and not layer.quant_method.accepts_shape(name, *shapes):
        raise ValueError(f"{what}: expected {tuple(target.shape)}, checkpoint has {tuple(loaded.shape)}")
    layer.quant_method.load(layer, name, target, loaded)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W: [out, in]`` (checkpoint layout)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        quant_method: Optional[QuantMethod] = None,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = dtype  # the model dtype (biases, outputs); the method may store weights otherwise
        self.quant_method = unquantized_or(quant_method)
        self.bias: Optional[nn.Parameter] = None
        weights = {"weight": (output_size, input_size)}
        if bias:
            weights["bias"] = (output_size,)
        self.quant_method.create_weights(self, weights, dtype, self._load_whole)

    def _load_whole(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter of shape {tuple(param.shape)} is not stacked; got shard {shard_id!r}")
        load_checked(self, self._param_name(param), param.data, loaded, "shape mismatch")

    def _param_name(self, param: nn.Parameter) -> str:
        for name, p in self.named_parameters(recurse=False):
            if p is param:
                return name
        raise ValueError(f"parameter of shape {tuple(param.shape)} does not belong to this {type(self).__name__}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.quant_method.apply(self, x))

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Finish an output of ``quant_method`` (``apply`` or a fused form): nothing here; a row-parallel layer
        sums the ranks' partial outputs."""
        return y

    @property
    def reduce_comm(self) -> Optional[Any]:
        """The communicator whose all-reduce ``reduce`` runs (a row-parallel layer's), or None: a caller that takes
        ``forward_partial``'s output owes it that all-reduce (``rmsnorm.norm_then_linear``'s ``pending``)."""
        return None

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` without ``reduce``: this rank's partial output of a row-parallel layer."""
        return self.quant_method.apply(self, x)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


def gated_linear(layer: Linear, act: nn.Module, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
    """``layer(act(x))`` for a gated activation over ``x = gate || up``; where the layer's method has a kernel
    for it (unquantized: on CUDA at batch 1) the SiLU-and-mul is computed inside the matmul's input (one kernel,
    no activation tensor).  ``reduce=False``: ``forward_partial``'s output (the caller owes the all-reduce)."""
    if getattr(act, "is_silu", False):
        y = layer.quant_method.apply_silu_mul_input(layer, x)
        if y is not None:
            return layer.reduce(y) if reduce else y
    return layer(act(x)) if reduce else layer.forward_partial(act(x))


class StackedLinear(Linear):
    """Several projections of the same input fused into one matmul.

    ``shards`` maps a shard id (e.g. ``"q"``, ``"k"``, ``"v"`` or ``0``, ``1``)
    to its output size, in stacking order.  The output is the concatenation;
    split it with ``output_sizes``.
    """

    def __init__(
        self,
        input_size: int,
        shards: dict[object, int],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        quant_method: Optional[QuantMethod] = None,
    ):
        super().__init__(input_size, sum(shards.values()), bias=bias, dtype=dtype, quant_method=quant_method)
        self.output_sizes = list(shards.values())
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        off = 0
        for sid, size in shards.items():
            self.shard_offsets[sid] = (off, size)
            off += size
        for p in self.parameters(recurse=False):  # weight, bias and the method's scales
            p.weight_loader = self._load_shard  # type: ignore[attr-defined]

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; this layer stacks {list(self.shard_offsets)}")
        off, size = self.shard_offsets[shard_id]
        name = self._param_name(param)
        target = self.quant_method.rows(name, param.data, off, size)
        load_checked(self, name, target, loaded, f"shard {shard_id!r}")
