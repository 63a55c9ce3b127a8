"""Tensor-parallel layers, applied to a built model (gpt-fast style).

A model class declares ``tp_plan``: module-name suffix -> style.  After the
model is built (on the meta device, so no full-size weight is ever
allocated), ``apply_tensor_parallel(model, tp)`` swaps each planned module for
its parallel version with this rank's parameter shapes and weight loaders that
take only this rank's block of a checkpoint tensor (``take``: a
``CheckpointSlice`` is read only there).  Model code is unchanged.

Styles (Megatron's split, as SGLang and vLLM do it):

=================  =========================================================
``qkv``            column-parallel fused q/k/v: rank r keeps query heads
                   ``[r*H/tp, (r+1)*H/tp)`` and their KV heads; when
                   ``tp > num_kv_heads`` each KV head is replicated on
                   ``tp / num_kv_heads`` ranks
``attention``      the attention module's head counts become the local ones
                   (the module must have ``num_heads``, ``num_kv_heads``,
                   ``head_dim``, ``q_size``, ``kv_size`` and ``attn``: an
                   ``Attention``)
``column``         column-parallel stacked linear (fused gate/up): every
                   shard split evenly along the output dim
``row``            row-parallel linear (o_proj, down_proj): input dim split,
                   outputs summed by an all-reduce (bias added once)
``column_linear``  column-parallel unstacked linear: output rows split evenly
                   (MLA's ``q_b_proj`` / ``kv_b_proj``: rows grouped by head,
                   so an even split is a split by heads)
``mla_qkv_a``      MLA's fused first projection (``q`` then ``kv_a``): the
                   latent part ``kv_a`` replicated on every rank; ``q``
                   replicated under q LoRA, else split by heads
``mla_attention``  an MLA module's head count becomes the local one (it must
                   have ``num_heads`` and ``spec``: an ``MLALayerSpec``)
``vocab_embed``    vocabulary-parallel embedding: rows split (padded to a
                   multiple of tp), lookups outside the shard are zero, all-reduce
``vocab_head``     vocabulary-parallel LM head (tied: the parallel
                   embedding's shard): local logits all-gathered, so every
                   rank samples from the same full ``[T, vocab]`` logits
=================  =========================================================

``check_tp_divisible(config, tp_size)`` raises a clear ValueError when the
model's heads or MLP width do not split over ``tp_size`` ranks; it is called
at startup before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import nn

from kvship.engine.distributed.communicator import Communicator
from kvship.engine.layers.attention import Attention
from kvship.engine.layers.embedding import LMHead, VocabEmbedding
from kvship.engine.layers.linear import Linear, StackedLinear, load_checked
from kvship.engine.layers.quantization import QuantMethod, Shard
from kvship.engine.layers.rotary import RotaryEmbedding
from kvship.engine.loaders.lazy import Loaded


@dataclass(frozen=True)
class HeadSplit:
    """One rank's attention heads: counts and first head index in the full model."""

    num_heads: int
    num_kv_heads: int
    q_head_start: int
    kv_head_start: int


def head_split(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadSplit:
    """This rank's query and KV heads (ValueError when they do not split over ``tp_size``)."""
    if num_heads % tp_size:
        raise ValueError(
            f"--tp-size {tp_size} does not divide the model's {num_heads} attention heads; "
            f"use a tp size that divides {num_heads}"
        )
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"--tp-size {tp_size} does not divide the model's {num_kv_heads} KV heads; "
                f"use a divisor of {num_kv_heads}, or a multiple of it that divides {num_heads}"
            )
        kv_local = num_kv_heads // tp_size
        kv_start = rank * kv_local
    else:
        if tp_size % num_kv_heads:
            raise ValueError(
                f"--tp-size {tp_size} is larger than the model's {num_kv_heads} KV heads but not a multiple of it: "
                "KV heads can only be replicated evenly"
            )
        kv_local = 1
        kv_start = rank // (tp_size // num_kv_heads)
    q_local = num_heads // tp_size
    return HeadSplit(q_local, kv_local, rank * q_local, kv_start)


def check_tp_divisible(config: Any, tp_size: int) -> None:
    """ValueError with a clear message unless ``config``'s model splits over ``tp_size`` ranks."""
    head_split(config.num_attention_heads, config.num_key_value_heads, tp_size, 0)
    if config.intermediate_size % tp_size:
        raise ValueError(
            f"--tp-size {tp_size} does not divide the model's MLP width (intermediate_size {config.intermediate_size})"
        )


def vocab_shard(vocab_size: int, tp_size: int, rank: int) -> tuple[int, int, int]:
    """(first row, rows per rank, real rows on this rank): the vocabulary padded to a multiple of tp."""
    per = -(-vocab_size // tp_size)
    start = rank * per
    return start, per, max(0, min(per, vocab_size - start))


# --- layers -------------------------------------------------------------------------
class ColumnParallelStackedLinear(StackedLinear):
    """A ``StackedLinear`` holding this rank's rows of every shard; ``ranges`` maps a shard id
    to (first row, rows) in the checkpoint tensor."""

    def __init__(
        self,
        input_size: int,
        ranges: dict[object, tuple[int, int]],
        bias: bool,
        dtype: torch.dtype,
        quant_method: QuantMethod | None = None,
        name: str = "",
    ):
        super().__init__(input_size, {sid: n for sid, (_, n) in ranges.items()}, bias, dtype, quant_method)
        self.source_ranges = dict(ranges)
        for sid, (start, n) in ranges.items():
            self.quant_method.check_shard(f"{name} ({sid})" if name else str(sid), Shard(0, start, n))

    def _load_shard(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if shard_id not in self.source_ranges:
            raise ValueError(f"unknown shard {shard_id!r}; this layer stacks {list(self.source_ranges)}")
        start, n = self.source_ranges[shard_id]
        block = self.quant_method.shard(self, self._param_name(param), loaded, Shard(0, start, n))
        super()._load_shard(param, block, shard_id)


class ColumnParallelLinear(Linear):
    """``y = x W_r^T + b_r``: this rank's output rows ``[out_start, out_start + output_size)``, no collective."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        out_start: int,
        quant_method: QuantMethod | None = None,
        name: str = "",
    ):
        super().__init__(input_size, output_size, bias=bias, dtype=dtype, quant_method=quant_method)
        self.out_start = out_start
        self.quant_method.check_shard(name, Shard(0, out_start, output_size))

    def _load_whole(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter of shape {tuple(param.shape)} is not stacked; got shard {shard_id!r}")
        name = self._param_name(param)
        block = self.quant_method.shard(self, name, loaded, Shard(0, self.out_start, self.output_size))
        load_checked(self, name, param.data, block, "shape mismatch")


class RowParallelLinear(Linear):
    """``y = all_reduce(x_r W_r^T) + b``: this rank's input columns ``[in_start, in_start + input_size)``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        tp: Communicator,
        in_start: int,
        quant_method: QuantMethod | None = None,
        name: str = "",
    ):
        super().__init__(input_size, output_size, bias=bias, dtype=dtype, quant_method=quant_method)
        self.tp = tp
        self.in_start = in_start
        self.quant_method.check_shard(name, Shard(1, in_start, input_size))

    def _load_whole(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter of shape {tuple(param.shape)} is not stacked; got shard {shard_id!r}")
        name = self._param_name(param)
        if name == "bias" and self.tp.rank != 0:  # added once: the other ranks' partial sums carry no bias
            with torch.no_grad():
                param.zero_()
            return
        block = self.quant_method.shard(self, name, loaded, Shard(1, self.in_start, self.input_size))
        load_checked(self, name, param.data, block, "shape mismatch")

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(y)

    @property
    def reduce_comm(self) -> Communicator:
        return self.tp


def _load_vocab_rows(layer: nn.Module, param: nn.Parameter, loaded: Loaded, shard_id: object, start: int, real: int):
    """Rows ``[start, start + real)`` of a vocabulary-sized checkpoint tensor into ``param``'s first rows; the
    padding rows past the vocabulary are zero."""
    if shard_id is not None:
        raise ValueError(f"vocabulary-parallel weight is not stacked; got shard {shard_id!r}")
    with torch.no_grad():
        param.zero_()  # padding rows past the vocabulary
    if real:
        block = layer.quant_method.shard(layer, "weight", loaded, Shard(0, start, real))
        if tuple(block.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"shape mismatch: parameter rows {tuple(param.shape[1:])} vs {tuple(block.shape[1:])}")
        load_checked(layer, "weight", param.data[:real], block, "shape mismatch")


class VocabParallelEmbedding(VocabEmbedding):
    """Rows ``[start, start + per)`` of the (padded) vocabulary; other ids look up zeros, then all-reduce."""

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: Communicator, quant_method: QuantMethod | None
    ):
        start, per, real = vocab_shard(vocab_size, tp.size, tp.rank)
        super().__init__(per, hidden_size, dtype, quant_method)
        self.vocab_size = vocab_size
        self.tp = tp
        self.start, self.per_rank, self.real_rows = start, per, real

    def _load_whole(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        _load_vocab_rows(self, param, loaded, shard_id, self.start, self.real_rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        out = self.quant_method.embed(self, local.masked_fill(~inside, 0))
        out.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class VocabParallelLMHead(LMHead):
    """Local logits for this rank's vocabulary rows, all-gathered to ``[T, vocab]`` float32 on every rank."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        tp: Communicator,
        tied: VocabParallelEmbedding | None,
        quant_method: QuantMethod | None = None,
    ):
        start, per, real = vocab_shard(vocab_size, tp.size, tp.rank)
        super().__init__(per, hidden_size, dtype, tied, quant_method)
        self.vocab_size = vocab_size
        self.tp = tp
        self.start, self.real_rows = start, real

    def _load_whole(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        _load_vocab_rows(self, param, loaded, shard_id, self.start, self.real_rows)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.quant_method.apply(self.weight_holder(), hidden)
        return self.tp.all_gather(local)[..., : self.vocab_size].float()


# --- styles -------------------------------------------------------------------------
# (module, its name in the model, model config, group, modules replaced so far by id) -> this rank's module
Style = Callable[[nn.Module, str, Any, Communicator, dict], nn.Module]


def _qkv(m: nn.Module, name: str, config: Any, tp: Communicator, replaced: dict) -> nn.Module:
    if not isinstance(m, StackedLinear) or set(m.shard_offsets) != {"q", "k", "v"}:
        raise TypeError(f"style 'qkv' needs a StackedLinear with q/k/v shards, got {type(m).__name__}")
    d = config.head_dim
    s = head_split(config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank)
    ranges = {
        "q": (s.q_head_start * d, s.num_heads * d),
        "k": (s.kv_head_start * d, s.num_kv_heads * d),
        "v": (s.kv_head_start * d, s.num_kv_heads * d),
    }
    return ColumnParallelStackedLinear(m.input_size, ranges, m.bias is not None, m.params_dtype, m.quant_method, name)


def _attention(m: nn.Module, name: str, config: Any, tp: Communicator, replaced: dict) -> nn.Module:
    s = head_split(config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank)
    old: Attention = m.attn
    m.num_heads, m.num_kv_heads = s.num_heads, s.num_kv_heads
    m.q_size, m.kv_size = s.num_heads * m.head_dim, s.num_kv_heads * m.head_dim
    spec = old.spec
    m.attn = Attention(spec.layer_id, s.num_heads, s.num_kv_heads, spec.head_dim, spec.scaling)
    return m


def _column(m: nn.Module, name: str, config: Any, tp: Communicator, replaced: dict) -> nn.Module:
    if not isinstance(m, StackedLinear):
        raise TypeError(f"style 'column' needs a StackedLinear, got {type(m).__name__}")
    ranges = {}
    for sid, (_, size) in m.shard_offsets.items():
        if size % tp.size:
            raise ValueError(f"--tp-size {tp.size} does not divide a projection of width {size}")
        per = size // tp.size
        ranges[sid] = (tp.rank * per, per)
    return ColumnParallelStackedLinear(m.input_size, ranges, m.bias is not None, m.params_dtype, m.quant_method, name)


def _row(m: nn.Module, name: str, config: Any, tp: Communicator, replaced: dict) -> nn.Module:
    if not isinstance(m, Linear) or isinstance(m, StackedLinear):
        raise TypeError(f"style 'row' needs an unstacked Linear, got {type(m).__name__}")
    if m.input_size % tp.size:
        raise ValueError(f"--tp-size {tp.size} does not divide a projection input of width {m.input_size}")
    per = m.input_size // tp.size
    return RowParallelLinear(
        per, m.output_size, m.bias is not None, m.params_dtype, tp, tp.rank * per, m.quant_method, name
    )


def _column_linear(m: nn.Module, name: str, config: Any, tp: Communicator, replaced: dict) -> nn.Module:
    if not isinstance(m, Linear) or isinstance(m, StackedLinear):
        raise TypeError(f"style 'column_linear' needs an unstacked Linear, got {type(m).__name__}")
    if m.output_size % tp.size:
        raise ValueError(f"--tp-size {tp.size} does not divide a projection of width {m.output_size}")
    per = m.output_size // tp.size
    return ColumnParallelLinear(
        m.input_size, per, m.bias is not None, m.params_dtype, tp.rank * per, m.quant_method, name
    )


def _mla_qkv_a(m: nn.Module, name: str, config: Any, tp: Communicator, replaced: dict) -> nn.Module:
    if not isinstance(m, StackedLinear) or set(m.shard_offsets) != {"q", "kv_a"}:
        raise TypeError(f"style 'mla_qkv_a' needs a StackedLinear with q/kv_a shards, got {type(m).__name__}")
    mla = config.mla
    local = head_split(config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank)
    q_rows = m.shard_offsets["q"][1]
    if mla.q_lora_rank is None:  # the whole q_proj: this rank's heads
        width = local.num_heads * mla.qk_head_dim
        q_range = (local.q_head_start * mla.qk_head_dim, width)
    else:  # q_a_proj feeds every head: replicated
        q_range = (0, q_rows)
    ranges = {"q": q_range, "kv_a": (0, m.shard_offsets["kv_a"][1])}
    return ColumnParallelStackedLinear(m.input_size, ranges, m.bias is not None, m.params_dtype, m.quant_method, name)


def _mla_attention(m: nn.Module, name: str, config: Any, tp: Communicator, replaced: dict) -> nn.Module:
    local = head_split(config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank)
    m.num_heads = local.num_heads
    m.spec = replace(m.spec, num_heads=local.num_heads)
    if config.mla.q_lora_rank is None:  # q_proj sliced by heads (style mla_qkv_a): its width shrinks with them
        m.q_width = local.num_heads * config.mla.qk_head_dim
    return m


def _vocab_embed(m: nn.Module, name: str, config: Any, tp: Communicator, replaced: dict) -> nn.Module:
    return VocabParallelEmbedding(m.vocab_size, m.hidden_size, m.weight.dtype, tp, m.quant_method)


def _vocab_head(m: nn.Module, name: str, config: Any, tp: Communicator, replaced: dict) -> nn.Module:
    tied = None
    if m.tied:
        tied = replaced.get(id(m._tied[0]))
        if not isinstance(tied, VocabParallelEmbedding):
            raise TypeError("a tied LM head needs its embedding planned as 'vocab_embed' (and listed before it)")
    weight = m.get_weight()
    return VocabParallelLMHead(m.vocab_size, weight.shape[1], weight.dtype, tp, tied, m.quant_method)


STYLES: dict[str, Style] = {
    "qkv": _qkv,
    "attention": _attention,
    "column": _column,
    "row": _row,
    "column_linear": _column_linear,
    "mla_qkv_a": _mla_qkv_a,
    "mla_attention": _mla_attention,
    "vocab_embed": _vocab_embed,
    "vocab_head": _vocab_head,
}


def apply_tensor_parallel(model: nn.Module, tp: Communicator) -> nn.Module:
    """Replace ``model``'s planned modules (its ``tp_plan``) by their parallel versions, in place.

    Call it on a freshly built model, before loading weights: the new modules
    have empty parameters of this rank's shapes.
    """
    plan: dict[str, str] = type(model).tp_plan
    unknown = set(plan.values()) - set(STYLES)
    if unknown:
        raise ValueError(f"unknown tensor-parallel styles {sorted(unknown)} in {type(model).__name__}.tp_plan")
    check_tp_divisible(model.config, tp.size)
    replaced: dict[int, nn.Module] = {}
    for name, module in list(model.named_modules()):
        style = next((s for suffix, s in plan.items() if name == suffix or name.endswith("." + suffix)), None)
        if style is None:
            continue
        new = STYLES[style](module, name, model.config, tp, replaced)
        replaced[id(module)] = new
        if new is not module:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    return model


def build_parallel_model(
    cls: type[nn.Module],
    config: Any,
    tp: Communicator,
    device: str | torch.device,
    on_meta: bool | None = None,
    ep: tuple[Any, ...] = (1, "all_reduce"),
    layers: Any = None,
) -> nn.Module:
    """``cls(config)`` (``cls(config, layers=layers)``: a pipeline stage's part) made tensor-parallel with only this rank's (empty) parameters on ``device``.

    On CUDA the model is built on the meta device, so no full-size weight is
    ever allocated, then moved with ``to_empty`` (the RoPE tables, our layers'
    only buffers, are recomputed on ``device``).  On CPU it is built in place:
    the full-size ``torch.empty`` parameters it replaces are never written,
    so their pages are never touched (and the meta device's first use costs
    seconds of imports).  ``on_meta`` overrides that choice (tests).
    MoE experts are split over the ranks too, ``ep = (ep size, dispatch[, redundant experts, two-batch overlap])``
    (``kvship.engine.parallel.ep.apply_expert_parallel``).
    """
    from kvship.engine.parallel.ep import apply_expert_parallel
    from kvship.engine.parallel.eplb import apply_eplb

    ep_size, dispatch, redundant, overlap = (*ep, 0, False)[:4]

    def parallel(model: nn.Module) -> nn.Module:
        model = apply_tensor_parallel(model, tp)
        if redundant:  # EPLB's layers (docs/parallel.md, "Expert load balancing")
            return apply_eplb(model, tp, ep_size, dispatch, redundant, overlap)
        return apply_expert_parallel(model, tp, ep_size, dispatch, overlap)

    kwargs = {} if layers is None else {"layers": layers}
    device = torch.device(device)
    if dispatch == "static" and ep_size > 1:  # its exchange over peer GPU memory where the group can (collective)
        tp.enable_peer_exchange(device)
    if not (device.type == "cuda" if on_meta is None else on_meta):
        with device:
            return parallel(cls(config, **kwargs))
    with torch.device("meta"):
        model = parallel(cls(config, **kwargs))
    loaders = {name: p.weight_loader for name, p in model.named_parameters()}
    model.to_empty(device=device)  # new Parameter objects: give them their loaders back
    for name, p in model.named_parameters():
        p.weight_loader = loaders[name]
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.rebuild_table_()
    return model
