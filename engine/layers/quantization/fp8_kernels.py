"""FP8 (e4m3) linear-layer kernels for CUDA: activation quantization, decode GEMV, FP8 GEMM.

They compute the reference arithmetic of docs/quantization.md ("Reference
arithmetic", ``fp8_math``) with the sums in another order:

* activations are quantized exactly as the reference quantizes them (scale
  ``max(amax, 1e-10) / 448`` and the quotient ``x / s`` both correctly rounded
  divisions, ``clamp(-448, 448)``, round-to-nearest-even cast to e4m3), per
  token-group of ``G`` columns, per token or with the static scale;
* the product is accumulated in fp32 from the e4m3 values and the scales;
* bias in fp32, one cast to the output dtype.

Kernels:

* ``_quant_act_kernel``: ``x`` -> e4m3 ``[M, K]`` + fp32 scales (``[M, ceil(K/G)]``
  per group, ``[M, 1]`` per token; static: the given scale).
* ``_fp8_gemv_kernel`` (decode rows, CUDA cores): each program streams
  ``BLOCK_N`` e4m3 weight rows in ``BLOCK_K`` chunks and quantizes its input
  tiles itself (per group and static: from the tile; per token: after one
  pass over the rows for their amax), or reads them quantized (``PREQ``).
  The input tile is dequantized exactly as the reference does it and, for
  128x128 block weights, multiplied by its block's weight scale (a program's
  rows lie in one row block); per-row weight scales multiply the sum.
* ``_fp8_mm_kernel`` (tensor cores): quantized input tiles times e4m3 weight
  tiles through ``tl.dot`` (e4m3 operands, or both widened exactly to fp16),
  fp32 accumulator; where a scale changes along K (per-group activations,
  block weights) each ``G``-wide K step's partial product is scaled before it
  is added, otherwise the row and column scales multiply the sum.  Skinny
  tiles (``BLOCK_M`` 16) serve decode batches, 128x128 tiles prefill.
* per-channel / per-tensor formats at larger M: ``torch._scaled_mm`` with
  row-wise scales where this torch and GPU have it (``_mm`` otherwise);
  block-128 at larger M: ``torch.nn.functional.scaled_mm`` with 1x128
  activation and 128x128 weight scales (cuBLAS) where ``probe_block_scaled_mm``
  found it right on the device before any graph was captured (``_mm``
  otherwise).

``fp8_linear`` picks the path; it returns None for what these kernels do not
take (the caller then runs the reference).  Every launch is asynchronous and
allocation-only on the host side: no synchronisation, safe inside CUDA-graph
capture.  The model reaches it on CUDA only (``fused_dispatch.cuda_fp8_kernels``);
the split-KV decode imports its quantization helpers (``_scale_of``, ``_to_e4m3``)
for ``decode_attention_quant``; the kernels also run under Triton's interpreter on
CPU tensors (tests).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvship.common.envs import ENV
from kvship.engine.layers.fused_dispatch import use_pdl
from kvship.engine.layers.fused_ops_cuda import pdl_enter, rmsnorm_row
from kvship.engine.layers.quantization import fp8_math as fm

logger = logging.getLogger(__name__)

ACT_GROUP, ACT_TOKEN, ACT_STATIC = 0, 1, 2
ACT_CODES = {"group": ACT_GROUP, "token": ACT_TOKEN, "static": ACT_STATIC}
# rows up to which the decode kernels run; more rows: quantize, then the GEMM
GEMV_MAX_M = 16
# rows above GEMV_MAX_M up to which a decode batch takes ``mid_config``'s tiles (still weight-bandwidth bound:
# the prefill tiles leave most SMs idle there, e.g. 32 programs for o_proj at 64 rows); more rows: the GEMM.
# ``KVSHIP_FP8_MID_MAX_M`` overrides it (16: off; benchmarks compare both in one run)
MID_MAX_M = ENV.FP8_MID_MAX_M
SWAP_MAX_M = ENV.FP8_SWAP_MAX_M


# --- arithmetic shared by the kernels ----------------------------------------------------------------
@triton.jit
def _scale_of(amax):
    """``max(amax, 1e-10) / 448`` (fp32, correctly rounded division, as fp8_math)."""
    return tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)


@triton.jit
def _to_e4m3(v, s):
    """``float8_e4m3fn(clamp(v / s, -448, 448))``: correctly rounded division, round-to-nearest-even cast."""
    return tl.clamp(tl.math.div_rn(v, s), -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def _group_scales(v, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr):
    """Scales of ``v [BLOCK_M, BLOCK_K]`` per row and ``G`` columns, repeated over the columns: ``[BLOCK_M,
    BLOCK_K]``.  Masked-out columns must hold 0 (they do not raise an amax)."""
    g = tl.reshape(tl.abs(v), (BLOCK_M, BLOCK_K // G, G))
    s = _scale_of(tl.max(g, axis=2))
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_M, BLOCK_K // G, G)), (BLOCK_M, BLOCK_K))


# --- activation quantization -------------------------------------------------------------------------
# per-token rows up to this long are quantized by one program each in one tile; longer ones in two kernels over
# TOKEN_CHUNK-column chunks (``quantize_act``)
TOKEN_SPLIT_MIN = 4096
TOKEN_CHUNK = 2048


@triton.jit
def _quant_act_kernel(
    x,
    q,
    s,
    s_in,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    ACT: tl.constexpr,
    G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    SILU: tl.constexpr = False,
    PARTS: tl.constexpr = 0,
):
    # ACT_TOKEN: one program per row (amax pass, then the quantize pass), or with PARTS > 0 one per row and
    # BLOCK_K columns whose row amax is the max of ``s_in``'s PARTS chunk maxima (``_row_amax_kernel``; the
    # chunk-0 program stores the scale); else one per row and BLOCK_K columns.
    # SILU: the row is ``g || u`` (2K wide) and the input is ``silu(g) * u`` as fused_ops_cuda.silu_and_mul
    # rounds it (recomputed in each pass: cheaper than a second tensor)
    m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1)
    rk = tl.arange(0, BLOCK_K)
    xr = x + m * stride_xm
    qr = q + m * stride_qm
    pdl_enter(USE_PDL)
    if ACT == 1 and PARTS > 0:
        parts = tl.arange(0, PARTS)
        nparts = tl.cdiv(K, BLOCK_K)
        sc = _scale_of(tl.max(tl.load(s_in + m * nparts + parts, mask=parts < nparts, other=0.0), axis=0))
        if pid_k == 0:
            tl.store(s + m * stride_sm, sc)
        ks = pid_k * BLOCK_K + rk
        ok = ks < K
        tl.store(qr + ks, _to_e4m3(_act_in(xr, ks, ok, K, SILU), sc), mask=ok)
    elif ACT == 1:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = _act_in(xr, k0 + rk, (k0 + rk) < K, K, SILU)
            amax = tl.maximum(amax, tl.abs(v))
        sc = _scale_of(tl.max(amax, axis=0))
        tl.store(s + m * stride_sm, sc)
        for k0 in range(0, K, BLOCK_K):
            ok = (k0 + rk) < K
            v = _act_in(xr, k0 + rk, ok, K, SILU)
            tl.store(qr + k0 + rk, _to_e4m3(v, sc), mask=ok)
    else:
        ks = pid_k * BLOCK_K + rk
        ok = ks < K
        v = _act_in(xr, ks, ok, K, SILU)
        _store_quant(v, qr + ks, ok, s + m * stride_sm, pid_k, s_in, K, ACT, G, BLOCK_K)


@triton.jit
def _row_amax_kernel(x, amax, K, stride_xm, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, SILU: tl.constexpr):
    """``amax[m, j]`` = max |input| over row ``m``'s columns ``[j * BLOCK_K, (j + 1) * BLOCK_K)`` (the input as
    ``_act_in`` forms it): per-token quantization's first pass, spread over the row's chunks."""
    m = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    ks = j * BLOCK_K + tl.arange(0, BLOCK_K)
    pdl_enter(USE_PDL)
    v = _act_in(x + m * stride_xm, ks, ks < K, K, SILU)
    tl.store(amax + m * tl.num_programs(1) + j, tl.max(tl.abs(v), axis=0))


@triton.jit
def _act_in(xr, ks, ok, K, SILU: tl.constexpr):
    """Columns ``ks`` of a row as fp32: the row itself, or (SILU) ``silu(g) * u`` of ``g || u`` rounded to the
    row's dtype exactly as ``fused_ops_cuda._silu_mul_kernel`` rounds it."""
    if SILU:
        g = tl.load(xr + ks, mask=ok, other=0.0)
        u = tl.load(xr + K + ks, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        return (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)
    return tl.load(xr + ks, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _store_quant(v, q_ptr, ok, s_row, pid_k, s_in, K, ACT: tl.constexpr, G: tl.constexpr, BLOCK_K: tl.constexpr):
    """Quantize ``v [BLOCK_K]`` (columns ``pid_k * BLOCK_K ..``, masked ones 0) per ``G``-group (scales stored at
    ``s_row``) or with the static scale ``s_in``, and store the e4m3 values at ``q_ptr``."""
    if ACT == 0:
        g = tl.reshape(tl.abs(v), (BLOCK_K // G, G))
        sg = _scale_of(tl.max(g, axis=1))
        sfull = tl.reshape(tl.broadcast_to(sg[:, None], (BLOCK_K // G, G)), (BLOCK_K,))
        tl.store(q_ptr, _to_e4m3(v, sfull), mask=ok)
        gi = pid_k * (BLOCK_K // G) + tl.arange(0, BLOCK_K // G)
        tl.store(s_row + gi, sg, mask=gi * G < K)
    else:
        tl.store(q_ptr, _to_e4m3(v, tl.load(s_in)), mask=ok)


@triton.jit
def _norm_quant_kernel(
    x,
    res,
    w,
    res_out,
    h,
    q,
    s,
    s_in,
    K,
    eps,
    stride_x,
    stride_r,
    stride_ro,
    stride_h,
    stride_qm,
    stride_sm,
    HAS_RES: tl.constexpr,
    KEEP: tl.constexpr,
    ACT: tl.constexpr,
    G: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row: ``x + residual`` (stored), its RMSNorm rounded exactly as ``fused_ops_cuda._rmsnorm_kernel``
    rounds it (stored in ``h`` if KEEP; ``h``'s dtype is the norm's output dtype either way), then quantized as
    ``_quant_act_kernel`` quantizes it."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    pdl_enter(USE_PDL)
    xv = tl.load(x + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        rv = tl.load(res + row * stride_r + offs, mask=mask, other=0.0)
        xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(xv.dtype)
        tl.store(res_out + row * stride_ro + offs, xv, mask=mask)
    out = rmsnorm_row(xv, tl.load(w + offs, mask=mask, other=0.0), K, eps).to(h.dtype.element_ty)
    if KEEP:
        tl.store(h + row * stride_h + offs, out, mask=mask)
    v = out.to(tl.float32)
    qr = q + row * stride_qm
    if ACT == 1:
        sc = _scale_of(tl.max(tl.abs(v), axis=0))
        tl.store(s + row * stride_sm, sc)
        tl.store(qr + offs, _to_e4m3(v, sc), mask=mask)
    else:
        _store_quant(v, qr + offs, mask, s + row * stride_sm, 0, s_in, K, ACT, G, BLOCK)


def _act_out(m: int, k: int, act: int, group: int, static_scale: Optional[torch.Tensor], device):
    """Empty e4m3 ``[m, k]`` and its scales (``quantize_act``'s layout)."""
    q = torch.empty((m, k), dtype=fm.FP8, device=device)
    if act == ACT_GROUP:
        s = torch.empty((m, triton.cdiv(k, group)), dtype=torch.float32, device=device)
    elif act == ACT_TOKEN:
        s = torch.empty((m, 1), dtype=torch.float32, device=device)
    else:
        if static_scale is None:
            raise ValueError("static activation quantization needs its input scale")
        s = static_scale
    return q, s


def quantize_act(
    x: torch.Tensor, act: int, group: int = 128, static_scale: Optional[torch.Tensor] = None, silu: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (row stride free, columns contiguous) -> (e4m3 ``[M, K]``, fp32 scales): ``[M, ceil(K/G)]``
    per group (``ACT_GROUP``), ``[M, 1]`` per token (``ACT_TOKEN``), ``static_scale`` itself (``ACT_STATIC``, a
    one-element fp32 tensor).  ``silu``: ``x [M, 2K]`` is ``g || u`` and what is quantized is
    ``silu_and_mul(x)`` (one kernel, no activation tensor)."""
    m, k = x.shape
    if silu:
        k //= 2
    q, s = _act_out(m, k, act, group, static_scale, x.device)
    if m == 0:
        return q, s
    warps = 4
    pdl = use_pdl(x)
    if act == ACT_TOKEN and k > TOKEN_SPLIT_MIN:
        # a long row (down_proj's input, 14336): its chunks' maxima in one kernel, then every chunk quantized
        # with the row's scale in a second, each over rows x chunks programs (one program a row took ~7.5 us
        # for a SiLU-and-mul row of 14336 on an H200, the two kernels ~3, docs/quantization.md)
        chunks = triton.cdiv(k, TOKEN_CHUNK)
        amax = torch.empty((m, chunks), dtype=torch.float32, device=x.device)
        _row_amax_kernel[(m, chunks)](
            x, amax, k, x.stride(0), BLOCK_K=TOKEN_CHUNK, USE_PDL=pdl, SILU=silu, launch_pdl=pdl, num_warps=4
        )  # fmt: skip
        _quant_act_kernel[(m, chunks)](
            x, q, s, amax, k, x.stride(0), q.stride(0), s.stride(0), ACT=act, G=group, BLOCK_K=TOKEN_CHUNK,
            USE_PDL=pdl, SILU=silu, PARTS=triton.next_power_of_2(chunks), launch_pdl=pdl, num_warps=4,
        )  # fmt: skip
        return q, s
    if act == ACT_TOKEN:
        # one program per row makes both passes: the whole row in one tile (up to 4096 columns, 8 warps) so
        # each pass is one load instead of a serial loop over 1024-column chunks
        block_k = max(16, triton.next_power_of_2(k))
        warps = 4 if block_k <= 2048 else 8
    else:
        block_k = max(group if act == ACT_GROUP else 16, min(1024, triton.next_power_of_2(k)))
    grid = (m, 1) if act == ACT_TOKEN else (m, triton.cdiv(k, block_k))
    _quant_act_kernel[grid](
        x, q, s, s, k, x.stride(0), q.stride(0), s.stride(0) if act != ACT_STATIC else 0,
        ACT=act, G=group, BLOCK_K=block_k, USE_PDL=pdl, SILU=silu, launch_pdl=pdl, num_warps=warps,
    )  # fmt: skip
    return q, s


def norm_quant(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    norm_weight: torch.Tensor,
    eps: float,
    keep_normed: bool,
    act: int,
    group: int = 128,
    static_scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``h = rmsnorm(x + residual)`` quantized in one kernel (``x``, ``residual`` ``[M, K]``, contiguous rows):
    returns (e4m3 ``[M, K]``, scales as ``quantize_act``, ``x + residual`` (``x`` itself without a residual),
    ``h`` if ``keep_normed``).  Bit-equal to ``fused_ops_cuda.rmsnorm`` followed by ``quantize_act``."""
    m, k = x.shape
    q, s = _act_out(m, k, act, group, static_scale, x.device)
    out_dtype = torch.promote_types(norm_weight.dtype, x.dtype)
    h = torch.empty((m, k), dtype=out_dtype, device=x.device) if keep_normed or out_dtype != x.dtype else x
    res_out = torch.empty_like(x) if residual is not None else x
    if m:
        block = max(group, triton.next_power_of_2(k))
        warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
        pdl = use_pdl(x)
        r = residual if residual is not None else x
        _norm_quant_kernel[(m,)](
            x, r, norm_weight, res_out, h, q, s, s, k, eps, x.stride(0), r.stride(0), res_out.stride(0),
            h.stride(0), q.stride(0), s.stride(0) if act != ACT_STATIC else 0,
            HAS_RES=residual is not None, KEEP=keep_normed, ACT=act, G=group, BLOCK=block, USE_PDL=pdl,
            launch_pdl=pdl, num_warps=warps,
        )  # fmt: skip
    return q, s, res_out, h if keep_normed else None


# --- decode GEMV (CUDA cores) -------------------------------------------------------------------------
@triton.jit
def _x_tile(
    x, xs, rm, m_ok, ks, K, stride_xm, stride_xsm, stride_xsg, amax_row,
    ACT: tl.constexpr, PREQ: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The input tile ``[BLOCK_M, BLOCK_K]`` quantized and dequantized as the reference does it (fp32)."""
    mask = m_ok[:, None] & (ks < K)[None, :]
    v = tl.load(x + rm[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    if PREQ:  # already e4m3: its scales
        if ACT == 0:
            sv = tl.load(xs + rm[:, None] * stride_xsm + (ks // G)[None, :] * stride_xsg, mask=mask, other=1.0)
        elif ACT == 1:
            sv = tl.load(xs + rm * stride_xsm, mask=m_ok, other=1.0)[:, None]
        else:
            sv = tl.load(xs)
        return v * sv
    if ACT == 0:
        sv = _group_scales(v, BLOCK_M, BLOCK_K, G)
    elif ACT == 1:
        sv = _scale_of(amax_row)[:, None]
    else:
        sv = tl.load(xs)
    return _to_e4m3(v, sv).to(tl.float32) * sv


@triton.jit
def _fp8_gemv_kernel(
    x,
    xs,
    w,
    ws,
    bias,
    y,
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_xsg,
    stride_wn,
    stride_wsn,
    stride_wsg,
    stride_ym,
    ACT: tl.constexpr,
    PREQ: tl.constexpr,
    WBLOCK: tl.constexpr,
    G: tl.constexpr,
    WBN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_ptr = w + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    wrow = ws + (pid * BLOCK_N // WBN) * stride_wsn  # WBLOCK: the row block of every row of this program
    # the first weight tile streams in before the wait on the previous kernel (weights never depend on it)
    w0 = tl.load(w_ptr, mask=n_ok[:, None] & (rk < K)[None, :], other=0.0, eviction_policy="evict_first")
    pdl_enter(USE_PDL)
    amax_row = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if ACT == 1:
        if not PREQ:  # per-token scales: one pass over the rows first
            amax = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + rk
                v = tl.load(
                    x + rm[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0
                )
                amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
            amax_row = tl.max(amax, axis=1)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        if k0 == 0:
            wt = w0
        else:
            wt = tl.load(w_ptr + k0, mask=n_ok[:, None] & (ks < K)[None, :], other=0.0, eviction_policy="evict_first")
        xt = _x_tile(
            x, xs, rm, m_ok, ks, K, stride_xm, stride_xsm, stride_xsg, amax_row, ACT, PREQ, G, BLOCK_M, BLOCK_K
        )
        if WBLOCK:
            xt = xt * tl.load(wrow + (ks // G) * stride_wsg, mask=ks < K, other=0.0)[None, :]
        acc += xt[:, None, :] * wt.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2)
    if not WBLOCK:
        out = out * tl.load(ws + rn * stride_wsn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rm[:, None] * stride_ym + rn[None, :], out.to(y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --- FP8 matmul (tensor cores) --------------------------------------------------------------------------
@triton.jit
def _fp8_mm_kernel(
    a,
    as_,
    b,
    bs,
    bias,
    c,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_asg,
    stride_bn,
    stride_bsn,
    stride_bsg,
    stride_cm,
    stride_cs,
    y,
    counters,
    ACT: tl.constexpr,
    WBLOCK: tl.constexpr,
    G: tl.constexpr,
    WBN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
    FIXUP: tl.constexpr = False,
    SWAP: tl.constexpr = False,
):
    # a: e4m3 [M, K] with scales as_ (ACT: per group [M, K/G], per token [M], static scalar); b: e4m3 [N, K] with
    # bs (WBLOCK: [N/WBN, K/G] blocks, else [N] rows).  Per-group activations or block weights: a scale changes
    # along K, BLOCK_K == G.  FP8_DOT: every K step's product is added to the fp32 accumulator outside the MMA
    # (Hopper's e4m3 MMAs keep fewer accumulator bits than fp32; a 14336-long sum must not stay in them).
    # SPLIT_K > 1:
    # program (pid, s) sums K steps [s * k_per, (s + 1) * k_per) and stores its fp32 partial (scales applied, the
    # bias on s == 0) at ``c + s * stride_cs``.  FIXUP: then it counts itself in at ``counters[pid]``; the
    # tile's last program adds the SPLIT_K partials in split order into ``y`` and sets the count back to 0
    # (the next launch, or graph replay, finds it 0).  Else ``_splitk_sum_kernel`` adds them.
    # SWAP: the products are taken as ``w x^T`` (the weight rows are the MMA's left operand, ``[BLOCK_N,
    # BLOCK_M]`` accumulators) and transposed once after the K loop: with BLOCK_N >= 64 weight rows a decode tile
    # fits Hopper's warpgroup MMA, whose left operand must be 64 rows tall, instead of padding a few activation
    # rows to 16 for the warp-level MMA.
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_ptr = a + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b_ptr = b + rn.to(tl.int64)[:, None] * stride_bn + rk[None, :]
    bs_row = bs + (pid_n * BLOCK_N // WBN) * stride_bsn  # WBLOCK: BLOCK_N rows lie in one row block
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_s * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    pdl_enter(USE_PDL)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + rk) < K
        at = tl.load(a_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if not FP8_DOT:  # e4m3 values are exact in fp16 (a single conversion instruction on Hopper)
            at = at.to(tl.float16)
            bt = bt.to(tl.float16)
        if ACT == 0 or WBLOCK or FP8_DOT:  # e4m3 MMAs: each K step's sum leaves the tensor cores (fp32 adds)
            if SWAP:
                part = tl.dot(bt, tl.trans(at))
            else:
                part = tl.dot(at, tl.trans(bt))
            g = k0 // G
            if ACT == 0:
                sa = tl.load(as_ + rm * stride_asm + g * stride_asg, mask=m_ok, other=0.0)
                if SWAP:
                    part = part * sa[None, :]
                else:
                    part = part * sa[:, None]
            if WBLOCK:
                part = part * tl.load(bs_row + g * stride_bsg)
            acc += part
        elif SWAP:
            acc = tl.dot(bt, tl.trans(at), acc)
        else:
            acc = tl.dot(at, tl.trans(bt), acc)
    if SWAP:
        acc = tl.trans(acc)
    if ACT == 1:
        acc = acc * tl.load(as_ + rm * stride_asm, mask=m_ok, other=0.0)[:, None]
    elif ACT == 2:
        acc = acc * tl.load(as_)
    if not WBLOCK:
        acc = acc * tl.load(bs + rn * stride_bsn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        if pid_s == 0:
            acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    offs = rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    tl.store(c + pid_s * stride_cs + offs, acc.to(c.dtype.element_ty), mask=ok)
    if FIXUP:
        tl.debug_barrier()  # every thread's partial issued before the count (released at GPU scope)
        arrived = tl.atomic_add(counters + pid, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(SPLIT_K):  # the order _splitk_sum_kernel adds in; L2 reads (.cg)
                tot += tl.load(c + i * stride_cs + offs, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(y + offs, tot.to(y.dtype.element_ty), mask=ok)
            tl.atomic_xchg(counters + pid, 0)


@triton.jit
def _splitk_sum_kernel(part, y, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """``y = sum_s part[s]`` over the split-K partials (fp32 ``[SPLIT_K, M, N]``), cast to ``y``'s dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        acc += tl.load(part + i * MN + offs, mask=ok, other=0.0)
    tl.store(y + offs, acc.to(y.dtype.element_ty), mask=ok)


# --- configs ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fp8Config:
    """One launch: ``kind`` ``"gemv"`` (CUDA cores; ``preq``: the input quantized by its own kernel first) or
    ``"mma"`` (tensor cores; the input always quantized first; ``fp8_dot``: e4m3 operands, else fp16)."""

    kind: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    preq: bool = False
    fp8_dot: bool = False
    group_m: int = 8
    #: mma: K split over that many programs per tile, partials summed by a second kernel (long-K decode
    #: projections: more programs in flight)
    split_k: int = 1
    #: mma: the weight rows as the MMA's left operand (``_fp8_mm_kernel``'s SWAP)
    swap: bool = False


def bucket(m: int) -> int:
    """Row counts share a config per power of two (1, 2, 4, 8, 16)."""
    return 1 << (max(m, 1) - 1).bit_length()


# (N, K, bucket, ACT_*) -> decode config where it differs from default_config (bench/fp8_gemm.py --sweep on an
# H200, docs/quantization.md); the 2026-11-29 sweep's best configs on the 8B shapes were default_config's at most
# shapes and differed in pipeline stages, K split or tile width at single ones (one sweep), so it holds none
TUNED: dict[tuple[int, int, int, int], Fp8Config] = {}

# the prefill / large-batch tiles of the Triton FP8 GEMM (best or within 5% of the best of five tilings for the
# 8B shapes at M >= 1024 on an H200, bench/fp8_gemm.py)
GEMM_CONFIG = Fp8Config("mma", 64, 128, 128, num_warps=4, num_stages=4, fp8_dot=True)


def default_config(m: int, n: int, k: int, act: int) -> Fp8Config:
    """Decode rows: skinny tensor-core tiles (16 rows, 128-wide K steps, 64 weight rows per program).  On an
    H200 they beat the CUDA-core GEMV at every M from 1 to 16 on the 8B shapes (the GEMV spends its time
    converting e4m3 to fp32, not reading).  The input is quantized first (``quantize_act``, or fused into the
    norm / SiLU-and-mul before it: ``norm_quant``, ``quantize_act(silu=True)``).  A projection narrower than
    16384 rows (the 8B qkv, o and down_proj: 64-96 tiles for 132 SMs) splits K four ways over programs so that
    enough weight bytes are in flight (H200 sweep, 2026-11-29: o_proj 14.3 -> 11.7 us, qkv 15.8 -> 13.9 us,
    block-128 down_proj 22 us; docs/quantization.md).  Up to ``SWAP_MAX_M`` rows (the default: 16) the weight
    rows are the MMA's left operand, so that a tile is one 64-row warpgroup MMA on the e4m3 values (no widening
    to fp16); on an H200 (session 38) a swapped tile was the best of 20 tilings at 23 of 24 (projection, M, format) cells
    of the 8B shapes (this one at 14; the others differ in stages or K split), and a batch-1 block-128 decode
    step went 2.916 -> 2.872 ms."""
    split = 4 if n < 16384 else 1
    if m <= SWAP_MAX_M:
        return Fp8Config("mma", 16, 64, 128, num_warps=4, num_stages=4, fp8_dot=True, split_k=split, swap=True)
    return Fp8Config("mma", 16, 64, 128, num_warps=4, num_stages=4, split_k=split)


def mid_config(m: int, n: int, k: int, act: int) -> Fp8Config:
    """Decode batches of ``GEMV_MAX_M`` < ``m`` <= ``MID_MAX_M`` rows: tensor-core tiles of up to 64 rows, so
    that every SM streams weights (the prefill tiles run 32-224 programs on the 8B shapes there).  A projection
    narrower than 16384 rows takes 64 weight rows a program and splits K (4 ways up to 64 rows, 2 above); a
    wide one (gate_up) 128 rows and no split.  e4m3 operands from 64 rows, fp16 below.  The H200 sweep of
    2026-11-29 (``bench/fp8_gemm.py --gemv-ms 32,64,128 --sweep``; docs/quantization.md) found these the best
    or within ~10% of the best at 64 and 128 rows on all four 8B projections, both formats."""
    bm = min(bucket(m), 64)
    if n >= 16384:
        bn, split = 128, 1
    else:
        bn, split = 64, (4 if m <= 64 else 2)
    if m <= SWAP_MAX_M:  # the weight rows as the MMA's left operand (default_config's tiles)
        return Fp8Config("mma", bm, bn, 128, num_warps=4, num_stages=4, fp8_dot=True, split_k=split, swap=True)
    return Fp8Config("mma", bm, bn, 128, num_warps=4, num_stages=4, fp8_dot=bm >= 64, split_k=split)


def pick_config(m: int, n: int, k: int, act: int) -> Fp8Config:
    """The config for ``[m, k] x [n, k]^T`` in the decode kernels (``m`` <= ``MID_MAX_M``)."""
    tuned = TUNED.get((n, k, bucket(m), act))
    if tuned is not None:
        return tuned
    return default_config(m, n, k, act) if m <= GEMV_MAX_M else mid_config(m, n, k, act)


# --- launches -----------------------------------------------------------------------------------------
def _pow2(v: int) -> bool:
    return v >= 16 and v & (v - 1) == 0


def _fit(cfg: Fp8Config, act: int, block: Optional[tuple[int, int]], group: int) -> Fp8Config:
    """``cfg`` with the tile widths the scale layout needs: a K step inside one scale group (``BLOCK_K`` a
    multiple of ``G`` for the GEMV, equal to it for the tensor-core kernel where a scale changes along K), and
    ``BLOCK_N`` rows inside one weight row block."""
    bk, bn = cfg.block_k, cfg.block_n
    kscale = act == ACT_GROUP or block is not None
    if cfg.kind == "mma" and kscale:
        bk = group
    elif cfg.kind == "gemv" and act == ACT_GROUP:
        bk = max(bk, group)
    if block is not None:
        bn = min(bn, block[0])
    if (bk, bn) == (cfg.block_k, cfg.block_n):
        return cfg
    return dataclasses.replace(cfg, block_n=bn, block_k=bk)


def _scale_strides(act: int, s: torch.Tensor) -> tuple[int, int]:
    if act == ACT_GROUP:
        return s.stride(0), s.stride(1)
    if act == ACT_TOKEN:
        return s.stride(0), 0
    return 0, 0


def launch(
    x: torch.Tensor,
    w: torch.Tensor,
    wscale: torch.Tensor,
    act: int,
    block: Optional[tuple[int, int]],
    group: int,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    cfg: Fp8Config,
    static_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``y = qdq(x) @ (w * wscale)^T + bias`` with ``cfg``; no checks beyond the layout (``fp8_linear`` and the
    benchmark choose).  ``block``: the weight's ``(bn, bk)`` (``wscale`` ``[ceil(N/bn), ceil(K/bk)]``, ``bk`` ==
    ``group``) or None (``wscale`` ``[N]``)."""
    if cfg.kind == "gemv" and not cfg.preq:  # the GEMV quantizes its input tiles itself
        return _launch(x, static_scale if static_scale is not None else wscale, w, wscale, act, block, group, bias,
                       out_dtype, cfg)  # fmt: skip
    xq, xs = quantize_act(x, act, group, static_scale)
    return launch_q(xq, xs, w, wscale, act, block, group, bias, out_dtype, cfg)


def launch_q(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    wscale: torch.Tensor,
    act: int,
    block: Optional[tuple[int, int]],
    group: int,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    cfg: Fp8Config,
) -> torch.Tensor:
    """``launch`` on an input already quantized (``quantize_act``'s layout: e4m3 ``xq [M, K]`` and its scales
    ``xs``); a GEMV ``cfg`` runs as its ``preq`` form."""
    if cfg.kind == "gemv" and not cfg.preq:
        cfg = dataclasses.replace(cfg, preq=True)
    return _launch(xq, xs, w, wscale, act, block, group, bias, out_dtype, cfg)


def _launch(xin, xs, w, wscale, act, block, group, bias, out_dtype, cfg) -> torch.Tensor:
    m, k = xin.shape
    n = w.shape[0]
    cfg = _fit(cfg, act, block, group)
    y = torch.empty((m, n), dtype=out_dtype, device=xin.device)
    if m == 0:
        return y
    pdl = use_pdl(xin)
    ssm, ssg = _scale_strides(act, xs) if cfg.kind == "mma" or cfg.preq else (0, 0)
    wbn = block[0] if block is not None else 1
    wsn, wsg = (wscale.stride(0), wscale.stride(1)) if block is not None else (wscale.stride(0), 0)
    b = bias if bias is not None else wscale
    common = dict(
        ACT=act, WBLOCK=block is not None, G=group, WBN=wbn, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_PDL=pdl, launch_pdl=pdl, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    if cfg.kind == "gemv":
        if m > cfg.block_m:
            raise ValueError(f"a GEMV config of block_m={cfg.block_m} cannot take {m} rows")
        _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            xin, xs, w, wscale, b, y, m, n, k, xin.stride(0), ssm, ssg, w.stride(0), wsn, wsg, y.stride(0),
            PREQ=cfg.preq, **common,
        )  # fmt: skip
    else:
        split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        c = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=xin.device)
        # decode tiles (16 rows) add their partials in their last program; bigger tiles leave it to a second
        # kernel (one program summing 4 x 64 x 64 partials is a serial tail: M = 64 layers got ~2-4 us slower
        # on an H200, docs/quantization.md)
        counters = _split_counters(xin.device, tiles) if split > 1 and cfg.block_m <= FIXUP_MAX_BLOCK_M else None
        _fp8_mm_kernel[(tiles, split)](
            xin, xs, w, wscale, b, c, m, n, k, xin.stride(0), ssm, ssg, w.stride(0), wsn, wsg, n, m * n,
            y, counters if counters is not None else wscale, FP8_DOT=cfg.fp8_dot, SPLIT_K=split,
            GROUP_M=cfg.group_m, FIXUP=counters is not None, SWAP=cfg.swap, **common,
        )  # fmt: skip
        if split > 1 and counters is None:
            blk = 1024
            _splitk_sum_kernel[(triton.cdiv(m * n, blk),)](c, y, m * n, SPLIT_K=split, BLOCK=blk, num_warps=4)
    return y


# split-K arrival counts (int32, 0 between launches), one buffer per (device, stream): kernels on one stream
# run one after another (a PDL launch waits for its predecessor before it counts), two streams never share one
SPLIT_COUNTERS = 1 << 16
FIXUP_MAX_BLOCK_M = 16
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def _split_counters(device: torch.device, tiles: int) -> Optional[torch.Tensor]:
    """The arrival counts for a split-K launch of ``tiles`` tiles on the current stream, or None (more tiles
    than the buffer: the partials are added by ``_splitk_sum_kernel``).  Created zeroed on a stream's first
    split launch (during a CUDA-graph capture too: the graph then re-zeroes it where it was created, and the
    last program of every tile zeroes its count anyway)."""
    if tiles > SPLIT_COUNTERS:
        return None
    key = (device.index if device.index is not None else -1, _stream_id(device))
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
    return buf


def _stream_id(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


_SCALED_MM: dict[int, bool] = {}


def scaled_mm_rowwise(
    xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype
) -> Optional[torch.Tensor]:
    """``torch._scaled_mm`` with row-wise scales (``xs [M, 1]``, ``ws [N]``), or None where this torch / GPU
    does not take it (remembered per device) or the shape does not fit (dims multiples of 16, bf16 out)."""
    m, k = xq.shape
    n = w.shape[0]
    if not xq.is_cuda:
        return None
    idx = xq.device.index if xq.device.index is not None else torch.cuda.current_device()
    if (
        _SCALED_MM.get(idx) is False
        or out_dtype != torch.bfloat16
        or k % 16
        or n % 16
        or not hasattr(torch, "_scaled_mm")
        or torch.cuda.get_device_capability(idx) < (9, 0)
    ):
        return None
    try:
        y = torch._scaled_mm(
            xq, w.t(), scale_a=xs.reshape(m, 1), scale_b=ws.reshape(1, n), out_dtype=out_dtype, use_fast_accum=False
        )
    except (RuntimeError, TypeError, ValueError):  # this torch build has no row-wise scaling: the Triton GEMM
        _SCALED_MM[idx] = False
        return None
    _SCALED_MM[idx] = True
    return y


# Block-128 products through cuBLAS (``torch.nn.functional.scaled_mm`` with 1x128 activation and 128x128 weight
# scales, the DeepSeek-V3 recipe this format is): per device, the scale layouts this torch build takes and computes
# right (``probe_block_scaled_mm``), or False where it has none (the Triton GEMM then runs).  Layout candidates:
# (activation scales, weight scales) as handed to ``scaled_mm`` from ``xs [M, K/128]`` and ``ws [N/128, K/128]``.
_BLOCK_MM: dict[int, Any] = {}
# Smaller products stay on the Triton GEMM: at M = 1024 cuBLAS lost on the Llama-3.1-8B qkv (25.8G multiply-adds:
# 457 vs 592 TFLOP/s) and o (17.2G: 359 vs 414) and won from down (60G: 711 vs 668) up; H200, session 25.
BLOCK_MM_MIN_MACS = 1 << 35
_BLOCK_MM_LAYOUTS = (  # the first is what torch 2.11 on an H200 takes (session 25)
    ("outer_major", "transposed"),
    ("outer_major", "as_is"),
    ("as_is", "as_is"),
    ("as_is", "transposed"),
)


def _block_scales(xs: torch.Tensor, ws: torch.Tensor, layout: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    a = xs.t().contiguous().t() if layout[0] == "outer_major" else xs
    b = ws.t() if layout[1] == "transposed" else ws
    return a, b


def _block_mm_call(xq, xs, w, ws, out_dtype, layout) -> torch.Tensor:
    st = F.ScalingType
    a, b = _block_scales(xs, ws, layout)
    return F.scaled_mm(xq, w.t(), a, st.BlockWise1x128, b, st.BlockWise128x128, output_dtype=out_dtype)


def probe_block_scaled_mm(device: torch.device) -> bool:
    """Find (once per device, outside any CUDA-graph capture) the scale layouts with which this torch's
    ``scaled_mm`` multiplies block-128 FP8 operands as the reference does (a small product against the
    dequantized one in fp32); True when one does.  ``torch.nn.functional.scaled_mm`` with block-wise recipes
    needs torch >= 2.10 and cuBLAS on sm90+; elsewhere (or when no layout computes right) the Triton GEMM
    stays in use."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _BLOCK_MM:
        return _BLOCK_MM[idx] is not False
    _BLOCK_MM[idx] = False
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType") or torch.cuda.get_device_capability(idx) < (9, 0):
        return False
    g = torch.Generator(device=device).manual_seed(0)
    m, n, k = 192, 256, 512
    xq = (torch.randn(m, k, device=device, generator=g) * 4).to(fm.FP8)
    wq = (torch.randn(n, k, device=device, generator=g) * 4).to(fm.FP8)
    xs = torch.rand(m, k // 128, device=device, generator=g) + 0.5
    ws = torch.rand(n // 128, k // 128, device=device, generator=g) + 0.5
    ref = (xq.float() * xs.repeat_interleave(128, 1)) @ (
        wq.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)
    ).t()
    for layout in _BLOCK_MM_LAYOUTS:
        try:
            y = _block_mm_call(xq, xs, wq, ws, torch.bfloat16, layout)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            continue
        if y.shape == ref.shape and float((y.float() - ref).norm() / ref.norm()) < 1e-2:
            _BLOCK_MM[idx] = layout
            logger.info("block-128 FP8 products through cuBLAS scaled_mm (scale layouts %s)", layout)
            return True
    logger.info("block-128 FP8 products through the Triton GEMM (this torch's scaled_mm takes no block scales)")
    return False


def scaled_mm_blockwise(
    xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype
) -> Optional[torch.Tensor]:
    """Block-128 ``xq W^T`` through cuBLAS where ``probe_block_scaled_mm`` found it right on this device (and the
    shape fits: N and K multiples of 128, bf16 out, at least ``BLOCK_MM_MIN_MACS`` multiply-adds), else None.
    Never probes itself (it may run under capture)."""
    if not xq.is_cuda or out_dtype != torch.bfloat16:
        return None
    idx = xq.device.index if xq.device.index is not None else torch.cuda.current_device()
    layout = _BLOCK_MM.get(idx, False)
    m, k = xq.shape
    n = w.shape[0]
    if layout is False or k % 128 or n % 128 or xs.shape != (m, k // 128) or ws.shape != (n // 128, k // 128):
        return None
    if m * n * k < BLOCK_MM_MIN_MACS:
        return None
    return _block_mm_call(xq, xs, w, ws.float(), out_dtype, layout)


def applies(
    x: torch.Tensor, w: torch.Tensor, block: Optional[tuple[int, int]], group: int, k: Optional[int] = None
) -> bool:
    """Whether these kernels take ``x [M, K]`` against e4m3 ``w [N, K]`` with this scale layout (``k``: the
    input's width after a producer, e.g. half of ``x``'s for ``quantize_act(silu=True)``)."""
    k = x.shape[-1] if k is None else k
    if x.dim() != 2 or w.dim() != 2 or w.dtype != fm.FP8 or k != w.shape[1]:
        return False
    if x.stride(1) != 1 or w.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if block is not None and not (_pow2(block[0]) and _pow2(block[1]) and block[1] == group):
        return False
    return _pow2(group)


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    wscale: torch.Tensor,
    act: int,
    block: Optional[tuple[int, int]] = None,
    group: int = 128,
    bias: Optional[torch.Tensor] = None,
    static_scale: Optional[torch.Tensor] = None,
    cfg: Optional[Fp8Config] = None,
) -> Optional[torch.Tensor]:
    """``x W^T + b`` of an FP8 linear layer as the reference computes it (module docstring), ``x [M, K]`` in
    the model dtype; None where these kernels do not apply (the caller runs the reference).  The input is
    quantized (``quantize_act``), then ``fp8_linear_q`` multiplies; ``cfg`` forces one launch config."""
    if not applies(x, w, block, group):
        return None
    if cfg is not None:
        return launch(x, w, wscale, act, block, group, bias, x.dtype, cfg, static_scale)
    xq, xs = quantize_act(x, act, group, static_scale)
    return fp8_linear_q(xq, xs, w, wscale, act, block, group, bias, x.dtype)


def fp8_linear_q(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    wscale: torch.Tensor,
    act: int,
    block: Optional[tuple[int, int]],
    group: int,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The product of a quantized input (``quantize_act``'s layout, or a fused producer's: ``norm_quant``,
    ``quantize_act(silu=True)``) and an FP8 weight that ``applies``.  Decode rows (``M <= MID_MAX_M``): the
    skinny and mid-size tensor-core tiles (``pick_config``); more rows: ``torch._scaled_mm`` (per-row weight
    scales, no bias) or the Triton GEMM."""
    m, k = xq.shape
    n = w.shape[0]
    if m > max(GEMV_MAX_M, MID_MAX_M):
        if block is None and bias is None and act != ACT_GROUP:
            rows = xs.reshape(1).expand(m).reshape(m, 1).contiguous() if act == ACT_STATIC else xs
            y = scaled_mm_rowwise(xq, rows, w, wscale, out_dtype)
            if y is not None:
                return y
        if block == (128, 128) and group == 128 and bias is None and act == ACT_GROUP:
            y = scaled_mm_blockwise(xq, xs, w, wscale, out_dtype)
            if y is not None:
                return y
        cfg = GEMM_CONFIG
    else:
        cfg = pick_config(m, n, k, act)
    return launch_q(xq, xs, w, wscale, act, block, group, bias, out_dtype, cfg)
