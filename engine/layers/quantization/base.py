"""The quantization seam: how a weight-holding layer stores, loads, shards and applies its weights.

Every weight-holding layer (``Linear`` and the stacked q/k/v and gate/up
linears, their tensor-parallel versions, ``VocabEmbedding`` / ``LMHead`` and
their vocabulary-parallel versions, ``FusedMoE`` / ``ParallelFusedMoE``) owns
a ``QuantMethod``, fixed when the layer is built (``quant_method_for(config)``
picks it from ``ModelConfig.quantization``; a layer built without one is
unquantized).  The layer keeps the geometry (which rows of a stacked
parameter a shard fills, which expert, which block of the checkpoint a rank
reads); the method owns the bytes: the parameters it creates, the conversion
of checkpoint tensors into them, and the kernels that read them.

Methods are found by name (``@register_quant_method("name")``); a name that is
not registered is refused at startup (``resolve_quantization``), never served
as bf16.  docs/quantization.md describes the seam and what exists.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, NamedTuple, Optional

import torch
from torch import nn

from kvship.engine.loaders.lazy import Loaded, materialize, take

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.model_config import ModelConfig

WeightLoader = Callable[..., None]


class QuantizedInput(NamedTuple):
    """A linear layer's input already quantized by the kernel that produced it (``QuantMethod.input_group``):
    e4m3 ``q [M, K]``, float32 ``scales [M, K / group]`` (one per row and group of columns), and ``dtype``, the
    model dtype the unquantized rows had (the product's output dtype)."""

    q: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


@dataclass(frozen=True)
class Shard:
    """The block of a checkpoint weight ``[out, in]`` one rank holds: along ``dim`` (0: output rows, 1: input
    columns), ``[start, start + size)``."""

    dim: int
    start: int
    size: int


class QuantMethod(ABC):
    """How one weight-holding layer keeps its weights.  A method instance holds no per-layer state (one
    instance may serve every layer of a model): whatever it creates lives on the layer.

    Contract (what a layer may rely on, what a method must keep):

    * ``create_weights(layer, weights, dtype, loader)`` registers on ``layer`` the parameters that hold the
      logical weights ``weights`` (name -> shape in the checkpoint's layout, this rank's share: ``"weight"``
      ``[out, in]``, ``"bias"`` ``[out]``, ``"w13_weight"`` ``[E, 2I, H]``...) and any the method adds (scales,
      named by their checkpoint suffix, e.g. ``weight_scale_inv``), each with ``weight_loader = loader``.  Biases
      stay in ``dtype``.  Parameters are ``torch.empty``: ``load`` fills them.
    * ``shard(layer, name, loaded, shard)``: the part of checkpoint tensor ``name`` a rank holding ``shard`` of
      the layer's weight reads (the loaders hand each rank ``CheckpointSlice``s, so only that part is read).
      Weights split along ``shard.dim``; a bias splits with the output rows and is whole on an input split;
      per-channel scales split with their rows; block scales by whole blocks.  ``check_shard`` (called when
      the layer is built, before any weight is read) refuses a split that cuts a block, naming the layer and the
      sizes: a method with block scales only declares ``weight_block``.
    * ``load(layer, name, target, loaded)`` writes one checkpoint tensor (already this rank's block, already
      checked against ``target``'s shape by the layer) into ``target``, the region of parameter ``name`` it
      fills; a method that quantizes at load converts here (and writes the region's scales).
    * ``apply(layer, x)`` -> ``x W^T + b`` for a linear layer, before ``layer.reduce`` (a row-parallel layer's
      all-reduce).  Optional fused forms return None where the method has no kernel for ``x``; the caller then
      composes the unfused ops, so a method is correct with only ``apply``: ``apply_silu_mul_input`` (``apply``
      over ``silu(gate) * up`` of ``x = gate || up``), ``apply_norm_input`` (``apply`` over
      ``rmsnorm(x + residual)``).
    * ``embed(layer, ids)``: the rows ``ids`` of an embedding's weight (ids inside the layer's rows).
    * ``apply_moe(layer, runner, x, topk_weights, topk_ids, absent, config_experts)``: the routed experts'
      outputs (``kvship.engine.layers.moe.runner``'s contract), the layer's routing already done by ``runner``.
    """

    name: ClassVar[str] = ""
    #: (rows, columns) of the weight one scale covers; None: no block scales (unquantized, per-channel, per-tensor)
    weight_block: ClassVar[Optional[tuple[int, int]]] = None

    @classmethod
    def from_config(cls, config: "ModelConfig") -> "QuantMethod":
        """The method for a model of ``config`` (a method with per-checkpoint settings reads
        ``config.quantization_config``)."""
        return cls()

    # --- weights ---------------------------------------------------------------
    @abstractmethod
    def create_weights(
        self, layer: nn.Module, weights: dict[str, tuple[int, ...]], dtype: torch.dtype, loader: WeightLoader
    ) -> None:
        """Register ``layer``'s parameters for ``weights`` (class docstring)."""

    @abstractmethod
    def load(self, layer: nn.Module, name: str, target: torch.Tensor, loaded: torch.Tensor) -> None:
        """Write checkpoint tensor ``loaded`` into ``target``, a region of parameter ``name`` (class docstring)."""

    def accepts_shape(self, name: str, target: tuple[int, ...], loaded: tuple[int, ...]) -> bool:
        """Whether checkpoint tensor ``name`` of shape ``loaded`` may fill a region of shape ``target`` that
        differs from it (a per-tensor scale stored per row); ``load`` then converts.  Default: never."""
        return False

    def rows(self, name: str, param: torch.Tensor, start: int, size: int) -> torch.Tensor:
        """The region of parameter ``name`` (``param``) that holds output rows ``[start, start + size)`` of the
        layer's weight (a stacked layer's shard): rows of weights, biases and per-row scales, whole blocks of
        block scales (ValueError when the region cuts a block), all of a per-tensor scale."""
        kind = self.tensor_kind(name)
        if kind == "tensor_scale" and param.dim() == 0:
            return param
        if kind == "block_scale":
            assert self.weight_block is not None, f"{type(self).__name__} has block scales but no weight_block"
            block = self.weight_block[0]
            last = start // block + -(-size // block) == param.shape[0]  # a partial block ends the weight
            if start % block or (size % block and not last):
                raise ValueError(
                    f"a stacked shard of rows [{start}, {start + size}) cuts the {block}-row scale blocks of "
                    f"'{self.name}' weights; the checkpoint's stacked projections must be whole blocks"
                )
            return param.narrow(0, start // block, -(-size // block))
        return param.narrow(0, start, size)

    def checkpoint_name(self, name: str) -> str:
        """The name checkpoint tensor ``name`` (a full name, ``model.layers.0.self_attn.q_proj.weight_scale``)
        is loaded under: a format that stores a tensor under another name than the parameter it fills renames it
        here (the safetensors loader asks for every tensor).  Default: unchanged."""
        return name

    def tensor_kind(self, name: str) -> str:
        """How checkpoint tensor ``name`` (a parameter's name) splits: ``"weight"``, ``"bias"``,
        ``"channel_scale"`` (one per output row), ``"block_scale"`` (one per ``weight_block``) or
        ``"tensor_scale"`` (one for the whole weight).  Default: ``"bias"`` for names ending in bias, else
        ``"weight"``; methods with scales extend it."""
        return "bias" if name == "bias" or name.endswith("_bias") else "weight"

    # --- sharding ----------------------------------------------------------------
    def check_shard(self, layer_name: str, shard: Shard) -> None:
        """ValueError naming the layer and the sizes when ``shard`` cuts one of this method's weight blocks."""
        if self.weight_block is None:
            return
        block = self.weight_block[shard.dim]
        if shard.start % block or shard.size % block:
            axis = "output rows" if shard.dim == 0 else "input columns"
            raise ValueError(
                f"layer '{layer_name}': this rank's {axis} [{shard.start}, {shard.start + shard.size}) cut the "
                f"{self.weight_block[0]}x{self.weight_block[1]} blocks of its '{self.name}' weights "
                f"({shard.size} per rank is not a multiple of {block}); use a --tp-size / --ep-size whose share of "
                "the layer is a whole number of blocks"
            )

    def shard(self, layer: nn.Module, name: str, loaded: Loaded, shard: Shard) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (class docstring); reads only that part."""
        kind = self.tensor_kind(name)
        if kind == "weight":
            return take(loaded, shard.dim, shard.start, shard.size)
        if kind == "tensor_scale" or (shard.dim == 1 and kind in ("bias", "channel_scale")):
            return materialize(loaded)
        if kind in ("bias", "channel_scale"):
            return take(loaded, 0, shard.start, shard.size)
        if kind == "block_scale":
            assert self.weight_block is not None, f"{type(self).__name__} has block scales but no weight_block"
            block = self.weight_block[shard.dim]
            return take(loaded, shard.dim, shard.start // block, -(-shard.size // block))
        raise ValueError(f"{type(self).__name__}: unknown tensor kind {kind!r} for '{name}'")

    # --- compute -----------------------------------------------------------------
    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` of linear ``layer``, before ``layer.reduce``."""

    def apply_silu_mul_input(self, layer: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``apply(layer, silu(g) * u)`` for ``x = g || u`` in one kernel, or None (the caller composes)."""
        return None

    def input_group(self, layer: nn.Module) -> int:
        """The column group by which a producer kernel may hand linear ``layer`` its input quantized (a
        ``QuantizedInput`` to ``apply``, bit-equal to the method quantizing it itself), or 0: ``apply`` takes
        only model-dtype rows."""
        return 0

    def apply_norm_input(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        residual: Optional[torch.Tensor],
        norm_weight: torch.Tensor,
        eps: float,
        keep_normed: bool,
    ) -> Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """``(apply(layer, rmsnorm(x + residual)), x + residual, the normed rows if keep_normed)`` in one kernel,
        or None (the caller runs the norm, then ``apply``)."""
        return None

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """Linear ``layer``'s weight ``[out, in]`` as plain numbers (what ``apply`` multiplies by): the stored
        weight itself here; a method that stores it scaled returns it dequantized, in float32.  For code that
        reads a weight as a matrix (MLA's absorbed ``kv_b_proj``, docs/deepseek.md)."""
        return layer.weight

    @abstractmethod
    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of embedding ``layer``'s weight, in the compute dtype."""

    @abstractmethod
    def apply_moe(
        self,
        layer: nn.Module,
        runner: object,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        absent: bool = False,
        config_experts: Optional[int] = None,
    ) -> torch.Tensor:
        """The routed experts of MoE ``layer`` over ``x`` (``MoERunner.__call__``'s contract)."""


# --- registry ---------------------------------------------------------------------
_REGISTRY: dict[str, type[QuantMethod]] = {}
_LAZY_MODULES = {
    "unquantized": "kvship.engine.layers.quantization.unquantized",
    "fp8": "kvship.engine.layers.quantization.fp8",
    "compressed-tensors": "kvship.engine.layers.quantization.fp8",
}
UNQUANTIZED = "unquantized"


def add_weights(layer: nn.Module, params: dict[str, tuple[tuple[int, ...], torch.dtype]], loader: WeightLoader) -> None:
    """``create_weights``' common step: an empty, frozen parameter ``name`` of ``(shape, dtype)`` on ``layer`` for
    each entry, filled later by ``loader`` (the layer is being built: its quant method owns these parameters)."""
    for name, (shape, dtype) in params.items():
        p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        p.weight_loader = loader  # type: ignore[attr-defined]
        if name not in layer._parameters and hasattr(layer, name):  # a placeholder such as ``bias = None``
            delattr(layer, name)
        layer.register_parameter(name, p)


def register_quant_method(name: str) -> Callable[[type[QuantMethod]], type[QuantMethod]]:
    def deco(cls: type[QuantMethod]) -> type[QuantMethod]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def supported_quant_methods() -> list[str]:
    return sorted(set(_REGISTRY) | set(_LAZY_MODULES))


def get_quant_method(name: str, config: Optional["ModelConfig"] = None) -> QuantMethod:
    """A method by name, set up for a model of ``config`` when given (ValueError naming the supported ones for
    an unknown name)."""
    if name not in _REGISTRY and name in _LAZY_MODULES:
        importlib.import_module(_LAZY_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(f"unsupported quantization method '{name}'; supported: {supported_quant_methods()}")
    cls = _REGISTRY[name]
    return cls.from_config(config) if config is not None else cls()


def resolve_quantization(checkpoint_method: Optional[str], requested: Optional[str]) -> str:
    """The method a model runs with: config.json's ``quantization_config.quant_method`` (``checkpoint_method``)
    and ``--quantization`` (``requested``).  ValueError, naming every unsupported name and the supported ones,
    when either is not registered, or when both are given and differ; never a silent unquantized fallback."""
    known = supported_quant_methods()
    sources = [(requested, "--quantization"), (checkpoint_method, "config.json quantization_config.quant_method")]
    bad = [f"'{m}' ({where})" for m, where in sources if m is not None and m not in known]
    if bad:
        raise ValueError(
            f"unsupported quantization method {' and '.join(bad)}; supported: {known} "
            "(kvship does not load such weights as unquantized)"
        )
    if requested is not None and checkpoint_method is not None and requested != checkpoint_method:
        raise ValueError(
            f"--quantization '{requested}' does not match the checkpoint's quantization_config.quant_method "
            f"'{checkpoint_method}'"
        )
    return requested or checkpoint_method or UNQUANTIZED


def quant_method_for(config: "ModelConfig") -> QuantMethod:
    """The method for the weight-holding layers of a model of ``config`` (its resolved ``quantization``)."""
    return get_quant_method(config.quantization, config)
