"""Block-FP8 fused MoE: the ``triton`` runner's scheme with e4m3 experts and per-token-group activations.

The arithmetic is the reference's (docs/quantization.md, "Reference arithmetic",
MoE; ``fp8.moe_reference``): ``x`` quantised per token and group of ``G``
columns (``G = block[1]``, 128), each expert's weights ``w13 [E, 2I, H]`` /
``w2 [E, H, I]`` e4m3 with one fp32 scale per ``block`` (``w13_scale [E, 2I/bn,
ceil(H/G)]``, ``w2_scale [E, ceil(H/bn), ceil(I/G)]``), ``silu(gate) * up``
computed in fp32 and quantised per token-group again before the down GEMM.

Steps for ``M`` tokens and ``n = M * k`` (token, expert) pairs:

* ``_quant_groups_kernel``: ``x`` -> e4m3 ``[M, H]`` + fp32 scales ``[M, ceil(H/G)]``.
* Aligned GEMMs (``fused_experts_fp8``): the pairs sorted and padded per expert
  by ``triton_moe.align_block_size`` (the bf16 runner's, no host sync), then
  ``_gate_up_fp8_kernel``: per ``[BLOCK_M, G]`` tile of one expert's pairs and
  gate/up columns, an FP8 MMA per K-block of ``G`` whose fp32 result is scaled
  by the rows' activation scales and the columns' weight-block scales and added
  to the fp32 accumulators; the epilogue's ``silu(g) * u`` tile is exactly one
  token-group of the down GEMM's input, so it is quantised in place (e4m3 +
  one scale per row) and the fp32/bf16 activation never reaches memory.
  ``_down_fp8_kernel``: the same K loop over ``I``, times the routing weight,
  into per-pair rows; ``triton_moe._topk_sum_kernel`` sums each token's ``k``
  rows in fp32.  Non-persistent (one program per tile, tiles past
  ``num_tokens_post_padded`` return) or persistent (one program per
  multiprocessor looping over the used tiles), as the bf16 kernels.
* Decode (at most ``GEMV_MAX_PAIRS`` pairs): ``_gate_up_gemv_fp8_kernel`` (one
  program per pair and ``BLOCK_N`` columns, weights dequantised in the kernel,
  ``silu(g) * u`` stored in fp32) and ``_down_sum_gemv_fp8_kernel`` (one program
  per token and ``BLOCK_N`` output columns: it quantises its token's ``k``
  activation rows per group, dequantises the down weights and sums the ``k``
  weighted rows in fp32): no alignment, no per-pair output.  The quantisation
  and both GEMVs launch under programmatic dependent launch on Hopper
  (``fused_dispatch.use_pdl``).  Quantising the row inside the gate/up GEMV
  instead (each program its groups' scales) was measured 1.7x slower at one
  token on an H200 (docs/quantization.md, "MoE experts").

Ids outside ``[0, E)`` (``-1``: another rank's expert under expert parallelism,
``absent=True``) add nothing.  Every launch grid depends on ``M`` only and no
step reads the device on the host: CUDA-graph safe.  Runs on CPU tensors under
``TRITON_INTERPRET=1`` (whose fp32 -> e4m3 cast can round differently from
torch's at an exponent boundary: compare there with a tolerance).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvship.common.envs import ENV
from kvship.engine.layers.fused_dispatch import use_pdl
from kvship.engine.layers.fused_ops_cuda import pdl_enter
from kvship.engine.layers.moe.kernel_config import GEMV_MAX_PAIRS
from kvship.engine.layers.moe.triton_moe import (
    _block_coords,
    _grid,
    align_block_size,
    topk_sum,
)

FP8_MAX = 448.0
ACT_EPS = 1e-10  # fp8_math.ACT_EPS: the smallest amax an activation scale is made from


@triton.jit
def _quantize(v, scale_den):
    """``v`` (fp32) over ``scale_den`` (broadcast), clamped to +-448, rounded to e4m3 (nearest even)."""
    q = tl.math.div_rn(v, scale_den)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return q.to(tl.float8e4nv)


@triton.jit
def _group_scale(amax):
    return tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)


@triton.jit
def _quant_groups_kernel(
    x_ptr, q_ptr, s_ptr, cols, stride_xm, stride_qm, stride_sm, GROUP: tl.constexpr, USE_PDL: tl.constexpr
):
    # one program per (row, group of GROUP columns): s = max(amax, 1e-10) / 448, q = e4m3(x / s)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    pdl_enter(USE_PDL)
    offs = g * GROUP + tl.arange(0, GROUP)
    mask = offs < cols
    v = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    s = _group_scale(tl.max(tl.abs(v), axis=0))
    tl.store(q_ptr + row * stride_qm + offs, _quantize(v, s), mask=mask)
    tl.store(s_ptr + row * stride_sm + g, s)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M, K]``, fp32 scales ``[M, ceil(K/group)]``): ``fp8_math.qdq_groups``'s scales and
    values before dequantisation."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, triton.cdiv(k, group), dtype=torch.float32, device=x.device)
    if m:
        pdl = use_pdl(x)
        _quant_groups_kernel[(m, s.shape[1])](
            x, q, s, k, x.stride(0), q.stride(0), s.stride(0), GROUP=group, USE_PDL=pdl, launch_pdl=pdl
        )
    return q, s


# --- aligned GEMMs ------------------------------------------------------------------------------------------
@triton.jit
def _scaled_k_loop(
    a_ptrs,
    as_ptrs,
    b_ptrs,
    bs_ptrs,
    mask_rows,
    mask_cols,
    k_size,
    acc,
    stride_bsk,
    BLOCK_K: tl.constexpr,
):
    """``acc += sum_kb (A_kb @ B_kb) * a_scale[row, kb] * b_scale[col, kb]`` over K-blocks of ``BLOCK_K`` (the
    scale block): ``a_ptrs`` a ``[M, K]`` e4m3 tile of gathered rows, ``as_ptrs`` their ``[M]`` scales of block 0,
    ``b_ptrs`` a ``[K, N]`` e4m3 weight tile, ``bs_ptrs`` its ``[N]`` column scales of block 0."""
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, tl.cdiv(k_size, BLOCK_K)):
        mask_k = offs_k < k_size - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_rows[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_cols[None, :], other=0.0)
        a_s = tl.load(as_ptrs + k0, mask=mask_rows, other=0.0)
        b_s = tl.load(bs_ptrs + k0 * stride_bsk, mask=mask_cols, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _gate_up_fp8_tile(
    pid_m,
    pid_n,
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    h_ptr,
    hs_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    inter_size,
    hidden_size,
    top_k: tl.constexpr,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_hm,
    stride_hsm,
    BLOCK_SIZE_M: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    RAW_OUT: tl.constexpr,
):
    # BLOCK_N == GROUP: this tile's silu(g) * u columns are one token-group of the down GEMM's input.  RAW_OUT:
    # store silu(g) * u in fp32 instead (per-channel experts quantise the whole row afterwards)
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    mask_m = pair < num_pairs
    row = (pair // top_k).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * GROUP + tl.arange(0, GROUP)
    mask_n = offs_n < inter_size
    offs_k = tl.arange(0, GROUP)
    a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :]
    as_ptrs = as_ptr + row * stride_asm
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    gs_ptrs = ws_ptr + expert * stride_wse + (offs_n // BLOCK_ROWS) * stride_wsn
    us_ptrs = ws_ptr + expert * stride_wse + ((offs_n + inter_size) // BLOCK_ROWS) * stride_wsn
    acc_g = tl.zeros((BLOCK_SIZE_M, GROUP), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_SIZE_M, GROUP), dtype=tl.float32)
    acc_g = _scaled_k_loop(a_ptrs, as_ptrs, g_ptrs, gs_ptrs, mask_m, mask_n, hidden_size, acc_g, stride_wsk, GROUP)
    u_ptrs = g_ptrs + inter_size * stride_wn
    acc_u = _scaled_k_loop(a_ptrs, as_ptrs, u_ptrs, us_ptrs, mask_m, mask_n, hidden_size, acc_u, stride_wsk, GROUP)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    h = tl.where(mask_n[None, :], h, 0.0)
    pair64 = pair.to(tl.int64)
    h_ptrs = h_ptr + pair64[:, None] * stride_hm + offs_n[None, :]
    if RAW_OUT:
        tl.store(h_ptrs, h, mask=mask_m[:, None] & mask_n[None, :])
    else:
        s = _group_scale(tl.max(tl.abs(h), axis=1))
        tl.store(h_ptrs, _quantize(h, s[:, None]), mask=mask_m[:, None] & mask_n[None, :])
        tl.store(hs_ptr + pair64 * stride_hsm + pid_n, s, mask=mask_m)


@triton.jit
def _gate_up_fp8_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    h_ptr,
    hs_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntp_ptr,
    num_pairs,
    padded_len,
    inter_size,
    hidden_size,
    top_k: tl.constexpr,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_hm,
    stride_hsm,
    BLOCK_SIZE_M: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    PERSISTENT: tl.constexpr = False,
    RAW_OUT: tl.constexpr = False,
):
    num_pid_n = tl.cdiv(inter_size, GROUP)
    if PERSISTENT:
        num_pid_m = tl.cdiv(tl.load(ntp_ptr), BLOCK_SIZE_M)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _block_coords(tile, num_pid_m, num_pid_n, GROUP_SIZE_M)
            _gate_up_fp8_tile(
                pid_m, pid_n, a_ptr, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, sorted_ids_ptr, expert_ids_ptr,
                num_pairs, inter_size, hidden_size, top_k, stride_am, stride_asm, stride_we, stride_wn,
                stride_wse, stride_wsn, stride_wsk, stride_hm, stride_hsm, BLOCK_SIZE_M, GROUP, BLOCK_ROWS, RAW_OUT,
            )  # fmt: skip
    else:
        pid_m, pid_n = _block_coords(tl.program_id(0), tl.cdiv(padded_len, BLOCK_SIZE_M), num_pid_n, GROUP_SIZE_M)
        if pid_m * BLOCK_SIZE_M >= tl.load(ntp_ptr):
            return
        _gate_up_fp8_tile(
            pid_m, pid_n, a_ptr, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, sorted_ids_ptr, expert_ids_ptr,
            num_pairs, inter_size, hidden_size, top_k, stride_am, stride_asm, stride_we, stride_wn,
            stride_wse, stride_wsn, stride_wsk, stride_hm, stride_hsm, BLOCK_SIZE_M, GROUP, BLOCK_ROWS, RAW_OUT,
        )  # fmt: skip


@triton.jit
def _down_fp8_tile(
    pid_m,
    pid_n,
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    hidden_size,
    inter_size,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_om,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    mask_m = pair < num_pairs
    pair64 = pair.to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    mask_n = offs_n < hidden_size
    offs_k = tl.arange(0, GROUP)
    a_ptrs = a_ptr + pair64[:, None] * stride_am + offs_k[None, :]
    as_ptrs = as_ptr + pair64 * stride_asm
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    ws_ptrs = ws_ptr + expert * stride_wse + (offs_n // BLOCK_ROWS) * stride_wsn
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc = _scaled_k_loop(a_ptrs, as_ptrs, w_ptrs, ws_ptrs, mask_m, mask_n, inter_size, acc, stride_wsk, GROUP)
    route_w = tl.load(weights_ptr + pair, mask=mask_m, other=0.0)
    acc = acc * route_w[:, None]
    out_ptrs = out_ptr + pair64[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_fp8_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntp_ptr,
    num_pairs,
    padded_len,
    hidden_size,
    inter_size,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_om,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    PERSISTENT: tl.constexpr = False,
):
    num_pid_n = tl.cdiv(hidden_size, BLOCK_SIZE_N)
    if PERSISTENT:
        num_pid_m = tl.cdiv(tl.load(ntp_ptr), BLOCK_SIZE_M)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _block_coords(tile, num_pid_m, num_pid_n, GROUP_SIZE_M)
            _down_fp8_tile(
                pid_m, pid_n, a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
                num_pairs, hidden_size, inter_size, stride_am, stride_asm, stride_we, stride_wn, stride_wse,
                stride_wsn, stride_wsk, stride_om, BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP, BLOCK_ROWS,
            )  # fmt: skip
    else:
        pid_m, pid_n = _block_coords(tl.program_id(0), tl.cdiv(padded_len, BLOCK_SIZE_M), num_pid_n, GROUP_SIZE_M)
        if pid_m * BLOCK_SIZE_M >= tl.load(ntp_ptr):
            return
        _down_fp8_tile(
            pid_m, pid_n, a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
            num_pairs, hidden_size, inter_size, stride_am, stride_asm, stride_we, stride_wn, stride_wse,
            stride_wsn, stride_wsk, stride_om, BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP, BLOCK_ROWS,
        )  # fmt: skip


# --- decode GEMVs -------------------------------------------------------------------------------------------
@triton.jit
def _gate_up_gemv_fp8_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    ids_ptr,
    h_ptr,
    num_experts,
    inter_size,
    hidden_size,
    top_k: tl.constexpr,
    stride_xm,
    stride_xsm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_hm,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    K_UNROLL: tl.constexpr,
    USE_PDL: tl.constexpr,
    MMA_M: tl.constexpr = 0,
):
    # one (token, expert) pair x BLOCK_N columns of gate and up; weights dequantised per K-block in the kernel,
    # K_UNROLL blocks an iteration (more bytes in flight; the blocks still added in order).
    # MMA_M > 0: the product on the tensor cores instead, the BLOCK_N weight rows as the MMA's left operand
    # (BLOCK_N >= 64: Hopper's warpgroup MMA on the e4m3 values, no widening), the pair's quantised row as the
    # right one (padded with zero rows to MMA_M); each K-block's product leaves the tensor cores, is scaled by
    # its weight block's and the row's group scale and added in fp32.  BLOCK_N rows then lie in one weight row
    # block on both halves (the caller checks inter_size); K_UNROLL is not used.
    pair = tl.program_id(0)
    pdl_enter(USE_PDL)  # the expert id comes from the routing kernel, the activations from the quantisation
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):  # absent: its row is never read
        return
    row = (pair // top_k).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter_size
    offs_k = tl.arange(0, GROUP)
    g_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + inter_size * stride_wn
    if MMA_M > 0:
        rm = tl.arange(0, MMA_M)
        gs_ptr = ws_ptr + expert * stride_wse + (n0 // BLOCK_ROWS) * stride_wsn
        us_ptr = ws_ptr + expert * stride_wse + ((n0 + inter_size) // BLOCK_ROWS) * stride_wsn
        xm_ptrs = xq_ptr + row * stride_xm + rm[:, None] * 0 + offs_k[None, :]
        mma_g = tl.zeros((BLOCK_N, MMA_M), dtype=tl.float32)
        mma_u = tl.zeros((BLOCK_N, MMA_M), dtype=tl.float32)
        for kg in range(0, tl.cdiv(hidden_size, GROUP)):
            mask_k = offs_k < hidden_size - kg * GROUP
            xt = tl.load(xm_ptrs + kg * GROUP, mask=(rm == 0)[:, None] & mask_k[None, :], other=0.0)
            xsc = tl.load(xs_ptr + row * stride_xsm + kg)
            m2 = mask_n[:, None] & mask_k[None, :]
            wg = tl.load(g_ptrs + kg * GROUP, mask=m2, other=0.0)
            wu = tl.load(u_ptrs + kg * GROUP, mask=m2, other=0.0)
            mma_g += tl.dot(wg, tl.trans(xt)) * (tl.load(gs_ptr + kg * stride_wsk) * xsc)
            mma_u += tl.dot(wu, tl.trans(xt)) * (tl.load(us_ptr + kg * stride_wsk) * xsc)
        first = (rm == 0)[None, :]
        g = tl.sum(tl.where(first, mma_g, 0.0), axis=1)
        u = tl.sum(tl.where(first, mma_u, 0.0), axis=1)
    else:
        gs_ptrs = ws_ptr + expert * stride_wse + (offs_n // BLOCK_ROWS) * stride_wsn
        us_ptrs = ws_ptr + expert * stride_wse + ((offs_n + inter_size) // BLOCK_ROWS) * stride_wsn
        x_ptrs = xq_ptr + row * stride_xm + offs_k
        acc_g = tl.zeros((BLOCK_N, GROUP), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, GROUP), dtype=tl.float32)
        n_groups = tl.cdiv(hidden_size, GROUP)
        for k0 in range(0, tl.cdiv(n_groups, K_UNROLL)):
            for j in tl.static_range(K_UNROLL):
                kg = k0 * K_UNROLL + j
                mask_k = offs_k < hidden_size - kg * GROUP  # all False past the last block: it adds zeros
                ks = tl.minimum(kg, n_groups - 1)  # the scales' block, a real one past the last
                a = tl.load(x_ptrs + kg * GROUP, mask=mask_k, other=0.0).to(tl.float32) * tl.load(
                    xs_ptr + row * stride_xsm + ks
                )
                m2 = mask_n[:, None] & mask_k[None, :]
                g_s = tl.load(gs_ptrs + ks * stride_wsk, mask=mask_n, other=0.0)
                u_s = tl.load(us_ptrs + ks * stride_wsk, mask=mask_n, other=0.0)
                acc_g += tl.load(g_ptrs + kg * GROUP, mask=m2, other=0.0).to(tl.float32) * g_s[:, None] * a[None, :]
                acc_u += tl.load(u_ptrs + kg * GROUP, mask=m2, other=0.0).to(tl.float32) * u_s[:, None] * a[None, :]
        g = tl.sum(acc_g, axis=1)
        u = tl.sum(acc_u, axis=1)
    tl.store(h_ptr + pair.to(tl.int64) * stride_hm + offs_n, g * tl.sigmoid(g) * u, mask=mask_n)


@triton.jit
def _down_sum_gemv_fp8_kernel(
    h_ptr,
    w_ptr,
    ws_ptr,
    ids_ptr,
    weights_ptr,
    y_ptr,
    num_experts,
    hidden_size,
    inter_size,
    stride_hm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_ym,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    K_UNROLL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # one token x BLOCK_N output columns: its TOP_K activation rows (fp32) quantised per group here (every
    # program of the token computes the same scales), the TOP_K experts' down weights dequantised, weighted sum;
    # K_UNROLL K-blocks an iteration (added in order)
    m = tl.program_id(0).to(tl.int64)
    pdl_enter(USE_PDL)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden_size
    offs_k = tl.arange(0, GROUP)
    js = tl.arange(0, TOP_K_P2)
    expert = tl.load(ids_ptr + m * TOP_K + js, mask=js < TOP_K, other=-1).to(tl.int64)
    present = (expert >= 0) & (expert < num_experts)
    route_w = tl.load(weights_ptr + m * TOP_K + js, mask=present, other=0.0)
    expert = tl.where(present, expert, 0)
    h_ptrs = h_ptr + (m * TOP_K + js)[:, None] * stride_hm + offs_k[None, :]
    w_ptrs = (
        w_ptr
        + expert[:, None, None] * stride_we
        + offs_n[None, :, None].to(tl.int64) * stride_wn
        + offs_k[None, None, :]
    )
    ws_ptrs = ws_ptr + expert[:, None] * stride_wse + (offs_n // BLOCK_ROWS)[None, :] * stride_wsn
    row_ok = present[:, None, None] & mask_n[None, :, None]
    acc = tl.zeros((TOP_K_P2, BLOCK_N, GROUP), dtype=tl.float32)
    n_groups = tl.cdiv(inter_size, GROUP)
    for k0 in range(0, tl.cdiv(n_groups, K_UNROLL)):
        for j in tl.static_range(K_UNROLL):
            kg = k0 * K_UNROLL + j
            mask_k = offs_k < inter_size - kg * GROUP  # all False past the last block: it adds zeros
            ks = tl.minimum(kg, n_groups - 1)
            h = tl.load(h_ptrs + kg * GROUP, mask=present[:, None] & mask_k[None, :], other=0.0)
            s = _group_scale(tl.max(tl.abs(h), axis=1))
            a = _quantize(h, s[:, None]).to(tl.float32) * s[:, None]
            w_s = tl.load(ws_ptrs + ks * stride_wsk, mask=present[:, None] & mask_n[None, :], other=0.0)
            w = tl.load(w_ptrs + kg * GROUP, mask=row_ok & mask_k[None, None, :], other=0.0).to(tl.float32)
            acc += w * w_s[:, :, None] * a[:, None, :]
    y = tl.sum(tl.sum(acc, axis=2) * route_w[:, None], axis=0)
    tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


# --- launch -------------------------------------------------------------------------------------------------
# bench/fp8_moe.py --gemv-sweep 1 on an H200, Qwen3-30B-A3B layer at one token (docs/quantization.md, "MoE
# experts"): 21.3 us with two K-blocks an iteration in both GEMVs (session 36; 26.6 us for session 25's
# one-block loops without PDL); session 38: the gate/up product on the tensor cores (MMA_BLOCK_N=64,
# _gate_up_gemv_fp8_kernel's MMA_M form), 21.1 -> 20.2-20.4 us at one token and 37.8-38.0 -> 33.5-34.4 at two
# (KVSHIP_FP8_MOE_GATE_UP_MMA=0: the CUDA-core GEMV)
GEMV_CONFIG_FP8 = dict(
    BLOCK_N=16, num_warps=8, num_stages=3, DOWN_BLOCK_N=8, down_num_warps=8, K_UNROLL=2, DOWN_K_UNROLL=2,
    MMA_BLOCK_N=ENV.FP8_MOE_GATE_UP_MMA,
)  # fmt: skip


def default_config_fp8(m: int, num_experts: int, top_k: int) -> dict:
    """Launch config of the FP8 kernels for ``m`` tokens: the GEMVs for at most ``GEMV_MAX_PAIRS`` pairs, else
    the aligned GEMMs (the gate/up tile's width is the token-group; ``BLOCK_SIZE_N`` is the down GEMM's)."""
    if m * top_k <= GEMV_MAX_PAIRS:
        return {"gemv": dict(GEMV_CONFIG_FP8)}
    if m * top_k <= num_experts * 2:
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, GROUP_SIZE_M=1, num_warps=4, num_stages=3)
    if m <= 512:
        return dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=128, GROUP_SIZE_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, GROUP_SIZE_M=8, num_warps=8, num_stages=3, persistent=True)


def _check(x, w13, w13_scale, w2, w2_scale, block) -> None:
    bn, group = block
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 experts must be float8_e4m3fn, got {w13.dtype} / {w2.dtype}")
    if group & (group - 1) or group < 16 or inter % bn:
        raise ValueError(f"FP8 MoE kernels need a power-of-2 column block >= 16 and whole row blocks, got {block}")
    want13 = (num_experts, two_i // bn, triton.cdiv(hidden, group))
    want2 = (num_experts, triton.cdiv(hidden, bn), triton.cdiv(inter, group))
    if tuple(w13_scale.shape) != want13 or tuple(w2_scale.shape) != want2:
        raise ValueError(
            f"FP8 expert scales {tuple(w13_scale.shape)} / {tuple(w2_scale.shape)}, want {want13} / {want2}"
        )
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("expert weights must be contiguous in their last dim")


def _align(topk_ids: torch.Tensor, bm: int, num_experts: int):
    """The pairs sorted and padded per expert in blocks of ``bm`` (``align_block_size``; ids of ``-1``, absent,
    are in no run)."""
    return align_block_size(topk_ids, bm, num_experts)


def _down_and_sum(hq, hs, w2, s2, s2_strides, weights, aligned, x, topk_ids, cfg, group, block_rows, absent):
    """The aligned down GEMM over the quantised ``silu(g) * u`` rows ``hq`` (scales ``hs`` per row and K-block of
    ``group``; weight scales ``s2`` with ``s2_strides`` (expert, row block, K-block) and ``block_rows`` rows a
    scale), each pair's row times its routing weight, then every token's ``top_k`` rows summed in fp32."""
    sorted_ids, expert_ids, ntp = aligned
    (_, hidden), (n, inter), padded = x.shape, hq.shape, sorted_ids.numel()
    bm, bn_down, persistent = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], bool(cfg.get("persistent"))
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)  # an absent pair's row stays unwritten
    _down_fp8_kernel[_grid(triton.cdiv(padded, bm) * triton.cdiv(hidden, bn_down), persistent, x.device)](
        hq, hs, w2, s2, out, weights, sorted_ids, expert_ids, ntp, n, padded, hidden, inter,
        hq.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), *s2_strides,
        out.stride(0), BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn_down, GROUP=group, BLOCK_ROWS=block_rows,
        GROUP_SIZE_M=cfg["GROUP_SIZE_M"], PERSISTENT=persistent, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    return topk_sum(out, topk_ids, absent, x.dtype)


def fused_experts_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    block: tuple[int, int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    absent: bool = False,
    config_experts: Optional[int] = None,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """The ``MoERunner`` contract over block-FP8 experts (module docstring): ``x [M, H]`` in the model dtype,
    ``w13`` / ``w2`` e4m3 with their ``weight_scale_inv``s, ``block = (bn, G)``; ``config`` overrides
    ``default_config_fp8`` (benchmarks), looked up with ``config_experts`` experts where given (expert
    parallelism: the model's count).  ``absent``: ids of ``-1`` add nothing."""
    m, hidden = x.shape
    if m == 0:
        return torch.zeros_like(x)
    _check(x, w13, w13_scale, w2, w2_scale, block)
    bn, group = block
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    x = x.contiguous()
    cfg = config or default_config_fp8(m, config_experts or num_experts, top_k)
    xq, xs = quantize_groups(x, group)
    weights = topk_weights.reshape(-1).float().contiguous()
    s13, s2 = w13_scale.float(), w2_scale.float()
    if "gemv" in cfg:  # the decode chain's kernels launch under PDL (fused_dispatch), as the bf16 GEMVs
        g = cfg["gemv"]
        pdl = use_pdl(x)
        ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
        h = torch.empty(m * top_k, inter, dtype=torch.float32, device=x.device)
        mma_bn = g.get("MMA_BLOCK_N", 0)
        mma = bool(mma_bn) and inter % mma_bn == 0 and bn % mma_bn == 0  # the gate/up product on the tensor cores
        bn_gu = mma_bn if mma else g["BLOCK_N"]
        _gate_up_gemv_fp8_kernel[(m * top_k, triton.cdiv(inter, bn_gu))](
            xq, xs, w13, s13, ids, h, num_experts, inter, hidden, top_k,
            xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), s13.stride(2),
            h.stride(0), BLOCK_N=bn_gu, GROUP=group, BLOCK_ROWS=bn, K_UNROLL=g.get("K_UNROLL", 1), USE_PDL=pdl,
            MMA_M=16 if mma else 0, launch_pdl=pdl,
            num_warps=g.get("mma_num_warps", 4) if mma else g["num_warps"],
            num_stages=g.get("mma_num_stages", 4) if mma else g["num_stages"],
        )  # fmt: skip
        y = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
        _down_sum_gemv_fp8_kernel[(m, triton.cdiv(hidden, g["DOWN_BLOCK_N"]))](
            h, w2, s2, ids, weights, y, num_experts, hidden, inter, h.stride(0),
            w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), s2.stride(2), y.stride(0),
            TOP_K=top_k, TOP_K_P2=triton.next_power_of_2(top_k), BLOCK_N=g["DOWN_BLOCK_N"], GROUP=group,
            BLOCK_ROWS=bn, K_UNROLL=g.get("DOWN_K_UNROLL", 1), USE_PDL=pdl, num_warps=g["down_num_warps"], num_stages=g["num_stages"], launch_pdl=pdl,
        )  # fmt: skip
        return y
    bm, gm = cfg["BLOCK_SIZE_M"], cfg["GROUP_SIZE_M"]
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    persistent = bool(cfg.get("persistent"))
    sorted_ids, expert_ids, ntp = _align(topk_ids, bm, num_experts)
    n = m * top_k
    padded = sorted_ids.numel()
    hq = torch.empty(n, inter, dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty(n, triton.cdiv(inter, group), dtype=torch.float32, device=x.device)
    _gate_up_fp8_kernel[_grid(triton.cdiv(padded, bm) * triton.cdiv(inter, group), persistent, x.device)](
        xq, xs, w13, s13, hq, hs, sorted_ids, expert_ids, ntp, n, padded, inter, hidden, top_k,
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), s13.stride(2),
        hq.stride(0), hs.stride(0), BLOCK_SIZE_M=bm, GROUP=group, BLOCK_ROWS=bn, GROUP_SIZE_M=gm,
        PERSISTENT=persistent, **launch,
    )  # fmt: skip
    s2_strides = (s2.stride(0), s2.stride(1), s2.stride(2))
    aligned = (sorted_ids, expert_ids, ntp)
    return _down_and_sum(hq, hs, w2, s2, s2_strides, weights, aligned, x, topk_ids, cfg, group, bn, absent)


# --- per-channel / per-tensor experts ---------------------------------------------------------------------------
# The K-block of the per-channel GEMMs: their scales are per row and per token (or per expert), not per block, so
# any power of two >= 16 works; 128 is the block kernels' tile.
CHANNEL_GROUP = 128
# their smallest batches take the aligned GEMMs too (the GEMV kernels read per-block scales)
CHANNEL_SMALL_CONFIG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, GROUP_SIZE_M=1, num_warps=4, num_stages=3)


def _check_channel(w13, w13_scale, w2, w2_scale, w13_input_scale, w2_input_scale) -> None:
    num_experts, two_i, hidden = w13.shape
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 experts must be float8_e4m3fn, got {w13.dtype} / {w2.dtype}")
    want = {"w13": (num_experts, two_i), "w2": (num_experts, hidden)}
    got = {"w13": tuple(w13_scale.shape), "w2": tuple(w2_scale.shape)}
    if (w13_input_scale is None) != (w2_input_scale is None):
        raise ValueError("static FP8 experts need both input scales (gate/up and down), or neither")
    if w13_input_scale is not None and (
        tuple(w13_input_scale.shape) != want["w13"] or tuple(w2_input_scale.shape) != want["w2"]
    ):
        raise ValueError(f"FP8 expert input scales {tuple(w13_input_scale.shape)} / {tuple(w2_input_scale.shape)}")
    if got != want:
        raise ValueError(f"per-channel FP8 expert scales {got['w13']} / {got['w2']}, want {want['w13']} / {want['w2']}")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1 or w13_scale.stride(-1) != 1 or w2_scale.stride(-1) != 1:
        raise ValueError("expert weights and scales must be contiguous in their last dim")


def fused_experts_fp8_channel(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_input_scale: Optional[torch.Tensor],
    w2_input_scale: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    absent: bool = False,
    config_experts: Optional[int] = None,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """The ``MoERunner`` contract over per-channel / per-tensor FP8 experts, ``fp8.moe_channel_reference``'s
    arithmetic: ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` e4m3 with one fp32 scale per output row (``[E, 2I]`` /
    ``[E, H]``); activations quantised per token (dynamic) or, with the input scales, per expert with the
    largest of its projection's static scales.  The block kernels' aligned GEMMs run it with a K-block of
    ``CHANNEL_GROUP`` columns whose row scales are the token's (or the pair's) scale repeated and whose weight
    scales are one per row (``BLOCK_ROWS = 1``, the same for every K-block); the gate/up GEMM stores
    ``silu(g) * u`` in fp32 (``RAW_OUT``) and the whole row is quantised before the down GEMM.  Static scales
    depend on the expert, so there each (token, expert) pair gets its own quantised input row.  Nothing is read
    on the host: CUDA-graph safe.  ``absent``: ids of ``-1`` add nothing."""
    from kvship.engine.layers.quantization import fp8_math as fm

    m, hidden = x.shape
    if m == 0:
        return torch.zeros_like(x)
    _check_channel(w13, w13_scale, w2, w2_scale, w13_input_scale, w2_input_scale)
    num_experts, two_i, _ = w13.shape
    inter, top_k, group = two_i // 2, topk_ids.shape[1], CHANNEL_GROUP
    n = m * top_k
    cfg = config or default_config_fp8(m, config_experts or num_experts, top_k)
    if "gemv" in cfg:
        cfg = dict(CHANNEL_SMALL_CONFIG)
    static = w13_input_scale is not None
    if static:  # one quantised input row per pair, with its expert's scale
        expert_of_pair = topk_ids.reshape(-1).clamp(0, num_experts - 1).long()
        s_in = w13_input_scale.float().amax(dim=1)[expert_of_pair][:, None]
        xq, xs, a_top_k = fm.to_fp8(x.repeat_interleave(top_k, 0), s_in), s_in, 1
    else:
        xq, xs = fm.quantize_tokens(x)
        a_top_k = top_k
    xs = xs.expand(-1, triton.cdiv(hidden, group)).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    s13, s2 = w13_scale.float(), w2_scale.float()
    bm, gm = cfg["BLOCK_SIZE_M"], cfg["GROUP_SIZE_M"]
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    persistent = bool(cfg.get("persistent"))
    sorted_ids, expert_ids, ntp = _align(topk_ids, bm, num_experts)
    padded = sorted_ids.numel()
    h = (torch.zeros if absent else torch.empty)(n, inter, dtype=torch.float32, device=x.device)
    _gate_up_fp8_kernel[_grid(triton.cdiv(padded, bm) * triton.cdiv(inter, group), persistent, x.device)](
        xq, xs, w13, s13, h, h, sorted_ids, expert_ids, ntp, n, padded, inter, hidden, a_top_k,
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), 0,
        h.stride(0), 0, BLOCK_SIZE_M=bm, GROUP=group, BLOCK_ROWS=1, GROUP_SIZE_M=gm,
        PERSISTENT=persistent, RAW_OUT=True, **launch,
    )  # fmt: skip
    if static:
        s_a = w2_input_scale.float().amax(dim=1)[expert_of_pair][:, None]
        hq = fm.to_fp8(h, s_a)
    else:
        hq, s_a = fm.quantize_tokens(h)
    s_a = s_a.expand(-1, triton.cdiv(inter, group)).contiguous()
    s2_strides = (s2.stride(0), s2.stride(1), 0)  # one scale per row, the same for every K-block
    aligned = (sorted_ids, expert_ids, ntp)
    return _down_and_sum(hq, s_a, w2, s2, s2_strides, weights, aligned, x, topk_ids, cfg, group, 1, absent)
