"""Split-KV MLA decode in Triton: absorbed attention straight over the latent pool (docs/deepseek.md).

``mla_decode(q, latent, req_to_token, req_pool_indices, seq_lens, kv_lora_rank, scale, num_splits)``:

* ``q [B, H, R + P]``: absorbed queries (``[q_nope @ W_UK | q_pe]``); ``latent [slots, 1, R + P]`` one
  layer's buffer of ``MLAKVPool``; request ``b``'s positions ``0..seq_lens[b]-1`` live at slots
  ``req_to_token[req_pool_indices[b], :]``.
* Stage 1, grid ``(B, ceil(H / BLOCK_H), num_splits)``: each program takes ``BLOCK_H`` heads of one request
  and one contiguous part of its context, loads each latent row ONCE for all those heads, and keeps an online
  softmax: scores ``q_c . c + q_pe . k_pe`` (two MMAs), values ``c`` (the row's first ``R`` columns).  It
  writes its normalised partial output and log-sum-exp.
* Stage 2, grid ``(B, H)``: merges the parts by their log-sum-exp.

Returns ``[B, H, R]`` in ``q``'s dtype; the model applies ``W_UV`` after it.  Accumulation is float32.
Parts past a short request's length are empty (log-sum-exp ``-inf``) and weigh nothing.

``MLATritonBackend`` (``--attention-backend triton`` for MLA models) runs decode through it, and extends
through the kernels of kvship.engine.attention.mla_triton_extend: prefill / prefix-cached extends decompressed
(``kv_b_proj`` of the request's latent rows as one GEMM, then a causal flash kernel), verify and draft extends
absorbed over the latent pool (tree masks for TARGET_VERIFY).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvship.engine.attention.mla import Decompress, MLALayerSpec, MLATorchBackend
from kvship.engine.attention.mla_triton_extend import mla_extend_absorbed, mla_extend_decompressed
from kvship.engine.attention.triton_backend import TritonExtendMeta, extend_meta
from kvship.engine.forward_batch import ForwardBatch


@triton.jit
def _mla_decode_part(
    Q,
    KV,
    R2T,
    RPI,
    SEQ,
    O_PART,
    LSE_PART,
    stride_qb,
    stride_qh,
    stride_kv,
    stride_r2t,
    num_heads,
    scale,
    R: tl.constexpr,
    P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    seq = tl.load(SEQ + b).to(tl.int32)
    row = tl.load(RPI + b).to(tl.int64)
    per = tl.cdiv(seq, NUM_SPLITS)
    start = s * per
    end = tl.minimum(start + per, seq)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    rmask = offs_r < R
    pmask = offs_p < P
    q_base = Q + b.to(tl.int64) * stride_qb + heads[:, None].to(tl.int64) * stride_qh
    q_c = tl.load(q_base + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
    q_p = tl.load(q_base + R + offs_p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        slot = tl.load(R2T + row * stride_r2t + pos, mask=nmask, other=0).to(tl.int64)
        kv_row = KV + slot[:, None] * stride_kv
        c = tl.load(kv_row + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        pe = tl.load(kv_row + R + offs_p[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0).to(tl.float32)
        qk = tl.dot(q_c, tl.trans(c)) + tl.dot(q_p, tl.trans(pe))
        qk = tl.where(nmask[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, c)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    part = (b.to(tl.int64) * num_heads + heads.to(tl.int64)) * NUM_SPLITS + s
    tl.store(O_PART + part[:, None] * R + offs_r[None, :], out, mask=hmask[:, None] & rmask[None, :])
    tl.store(LSE_PART + part, lse, mask=hmask)


@triton.jit
def _mla_decode_merge(
    O_PART,
    LSE_PART,
    OUT,
    R: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_r = tl.arange(0, BLOCK_R)
    lse = tl.load(LSE_PART + bh * NUM_SPLITS + offs_s)
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - m), 0.0)
    parts = tl.load(
        O_PART + (bh * NUM_SPLITS + offs_s)[:, None] * R + offs_r[None, :], mask=(offs_r < R)[None, :], other=0.0
    )
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(OUT + bh * R + offs_r, out.to(OUT.dtype.element_ty), mask=offs_r < R)


def mla_decode(
    q: torch.Tensor,
    latent: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    num_splits: int = 8,
    block_h: int = 16,
    block_n: int = 32,
) -> torch.Tensor:
    """Absorbed MLA decode (module docstring): ``[B, H, kv_lora_rank]`` in ``q``'s dtype."""
    bs, num_heads, dim = q.shape
    r, p = kv_lora_rank, dim - kv_lora_rank
    if latent.shape[-1] != dim or p <= 0:
        raise ValueError(f"latent rows of {latent.shape[-1]} values do not match queries of {dim} = {r} + rope dims")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    q = q.contiguous()
    kv = latent.reshape(latent.shape[0], dim)
    if kv.stride(-1) != 1:
        raise ValueError("the latent buffer's rows must be contiguous")
    o_part = torch.empty((bs, num_heads, num_splits, r), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((bs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty((bs, num_heads, r), dtype=q.dtype, device=q.device)
    if bs == 0:
        return out
    block_r, block_p = triton.next_power_of_2(r), max(triton.next_power_of_2(p), 16)
    grid = (bs, triton.cdiv(num_heads, block_h), num_splits)
    _mla_decode_part[grid](
        q,
        kv,
        req_to_token,
        req_pool_indices,
        seq_lens,
        o_part,
        lse_part,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        req_to_token.stride(0),
        num_heads,
        scale,
        R=r,
        P=p,
        NUM_SPLITS=num_splits,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_P=block_p,
    )
    _mla_decode_merge[(bs * num_heads,)](o_part, lse_part, out, R=r, NUM_SPLITS=num_splits, BLOCK_R=block_r)
    return out


# context tokens per decode split worth a program of its own: shorter contexts take fewer splits (a split
# shorter than this costs a program and a merge term for little parallel work)
TOKENS_PER_SPLIT = 128


def decode_splits(max_seq_len: int, max_splits: int = 8) -> int:
    """``mla_decode``'s ``num_splits`` for a batch whose longest context is ``max_seq_len``: a power of two,
    one per ``TOKENS_PER_SPLIT`` tokens, at most ``max_splits``."""
    want = triton.cdiv(max(max_seq_len, 1), TOKENS_PER_SPLIT)
    return min(triton.next_power_of_2(want), max_splits)


@dataclass
class MLAExtendMeta:
    """Per-step tensors of the Triton MLA extends (shared by every layer of the forward)."""

    ext: TritonExtendMeta  # prefix / extend lengths, query starts, tree masks
    kv_starts: torch.Tensor  # [bs] int32: where request b's rows start in the packed decompressed K / V
    kv_slots: torch.Tensor  # [sum(seq_lens)] int64: every request's slots, prefix then new (position order)


def mla_extend_meta(fb: ForwardBatch) -> MLAExtendMeta:
    """``MLAExtendMeta`` for an extend batch (``extend_meta``'s tensors plus the decompression gather)."""
    r2t = fb.req_to_token_pool.req_to_token
    device = r2t.device
    seq = [int(x) for x in fb.seq_lens_cpu]
    starts = [0] * len(seq)
    for i in range(1, len(seq)):
        starts[i] = starts[i - 1] + seq[i - 1]
    owner = torch.repeat_interleave(torch.arange(len(seq)), torch.tensor(seq, dtype=torch.int64))
    pos = torch.arange(int(owner.numel())) - torch.tensor(starts, dtype=torch.int64)[owner]
    rows = fb.req_pool_indices.to(device=device, dtype=torch.int64)[owner.to(device)]
    return MLAExtendMeta(
        ext=extend_meta(fb, device),
        kv_starts=torch.tensor(starts, dtype=torch.int32).to(device),
        kv_slots=r2t[rows, pos.to(device)].to(torch.int64),
    )


class MLATritonBackend(MLATorchBackend):
    """``--attention-backend triton`` for MLA models: decode through ``mla_decode`` (split-KV over the latent
    pool), extends through ``mla_extend_decompressed`` (prefill, prefix-cached extends) and
    ``mla_extend_absorbed`` (verify with its tree masks, draft extends).  No CUDA graphs yet."""

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode.is_decode():
            # the kernel reads req_to_token and seq_lens itself; the metadata is its number of splits
            forward_batch.attn_metadata = decode_splits(max(forward_batch.seq_lens_cpu, default=1))
        else:
            forward_batch.attn_metadata = mla_extend_meta(forward_batch)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        fb = forward_batch
        buf = self._store(fb, layer, k, save_kv_cache)
        return mla_decode(
            q.view(-1, layer.num_heads, layer.latent_dim),
            buf,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            layer.kv_lora_rank,
            layer.scaling,
            num_splits=fb.attn_metadata,
        )

    def forward_extend(self, q, k, v, layer: MLALayerSpec, forward_batch: ForwardBatch, save_kv_cache=True):
        """Absorbed: ``q [T, H, latent_dim]`` -> ``[T, H, kv_lora_rank]`` (causal, or the verify tree masks)."""
        fb = forward_batch
        meta: MLAExtendMeta = fb.attn_metadata
        buf = self._store(fb, layer, k, save_kv_cache)
        e = meta.ext
        return mla_extend_absorbed(
            q.view(-1, layer.num_heads, layer.latent_dim).contiguous(),
            buf,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            e.prefix_lens,
            e.extend_lens,
            e.extend_starts,
            e.max_extend_len,
            layer.kv_lora_rank,
            layer.scaling,
            tree_mask=e.custom_mask,
            mask_starts=e.mask_starts,
        )

    def forward_extend_decompressed(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        layer: MLALayerSpec,
        forward_batch: ForwardBatch,
        decompress: Decompress,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Decompressed: ``q [T, H, d_nope + d_rope]`` -> ``[T, H, d_v]``; ``decompress`` (``kv_b_proj``) runs
        once over all the batch's latent rows, the kernel reads ``k_pe`` from the pool."""
        fb = forward_batch
        meta: MLAExtendMeta = fb.attn_metadata
        buf = self._store(fb, layer, latent, save_kv_cache)
        r = layer.kv_lora_rank
        c = buf.index_select(0, meta.kv_slots)[:, 0, :r].to(q.dtype)
        k_nope, v = decompress(c)
        e = meta.ext
        return mla_extend_decompressed(
            q.contiguous(),
            k_nope,
            v,
            buf,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            e.prefix_lens,
            e.extend_lens,
            e.extend_starts,
            meta.kv_starts,
            e.max_extend_len,
            r,
            layer.scaling,
        )
