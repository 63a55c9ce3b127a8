"""DeepSeek-V2 / V2-Lite / V3 (and models of the same architecture): MLA attention and DeepSeekMoE
(docs/deepseek.md).

One block = RMSNorm -> MLA -> residual -> RMSNorm -> MLP -> residual, where
the MLP is dense on layers ``< first_k_dense_replace`` and DeepSeekMoE on the
others.

**MLA** (``MLAAttention``): ``fused_qkv_a_proj`` stacks the query's first
projection (``q_a_proj`` with q LoRA, else the whole ``q_proj``) and
``kv_a_proj_with_mqa`` (the compressed KV ``c`` and the shared RoPE key
``k_pe``); with q LoRA the query continues through ``q_a_layernorm`` and
``q_b_proj``.  ``c`` is normalised (``kv_a_layernorm``), ``q_pe`` / ``k_pe``
rotated (``DeepseekRotary``: interleaved pairs, YaRN with its attention
factor), and the latent row ``[c | k_pe]`` goes to the latent pool (the
backend stores it; over an FP8 pool quantized with the layer's scale, and every
path reads it back dequantized, docs/deepseek.md "FP8 latent cache").  Two exact
ways to attend (kvship.engine.attention.mla): **decompressed**, over keys and
values ``kv_b_proj`` makes from every latent row of the request, and
**absorbed**, folding ``W_UK`` into the query and ``W_UV`` into the output and
attending over the latent rows directly.  Decode, verify and draft extends
absorb; an ``EXTEND`` (prefill, prefix-cached extend) takes the cheaper of the
two by ``mla_extend_flops`` (a few new tokens over a long prefix: absorbed; a
fresh prefill: decompressed), chosen once per forward (``KVSHIP_MLA_EXTEND``
forces one).  The softmax scale is ``qk_head_dim ** -0.5`` times YaRN's
``mscale_all_dim`` factor squared.

**DeepSeekMoE** (``DeepseekMoE``): router logits in float32 from
``gate.weight`` (kept in float32), grouped routing
(``deepseek_config.GroupedRouting``; V3's ``e_score_correction_bias``), the
routed experts on the fused-MoE path (``FusedMoE`` with this routing), plus
the un-gated shared experts (one dense MLP of ``n_shared_experts *
moe_intermediate_size``).

Checkpoint names are Hugging Face's; per-expert tensors are stacked as for
the other MoE models (kvship.engine.models.moe).  Weights: bf16/fp32, or
block-128 FP8 through the quantization seam (every projection; ``kv_b_proj``
dequantized once after loading and read as that dense matrix by both MLA
paths, ``MLAAttention.process_weights_after_loading``).  Tensor / expert
parallelism: ``tp_plan`` below (the latent cache replicated on every rank).
The model runner refuses the modes it does not support yet, naming them
(``check_mla_serving``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from kvship.common.envs import ENV
from kvship.engine.attention.mla import MLALayerSpec
from kvship.engine.deepseek_config import GroupedRouting, yarn_mscale
from kvship.engine.forward_batch import ForwardBatch, ForwardMode
from kvship.engine.layers.fused_dispatch import cuda_moe_route
from kvship.engine.layers.linear import Linear, StackedLinear, _param
from kvship.engine.layers.moe.layer import FusedMoE
from kvship.engine.layers.moe.topk import count_routed
from kvship.engine.layers.quantization import quant_method_for
from kvship.engine.layers.rmsnorm import RMSNorm, norm_then_linear
from kvship.engine.layers.rotary import RotaryEmbedding
from kvship.engine.layers.side_stream import beside, partials_comm, side_stream_limit
from kvship.engine.model_config import ModelConfig
from kvship.engine.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from kvship.engine.models.moe import MoEForCausalLM
from kvship.engine.models.registry import register_model
from kvship.engine.models.stage import LayerRange

# the eps of q_a_layernorm / kv_a_layernorm (DeepSeek's code builds them with the RMSNorm default)
_LATENT_NORM_EPS = 1e-6


def check_mla_serving(server_args) -> None:
    """ValueError naming the first mode an MLA (DeepSeek) model cannot run in yet (docs/deepseek.md)."""
    sa = server_args
    refusals = [
        (  # eagle: the checkpoint's MTP module as the head (kvship.engine.models.deepseek_mtp); ngram
            sa.speculative_algorithm not in (None, "eagle", "ngram"),
            f"--speculative-algorithm {sa.speculative_algorithm} (eagle drafts with the checkpoint's MTP module)",
        ),
    ]
    for bad, what in refusals:
        if bad:
            raise ValueError(f"DeepSeek (MLA) models do not support {what} yet; see docs/deepseek.md")


class DeepseekRotary(RotaryEmbedding):
    """RoPE over the ``qk_rope_head_dim`` dims of ``q_pe [T, H, d]`` and ``k_pe [T, d]``.

    Pairs are ``(x[2i], x[2i+1])`` when ``interleave`` (DeepSeek's layout), else ``(x[i], x[i + d/2])``; the
    output puts the pairs' first members in the first half and their second members in the second (q and k
    alike, so their dot products are the rotated pairs').  ``scaling``: none/default or ``yarn`` (with its
    attention factor folded into cos and sin).  The table is computed once, in float32."""

    def __init__(self, dim: int, max_position: int, base: float, scaling: Optional[dict], interleave: bool):
        self.dim, self.interleave = dim, interleave
        # the base class stores the settings and builds ``cos_sin_cache`` by ``_table`` (rebuilt after a model
        # built on the meta device is moved: ``RotaryEmbedding.rebuild_table_``)
        super().__init__(dim, max_position, base, scaling)

    def _table(self) -> torch.Tensor:
        inv_freq, factor = _inv_freq(self.dim, self._base, self._scaling)
        t = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        return torch.cat([freqs.cos(), freqs.sin()], -1) * factor

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cs = self.cos_sin_cache.index_select(0, positions)
        half = self.dim // 2
        cos, sin = cs[:, :half], cs[:, half:]
        return self._rotate(q, cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)), self._rotate(
            k, cos.to(k.dtype), sin.to(k.dtype)
        )

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _inv_freq(dim: int, base: float, scaling: Optional[dict]) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2], attention factor)`` for RoPE without scaling or with YaRN."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    pos_freqs = base**exponents
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise ValueError(f"DeepSeek rope_scaling type '{kind}' is not supported (default, yarn)")
    s = dict(scaling or {})
    orig = float(s["original_max_position_embeddings"])
    factor = float(s["factor"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dim index whose wavelength turns ``rotations`` times in orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies kept), 0: interpolate (divided by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = yarn_mscale(factor, float(m)) / yarn_mscale(factor, float(m_all)) if m and m_all else yarn_mscale(factor)
    return inv_freq, float(attn)


def mla_extend_flops(spec: MLALayerSpec, extend_lens: Sequence[int], seq_lens: Sequence[int]) -> tuple[int, int]:
    """``(decompressed, absorbed)`` FLOPs of one MLA layer's attention for an extend of ``extend_lens[b]`` new
    tokens over ``seq_lens[b]`` positions (cached prefix + new) per request; ``T``, ``S``: their sums.  What the
    two paths share (the q / kv_a / o projections) is left out (docs/deepseek.md, "Absorbed or decompressed
    extend"):

    * decompressed: ``kv_b_proj`` over every position, ``2 S r H (d_nope + d_v)``, then attention with per-head
      keys and values, ``2 sum_b T_b S_b H (d_nope + d_rope + d_v)``;
    * absorbed: ``W_UK`` into each query and ``W_UV`` out of each output, ``2 T H r (d_nope + d_v)``, then
      attention over the latent rows, ``2 sum_b T_b S_b H (2 r + d_rope)``."""
    h, r = spec.num_heads, spec.kv_lora_rank
    dn, dr, dv = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    ts = sum(t * s for t, s in zip(extend_lens, seq_lens))
    kv_b = r * h * (dn + dv)  # multiply-adds of W_UK and W_UV for one row
    decompressed = 2 * sum(seq_lens) * kv_b + 2 * ts * h * (dn + dr + dv)
    absorbed = 2 * sum(extend_lens) * kv_b + 2 * ts * h * (2 * r + dr)
    return decompressed, absorbed


def extend_takes_absorbed(path: str, spec: MLALayerSpec, extend_lens: Sequence[int], seq_lens: Sequence[int]) -> bool:
    """Whether an ``EXTEND`` attends absorbed: ``path`` ``absorbed`` / ``decompressed`` (``KVSHIP_MLA_EXTEND``)
    forces it; ``auto`` absorbs only where ``mla_extend_flops`` says it is strictly cheaper (so never for a
    fresh prefill, where every position is new)."""
    if path != "auto":
        return path == "absorbed"
    decompressed, absorbed = mla_extend_flops(spec, extend_lens, seq_lens)
    return absorbed < decompressed


class MLAAttention(nn.Module):
    """Multi-head Latent Attention (module docstring); ``layer_id``: the layer's index in the latent pool.

    ``kv_b_dense``: ``kv_b_proj``'s weight dequantized in the model dtype when the checkpoint stores it
    quantized (``process_weights_after_loading``), else None and the weight itself is read."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: DeepseekRotary):
        super().__init__()
        mla = config.mla
        assert mla is not None
        dt, qm = config.dtype, quant_method_for(config)
        h = self.num_heads = config.num_attention_heads
        self.mla = mla
        self.q_lora = mla.q_lora_rank is not None
        self.q_width = mla.q_lora_rank if self.q_lora else h * mla.qk_head_dim
        self.side_stream_tokens = side_stream_limit()
        # decode steps of at most this many requests apply W_UV inside the attention's merge kernel (0: off)
        self.merge_uv_tokens = ENV.MLA_MERGE_UV_TOKENS
        self.fused_qkv_a_proj = StackedLinear(
            config.hidden_size,
            {"q": self.q_width, "kv_a": mla.latent_dim},
            bias=config.attention_bias,
            dtype=dt,
            quant_method=qm,
        )
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(self.q_width, _LATENT_NORM_EPS, dt)
            self.q_b_proj = Linear(self.q_width, h * mla.qk_head_dim, dtype=dt, quant_method=qm)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS, dt)
        # W_UK / W_UV of every head: both paths read it as a dense matrix (``_kv_b_weight``; an FP8 checkpoint's
        # is dequantized once after loading into ``kv_b_dense``, docs/deepseek.md)
        self.kv_b_proj = Linear(
            mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim), dtype=dt, quant_method=qm
        )
        self.dtype = dt
        self.register_buffer("kv_b_dense", None, persistent=False)
        self.extend_path = ENV.MLA_EXTEND  # auto / absorbed / decompressed, read once when the layer is built
        self.o_proj = Linear(h * mla.v_head_dim, config.hidden_size, bias=config.o_proj_bias, dtype=dt, quant_method=qm)
        self._rotary = [rotary]  # shared by all layers; a list keeps it out of this module's state dict
        self.spec = MLALayerSpec(
            layer_id=layer_id,
            num_heads=h,
            kv_lora_rank=mla.kv_lora_rank,
            qk_nope_head_dim=mla.qk_nope_head_dim,
            qk_rope_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim,
            scaling=mla.softmax_scale(config.rope_scaling),
        )

    def process_weights_after_loading(self) -> None:
        """Once every weight of the layer is loaded: a quantized ``kv_b_proj`` is dequantized (this rank's heads)
        into ``kv_b_dense`` in the model dtype, so no step dequantizes it again; an unquantized one is read as it
        is (no copy).  ``DeepseekV2ForCausalLM.load_weights`` calls it; a module that loads an MLA layer by other
        means should too (until then such a layer dequantizes on every call, as ``_kv_b_weight`` says)."""
        kv_b = self.kv_b_proj
        with torch.no_grad():
            w = kv_b.quant_method.dequantized_weight(kv_b)
            self.kv_b_dense = None if w is kv_b.weight else w.to(self.dtype).contiguous()

    def _kv_b_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``kv_b_proj``'s weight ``[H * (d_nope + d_v), kv_lora_rank]`` (this rank's heads) in ``dtype``: the
        weight itself, or ``kv_b_dense`` for a quantized checkpoint, so absorption and decompression multiply by
        the same matrix and neither quantizes its input.  (A quantized layer never prepared by
        ``process_weights_after_loading`` dequantizes here, each call.)"""
        w = self.kv_b_dense
        if w is None:
            w = self.kv_b_proj.quant_method.dequantized_weight(self.kv_b_proj)
        return w if w.dtype == dtype else w.to(dtype)

    def _extend_absorbed(self, fb: ForwardBatch) -> bool:
        """This ``EXTEND``'s path (``extend_takes_absorbed``), picked by the forward's first MLA layer and kept
        on ``fb`` for the others."""
        if fb.mla_absorbed_extend is None:
            assert fb.extend_seq_lens_cpu is not None, "an EXTEND batch carries its host extend lengths"
            fb.mla_absorbed_extend = extend_takes_absorbed(
                self.extend_path, self.spec, fb.extend_seq_lens_cpu, fb.seq_lens_cpu
            )
        return fb.mla_absorbed_extend

    def _decompress(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.mla
        w = self._kv_b_weight(c.dtype)
        kv = torch.nn.functional.linear(c, w).view(-1, self.num_heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        return k_nope, v

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        norm: RMSNorm,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's input norm (``norm`` over ``hidden + residual``) and MLA: ``(output, residual)``."""
        m, h, fb = self.mla, self.num_heads, forward_batch
        qkv_a, residual, _ = norm_then_linear(norm, self.fused_qkv_a_proj, hidden, residual)
        q, kv_a = qkv_a.split([self.q_width, m.latent_dim], dim=-1)
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous()))
        q = q.view(-1, h, m.qk_head_dim)
        if fb.forward_mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY) and self._prep_fits(fb):
            return self._prepped(positions, q, kv_a, fb), residual
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_pe = kv_a.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        q_pe, k_pe = self._rotary[0](positions, q_pe, k_pe)
        latent = torch.cat([c, k_pe], dim=-1)
        backend = fb.attn_backend
        if fb.kv_ready is not None:  # host-tier pages loading back (docs/cache.md, "Load-back")
            fb.kv_ready(self.spec.layer_id)
        if fb.forward_mode == ForwardMode.EXTEND and not self._extend_absorbed(fb):  # decompress K and V
            out = backend.forward_extend_decompressed(
                torch.cat([q_nope, q_pe], dim=-1), latent, self.spec, fb, self._decompress
            )
        else:  # decode, verify, draft extends, and the extends where absorbing is cheaper: over the latent rows
            w = self._kv_b_weight(q_nope.dtype).view(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
            q_lat = torch.einsum("thd,hdr->thr", q_nope, w[:, : m.qk_nope_head_dim])
            qa = torch.cat([q_lat, q_pe], dim=-1)
            if fb.forward_mode.is_decode():
                o = backend.forward_decode(qa, latent, None, self.spec, fb)
            else:
                o = backend.forward_extend(qa, latent, None, self.spec, fb)
            out = torch.einsum("thr,hvr->thv", o, w[:, m.qk_nope_head_dim :])
        if fb.layer_done is not None:
            fb.layer_done(self.spec.layer_id)
        return self.o_proj(out.reshape(-1, h * m.v_head_dim)), residual

    def _prep_fits(self, fb: ForwardBatch) -> bool:
        """Whether this decode step or verify forward runs ``mla_decode_prep`` (a backend with
        ``fused_decode_prep``, a rope dim whose half is a power of two)."""
        half = self.mla.qk_rope_head_dim // 2
        return getattr(fb.attn_backend, "fused_decode_prep", False) and half > 0 and half & (half - 1) == 0

    def _prepped(self, positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """A decode step's (or a speculative verify forward's) attention with the norm, the rotary and the latent
        store in one kernel (kvship.engine.attention.mla_prep): the eager path's numbers, fewer kernels
        (docs/deepseek.md, "Decode step").  Verify then attends through the absorbed extend (its tree masks)."""
        from kvship.engine.attention.mla_prep import mla_decode_prep

        m, h, layer = self.mla, self.num_heads, self.spec.layer_id
        if fb.kv_ready is not None:  # host-tier pages loading back (docs/cache.md, "Load-back")
            fb.kv_ready(layer)
        rotary = self._rotary[0]
        w = self._kv_b_weight(q.dtype).view(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)

        def prep() -> None:  # rotates q_pe in place; the GEMM beside it reads only q_nope
            mla_decode_prep(
                q,
                kv_a,
                positions,
                rotary.cos_sin_cache,
                self.kv_a_layernorm.weight,
                self.kv_a_layernorm.eps,
                fb.kv_pool.get_latent_buffer(layer),
                fb.out_cache_loc,
                fb.kv_pool.latent_scale(layer),
                rotary.interleave,
                m.qk_nope_head_dim,
            )

        # [H, T, R] from one batched GEMM over the heads, on a side stream beside the prep kernel (docs/deepseek.md,
        # "Two streams"); the attention kernel reads it as [T, H, R] through its strides
        q_lat, _ = beside(
            lambda: torch.bmm(q[..., : m.qk_nope_head_dim].transpose(0, 1), w[:, : m.qk_nope_head_dim]),
            prep,
            q,
            self.side_stream_tokens,
        )
        q_lat = q_lat.transpose(0, 1)
        q_pe = q[..., m.qk_nope_head_dim :]
        w_uv = w[:, m.qk_nope_head_dim :]
        if fb.forward_mode.is_decode() and q.shape[0] <= self.merge_uv_tokens:  # W_UV inside the merge kernel
            out = fb.attn_backend.forward_decode_prepped(q_lat, q_pe, self.spec, fb, w_uv=w_uv)
        else:
            if fb.forward_mode.is_decode():
                o = fb.attn_backend.forward_decode_prepped(q_lat, q_pe, self.spec, fb)
            else:  # the new rows are stored: the absorbed extend reads them from the pool
                o = fb.attn_backend.forward_extend(torch.cat([q_lat, q_pe], dim=-1), None, None, self.spec, fb, False)
            out = torch.einsum("thr,hvr->thv", o, w_uv)
        if fb.layer_done is not None:
            fb.layer_done(layer)
        return self.o_proj(out.reshape(-1, h * m.v_head_dim))


class DeepseekRouter(nn.Module):
    """``gate.weight [E, H]`` (float32) and, with ``noaux_tc``, ``e_score_correction_bias [E]``; ``select`` is
    the routing ``FusedMoE`` calls (``GroupedRouting``'s rules)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, routing: GroupedRouting):
        super().__init__()
        if num_experts % routing.n_group:
            raise ValueError(f"{num_experts} experts do not split into n_group={routing.n_group} groups")
        self.weight = _param((num_experts, hidden_size), torch.float32)
        if routing.has_correction_bias:
            self.e_score_correction_bias = _param((num_experts,), torch.float32)
        self.routing, self.top_k, self.renormalize = routing, top_k, renormalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[M, E]``; decode batches on CUDA in one kernel (``topk_triton.router_logits``)."""
        fused = cuda_moe_route(x)
        logits = fused.router_logits(x, self.weight) if fused is not None else None
        return logits if logits is not None else torch.nn.functional.linear(x.float(), self.weight)

    def normed_logits(
        self, norm: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(forward(h), h, x + residual)`` for ``h = norm(x + residual)`` from one kernel where there is one (CUDA,
        an RMSNorm, the smallest decode batches: ``topk_triton.router_logits_normed``); None elsewhere."""
        fused = cuda_moe_route(x)
        if fused is None or residual is None or type(norm).forward is not RMSNorm.forward:
            return None
        return fused.router_logits_normed(x, residual, norm.weight, norm.eps, self.weight)

    def select(
        self, logits: torch.Tensor, counts: Optional[torch.Tensor] = None, rows_slots: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits ``[M, E]`` -> float32 weights and int32 expert ids, ``[M, top_k]`` each; with
        ``counts`` the picks are added to the expert load (``topk.count_routed``'s contract)."""
        r = self.routing
        fused = cuda_moe_route(logits)
        if fused is not None and fused.fits(logits.shape[-1], self.top_k, r.n_group):  # one kernel
            return fused.route(
                logits,
                self.top_k,
                r.scoring,
                self.renormalize,
                1e-20,
                r.topk_method,
                r.n_group,
                r.topk_group,
                self.e_score_correction_bias if r.has_correction_bias else None,
                r.routed_scaling_factor,
                counts=counts,
                rows_slots=rows_slots,
            )
        logits = logits.float()
        scores = logits.sigmoid() if r.scoring == "sigmoid" else logits.softmax(dim=-1)
        m, e = scores.shape
        grouped = r.topk_method != "greedy" and r.n_group > 1
        if r.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias
            if grouped:
                per = choice.view(m, r.n_group, e // r.n_group)
                keep = self._group_mask(per.topk(min(2, e // r.n_group), dim=-1).values.sum(-1), e)
                choice = choice.masked_fill(~keep, float("-inf"))
            ids = choice.topk(self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        else:
            if grouped:  # group_limited_greedy: groups ranked by their best expert
                keep = self._group_mask(scores.view(m, r.n_group, e // r.n_group).amax(dim=-1), e)
                scores = scores.masked_fill(~keep, 0.0)
            weights, ids = scores.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        ids = ids.to(torch.int32)
        if counts is not None:
            count_routed(counts, ids, rows_slots)
        return weights * r.routed_scaling_factor, ids

    def _group_mask(self, group_scores: torch.Tensor, num_experts: int) -> torch.Tensor:
        """``[M, E]`` bool: the experts of each row's ``topk_group`` best groups."""
        r = self.routing
        best = group_scores.topk(r.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return keep.repeat_interleave(num_experts // r.n_group, dim=1)


class DeepseekMoE(nn.Module):
    """Routed experts (grouped routing) plus the shared experts: ``[T, H] -> [T, H]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        assert moe is not None and moe.routing is not None
        if config.hidden_act != "silu":
            raise ValueError(f"MoE experts support hidden_act 'silu' only, got '{config.hidden_act}'")
        dt, qm = config.dtype, quant_method_for(config)
        self.gate = DeepseekRouter(config.hidden_size, moe.num_experts, moe.top_k, moe.norm_topk_prob, moe.routing)
        self.experts = FusedMoE(
            moe.num_experts,
            moe.top_k,
            config.hidden_size,
            moe.intermediate_size,
            moe.norm_topk_prob,
            dt,
            quant_method=qm,
            routing=self.gate.select,
        )
        self.has_shared = moe.shared_expert_intermediate_size > 0
        if self.has_shared:
            width = moe.shared_expert_intermediate_size
            self.shared_experts = LlamaMLP(replace(config, intermediate_size=width))
        self.side_stream_tokens = side_stream_limit()

    def forward(self, x: torch.Tensor, logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer over ``x``; ``logits``: the router's, where they were computed already."""

        def router() -> torch.Tensor:
            return logits if logits is not None else self.gate(x)

        if not self.has_shared:
            return self.experts(x, router())
        # tensor parallelism replaces the modules after construction: asked at the first forward
        apart, comm = partials_comm(self.shared_experts, self.experts)
        if not apart:  # a dispatch that exchanges rows keeps its own collectives
            return self.experts(x, router()) + self.shared_experts(x)
        # the shared experts on a side stream beside the router and the routed experts (docs/deepseek.md,
        # "Two streams"); under TP both leave partial sums, added and all-reduced once
        shared, out = beside(
            lambda: self.shared_experts.forward_partial(x),
            lambda: self.experts.forward_partial(x, router()),
            x,
            self.side_stream_tokens,
        )
        out = out + shared
        return comm.all_reduce(out) if comm is not None else out

    def forward_normed(
        self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(norm(x + residual))`` and the new residual; at the smallest decode batches on CUDA the norm
        and the router's logits are one kernel (``DeepseekRouter.normed_logits``)."""
        fused = self.gate.normed_logits(norm, x, residual)
        if fused is not None:
            logits, h, residual = fused
            return self.forward(h, logits), residual
        h, residual = norm(x, residual)
        return self.forward(h), residual


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: DeepseekRotary, kv_layer_id: int):
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.self_attn = MLAAttention(config, kv_layer_id, rotary)
        self.mlp = DeepseekMoE(config) if moe.is_sparse_layer(layer_id) else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor], fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, fb)
        return self.mlp.forward_normed(self.post_attention_layernorm, hidden, residual)


class DeepseekModel(LlamaModel):
    """``LlamaModel`` (embedding, ``run_layers``, final norm, pipeline parts) with DeepSeek's decoder layers and
    RoPE, so ``LlamaForCausalLM``'s forward and logits serve this model too."""

    def __init__(self, config: ModelConfig, layers: Optional[LayerRange] = None):
        if config.mla is None:
            raise ValueError(f"{config.architecture}: config.json lacks the MLA fields")
        super().__init__(config, None, layers)

    def build_rotary(self, config: ModelConfig) -> nn.Module:
        mla = config.mla
        assert mla is not None
        return DeepseekRotary(
            mla.qk_rope_head_dim,
            max(config.context_len, 1),
            config.rope_theta,
            config.rope_scaling,
            mla.rope_interleave,
        )

    def build_layer(
        self, config: ModelConfig, i: int, mlp_for_layer: Optional[Callable[[int], nn.Module]]
    ) -> nn.Module:
        return DeepseekDecoderLayer(config, i, self.rotary_emb, i - self.part.start)


@register_model("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
class DeepseekV2ForCausalLM(MoEForCausalLM):
    """DeepSeek-V2/V3 (module docstring); loading as ``MoEForCausalLM`` with the MLA projections stacked."""

    stacked_params_mapping = [
        ("fused_qkv_a_proj", "q_a_proj", "q"),
        ("fused_qkv_a_proj", "q_proj", "q"),
        ("fused_qkv_a_proj", "kv_a_proj_with_mqa", "kv_a"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    checkpoint_renames = ()
    # tensor parallelism (kvship.engine.parallel.layers; docs/deepseek.md, "Tensor and expert parallelism"):
    # query heads split (q_b_proj / q_proj, kv_b_proj by heads, o_proj row-parallel), the latent projection
    # kv_a_proj_with_mqa and q_a_proj replicated (every rank caches the whole latent row), dense and shared
    # MLPs as Llama's, the router whole and the routed experts split by kvship.engine.parallel.ep
    tp_plan = {
        "embed_tokens": "vocab_embed",
        "self_attn": "mla_attention",
        "fused_qkv_a_proj": "mla_qkv_a",
        "q_b_proj": "column_linear",
        "kv_b_proj": "column_linear",
        "o_proj": "row",
        "gate_up_proj": "column",
        "down_proj": "row",
        "lm_head": "vocab_head",
    }

    def __init__(self, config: ModelConfig, layers: Optional[LayerRange] = None):
        if config.mla is None or config.moe is None or config.moe.routing is None:
            raise ValueError(f"{config.architecture}: config.json lacks the MLA / DeepSeekMoE fields")
        # the Llama causal-LM shell (LM head, forward, logits) around this file's decoder; MoEForCausalLM's own
        # constructor builds Llama blocks, so it is not the one called
        LlamaForCausalLM.__init__(self, config, layers=layers)

    def build_decoder(self, config: ModelConfig, mlp_for_layer, layers: Optional[LayerRange]) -> nn.Module:
        return DeepseekModel(config, layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``MoEForCausalLM.load_weights``, then every MLA layer's ``process_weights_after_loading`` (the dense
        ``kv_b_proj`` of a quantized checkpoint, made once)."""
        loaded = super().load_weights(weights)
        for m in self.modules():
            if isinstance(m, MLAAttention):
                m.process_weights_after_loading()
        return loaded
