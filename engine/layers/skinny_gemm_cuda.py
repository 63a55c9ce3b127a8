"""Decode-shaped matmuls in Triton: a few activation rows against a large weight.

At decode each projection multiplies ``M`` = batch rows (1..64) by a weight
``W [N, K]`` that is read once from HBM per step: the step is bound by the
weight bytes, not by FLOPs, and batch-1 decode is a chain of GEMVs.  cuBLAS
leaves bandwidth on the table for some of these shapes (docs/benchmarks.md).
Two kernels here:

* ``_gemv_kernel`` (M <= 8, CUDA cores): each program streams ``BLOCK_N`` full
  weight rows in ``BLOCK_K`` chunks, the way they lie in memory, and keeps a
  float32 partial product per element that is reduced once at the end.  There
  is no split over K, so no reduction kernel; enough programs come from small
  ``BLOCK_N`` instead.
* ``_skinny_mma_kernel`` (M up to 64, tensor cores): the same weight stream
  through ``tl.dot`` with the rows of ``x`` padded to ``BLOCK_M``.

Both can compute their input on the fly as ``silu(gate) * up`` from a fused
gate/up output ``[M, 2K]`` (SwiGLU's down projection), with the same rounding
as ``fused_ops_cuda.silu_and_mul`` followed by a matmul, which saves that
kernel and its round trip.

``linear(x, w, bias, act)`` picks a kernel and its tile sizes from
``pick_config`` (the ``TUNED`` table, from ``bench/skinny_gemm.py``) and returns None where these kernels do not apply
(too many rows, a weight that is not row-contiguous, float32) or cuBLAS was
faster, so the caller falls back to ``F.linear``.  ``KVSHIP_DISABLE_SKINNY_GEMM=1``
turns them off (the benchmark's cuBLAS baseline).

On Hopper both can launch with programmatic dependent launch
(``fused_dispatch.use_pdl``, on by default): a program loads its first weight tile (weights
never depend on the previous kernel) before ``griddepcontrol.wait``, so the
weight stream starts while the kernel before it drains.

Only imported on CUDA, through ``kvship.engine.layers.fused_dispatch``; the
kernels also run under Triton's interpreter on CPU tensors (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kvship.common.envs import ENV
from kvship.engine.layers.fused_dispatch import use_pdl
from kvship.engine.layers.fused_ops_cuda import pdl_enter

ACT_NONE = 0
ACT_SILU_MUL = 1

# rows up to which the CUDA-core GEMV runs, and up to which the tensor-core kernel runs
GEMV_MAX_M = 8
MMA_MAX_M = 64


@triton.jit
def _load_input(x_ptr, k0, K, m_ok, k_ok, ACT: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_K]`` tile of the input; with ``ACT == 1`` it is ``silu(gate) * up``."""
    mask = m_ok[:, None] & k_ok[None, :]
    if ACT == 1:
        g = tl.load(x_ptr + k0, mask=mask, other=0.0)
        u = tl.load(x_ptr + K + k0, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        return (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    else:
        return tl.load(x_ptr + k0, mask=mask, other=0.0)


@triton.jit
def _norm_input_tile(x_ptr, r_ptr, k0, mask, HAS_RES: tl.constexpr):
    """``x (+ residual)`` tile, the sum rounded to the activation dtype as ``fused_ops_cuda.rmsnorm`` rounds it."""
    xv = tl.load(x_ptr + k0, mask=mask, other=0.0)
    if HAS_RES:
        xv = (xv.to(tl.float32) + tl.load(r_ptr + k0, mask=mask, other=0.0).to(tl.float32)).to(xv.dtype)
    return xv


@triton.jit
def _first_tile_after_wait(w_ptr, x_ptr, K, n_ok, m_ok, rk, ACT: tl.constexpr, USE_PDL: tl.constexpr):
    """Under PDL: the first weight tile streams in while the previous kernel finishes (weights never depend on
    it), then wait for that kernel and load the first input tile."""
    k_ok = rk < K
    w0 = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
    pdl_enter(USE_PDL)
    x0 = _load_input(x_ptr, 0, K, m_ok, k_ok, ACT)
    return w0, x0


@triton.jit
def _gemv_kernel(
    x,
    w,
    bias,
    y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    res,
    norm_w,
    res_out,
    normed,
    eps,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    NORM: tl.constexpr = False,
    HAS_RES: tl.constexpr = False,
    WRITE_NORMED: tl.constexpr = False,
):
    # NORM: the input is rmsnorm(x (+ res)) with weight norm_w (rows of K, contiguous); the per-row scale is
    # applied to the product at the end; the first program writes x + res to res_out (and the normalised rows to
    # normed, a second pass over its row)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_ptr = w + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    x_ptr = x + rm[:, None] * stride_xm + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = 0
    if NORM:
        # one pass: y = rstd * (w @ (norm_w * (x + res))) with the rows' sums of squares gathered on the way
        row_k = rm[:, None] * K + rk[None, :]  # res, res_out and normed are [M, K] contiguous
        r_ptr = res + row_k
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            mask = m_ok[:, None] & k_ok[None, :]
            if EVEN:
                wt = tl.load(w_ptr + k0, eviction_policy="evict_first")
            else:
                wt = tl.load(w_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
            xv = _norm_input_tile(x_ptr, r_ptr, k0, mask, HAS_RES)
            if HAS_RES:
                if pid == 0:
                    tl.store(res_out + row_k + k0, xv, mask=mask)
            xf = xv.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            xt = xf * tl.load(norm_w + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc += xt[:, None, :] * wt.to(tl.float32)[None, :, :]
        rstd = tl.rsqrt(ss / K + eps)
        if WRITE_NORMED:
            if pid == 0:  # the normalised rows for later consumers, rounded as rmsnorm rounds them
                for k0 in range(0, K, BLOCK_K):
                    k_ok = (k0 + rk) < K
                    mask = m_ok[:, None] & k_ok[None, :]
                    xv = _norm_input_tile(x_ptr, r_ptr, k0, mask, HAS_RES)
                    h = (xv.to(tl.float32) * rstd[:, None]).to(xv.dtype)
                    nv = tl.load(norm_w + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
                    tl.store(normed + row_k + k0, (nv[None, :] * h.to(tl.float32)).to(xv.dtype), mask=mask)
        acc = acc * rstd[:, None, None]
        k_start = K
    if USE_PDL:
        w0, x0 = _first_tile_after_wait(w_ptr, x_ptr, K, n_ok, m_ok, rk, ACT, USE_PDL)
        acc += x0.to(tl.float32)[:, None, :] * w0.to(tl.float32)[None, :, :]
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        if EVEN:
            wt = tl.load(w_ptr + k0, eviction_policy="evict_first")
        else:
            wt = tl.load(w_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        xt = _load_input(x_ptr, k0, K, m_ok, k_ok, ACT)
        acc += xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2)
    if HAS_BIAS:
        out += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rm[:, None] * stride_ym + rn[None, :], out.to(y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _skinny_mma_kernel(
    x,
    w,
    bias,
    y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_ptr = w + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    x_ptr = x + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = 0
    if USE_PDL:
        w0, x0 = _first_tile_after_wait(w_ptr, x_ptr, K, n_ok, m_ok, rk, ACT, USE_PDL)
        acc = tl.dot(x0, tl.trans(w0), acc)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        if EVEN:
            wt = tl.load(w_ptr + k0, eviction_policy="evict_first")
        else:
            wt = tl.load(w_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        xt = _load_input(x_ptr, k0, K, m_ok, k_ok, ACT)
        acc = tl.dot(xt, tl.trans(wt), acc)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
        acc.to(y.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@dataclass(frozen=True)
class SkinnyConfig:
    """Tile sizes of one launch.  ``mma`` picks the tensor-core kernel (``block_m`` >= 16)."""

    mma: bool
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1

    def grid(self, m: int, n: int) -> tuple[int, ...]:
        if self.mma:
            return (triton.cdiv(n, self.block_n), triton.cdiv(m, self.block_m))
        return (triton.cdiv(n, self.block_n),)


def bucket(m: int) -> int:
    """Row counts share a tuned config per power of two (1, 2, 4, ..., 64)."""
    return 1 << (max(m, 1) - 1).bit_length()


def _gemv(bn: int, bk: int, warps: int, bm: int = 1) -> SkinnyConfig:
    return SkinnyConfig(False, bm, bn, bk, num_warps=warps)


def _mma(bm: int, bn: int, bk: int) -> SkinnyConfig:
    return SkinnyConfig(True, bm, bn, bk, num_warps=4, num_stages=4)


# (N, K, bucket) -> config, or None for cuBLAS, for the Llama-3.1-8B projections on an H100 (bench/skinny_gemm.py;
# docs/benchmarks.md): a config is listed where it beat cuBLAS by >= 3% inside a CUDA graph (down_proj with
# SiLU-and-mul fused into its input).  Other buckets of these shapes stay on cuBLAS; other shapes use
# _default_config.
_QKV, _O, _GATE_UP, _DOWN, _LM_HEAD = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)
TUNED: dict[tuple[int, int, int], Optional[SkinnyConfig]] = {
    (*_QKV, 1): _gemv(4, 1024, 4),
    (*_O, 1): _gemv(2, 2048, 4),
    (*_GATE_UP, 1): _gemv(2, 2048, 4),
    (*_DOWN, 1): _gemv(8, 512, 8),
    (*_LM_HEAD, 1): _gemv(2, 2048, 4),
    (*_QKV, 2): None,
    (*_O, 2): _gemv(8, 512, 8, bm=2),
    (*_GATE_UP, 2): None,
    (*_DOWN, 2): None,
    (*_LM_HEAD, 2): _gemv(8, 512, 8, bm=2),
    (*_QKV, 4): None,
    (*_O, 4): None,
    (*_GATE_UP, 4): None,
    (*_DOWN, 4): None,
    (*_LM_HEAD, 4): None,
    (*_QKV, 8): _mma(16, 32, 128),
    (*_O, 8): _mma(16, 32, 256),
    (*_GATE_UP, 8): None,
    (*_DOWN, 8): None,
    (*_LM_HEAD, 8): _mma(16, 32, 256),
    (*_QKV, 16): _mma(16, 32, 128),
    (*_O, 16): _mma(16, 32, 256),
    (*_GATE_UP, 16): None,
    (*_DOWN, 16): None,
    (*_LM_HEAD, 16): _mma(16, 32, 256),
    (*_QKV, 32): None,
    (*_O, 32): None,
    (*_GATE_UP, 32): None,
    (*_DOWN, 32): None,
    (*_LM_HEAD, 32): _mma(32, 32, 256),
    (*_QKV, 64): None,
    (*_O, 64): None,
    (*_GATE_UP, 64): None,
    (*_DOWN, 64): None,
    (*_LM_HEAD, 64): _mma(64, 32, 128),
}
# Qwen3-30B-A3B's projections on an H100 (bench/skinny_gemm.py --shape qwen3-30b-a3b, docs/benchmarks.md), the
# same rule; the experts run the fused-MoE kernels (engine/layers/moe)
_Q3_QKV, _Q3_O, _Q3_LM_HEAD, _Q3_ROUTER = (5120, 2048), (2048, 4096), (151936, 2048), (128, 2048)
TUNED.update(
    {
        (*_Q3_QKV, 1): _gemv(4, 1024, 4),
        (*_Q3_QKV, 2): None,
        (*_Q3_QKV, 4): None,
        (*_Q3_QKV, 8): None,
        (*_Q3_O, 1): _gemv(1, 1024, 4),
        (*_Q3_O, 2): _gemv(8, 1024, 8, bm=2),
        (*_Q3_O, 4): None,
        (*_Q3_O, 8): _mma(16, 16, 256),
        (*_Q3_LM_HEAD, 1): _gemv(4, 1024, 4),
        (*_Q3_LM_HEAD, 2): None,
        (*_Q3_LM_HEAD, 4): None,
        (*_Q3_LM_HEAD, 8): _mma(16, 64, 256),
        (*_Q3_ROUTER, 1): _gemv(1, 2048, 4),
        (*_Q3_ROUTER, 2): _gemv(2, 1024, 8, bm=2),
        (*_Q3_ROUTER, 4): _gemv(2, 1024, 8, bm=4),
        (*_Q3_ROUTER, 8): _gemv(2, 1024, 8, bm=8),
    }
)


# One rank of the Llama-3.1-8B shape at --tp-size 2 on an H200 (bench/skinny_gemm.py --tp-size 2, docs/benchmarks.md
# "session 24"): qkv and gate/up split by columns, o and down by rows, the vocabulary halved; the same rule
_TP2_QKV, _TP2_O, _TP2_GATE_UP, _TP2_DOWN, _TP2_LM_HEAD = (
    (3072, 4096),
    (4096, 2048),
    (14336, 4096),
    (4096, 7168),
    (
        64128,
        4096,
    ),
)
TUNED.update(
    {
        (*_TP2_QKV, 1): _gemv(4, 1024, 4),  # 7.3 vs 10.9 us (cuBLAS)
        (*_TP2_QKV, 2): _gemv(2, 1024, 8, bm=2),  # 10.7 vs 11.7
        (*_TP2_QKV, 4): None,
        (*_TP2_QKV, 8): _mma(16, 32, 256),  # 9.1 vs 11.7
        (*_TP2_QKV, 16): _mma(16, 32, 256),  # 9.1 vs 11.8
        (*_TP2_QKV, 32): _mma(32, 32, 256),  # 10.2 vs 12.1
        (*_TP2_QKV, 64): None,
        (*_TP2_O, 1): _gemv(4, 512, 4),  # 6.0 vs 7.2
        (*_TP2_O, 2): None,
        (*_TP2_O, 4): None,
        (*_TP2_O, 8): _mma(16, 32, 256),  # 6.4 vs 7.1
        (*_TP2_O, 16): _mma(16, 32, 256),  # 6.5 vs 7.3
        (*_TP2_O, 32): _mma(32, 32, 256),  # 6.9 vs 7.2
        (*_TP2_O, 64): None,
        (*_TP2_GATE_UP, 1): None,  # 30.3 vs 30.4: cuBLAS (the untuned default GEMV took 32.1)
        (*_TP2_DOWN, 1): _gemv(8, 512, 8),  # 18.2 vs 19.6 (the untuned default took 24.7)
        (*_TP2_LM_HEAD, 1): None,  # 122.5 vs 125.1: within 3%, cuBLAS (the default took 131.2)
    }
)
for _m in (2, 4, 8, 16, 32, 64):  # gate/up, down and lm_head: cuBLAS at every other bucket
    for _shape in (_TP2_GATE_UP, _TP2_DOWN, _TP2_LM_HEAD):
        TUNED[(*_shape, _m)] = None


# DeepSeek-V2-Lite's dense projections on an H200 (bench/skinny_gemm.py --shape deepseek-v2-lite --ms 1,2,
# docs/benchmarks.md): the fused q / kv_a projection, o_proj, the shared experts' gate/up and down (SiLU-and-mul
# in its input); the same rule
_DS_QKV_A, _DS_O, _DS_SH_GATE_UP, _DS_SH_DOWN = (3648, 2048), (2048, 2048), (5632, 2048), (2048, 2816)
TUNED.update(
    {
        (*_DS_QKV_A, 1): _gemv(4, 512, 4),  # 5.7 vs 6.4 us (cuBLAS)
        (*_DS_QKV_A, 2): None,
        (*_DS_O, 1): _gemv(2, 1024, 4),  # 3.5 vs 6.1
        (*_DS_O, 2): _gemv(4, 1024, 8, bm=2),  # 4.4 vs 6.1
        (*_DS_SH_GATE_UP, 1): _gemv(8, 512, 4),  # 7.1 vs 8.4
        (*_DS_SH_GATE_UP, 2): None,
        (*_DS_SH_DOWN, 1): _gemv(4, 1024, 8),  # 5.2 vs 8.0
        (*_DS_SH_DOWN, 2): _gemv(8, 1024, 8, bm=2),  # 5.8 vs 8.1
    }
)


def _default_config(m: int, n: int, k: int) -> Optional[SkinnyConfig]:
    """Shapes nobody tuned: the batch-1 GEMV that won on most H100 shapes; cuBLAS for more rows."""
    if m != 1:
        return None
    return _gemv(2, min(2048, triton.next_power_of_2(k)), 4)


def pick_config(m: int, n: int, k: int) -> Optional[SkinnyConfig]:
    """The launch config for ``[m, k] x [n, k]^T``, or None where cuBLAS is the better choice."""
    if m < 1 or m > MMA_MAX_M:
        return None
    key = (n, k, bucket(m))
    return TUNED[key] if key in TUNED else _default_config(m, n, k)


# (N, K, bucket) -> the GEMV config that computes an RMSNorm in its input (``norm_linear``), or None where the
# norm kernel + the plain matmul were faster (bench/skinny_gemm.py --norm; docs/benchmarks.md).  Every program
# reads the input row, its residual and the norm weight besides its BLOCK_N weight rows, so a GEMV of many
# narrow programs (the 8B shape's gate/up: 14k programs of 2 rows) pays more in input reads than the norm
# kernel costs.
NORM_TUNED: dict[tuple[int, int, int], Optional[SkinnyConfig]] = {
    # Qwen3-30B-A3B: qkv at batch 1 (10.1 vs 10.8 us), the router at every bucket (2.5-4.7 vs 3.8-5.5 us)
    (*_Q3_QKV, 1): _gemv(8, 512, 4),
    (*_Q3_ROUTER, 1): _gemv(2, 2048, 4),
    (*_Q3_ROUTER, 2): _gemv(2, 1024, 8, bm=2),
    (*_Q3_ROUTER, 4): _gemv(2, 1024, 8, bm=4),
    (*_Q3_ROUTER, 8): _gemv(2, 1024, 8, bm=8),
    # Llama-3.1-8B: qkv ties at batch 1 (20.4 vs 20.3 us) and gate/up loses (79.7 vs 77.5 us): the norm apart
    (*_QKV, 1): None,
    (*_GATE_UP, 1): None,
}


def pick_norm_config(m: int, n: int, k: int) -> Optional[SkinnyConfig]:
    """The config of ``norm_linear`` for ``[m, k] x [n, k]^T``, or None (run the norm, then ``linear``).
    Untuned shapes: the plain GEMV config where the matrix is small (a router: at most 1M
    elements); larger matrices measured no gain (docs/benchmarks.md)."""
    if m < 1 or m > GEMV_MAX_M:
        return None
    key = (n, k, bucket(m))
    if key in NORM_TUNED:
        return NORM_TUNED[key]
    cfg = pick_config(m, n, k)
    if cfg is None or cfg.mma:
        return None
    return cfg if n * k <= 1 << 20 else None


def _enabled() -> bool:
    return not ENV.DISABLE_SKINNY_GEMM


def applies(x: torch.Tensor, w: torch.Tensor, act: int = ACT_NONE) -> bool:
    """Whether ``x`` (rows x features) and ``w`` are something these kernels take (shape, dtype, layout)."""
    if not _enabled() or x.dim() != 2 or w.dim() != 2:
        return False
    m = x.shape[0]
    k = w.shape[1]
    if m < 1 or m > MMA_MAX_M or x.dtype != w.dtype:
        return False
    # float32 models stay on cuBLAS on the GPU (CPU tensors only get here under Triton's interpreter, in tests)
    if x.is_cuda and w.dtype not in (torch.bfloat16, torch.float16):
        return False
    if w.stride(1) != 1 or x.stride(1) != 1:
        return False
    return x.shape[1] == (2 * k if act == ACT_SILU_MUL else k)


def launch(
    x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor, act: int, cfg: SkinnyConfig
) -> torch.Tensor:
    """Run ``cfg`` for ``y = act(x) @ w^T (+ bias)``; no checks (``linear`` and the benchmark check)."""
    m = x.shape[0]
    n, k = w.shape
    if not cfg.mma and m > cfg.block_m:
        raise ValueError(f"a GEMV config of block_m={cfg.block_m} cannot take {m} rows")
    even = n % cfg.block_n == 0 and k % cfg.block_k == 0
    pdl = use_pdl(x)
    common = dict(
        ACT=act,
        HAS_BIAS=bias is not None,
        EVEN=even,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    b = bias if bias is not None else w
    if cfg.mma:
        _skinny_mma_kernel[cfg.grid(m, n)](x, w, b, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), **common)
    else:
        _gemv_kernel[cfg.grid(m, n)](
            x, w, b, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), x, x, x, x, 0.0, **common
        )  # fmt: skip
    return y


def norm_linear(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    keep_normed: bool = False,
    cfg: Optional[SkinnyConfig] = None,
) -> Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """``rmsnorm(x (+ residual)) @ w^T + bias`` in one GEMV kernel (batch-1-sized decode): returns ``(y, x +
    residual (x itself without one), the normalised rows if keep_normed)``.  One pass over the weights: the
    product is taken with ``norm_w * (x + residual)`` and scaled by each row's ``rsqrt(mean square + eps)`` at
    the end, so the normalised input is not rounded to the activation dtype first (the difference is within
    bf16 rounding of the product); the residual sum and the normalised rows are rounded as
    ``fused_ops_cuda.rmsnorm`` rounds them.  None where the GEMV kernel does not apply (more rows, PDL on, a layout it does
    not take, cuBLAS picked for the shape): the caller then runs the norm and the matmul apart."""
    if not applies(x, w) or not x.is_contiguous() or use_pdl(x):
        return None
    m = x.shape[0]
    n, k = w.shape
    cfg = cfg or pick_norm_config(m, n, k)
    if cfg is None or cfg.mma or m > cfg.block_m or norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        return None
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        return None
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    normed = torch.empty_like(x) if keep_normed else None
    _gemv_kernel[cfg.grid(m, n)](
        x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        x if residual is None else residual, norm_weight, res_out, x if normed is None else normed, float(eps),
        ACT=ACT_NONE, HAS_BIAS=bias is not None, EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, USE_PDL=False, launch_pdl=False,
        NORM=True, HAS_RES=residual is not None, WRITE_NORMED=keep_normed,
    )  # fmt: skip
    return y, res_out, normed


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    act: int = ACT_NONE,
    cfg: Optional[SkinnyConfig] = None,
) -> Optional[torch.Tensor]:
    """``act(x) @ w^T + bias`` for ``x [M, K]`` (``[M, 2K]`` with ``ACT_SILU_MUL``), or None where these kernels
    do not apply or cuBLAS is faster (the caller then runs PyTorch)."""
    if not applies(x, w, act):
        return None
    m = x.shape[0]
    n, k = w.shape
    if cfg is None:
        cfg = pick_config(m, n, k)
        if cfg is None:
            return None
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    return launch(x, w, bias, y, act, cfg)
