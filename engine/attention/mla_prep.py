"""One Triton kernel for what an MLA decode step does between the ``qkv_a`` projection and the attention kernel
(docs/deepseek.md, "Decode step").

``mla_decode_prep(q, kv_a, positions, cos_sin, norm_weight, eps, latent_buf, loc, kv_scale, interleave)``, one
program per token:

* the latent's ``c`` part (``kv_a[:, :R]``) through the ``kv_a_layernorm`` RMSNorm (``fused_ops_cuda.rmsnorm_row``:
  the rounding of ``RMSNorm``);
* ``k_pe`` (``kv_a[:, R:]``) and every head's ``q_pe`` (``q[:, :, d_nope:]``) rotated by the token's position as
  ``DeepseekRotary`` does (interleaved pairs out to halves, or rotate-half), with its rounding: the float32
  table's cos and sin cast to the activation dtype, each product and each sum rounded to it (what the PyTorch
  elementwise ops do), so the result is the eager layer's bit for bit;
* the latent row ``[norm(c) | rot(k_pe)]`` stored at slot ``loc`` of the layer's pool buffer (an FP8 pool:
  ``e4m3(clamp(x / kv_scale))`` in float32, as ``quantize_kv``), and ``q_pe`` rotated in place.

It replaces the copy, the norm, the ~19 small kernels of the rotary, the two concatenations and the KV store of
each layer (``MLAAttention.forward`` with a backend that has ``fused_decode_prep``).  Runs under Triton's
interpreter on CPU tensors too (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvship.engine.layers.fused_dispatch import use_pdl
from kvship.engine.layers.fused_ops_cuda import pdl_enter, rmsnorm_row


@triton.jit
def _rot(x1, x2, cos, sin, DT: tl.constexpr):
    """``(x1 cos - x2 sin, x2 cos + x1 sin)`` with every product and sum rounded to ``DT`` (PyTorch's rounding)."""
    a = ((x1 * cos).to(DT).to(tl.float32) - (x2 * sin).to(DT).to(tl.float32)).to(DT)
    b = ((x2 * cos).to(DT).to(tl.float32) + (x1 * sin).to(DT).to(tl.float32)).to(DT)
    return a, b


@triton.jit
def _e4m3_values(x, scale):
    """``clamp(x / scale, -448, 448)`` (IEEE division, float32) rounded to the nearest e4m3 value, ties to even,
    as float32: the value ``quantize_kv`` stores, exactly representable, so the final cast to float8 is exact.
    Rounded by arithmetic (scale to the value's e4m3 step, round with the 1.5 * 2^23 trick, scale back) rather
    than by the float8 cast, which Triton's interpreter gets wrong at some binade edges (tests run there)."""
    v = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0)
    a = tl.abs(v)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6) - 3  # log2 of the e4m3 step at |v|
    step = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    q = ((a * inv + 12582912.0) - 12582912.0) * step
    return tl.where(v < 0, -q, q)


@triton.jit
def _mla_decode_prep_kernel(
    Q,
    KVA,
    POS,
    CS,
    W,
    KV,
    LOC,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kv,
    num_heads,
    eps,
    kv_scale,
    R: tl.constexpr,
    P: tl.constexpr,
    D_NOPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = P // 2
    DT = Q.dtype.element_ty
    pdl_enter(USE_PDL)
    pos = tl.load(POS + t).to(tl.int64)
    j = tl.arange(0, HALF)
    cos = tl.load(CS + pos * P + j).to(DT).to(tl.float32)
    sin = tl.load(CS + pos * P + HALF + j).to(DT).to(tl.float32)
    if INTERLEAVE:
        first, second = 2 * j, 2 * j + 1
    else:
        first, second = j, HALF + j

    # the latent row: norm(c) | rot(k_pe)
    kva = KVA + t * stride_kt
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    c = tl.load(kva + offs_r, mask=rmask, other=0.0)
    cn = rmsnorm_row(c, tl.load(W + offs_r, mask=rmask, other=0.0), R, eps).to(DT)
    k1, k2 = _rot(tl.load(kva + R + first).to(tl.float32), tl.load(kva + R + second).to(tl.float32), cos, sin, DT)
    row = KV + tl.load(LOC + t).to(tl.int64) * stride_kv
    if FP8:
        out_ty = KV.dtype.element_ty
        tl.store(row + offs_r, _e4m3_values(cn, kv_scale).to(out_ty), mask=rmask)
        tl.store(row + R + j, _e4m3_values(k1, kv_scale).to(out_ty))
        tl.store(row + R + HALF + j, _e4m3_values(k2, kv_scale).to(out_ty))
    else:
        tl.store(row + offs_r, cn.to(KV.dtype.element_ty), mask=rmask)
        tl.store(row + R + j, k1.to(KV.dtype.element_ty))
        tl.store(row + R + HALF + j, k2.to(KV.dtype.element_ty))

    # every head's q_pe, rotated in place (each head's whole row is loaded before it is stored)
    heads = tl.arange(0, BLOCK_H)
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + heads
        hmask = (h < num_heads)[:, None]
        qp = Q + t * stride_qt + h[:, None].to(tl.int64) * stride_qh + D_NOPE
        x1 = tl.load(qp + first[None, :], mask=hmask, other=0.0).to(tl.float32)
        x2 = tl.load(qp + second[None, :], mask=hmask, other=0.0).to(tl.float32)
        a, b = _rot(x1, x2, cos[None, :], sin[None, :], DT)
        tl.store(qp + j[None, :], a, mask=hmask)
        tl.store(qp + HALF + j[None, :], b, mask=hmask)


def mla_decode_prep(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    latent_buf: torch.Tensor,
    loc: torch.Tensor,
    kv_scale: float,
    interleave: bool,
    qk_nope_head_dim: int,
) -> None:
    """The module docstring's step for ``T`` decode tokens, in place.

    ``q [T, H, d_nope + P]`` (last dim contiguous; its ``q_pe`` part is rotated in place); ``kv_a [T, R + P]``
    (rows contiguous); ``positions [T]``; ``cos_sin [max_pos, P]`` float32 (cos half, sin half);
    ``norm_weight [R]``; ``latent_buf [slots, 1, R + P]`` (one layer's pool buffer, model dtype or
    ``float8_e4m3fn``); ``loc [T]`` the new tokens' slots; ``kv_scale`` the layer's latent scale (FP8 pools)."""
    t, num_heads, dq = q.shape
    p = cos_sin.shape[-1]
    r = kv_a.shape[-1] - p
    if dq != qk_nope_head_dim + p or p % 2 or r <= 0:
        raise ValueError(f"mla_decode_prep: q rows of {dq}, kv_a rows of {kv_a.shape[-1]}, rope dim {p}")
    if q.stride(-1) != 1 or kv_a.stride(-1) != 1:
        raise ValueError("mla_decode_prep: q and kv_a need contiguous rows")
    kv = latent_buf.reshape(latent_buf.shape[0], r + p)
    if kv.stride(-1) != 1 or norm_weight.numel() != r:
        raise ValueError("mla_decode_prep: the latent buffer's rows must be contiguous, the norm weight R wide")
    if t == 0:
        return
    fp8 = latent_buf.dtype == torch.float8_e4m3fn
    pdl = use_pdl(q)
    _mla_decode_prep_kernel[(t,)](
        q,
        kv_a,
        positions,
        cos_sin,
        norm_weight,
        kv,
        loc,
        q.stride(0),
        q.stride(1),
        kv_a.stride(0),
        kv.stride(0),
        num_heads,
        eps,
        float(kv_scale),
        R=r,
        P=p,
        D_NOPE=qk_nope_head_dim,
        BLOCK_R=triton.next_power_of_2(r),
        BLOCK_H=min(16, triton.next_power_of_2(num_heads)),
        INTERLEAVE=interleave,
        FP8=fp8,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
