"""Mixture-of-Experts decoders of the Llama family: Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral.

A block is the Llama block (``LlamaAttention``, RMSNorms, residuals) whose
MLP is, on sparse layers (``MoEConfig.is_sparse_layer``), a ``SparseMoeBlock``:
router ``gate`` (``[E, H]``) -> top-k -> ``FusedMoE`` (experts stacked as
``w13 [E, 2I, H]`` / ``w2 [E, H, I]``), plus Qwen2-MoE's sigmoid-gated shared
expert; other layers keep the dense ``LlamaMLP``.

Checkpoint names are Hugging Face's.  Mixtral's ``block_sparse_moe`` is read
as ``mlp`` and its ``w1``/``w3``/``w2`` as gate/up/down; every per-expert
tensor ``...mlp.experts.N.<proj>.weight`` goes into the stacked parameter
with shard ``(N, part)`` (``FusedMoE``'s weight loader).

Tensor parallelism (``tp_plan``): attention, dense and shared-expert MLPs and
the vocabulary split as in Llama; the router stays whole on every rank and
the experts are split by ``kvship.engine.parallel.ep`` (``--ep-size``:
experts over ranks, the rest of the split over each expert's width).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Iterable, Optional

import torch
from torch import nn

from kvship.engine.layers.linear import Linear
from kvship.engine.layers.moe.layer import FusedMoE
from kvship.engine.layers.quantization import quant_method_for
from kvship.engine.layers.rmsnorm import norm_then_linear
from kvship.engine.layers.side_stream import beside, partials_comm, side_stream_limit
from kvship.engine.mem.kv_scales import KV_SCALE_SUFFIXES
from kvship.engine.model_config import ModelConfig
from kvship.engine.models.llama import LlamaForCausalLM, LlamaMLP
from kvship.engine.models.registry import register_model
from kvship.engine.models.stage import LayerRange

# ``<prefix>.experts.<N>.<proj>.weight`` -> (prefix, expert, projection)
_EXPERT_RE = re.compile(
    r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.(weight(?:_scale_inv|_scale)?|input_scale)$"
)
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_PART_PARAM = {"gate": "w13_weight", "up": "w13_weight", "down": "w2_weight"}


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert): ``[T, H] -> [T, H]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        assert moe is not None
        if config.hidden_act != "silu":
            raise ValueError(f"MoE experts support hidden_act 'silu' only, got '{config.hidden_act}'")
        dt, qm = config.dtype, quant_method_for(config)
        # the router (and Qwen2-MoE's shared-expert gate) stay unquantized, as FP8 checkpoints keep them
        self.gate = Linear(config.hidden_size, moe.num_experts, dtype=dt)
        self.experts = FusedMoE(
            moe.num_experts,
            moe.top_k,
            config.hidden_size,
            moe.intermediate_size,
            moe.norm_topk_prob,
            dt,
            quant_method=qm,
        )
        self.has_shared_expert = moe.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = LlamaMLP(replace(config, intermediate_size=moe.shared_expert_intermediate_size))
            self.shared_expert_gate = Linear(config.hidden_size, 1, dtype=dt)
        self.side_stream_tokens = side_stream_limit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._experts(x, self.gate(x))

    # as LlamaMLP: the input may owe an all-reduce, the output's may be left to the caller (LlamaDecoderLayer)
    takes_pending = True

    def output_comm(self) -> Optional[Any]:
        """The all-reduce ``forward_normed(defer=True)`` leaves to the caller: the experts' (their ``all_reduce``
        dispatch), with a shared expert the one that sums both partial outputs; None for another dispatch."""
        if not self.has_shared_expert:
            return self.experts.reduce_comm
        apart, comm = partials_comm(self.shared_expert, self.experts)
        return comm if apart else None

    def forward_normed(
        self,
        norm: nn.Module,
        x: torch.Tensor,
        residual: torch.Tensor,
        pending: Optional[Any] = None,
        defer: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(norm(x + residual))`` and the new residual: the norm runs inside the router's GEMV at
        batch-1-sized decode (``rmsnorm.norm_then_linear``, ``pending`` as there), which also hands the experts the
        normalised rows.  ``defer`` (only where ``output_comm`` is not None): the experts' partial sum."""
        logits, residual, h = norm_then_linear(norm, self.gate, x, residual, keep_normed=True, pending=pending)
        if defer and not self.has_shared_expert:
            return self.experts.forward_partial(h, logits), residual
        return self._experts(h, logits, reduce=not defer), residual

    def _experts(self, x: torch.Tensor, logits: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The routed experts plus the gated shared expert; ``reduce=False`` (only where ``output_comm`` is not
        None): the sum of the two partial outputs, its all-reduce left to the caller."""
        if not self.has_shared_expert:
            return self.experts(x, logits)
        apart, comm = partials_comm(self.shared_expert, self.experts)
        if not apart:  # a dispatch that exchanges rows keeps its own collectives
            return self.experts(x, logits) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        # the gated shared expert on a side stream beside the routed experts (docs/deepseek.md, "Two streams");
        # under TP both leave partial sums (the gate scales each row: it commutes with the sum), all-reduced once
        shared, out = beside(
            lambda: torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.forward_partial(x),
            lambda: self.experts.forward_partial(x, logits),
            x,
            self.side_stream_tokens,
        )
        out = out + shared
        return comm.all_reduce(out) if comm is not None and reduce else out


@register_model("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family model whose sparse layers use ``SparseMoeBlock``; adds expert stacking to the loading."""

    # (parameter suffix, checkpoint suffix, shard id) of the fused attention / dense-MLP projections
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    # checkpoint name fragments renamed before mapping (Mixtral's MoE block)
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)
    # (KV-cache scales are read by the model runner for an FP8 pool: kvship.engine.mem.kv_scales)
    ignored_checkpoint_suffixes = ("rotary_emb.inv_freq",) + KV_SCALE_SUFFIXES
    tp_plan = {
        "embed_tokens": "vocab_embed",
        "self_attn": "attention",
        "qkv_proj": "qkv",
        "o_proj": "row",
        "gate_up_proj": "column",
        "down_proj": "row",
        "lm_head": "vocab_head",
    }

    def __init__(self, config: ModelConfig, layers: Optional[LayerRange] = None):
        if config.moe is None:
            raise ValueError(f"{config.architecture} config.json names no experts (num_experts / num_local_experts)")
        moe = config.moe
        super().__init__(
            config,
            mlp_for_layer=lambda i: SparseMoeBlock(config) if moe.is_sparse_layer(i) else LlamaMLP(config),
            layers=layers,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into parameters; returns ``name`` or ``name#shard`` filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            if ckpt_name.endswith(self.ignored_checkpoint_suffixes):
                continue
            tied = self.config.tie_word_embeddings
            if ckpt_name == "lm_head.weight" and tied:
                continue
            if not self.part.holds_checkpoint_tensor(ckpt_name, tied):
                continue  # another pipeline stage's tensor: never read
            name = ckpt_name
            for old, new in self.checkpoint_renames:
                name = name.replace(old, new)
            m = _EXPERT_RE.match(name)
            if m is not None:
                part = _EXPERT_PART[m.group(3)]
                # ``weight`` -> w13_weight, a quantized checkpoint's ``weight_scale_inv`` -> w13_weight_scale_inv,
                # ``input_scale`` -> w13_weight_input_scale
                suffix = m.group(4)
                param = _PART_PARAM[part] + (
                    suffix.removeprefix("weight") if suffix.startswith("weight") else "_" + suffix
                )
                pname, shard = f"{m.group(1)}.{param}", (int(m.group(2)), part)
            else:
                pname, shard = name, None
                for param_part, ckpt_part, sid in self.stacked_params_mapping:
                    if f".{ckpt_part}." in name:
                        pname, shard = name.replace(f".{ckpt_part}.", f".{param_part}."), sid
                        break
            _load_one(params, pname, tensor, shard, ckpt_name)
            loaded.add(pname if shard is None else f"{pname}#{_shard_key(shard)}")
        return loaded

    def expected_weights(self) -> set[str]:
        """What ``load_weights`` must report for a complete checkpoint."""
        out: set[str] = set()
        stacked: dict[str, list] = {}
        for p, _, sid in self.stacked_params_mapping:
            stacked.setdefault(p, []).append(sid)
        moe_params: dict[str, list] = {}
        for mname, module in self.named_modules():
            if isinstance(module, FusedMoE):
                for attr, shards in module.expected_shards().items():
                    moe_params[f"{mname}.{attr}"] = shards
        for name, _ in self.named_parameters():
            part = name.split(".")[-2]
            if name in moe_params:
                out.update(f"{name}#{_shard_key(s)}" for s in moe_params[name])
            elif part in stacked:
                out.update(f"{name}#{s}" for s in stacked[part])
            else:
                out.add(name)
        return out


def _shard_key(shard: object) -> str:
    return ".".join(map(str, shard)) if isinstance(shard, tuple) else str(shard)


def _load_one(params: dict, pname: str, tensor: torch.Tensor, shard: object, ckpt_name: str) -> None:
    param = params.get(pname)
    if param is None:
        raise ValueError(f"checkpoint tensor '{ckpt_name}' matches no parameter of this model")
    try:
        if shard is None:  # the checkpoint's dtype as it is: the layer's quantization method converts
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard)
    except ValueError as e:
        raise ValueError(f"loading '{ckpt_name}': {e}") from None
