"""The Llama family of dense decoders: Llama (incl. llama3 RoPE scaling and
SmolLM2), Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

One block = RMSNorm -> attention (fused qkv, GQA, RoPE) -> residual ->
RMSNorm -> SwiGLU MLP (fused gate/up) -> residual.  The differences between
the architectures are all ModelConfig flags, so one class serves them all.
Parameter names follow Hugging Face except for the two fused projections;
``stacked_params_mapping`` says how checkpoint tensors land in them.
Built with ``layers=LayerRange(...)`` (``kvship.engine.models.stage``) a
model holds only that part of the decoder: ``forward`` then takes the
residual stream of the part before it (``stage_input``) unless it starts at
layer 0, and returns a ``StageOutput`` unless it ends at the last layer.  Every
weight-holding layer gets the model's quantization method
(``quant_method_for(config)``); what it does is the method's business.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from kvship.engine.forward_batch import ForwardBatch, LogitsOutput, StageOutput
from kvship.engine.layers.activation import GatedActivation
from kvship.engine.layers.attention import Attention
from kvship.engine.layers.embedding import LMHead, VocabEmbedding
from kvship.engine.layers.linear import Linear, StackedLinear, gated_linear
from kvship.engine.layers.quantization import quant_method_for
from kvship.engine.layers.rmsnorm import RMSNorm, norm_then_linear
from kvship.engine.layers.rotary import RotaryEmbedding
from kvship.engine.mem.kv_scales import KV_SCALE_SUFFIXES
from kvship.engine.model_config import ModelConfig
from kvship.engine.models.registry import register_model
from kvship.engine.models.stage import LayerRange


class LlamaAttention(nn.Module):
    """``layer_id``: the layer's index in the KV pool (its index inside the model's ``LayerRange``)."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        dt, qm = config.dtype, quant_method_for(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.qkv_proj = StackedLinear(
            config.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=config.attention_bias,
            dtype=dt,
            quant_method=qm,
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias, dtype=dt, quant_method=qm)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dt)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dt)
        self.qk_norm = config.qk_norm
        # shared by all layers; a list keeps it out of this module's state dict
        self._rotary = [rotary]
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        norm: RMSNorm,
        forward_batch: ForwardBatch,
        pending: Optional[Any] = None,
        defer: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's input norm (``norm`` over ``hidden + residual``) and attention: ``(output, residual)``.
        ``pending``: the all-reduce ``hidden`` still owes (``norm_then_linear``); ``defer``: the output is
        ``o_proj``'s partial sum, its all-reduce left to the caller (``o_proj.reduce_comm``)."""
        qkv, residual, _ = norm_then_linear(norm, self.qkv_proj, hidden, residual, pending=pending)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn.rope_and_forward(
            self._rotary[0],
            positions,
            q,
            k,
            v.view(-1, self.num_kv_heads, self.head_dim),
            forward_batch,
            (self.q_norm, self.k_norm) if self.qk_norm else None,
            # a decode step may hand o_proj its input already quantized (block-128 FP8: docs/quantization.md)
            self.o_proj.quant_method.input_group(self.o_proj),
        )
        return (self.o_proj.forward_partial(out) if defer else self.o_proj(out)), residual


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        dt, qm = config.dtype, quant_method_for(config)
        self.gate_up_proj = StackedLinear(
            config.hidden_size,
            {0: config.intermediate_size, 1: config.intermediate_size},
            bias=config.mlp_bias,
            dtype=dt,
            quant_method=qm,
        )
        self.down_proj = Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias, dtype=dt, quant_method=qm
        )
        self.act = GatedActivation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # down_proj(act(gate) * up): one kernel on CUDA at batch 1 (the activation inside the GEMV's input)
        return gated_linear(self.down_proj, self.act, self.gate_up_proj(x))

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` without ``down_proj``'s all-reduce: this rank's partial output (``output_comm`` owed)."""
        return gated_linear(self.down_proj, self.act, self.gate_up_proj(x), reduce=False)

    # ``forward_normed`` takes an input that still owes an all-reduce and can leave its own output's to the caller
    takes_pending = True

    def forward_normed(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor, pending: Optional[Any] = None, defer: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(norm(x + residual))`` and the new residual (``rmsnorm.norm_then_linear``, ``pending`` as
        there); ``defer``: the output is ``down_proj``'s partial sum (``down_proj.reduce_comm`` owed)."""
        gate_up, residual, _ = norm_then_linear(norm, self.gate_up_proj, x, residual, pending=pending)
        return gated_linear(self.down_proj, self.act, gate_up, reduce=not defer), residual

    def output_comm(self) -> Optional[Any]:
        """The all-reduce ``forward_normed(defer=True)`` leaves to the caller: ``down_proj``'s (row-parallel)."""
        return self.down_proj.reduce_comm


class LlamaDecoderLayer(nn.Module):
    """Attention then MLP, pre-norm with a carried residual; ``mlp`` replaces the dense MLP (MoE models) and
    takes its norm like ``LlamaMLP.forward_normed``."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        mlp: Optional[nn.Module] = None,
        kv_layer_id: Optional[int] = None,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id if kv_layer_id is None else kv_layer_id, rotary)
        self.mlp = LlamaMLP(config) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    # the input may still owe a row-parallel layer's all-reduce (``pending``; ``LlamaModel.run_layers``)
    takes_pending = True

    def output_comm(self) -> Optional[Any]:
        """The communicator whose all-reduce this layer's output can leave to the next layer (``defer``): the
        MLP's (``output_comm``: a row-parallel ``down_proj``, an ``all_reduce`` expert dispatch); None where the
        output is always whole (one rank, other dispatches, MLPs that take no ``pending``)."""
        return self.mlp.output_comm() if getattr(self.mlp, "takes_pending", False) else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
        pending: Optional[Any] = None,
        defer: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` out; ``pending``: the all-reduce ``hidden`` still owes; ``defer``: leave this
        layer's own output's (``output_comm``) to the caller.  Under tensor parallelism the attention's
        all-reduce always meets the MLP's norm here, so the push kernel runs both (docs/parallel.md)."""
        takes = getattr(self.mlp, "takes_pending", False)
        o_comm = self.self_attn.o_proj.reduce_comm if takes else None
        hidden, residual = self.self_attn(
            positions, hidden, residual, self.input_layernorm, forward_batch, pending=pending, defer=o_comm is not None
        )
        if not takes:
            return self.mlp.forward_normed(self.post_attention_layernorm, hidden, residual)
        return self.mlp.forward_normed(self.post_attention_layernorm, hidden, residual, pending=o_comm, defer=defer)


class AbsentLayer(nn.Module):
    """The place of a decoder layer another ``LayerRange`` holds: no parameters, never run."""


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm; ``mlp_for_layer(i)`` gives layer ``i`` another MLP (MoE models).
    ``layers``: the part built (module docstring); ``self.layers[i]`` is layer ``i`` of the whole model."""

    def __init__(
        self,
        config: ModelConfig,
        mlp_for_layer: Optional[Callable[[int], nn.Module]] = None,
        layers: Optional[LayerRange] = None,
    ):
        super().__init__()
        part = self.part = layers or LayerRange.whole(config.num_hidden_layers)
        if part.num_layers != config.num_hidden_layers:
            raise ValueError(f"layer range of {part.num_layers} layers for a model of {config.num_hidden_layers}")
        if part.first or (part.last and config.tie_word_embeddings):  # the last range's tied LM head reads it
            self.embed_tokens = VocabEmbedding(
                config.vocab_size, config.hidden_size, config.dtype, quant_method=quant_method_for(config)
            )
        self.rotary_emb = self.build_rotary(config)
        self.layers = nn.ModuleList(
            self.build_layer(config, i, mlp_for_layer) if i in part else AbsentLayer()
            for i in range(config.num_hidden_layers)
        )
        if part.last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def build_rotary(self, config: ModelConfig) -> nn.Module:
        """The RoPE table every layer shares (another model family's decoder returns its own)."""
        return RotaryEmbedding(config.head_dim, max(config.context_len, 1), config.rope_theta, config.rope_scaling)

    def build_layer(
        self, config: ModelConfig, i: int, mlp_for_layer: Optional[Callable[[int], nn.Module]]
    ) -> nn.Module:
        """Decoder layer ``i`` of the whole model (this part's KV layer ``i - part.start``)."""
        mlp = None if mlp_for_layer is None else mlp_for_layer(i)
        return LlamaDecoderLayer(config, i, self.rotary_emb, mlp, kv_layer_id=i - self.part.start)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.forward_with_aux(input_ids, positions, forward_batch, ())[0]

    def forward_with_aux(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch, aux_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The final normed hidden states and the outputs of layers ``aux_layers`` (EAGLE-3's inputs)."""
        hidden, residual, aux = self.run_layers(input_ids, positions, forward_batch, None, aux_layers)
        hidden, _ = self.norm(hidden, residual)
        return hidden, aux

    def run_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        stage_input: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], list[torch.Tensor]]:
        """This part's layers: ``(hidden, residual, aux)`` before the final norm.  The first part embeds
        ``input_ids``; the others continue from ``stage_input`` = the previous part's ``(hidden, residual)``."""
        part = self.part
        if part.first:
            hidden, residual = self.embed_tokens(input_ids), None
        elif stage_input is None:
            raise ValueError(f"layers [{part.start}, {part.end}) continue a residual stream: pass stage_input")
        else:
            hidden, residual = stage_input
        aux = []
        pending = None  # the all-reduce the previous layer left to this one (LlamaDecoderLayer.forward's ``defer``)
        for i in range(part.start, part.end):
            layer = self.layers[i]
            if getattr(layer, "takes_pending", False):
                comm = layer.output_comm()
                nxt = self.layers[i + 1] if i + 1 < part.end else None
                defer = comm is not None and i not in aux_layers and getattr(nxt, "takes_pending", False)
                hidden, residual = layer(positions, hidden, residual, forward_batch, pending=pending, defer=defer)
                pending = comm if defer else None
            else:
                hidden, residual = layer(positions, hidden, residual, forward_batch)
            if i in aux_layers:
                aux.append(hidden + residual)
        return hidden, residual, aux


@register_model("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
class LlamaForCausalLM(nn.Module):
    # (parameter suffix, checkpoint suffix, shard id)
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    # checkpoint tensors that are not parameters here
    # (KV-cache scales are read by the model runner for an FP8 pool: kvship.engine.mem.kv_scales)
    ignored_checkpoint_suffixes = ("rotary_emb.inv_freq",) + KV_SCALE_SUFFIXES
    # tensor parallelism, applied after construction (kvship.engine.parallel.layers): module suffix -> style
    tp_plan = {
        "embed_tokens": "vocab_embed",
        "self_attn": "attention",
        "qkv_proj": "qkv",
        "o_proj": "row",
        "gate_up_proj": "column",
        "down_proj": "row",
        "lm_head": "vocab_head",
    }

    def __init__(
        self,
        config: ModelConfig,
        mlp_for_layer: Optional[Callable[[int], nn.Module]] = None,
        layers: Optional[LayerRange] = None,
    ):
        super().__init__()
        self.config = config
        self.model = self.build_decoder(config, mlp_for_layer, layers)
        self.part = self.model.part
        if self.part.last:
            self.lm_head = LMHead(
                config.vocab_size,
                config.hidden_size,
                config.dtype,
                tied=self.model.embed_tokens if config.tie_word_embeddings else None,
                quant_method=quant_method_for(config),
            )

    def build_decoder(
        self, config: ModelConfig, mlp_for_layer: Optional[Callable[[int], nn.Module]], layers: Optional[LayerRange]
    ) -> nn.Module:
        """The decoder stack (``LlamaModel``'s interface: ``run_layers``, ``norm``, ``embed_tokens``, ``part``);
        a model family with other blocks (kvship.engine.models.deepseek) returns its own."""
        return LlamaModel(config, mlp_for_layer, layers)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        stage_input: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> LogitsOutput | StageOutput:
        """Logits, or (a part that does not end the model) its residual stream as a ``StageOutput``."""
        if not self.part.is_whole:
            if forward_batch.capture_hidden is not None:
                raise ValueError("hidden-state capture needs the whole model (no layer range)")
            hidden, residual, _ = self.model.run_layers(input_ids, positions, forward_batch, stage_input)
            if not self.part.last:
                return StageOutput(hidden, residual)
            hidden, _ = self.model.norm(hidden, residual)
            return self.logits(hidden, forward_batch)
        capture = forward_batch.capture_hidden
        if capture is None:
            hidden = self.model(input_ids, positions, forward_batch)
            captured = None
        else:  # speculative drafting reads the target's hidden states (docs/speculative.md)
            hidden, aux = self.model.forward_with_aux(input_ids, positions, forward_batch, capture)
            captured = torch.cat(aux, dim=-1) if capture else hidden
        return self.logits(hidden, forward_batch, captured)

    def logits(
        self, hidden: torch.Tensor, forward_batch: ForwardBatch, captured: Optional[torch.Tensor] = None
    ) -> LogitsOutput:
        """The LM head over the final hidden states' rows ``forward_batch.logits_indices`` (default: each
        request's last new token); the prefill graphs (engine/prefill_graph_runner.py) call it after their
        replay of ``self.model``."""
        idx = forward_batch.logits_indices
        if idx is None:
            idx = forward_batch.default_logits_indices()
        return LogitsOutput(next_token_logits=self.lm_head(hidden.index_select(0, idx)), hidden_states=captured)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into parameters; returns names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        tied = self.config.tie_word_embeddings
        for name, tensor in weights:
            if name.endswith(self.ignored_checkpoint_suffixes):
                continue
            if name == "lm_head.weight" and tied:
                continue  # some tied checkpoints store the copy anyway
            if not self.part.holds_checkpoint_tensor(name, tied):
                continue  # another pipeline stage's tensor: never read
            for param_part, ckpt_part, shard in self.stacked_params_mapping:
                if f".{ckpt_part}." in name:
                    pname = name.replace(f".{ckpt_part}.", f".{param_part}.")
                    self._load_one(params, pname, tensor, shard, name)
                    loaded.add(f"{pname}#{shard}")
                    break
            else:
                self._load_one(params, name, tensor, None, name)
                loaded.add(name)
        return loaded

    @staticmethod
    def _load_one(params: dict, pname: str, tensor: torch.Tensor, shard: object, ckpt_name: str) -> None:
        param = params.get(pname)
        if param is None:
            raise ValueError(f"checkpoint tensor '{ckpt_name}' matches no parameter of this model")
        try:
            # the checkpoint's dtype as it is: the layer's quantization method converts (``QuantMethod.load``)
            param.weight_loader(param, tensor, shard) if shard is not None else param.weight_loader(param, tensor)
        except ValueError as e:
            raise ValueError(f"loading '{ckpt_name}': {e}") from None

    def expected_weights(self) -> set[str]:
        """What ``load_weights`` must report for a complete checkpoint."""
        out: set[str] = set()
        stacked = {p: [] for p, _, _ in self.stacked_params_mapping}
        for p, _, shard in self.stacked_params_mapping:
            stacked[p].append(shard)
        for name, _ in self.named_parameters():
            part = name.split(".")[-2]
            if part in stacked:
                out.update(f"{name}#{s}" for s in stacked[part])
            else:
                out.add(name)
        return out
