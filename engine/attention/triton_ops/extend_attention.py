"""Extend (prefill) attention in Triton over a cached prefix plus the new tokens.

Grid ``(bs, num_heads, ceil(max_extend_len / BLOCK_M))``: a program owns
``BLOCK_M`` new tokens of one request and one query head.  It first streams the
request's cached prefix (positions ``0..prefix_len-1``, slots read through
``req_to_token``; every prefix position is visible to every new token), then
the new tokens themselves from the packed ``k`` / ``v`` (causal: new token
``i`` sees new tokens ``0..i``).  One online softmax spans both parts, so no
merge pass is needed.

With ``custom_mask`` (a TARGET_VERIFY batch: draft trees) the new tokens see
each other through the request's own ``[ext_len, ext_len]`` mask instead of
causality (``custom_mask[mask_starts[b] + i * ext_len + j]`` != 0: new token
``i`` sees new token ``j``); the prefix stays fully visible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def kv_is_fp8(k_buf: torch.Tensor, k_new: torch.Tensor) -> bool:
    fp8 = k_buf.dtype == torch.float8_e4m3fn
    if fp8 != (k_new.dtype == torch.float8_e4m3fn):
        raise ValueError(f"new K/V of dtype {k_new.dtype} over a {k_buf.dtype} pool: pass them as stored")
    return fp8


@triton.jit
def _extend_kernel(
    q,
    k_new,
    v_new,
    o,
    k_buf,
    v_buf,
    req_to_token,
    req_pool_indices,
    prefix_lens,
    extend_lens,
    extend_starts,
    custom_mask,
    mask_starts,
    sm_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_r2t,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_MASK: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    ext_len = tl.load(extend_lens + b).to(tl.int32)
    if mb * BLOCK_M >= ext_len:
        return
    prefix_len = tl.load(prefix_lens + b).to(tl.int32)
    q_start = tl.load(extend_starts + b).to(tl.int64)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    kvh = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < ext_len
    d_mask = offs_d < HEAD_DIM
    qv = tl.load(
        q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # cached prefix: fully visible
    for n0 in range(0, prefix_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < prefix_len
        slot = tl.load(req_to_token + row * stride_r2t + offs_n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        kb = tl.load(k_buf + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(qv, tl.trans(kb).to(qv.dtype)).to(tl.float32) * sm_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        vb = tl.load(v_buf + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:  # e4m3 is exact in the model dtype; the scales multiply the scores (k) and the sums (v)
            vb = vb.to(qv.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb).to(tl.float32) * v_scale
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    # new tokens: causal, or the request's custom (tree) mask
    if USE_MASK:
        hi = ext_len
        mask_start = tl.load(mask_starts + b).to(tl.int64)
    else:
        hi = tl.minimum(ext_len, (mb + 1) * BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        kb = tl.load(
            k_new + (q_start + offs_n)[:, None] * stride_knt + kvh * stride_knh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(qv, tl.trans(kb).to(qv.dtype)).to(tl.float32) * sm_scale
        if USE_MASK:
            allowed = tl.load(
                custom_mask + mask_start + offs_m[:, None] * ext_len + offs_n[None, :],
                mask=m_mask[:, None] & n_mask[None, :],
                other=0,
            )
            visible = n_mask[None, :] & (allowed != 0)
        else:
            visible = n_mask[None, :] & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows that have seen nothing yet keep m = -inf; avoid (-inf) - (-inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        vb = tl.load(
            v_new + (q_start + offs_n)[:, None] * stride_vnt + kvh * stride_vnh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if KV_FP8:
            vb = vb.to(qv.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb).to(tl.float32) * v_scale
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    tl.store(
        o + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(o.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    custom_mask: torch.Tensor | None = None,
    mask_starts: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal (or ``custom_mask``) attention of the packed new tokens; writes and returns ``o``.

    Shapes: ``q`` / ``o`` ``[T, H, D]``, ``k_new`` / ``v_new`` ``[T, Hkv, D]`` (the
    new tokens, packed by request), ``k_buf`` / ``v_buf`` ``[slots, Hkv, D]``;
    per-request ``[bs]`` tensors ``prefix_lens``, ``extend_lens``,
    ``extend_starts`` (offset of the request's first new token in the packed
    dim).  ``max_extend_len`` (host int) sizes the grid.  ``custom_mask`` (uint8,
    every request's ``[ext_len, ext_len]`` mask flattened, packed by request) with
    ``mask_starts`` ([bs] int64 offsets) replaces causality among the new tokens.
    An FP8 pool: ``k_buf`` / ``v_buf`` and ``k_new`` / ``v_new`` are all ``float8_e4m3fn`` (the new tokens as
    stored), read as ``e4m3 * k_scale`` / ``e4m3 * v_scale``.
    """
    bs = int(req_pool_indices.shape[0])
    if bs == 0 or max_extend_len == 0:
        return o
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_new.shape[1]
    block_d = triton.next_power_of_2(head_dim)
    block_m = 64 if block_d <= 128 else 32
    block_n = 64 if block_d <= 64 else 32
    grid = (bs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_new,
        v_new,
        o,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_starts,
        custom_mask if custom_mask is not None else extend_starts,
        mask_starts if mask_starts is not None else extend_starts,
        sm_scale * k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        o.stride(0),
        o.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_MASK=custom_mask is not None,
        KV_FP8=kv_is_fp8(k_buf, k_new),
        num_warps=4 if block_d <= 64 else 8,
        num_stages=2,
    )
    return o
