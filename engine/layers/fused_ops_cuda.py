"""Fused small ops for CUDA in Triton: RMSNorm (+ residual add), SiLU-and-mul, in-place RoPE.

Each replaces several PyTorch kernels (and as many passes over the
activations) with one.  Numerics follow the PyTorch layers they stand in for:

* ``rmsnorm``: the residual sum is rounded to the activation dtype first (as
  ``x + residual`` is), normalised in float32, rounded, then scaled by the
  weight (``weight * h.to(dtype)``);
* ``silu_and_mul``: ``silu(gate)`` rounded to the dtype, times ``up``;
* ``rope_inplace``: NeoX rotate-half with the float32 cos/sin table, computed in
  float32 and rounded once (PyTorch's layer rounds each product; the
  difference is within one bf16 ulp).

``rope_inplace`` can also write the rotated keys and the values of the new
tokens into the KV pool's layer buffers in the same kernel (``store=``), which
saves the separate KV-store kernel of every attention layer.

On Hopper every kernel here can launch with programmatic dependent launch
(``fused_dispatch.use_pdl``, on by default, ``KVSHIP_PDL=0`` off): it waits for the previous kernel with
``griddepcontrol.wait`` before touching memory, then lets the next kernel be
scheduled at once (``launch_dependents``).

Only imported on CUDA, through ``kvship.engine.layers.fused_dispatch``.  The
kernels also run under Triton's interpreter on CPU tensors (tests).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvship.engine.layers.fused_dispatch import use_pdl


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel has finished and its writes are visible, then let the next
    kernel be scheduled.  Every program must call it before its first activation load or any store."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _rmsnorm_kernel(
    x,
    res,
    w,
    y,
    res_out,
    n_cols,
    eps,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    pdl_enter(USE_PDL)
    xv = tl.load(x + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        rv = tl.load(res + row * stride_r + offs, mask=mask, other=0.0)
        xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(xv.dtype)
        tl.store(res_out + row * stride_ro + offs, xv, mask=mask)
    out = rmsnorm_row(xv, tl.load(w + offs, mask=mask, other=0.0), n_cols, eps)
    tl.store(y + row * stride_y + offs, out.to(y.dtype.element_ty), mask=mask)


@triton.jit
def rmsnorm_row(xv, wv, n_cols, eps):
    """RMSNorm of one row ``xv`` (masked columns 0) as Hugging Face rounds it: normalised in float32, cast to the
    row's dtype, times the weight ``wv``; float32 (the caller casts to the output dtype).  Shared with the FP8
    norm-and-quantize kernel (``fp8_kernels._norm_quant_kernel``), which must round exactly as this one."""
    h = xv.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    h = (h * tl.rsqrt(var + eps)).to(xv.dtype)
    return wv.to(tl.float32) * h.to(tl.float32)


def rmsnorm_warps(block: int) -> int:
    """The warps of a program normalising one row of ``block`` (a power of two) columns; a kernel that must round
    as ``rmsnorm`` does (the push all-reduce's norm) reduces its rows with the same count."""
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """``norm(x)``, or ``(norm(x + residual), x + residual)`` when ``residual`` is given (new tensors)."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    block = triton.next_power_of_2(n)
    warps = rmsnorm_warps(block)
    pdl = use_pdl(x)
    if residual is None:
        if rows:
            _rmsnorm_kernel[(rows,)](
                x2,
                x2,
                weight,
                y,
                y,
                n,
                eps,
                x2.stride(0),
                0,
                y.stride(0),
                0,
                HAS_RES=False,
                BLOCK=block,
                num_warps=warps,
                USE_PDL=pdl,
                launch_pdl=pdl,
            )
        return y.view(shape)
    r2 = residual.reshape(-1, n)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    res_out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        _rmsnorm_kernel[(rows,)](
            x2,
            r2,
            weight,
            y,
            res_out,
            n,
            eps,
            x2.stride(0),
            r2.stride(0),
            y.stride(0),
            res_out.stride(0),
            HAS_RES=True,
            BLOCK=block,
            num_warps=warps,
            USE_PDL=pdl,
            launch_pdl=pdl,
        )
    return y.view(shape), res_out.view(shape)


@triton.jit
def _silu_mul_kernel(x, y, d, stride_x, stride_y, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    pdl_enter(USE_PDL)
    g = tl.load(x + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x + row * stride_x + d + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    out = a.to(tl.float32) * u.to(tl.float32)
    tl.store(y + row * stride_y + offs, out.to(y.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d]``."""
    shape = x.shape
    d = shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(d))
        pdl = use_pdl(x)
        _silu_mul_kernel[(rows, triton.cdiv(d, block))](
            x2, y, d, x2.stride(0), y.stride(0), BLOCK=block, num_warps=4, USE_PDL=pdl, launch_pdl=pdl
        )
    return y.view(*shape[:-1], d)


@triton.jit
def _head_rmsnorm(x1, x2, w, offs, d_mask, eps, HALF: tl.constexpr):
    # RMSNorm of each head ([BLOCK_H, HALF] halves), rounded as ``_rmsnorm_kernel`` rounds: x * rsqrt in
    # float32 -> x's dtype, times the weight in float32 -> x's dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    var = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF)
    r = tl.rsqrt(var + eps)[:, None]
    w1 = tl.load(w + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    n1 = (w1 * (f1 * r).to(x1.dtype).to(tl.float32)).to(x1.dtype)
    n2 = (w2 * (f2 * r).to(x2.dtype).to(tl.float32)).to(x2.dtype)
    return n1, n2


@triton.jit
def _rope_kernel(
    q,
    k,
    positions,
    cos_sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    v,
    k_buf,
    v_buf,
    loc,
    stride_vt,
    stride_vh,
    stride_kb,
    stride_vb,
    q_w,
    k_w,
    eps,
    NUM_Q: tl.constexpr,
    NUM_K: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    STORE: tl.constexpr,
    NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # program (token t, head block hb): blocks [0, NQB) rotate q heads, the rest k heads (and store k, v)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    NQB: tl.constexpr = (NUM_Q + BLOCK_H - 1) // BLOCK_H
    offs = tl.arange(0, BLOCK_HALF)
    d_mask = offs < HALF
    heads = tl.arange(0, BLOCK_H)
    pdl_enter(USE_PDL)
    pos = tl.load(positions + t).to(tl.int64)
    cos = tl.load(cos_sin + pos * stride_cs + offs, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin + pos * stride_cs + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)
    if hb < NQB:
        hh = hb * BLOCK_H + heads
        m = (hh < NUM_Q)[:, None] & d_mask[None, :]
        p = q + t * stride_qt + hh[:, None] * stride_qh + offs[None, :]
        x1 = tl.load(p, mask=m, other=0.0)
        x2 = tl.load(p + HALF, mask=m, other=0.0)
        if NORM:
            x1, x2 = _head_rmsnorm(x1, x2, q_w, offs, d_mask, eps, HALF)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        tl.store(p, (f1 * cos[None, :] - f2 * sin[None, :]).to(x1.dtype), mask=m)
        tl.store(p + HALF, (f2 * cos[None, :] + f1 * sin[None, :]).to(x1.dtype), mask=m)
    else:
        hh = (hb - NQB) * BLOCK_H + heads
        m = (hh < NUM_K)[:, None] & d_mask[None, :]
        p = k + t * stride_kt + hh[:, None] * stride_kh + offs[None, :]
        x1 = tl.load(p, mask=m, other=0.0)
        x2 = tl.load(p + HALF, mask=m, other=0.0)
        if NORM:
            x1, x2 = _head_rmsnorm(x1, x2, k_w, offs, d_mask, eps, HALF)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        r1 = (f1 * cos[None, :] - f2 * sin[None, :]).to(x1.dtype)
        r2 = (f2 * cos[None, :] + f1 * sin[None, :]).to(x1.dtype)
        tl.store(p, r1, mask=m)
        tl.store(p + HALF, r2, mask=m)
        if STORE:
            slot = tl.load(loc + t).to(tl.int64)
            # the pool row is [Hkv, D] contiguous: head hh starts at hh * 2 * HALF
            kb = k_buf + slot * stride_kb + hh[:, None] * (2 * HALF) + offs[None, :]
            tl.store(kb, r1.to(k_buf.dtype.element_ty), mask=m)
            tl.store(kb + HALF, r2.to(k_buf.dtype.element_ty), mask=m)
            pv = v + t * stride_vt + hh[:, None] * stride_vh + offs[None, :]
            vb = v_buf + slot * stride_vb + hh[:, None] * (2 * HALF) + offs[None, :]
            tl.store(vb, tl.load(pv, mask=m, other=0.0).to(v_buf.dtype.element_ty), mask=m)
            tl.store(vb + HALF, tl.load(pv + HALF, mask=m, other=0.0).to(v_buf.dtype.element_ty), mask=m)


def rope_inplace(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    store: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place (last dim contiguous); returns them.

    ``cos_sin_cache`` is ``[max_position, D]``: cos of the ``D/2`` frequencies,
    then their sin.  With ``store=(v, k_buf, v_buf, loc)`` the same kernel also
    writes the rotated keys and ``v [T, Hk, D]`` into the pool buffers
    ``k_buf`` / ``v_buf`` ``[slots, Hk, D]`` (contiguous) at slots ``loc [T]``,
    cast to the pool dtype, as ``KVPool.set_kv_buffer`` would.  With ``qk_norm=(q_weight, k_weight, eps)``
    (Qwen3's per-head RMSNorm, weights ``[D]``) each head of ``q`` and ``k`` is normalised first, in the same
    kernel, rounded as ``rmsnorm`` rounds.
    """
    t, hq, d = q.shape
    hk = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope_inplace needs q and k with a contiguous last dim")
    if t == 0:
        return q, k
    half = d // 2
    # a few heads per program: a decode step's handful of tokens still spreads over several SMs
    block_h = min(8, triton.next_power_of_2(max(hq, hk)))
    if store is not None:
        v, k_buf, v_buf, loc = store
        if (
            v.shape != k.shape
            or v.stride(-1) != 1
            or not k_buf.is_contiguous()
            or not v_buf.is_contiguous()
            or tuple(k_buf.shape[1:]) != (hk, d)
            or tuple(v_buf.shape[1:]) != (hk, d)
            or loc.numel() != t
        ):
            raise ValueError("rope_inplace(store=...) needs v shaped like k and [slots, Hk, D] pool buffers")
        sv = (v, k_buf, v_buf, loc, v.stride(0), v.stride(1), k_buf.stride(0), v_buf.stride(0))
    else:
        sv = (k, k, k, positions, 0, 0, 0, 0)
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        if q_w.shape != (d,) or k_w.shape != (d,) or not q_w.is_contiguous() or not k_w.is_contiguous():
            raise ValueError("rope_inplace(qk_norm=...) needs contiguous [D] norm weights")
        nv = (q_w, k_w, float(eps))
    else:
        nv = (q, k, 0.0)
    pdl = use_pdl(q)
    _rope_kernel[(t, triton.cdiv(hq, block_h) + triton.cdiv(hk, block_h))](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        *sv,
        *nv,
        NUM_Q=hq,
        NUM_K=hk,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(half),
        STORE=store is not None,
        NORM=qk_norm is not None,
        USE_PDL=pdl,
        launch_pdl=pdl,
        num_warps=4,
    )
    return q, k
