"""The ``triton`` MoE runner: aligned token->expert blocks and two grouped GEMMs.

Steps for ``x [M, H]`` routed to ``k`` experts per token (``n = M * k`` pairs):

1. ``align_block_size``: pairs sorted by expert, each run padded to
   ``BLOCK_SIZE_M`` (fixed-size outputs, no host sync): one Triton program
   (``_align_kernel``) for decode-sized batches, else ``_align_chunked``'s
   three kernels (per-chunk expert counts and per-expert totals, a scan per 16
   experts, per-chunk scatter and padding), or ``align.moe_align_block_size``'s torch ops past
   ``_ALIGN_MAX_EXPERTS`` experts (all three give the same outputs).
2. ``_gate_up_kernel``: for each block of one expert's pairs and each
   ``BLOCK_SIZE_N`` columns of the expert width ``I``, ``x[pair // k] @
   w13[e, gate rows]^T`` and ``... @ w13[e, up rows]^T`` side by side, then
   ``silu(gate) * up`` into ``inter [n, I]`` at the pair's row (the
   ``[n, 2I]`` activation never exists).
3. ``_down_kernel``: ``inter[pair] @ w2[e]^T`` times the pair's routing
   weight into ``out [n, H]``.
4. ``_topk_sum_kernel``: each token's ``k`` rows of ``out`` summed in float32.

A pair whose id is ``-1`` (``absent``: an expert another rank holds) is in no run: steps 1-3 never touch it
and step 4 skips its row.

Routing (``TritonMoERunner.select_experts``): ``moe.topk_triton.route``, softmax
-> top-k -> renormalise and the expert-load count in one program per token
(``topk.select_experts``'s contract; ties go to the lower expert id).

Both kernels skip blocks past ``num_tokens_post_padded`` and padding entries,
so the launch grid depends only on ``M`` and the config: the step is captured
in CUDA graphs like any other.  With ``"persistent"`` a GEMM runs one program
per multiprocessor that loops over the used tiles (``_gate_up_kernel``); the
tiles, and so the output, are the same.  Launch configs: ``kernel_config.get_config``.
Runs on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from kvship.engine.layers.fused_dispatch import use_pdl
from kvship.engine.layers.fused_ops_cuda import pdl_enter
from kvship.engine.layers.moe import topk_triton
from kvship.engine.layers.moe.align import moe_align_block_size, padded_size
from kvship.engine.layers.moe.kernel_config import get_config
from kvship.engine.layers.moe.runner import MoERunner, register_moe_runner

try:  # host-side TMA descriptors (Triton 3.4+)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer path only
    TensorDescriptor = None


@triton.jit
def _block_coords(pid, num_pid_m, num_pid_n, GROUP_SIZE_M: tl.constexpr):
    # grouped ordering: consecutive programs share the same rows of A (L2 reuse)
    in_group = GROUP_SIZE_M * num_pid_n
    group = pid // in_group
    first_m = group * GROUP_SIZE_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_SIZE_M)
    pid_m = first_m + ((pid % in_group) % group_m)
    pid_n = (pid % in_group) // group_m
    return pid_m, pid_n


@triton.jit
def _dot_k_loop(a_ptrs, b_ptrs, mask_rows, mask_cols, k_size, acc, BLOCK_SIZE_K: tl.constexpr):
    """``acc += A @ B`` over ``k_size`` in ``BLOCK_SIZE_K`` steps: ``a_ptrs`` a ``[M, K]`` tile of (gathered)
    rows, ``b_ptrs`` a ``[K, N]`` weight tile, both advancing along K; masked rows and columns read zeros."""
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    for k0 in range(0, tl.cdiv(k_size, BLOCK_SIZE_K)):
        mask_k = offs_k < k_size - k0 * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=mask_rows[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_cols[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_SIZE_K
        b_ptrs += BLOCK_SIZE_K
    return acc


@triton.jit
def _dot_k_loop_tma(
    a_ptrs,
    mask_rows,
    k_size,
    w_desc,
    lead,
    n0,
    acc,
    LEAD: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
):
    """``_dot_k_loop`` with the weight tile fetched by TMA: ``w_desc`` a 3-D descriptor whose block
    ``[LEAD, BLOCK_N, BLOCK_K]`` at ``(lead, n0, k)`` is used as one ``[K, LEAD * BLOCK_N]`` operand (the
    tensor memory accelerator writes it to shared memory without registers or per-thread addresses;
    out-of-range rows and columns read zeros).  ``a_ptrs`` stays a gathered pointer tile."""
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    for k0 in range(0, tl.cdiv(k_size, BLOCK_SIZE_K)):
        mask_k = offs_k < k_size - k0 * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=mask_rows[:, None] & mask_k[None, :], other=0.0)
        b = tl.reshape(w_desc.load([lead, n0, k0 * BLOCK_SIZE_K]), (LEAD * BLOCK_SIZE_N, BLOCK_SIZE_K))
        acc = tl.dot(a, b.T, acc)
        a_ptrs += BLOCK_SIZE_K
    return acc


@triton.jit
def _gate_up_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntp_ptr,
    num_pairs,
    padded_len,
    inter_size,
    hidden_size,
    top_k: tl.constexpr,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    ONE_DOT: tl.constexpr = False,
    TMA: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False,
):
    # PERSISTENT: about one program per multiprocessor, each walking every num_programs-th tile of the aligned
    # rows actually used (num_tokens_post_padded); one flattened loop lets the compiler's pipeline fetch the next
    # tile's first operands during this tile's epilogue.  Else one program per tile, none past the used rows.
    num_pid_n = tl.cdiv(inter_size, BLOCK_SIZE_N)
    if PERSISTENT:
        num_pid_m = tl.cdiv(tl.load(ntp_ptr), BLOCK_SIZE_M)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _block_coords(tile, num_pid_m, num_pid_n, GROUP_SIZE_M)
            _gate_up_tile(
                pid_m, pid_n, a_ptr, w_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, inter_size,
                hidden_size, top_k, stride_am, stride_we, stride_wn, stride_om,
                BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, ONE_DOT, TMA,
            )  # fmt: skip
    else:
        pid_m, pid_n = _block_coords(tl.program_id(0), tl.cdiv(padded_len, BLOCK_SIZE_M), num_pid_n, GROUP_SIZE_M)
        if pid_m * BLOCK_SIZE_M >= tl.load(ntp_ptr):
            return
        _gate_up_tile(
            pid_m, pid_n, a_ptr, w_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, inter_size, hidden_size,
            top_k, stride_am, stride_we, stride_wn, stride_om,
            BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, ONE_DOT, TMA,
        )  # fmt: skip


@triton.jit
def _gate_up_tile(
    pid_m,
    pid_n,
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    inter_size,
    hidden_size,
    top_k: tl.constexpr,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    ONE_DOT: tl.constexpr,
    TMA: tl.constexpr,
):
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    mask_m = pair < num_pairs
    row = (pair // top_k).to(tl.int64)
    expert32 = tl.load(expert_ids_ptr + pid_m)
    expert = expert32.to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    mask_n = offs_n < inter_size
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :]
    if TMA:
        # ``w_ptr`` is a descriptor of w13 as ``[E * 2, I, H]``: one TMA block holds this expert's gate rows
        # and its up rows, so the accumulator's first BLOCK_N columns are gate and the next BLOCK_N up
        acc = tl.zeros((BLOCK_SIZE_M, 2 * BLOCK_SIZE_N), dtype=tl.float32)
        acc = _dot_k_loop_tma(
            a_ptrs, mask_m, hidden_size, w_ptr, expert32 * 2, pid_n * BLOCK_SIZE_N, acc, 2, BLOCK_SIZE_N, BLOCK_SIZE_K
        )
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_SIZE_M, 2, BLOCK_SIZE_N)), (0, 2, 1)))
    elif ONE_DOT:
        # one [BLOCK_K, 2 * BLOCK_N] weight tile, gate and up rows interleaved (even columns gate, odd up):
        # one MMA of twice the width per step instead of two that each read the activation tile
        offs_j = tl.arange(0, 2 * BLOCK_SIZE_N)
        col = pid_n * BLOCK_SIZE_N + offs_j // 2
        mask_j = col < inter_size
        w_row = (col + (offs_j % 2) * inter_size).to(tl.int64)
        b_ptrs = w_ptr + expert * stride_we + w_row[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_SIZE_M, 2 * BLOCK_SIZE_N), dtype=tl.float32)
        acc = _dot_k_loop(a_ptrs, b_ptrs, mask_m, mask_j, hidden_size, acc, BLOCK_SIZE_K)
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_SIZE_M, BLOCK_SIZE_N, 2)))
    else:
        g_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        u_ptrs = g_ptrs + inter_size * stride_wn
        acc_g = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(hidden_size, BLOCK_SIZE_K)):
            mask_k = offs_k < hidden_size - k0 * BLOCK_SIZE_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BLOCK_SIZE_K
            g_ptrs += BLOCK_SIZE_K
            u_ptrs += BLOCK_SIZE_K
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(
    a_ptr,
    w_ptr,
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
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    TMA: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False,
):
    num_pid_n = tl.cdiv(hidden_size, BLOCK_SIZE_N)  # PERSISTENT: as in _gate_up_kernel
    if PERSISTENT:
        num_pid_m = tl.cdiv(tl.load(ntp_ptr), BLOCK_SIZE_M)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _block_coords(tile, num_pid_m, num_pid_n, GROUP_SIZE_M)
            _down_tile(
                pid_m, pid_n, a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs,
                hidden_size, inter_size, stride_am, stride_we, stride_wn, stride_om,
                BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, TMA,
            )  # fmt: skip
    else:
        pid_m, pid_n = _block_coords(tl.program_id(0), tl.cdiv(padded_len, BLOCK_SIZE_M), num_pid_n, GROUP_SIZE_M)
        if pid_m * BLOCK_SIZE_M >= tl.load(ntp_ptr):
            return
        _down_tile(
            pid_m, pid_n, a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_pairs, hidden_size,
            inter_size, stride_am, stride_we, stride_wn, stride_om, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, TMA,
        )  # fmt: skip


@triton.jit
def _down_tile(
    pid_m,
    pid_n,
    a_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    hidden_size,
    inter_size,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    TMA: tl.constexpr,
):
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    mask_m = pair < num_pairs
    pair64 = pair.to(tl.int64)
    expert32 = tl.load(expert_ids_ptr + pid_m)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    mask_n = offs_n < hidden_size
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + pair64[:, None] * stride_am + offs_k[None, :]
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if TMA:  # ``w_ptr`` is a descriptor of w2 ``[E, H, I]``
        acc = _dot_k_loop_tma(
            a_ptrs, mask_m, inter_size, w_ptr, expert32, pid_n * BLOCK_SIZE_N, acc, 1, BLOCK_SIZE_N, BLOCK_SIZE_K
        )
    else:
        w_ptrs = w_ptr + expert32.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
        acc = _dot_k_loop(a_ptrs, w_ptrs + offs_k[:, None], mask_m, mask_n, inter_size, acc, BLOCK_SIZE_K)
    route_w = tl.load(weights_ptr + pair, mask=mask_m, other=0.0)
    acc = acc * route_w[:, None]
    out_ptrs = out_ptr + pair64[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    out_ptr,
    num_experts,
    inter_size,
    hidden_size,
    top_k: tl.constexpr,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # one (token, expert) pair x BLOCK_N columns of gate and up: a GEMV, no alignment (few pairs per step)
    pair = tl.program_id(0)
    pdl_enter(USE_PDL)  # the expert id comes from the routing kernel before this one
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):  # absent (another rank's expert): its row is never read
        return
    row = (pair // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter_size
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + inter_size * stride_wn
    x_ptrs = x_ptr + row * stride_xm + offs_k
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(hidden_size, BLOCK_K)):
        mask_k = offs_k < hidden_size - k0 * BLOCK_K
        a = tl.load(x_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        m2 = mask_n[:, None] & mask_k[None, :]
        acc_g += tl.load(g_ptrs, mask=m2, other=0.0).to(tl.float32) * a[None, :]
        acc_u += tl.load(u_ptrs, mask=m2, other=0.0).to(tl.float32) * a[None, :]
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    h = g * tl.sigmoid(g) * u
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, h.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _down_sum_gemv_kernel(
    h_ptr,
    w_ptr,
    ids_ptr,
    weights_ptr,
    y_ptr,
    num_experts,
    hidden_size,
    inter_size,
    stride_hm,
    stride_we,
    stride_wn,
    stride_ym,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # one token x BLOCK_N output columns: its TOP_K experts' down GEMVs side by side ([TOP_K, BLOCK_N,
    # BLOCK_K] weight tiles, so all of them are in flight at once), weighted and summed in float32
    m = tl.program_id(0).to(tl.int64)
    pdl_enter(USE_PDL)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden_size
    offs_k = tl.arange(0, BLOCK_K)
    js = tl.arange(0, TOP_K_P2)
    expert = tl.load(ids_ptr + m * TOP_K + js, mask=js < TOP_K, other=-1).to(tl.int64)
    present = (expert >= 0) & (expert < num_experts)  # absent: another rank's expert adds nothing
    route_w = tl.load(weights_ptr + m * TOP_K + js, mask=present, other=0.0)
    expert = tl.where(present, expert, 0)
    h_ptrs = h_ptr + (m * TOP_K + js)[:, None] * stride_hm + offs_k[None, :]
    w_ptrs = (
        w_ptr
        + expert[:, None, None] * stride_we
        + offs_n[None, :, None].to(tl.int64) * stride_wn
        + offs_k[None, None, :]
    )
    row_ok = present[:, None, None] & mask_n[None, :, None]
    acc = tl.zeros((TOP_K_P2, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(inter_size, BLOCK_K)):
        mask_k = offs_k < inter_size - k0 * BLOCK_K
        a = tl.load(h_ptrs, mask=present[:, None] & mask_k[None, :], other=0.0).to(tl.float32) * route_w[:, None]
        w = tl.load(w_ptrs, mask=row_ok & mask_k[None, None, :], other=0.0).to(tl.float32)
        acc += w * a[:, None, :]
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(tl.sum(acc, axis=2), axis=0)
    tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _down_sum_gemv_unrolled_kernel(
    h_ptr,
    w_ptr,
    ids_ptr,
    weights_ptr,
    y_ptr,
    num_experts,
    hidden_size,
    inter_size,
    stride_hm,
    stride_we,
    stride_wn,
    stride_ym,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # ``_down_sum_gemv_kernel`` with the token's experts unrolled (``tl.static_range``) into one [BLOCK_N, BLOCK_K]
    # float32 accumulator: no padding of TOP_K to a power of two (top-6 models) and an eighth of the accumulator
    # registers at top-8; each expert's loads are still issued back to back in one block (``DOWN_UNROLL`` 1)
    m = tl.program_id(0).to(tl.int64)
    pdl_enter(USE_PDL)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden_size
    rows = offs_n[:, None].to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(inter_size, BLOCK_K)):
        kk = k0 * BLOCK_K + offs_k
        mask_k = kk < inter_size
        for j in tl.static_range(TOP_K):
            expert = tl.load(ids_ptr + m * TOP_K + j).to(tl.int64)
            # absent (another rank's expert): adds nothing, and neither its row nor its weights are read
            ek = expert + tl.zeros((BLOCK_K,), dtype=tl.int64)  # the id over the columns (a block mask)
            take = mask_k & (ek >= 0) & (ek < num_experts)
            route_w = tl.load(weights_ptr + m * TOP_K + j)
            expert = tl.where((expert >= 0) & (expert < num_experts), expert, 0)
            a = tl.load(h_ptr + (m * TOP_K + j) * stride_hm + kk, mask=take, other=0.0).to(tl.float32)
            w = tl.load(
                w_ptr + expert * stride_we + rows + kk[None, :], mask=mask_n[:, None] & take[None, :], other=0.0
            ).to(tl.float32)
            acc += w * (a * route_w)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    ntp_ptr,
    num_pairs,
    padded_len,
    num_experts,
    BLOCK_M: tl.constexpr,
    PAIRS: tl.constexpr,
    EXPERTS: tl.constexpr,
    FILL: tl.constexpr,
):
    # one program: one-hot [PAIRS, EXPERTS] -> counts, padded run starts, each pair's rank in its run
    pairs = tl.arange(0, PAIRS)
    pmask = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=pmask, other=-1)
    experts = tl.arange(0, EXPERTS)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    counts = tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    dest = tl.sum(onehot * starts[None, :], axis=1) + rank
    total = tl.sum(padded, axis=0)
    for off in range(0, padded_len, FILL):
        idx = off + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + idx, num_pairs, mask=idx < padded_len)
        # block b's expert: the number of experts whose run ends at or before b * BLOCK_M (clamped)
        bstart = idx * BLOCK_M
        ends_real = tl.where(experts < num_experts, ends, total + padded_len * BLOCK_M)
        eid = tl.sum((ends_real[None, :] <= bstart[:, None]).to(tl.int32), axis=1)
        eid = tl.minimum(eid, num_experts - 1)
        tl.store(expert_ids_ptr + idx, eid, mask=idx < padded_len // BLOCK_M)
    tl.debug_barrier()  # the padding fill above lands before the scatter below
    tl.store(sorted_ids_ptr + dest, pairs, mask=pmask & (ids >= 0))  # an absent pair (id -1) is in no run
    tl.store(ntp_ptr, total)


# the one-program align takes up to this many (pairs x experts) one-hot cells; more goes to the chunked kernels
_ALIGN_MAX_CELLS = 128 * 256
# chunked align: pairs per program of the count and scatter kernels; the scan kernel holds [E] vectors in one
# program, so past this many experts the torch ops run instead
_ALIGN_CHUNK = 128
_ALIGN_MAX_EXPERTS = 1024


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, totals_ptr, num_pairs, num_experts, CHUNK: tl.constexpr, ET: tl.constexpr):
    # one program per CHUNK pairs: its expert histogram (one-hot [CHUNK, ET] per ET experts) into counts[chunk, :],
    # and added to totals (zeroed before; integer adds, so the order does not matter)
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    for e0 in range(0, num_experts, ET):
        experts = e0 + tl.arange(0, ET)
        cnt = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        tl.store(counts_ptr + chunk * num_experts + experts, cnt, mask=experts < num_experts)
        tl.atomic_add(totals_ptr + experts, cnt, mask=(experts < num_experts) & (cnt > 0), sem="relaxed")


@triton.jit
def _align_scan_kernel(
    counts_ptr,
    totals_ptr,
    prefix_ptr,
    meta_ptr,
    ntp_ptr,
    num_chunks,
    num_experts,
    BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr,
    EB: tl.constexpr,
    TILE_C: tl.constexpr,
):
    # one program per EB experts: prefix[c, e] = pairs of expert e in chunks before c (a cumsum down TILE_C
    # chunks at a time, carried across tiles).  Program 0 also lays out every expert's padded run from the
    # totals: meta = [starts | ends | starts + count], ntp.
    experts = tl.program_id(0) * EB + tl.arange(0, EB)
    emask = experts < num_experts
    running = tl.zeros((EB,), dtype=tl.int32)
    for c0 in range(0, num_chunks, TILE_C):
        rows = c0 + tl.arange(0, TILE_C)
        offs = rows[:, None] * num_experts + experts[None, :]
        mask = (rows < num_chunks)[:, None] & emask[None, :]
        cnt = tl.load(counts_ptr + offs, mask=mask, other=0)
        tl.store(prefix_ptr + offs, tl.cumsum(cnt, axis=0) - cnt + running[None, :], mask=mask)
        running += tl.sum(cnt, axis=0)
    if tl.program_id(0) == 0:
        every = tl.arange(0, EXPERTS)
        total = tl.load(totals_ptr + every, mask=every < num_experts, other=0)
        padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
        tl.store(meta_ptr + every, starts, mask=every < num_experts)
        tl.store(meta_ptr + num_experts + every, ends, mask=every < num_experts)
        tl.store(meta_ptr + 2 * num_experts + every, starts + total, mask=every < num_experts)
        tl.store(ntp_ptr, tl.sum(padded, axis=0))


@triton.jit
def _align_scatter_kernel(
    ids_ptr,
    prefix_ptr,
    meta_ptr,
    ntp_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    num_experts,
    num_blocks,
    blocks_per_prog,
    BLOCK_M: tl.constexpr,
    BM_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    JT: tl.constexpr,
    EXPERTS: tl.constexpr,
    NB: tl.constexpr,
):
    # one program per CHUNK pairs.  Scatter: pair -> its run start + earlier chunks' pairs of its expert + its
    # rank among its expert's pairs in this chunk (equal ids before it: [CHUNK, JT] compares, no [CHUNK, E]
    # one-hot), so the order within an expert is the pair order.
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    pmask = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=pmask, other=-1)
    rank = tl.zeros((CHUNK,), dtype=tl.int32)
    for j0 in tl.static_range(0, CHUNK, JT):
        js = chunk * CHUNK + j0 + tl.arange(0, JT)
        jids = tl.load(ids_ptr + js, mask=js < num_pairs, other=-1)
        same = (jids[None, :] == ids[:, None]) & (js[None, :] < pairs[:, None])
        rank += tl.sum(same.to(tl.int32), axis=1)
    present = pmask & (ids >= 0)  # an absent pair (id -1) is in no run
    e = tl.where(present, ids, 0)
    start = tl.load(meta_ptr + e, mask=present, other=0)
    before = tl.load(prefix_ptr + chunk * num_experts + e, mask=present, other=0)
    tl.store(sorted_ids_ptr + start + before + rank, pairs, mask=present)
    # This program's share of the blocks: expert_ids and the padding entries (= num_pairs).  The padding
    # slots (past an expert's pairs in its run, and past the last run) are exactly the slots no pair is
    # scattered to, so no program's fill can race with any program's scatter.
    experts = tl.arange(0, EXPERTS)
    ends = tl.load(meta_ptr + num_experts + experts, mask=experts < num_experts, other=2147483647)
    total = tl.load(ntp_ptr)
    b_end = tl.minimum((chunk + 1) * blocks_per_prog, num_blocks)
    cols = tl.arange(0, BM_P2)
    for b0 in range(chunk * blocks_per_prog, b_end, NB):
        blocks = b0 + tl.arange(0, NB)
        bmask = blocks < b_end
        bstart = blocks * BLOCK_M
        # block b's expert: the number of runs ending at or before b * BLOCK_M (clamped, as searchsorted is)
        eid = tl.minimum(tl.sum((ends[None, :] <= bstart[:, None]).to(tl.int32), axis=1), num_experts - 1)
        tl.store(expert_ids_ptr + blocks, eid, mask=bmask)
        data_end = tl.load(meta_ptr + 2 * num_experts + eid, mask=bmask, other=0)
        data_end = tl.where(bstart < total, data_end, 0)  # blocks past the last run: all padding
        pos = bstart[:, None] + cols[None, :]
        pad = bmask[:, None] & (cols < BLOCK_M)[None, :] & (pos >= data_end[:, None])
        tl.store(sorted_ids_ptr + pos, num_pairs, mask=pad)


def _align_chunked(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, chunk: int = _ALIGN_CHUNK, jt: int = 32, warps: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``align.moe_align_block_size`` (same outputs) for any number of pairs: three launches, fixed grids
    (``cdiv(n, chunk)``, ``cdiv(E, 16)``, ``cdiv(n, chunk)``) after zeroing the per-expert totals, no host
    sync; ``chunk`` a power of 2."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    size = padded_size(n, num_experts, block_m)
    num_blocks = size // block_m
    num_chunks = max(1, triton.cdiv(n, chunk))
    experts = triton.next_power_of_2(num_experts)
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=dev)
    totals = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    prefix = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=dev)
    meta = torch.empty(3, num_experts, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    ntp = torch.empty(1, dtype=torch.int32, device=dev)
    _align_count_kernel[(num_chunks,)](
        flat, counts, totals, n, num_experts, CHUNK=chunk, ET=min(experts, max(1, 8192 // chunk)), num_warps=4
    )
    eb = min(experts, 16)
    tile_c = min(triton.next_power_of_2(num_chunks), max(2, 4096 // eb))
    _align_scan_kernel[(triton.cdiv(num_experts, eb),)](
        counts, totals, prefix, meta, ntp, num_chunks, num_experts,
        BLOCK_M=block_m, EXPERTS=experts, EB=eb, TILE_C=max(2, tile_c), num_warps=4,
    )  # fmt: skip
    _align_scatter_kernel[(num_chunks,)](
        flat, prefix, meta, ntp, sorted_ids, expert_ids, n, num_experts, num_blocks, triton.cdiv(num_blocks, num_chunks),
        BLOCK_M=block_m, BM_P2=triton.next_power_of_2(block_m), CHUNK=chunk, JT=min(chunk, jt), EXPERTS=experts,
        NB=32, num_warps=warps,
    )  # fmt: skip
    return sorted_ids, expert_ids, ntp


def align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``align.moe_align_block_size`` (same outputs): one Triton program for decode-sized batches, three
    (``_align_chunked``) for larger ones, the torch ops past ``_ALIGN_MAX_EXPERTS`` experts."""
    n = topk_ids.numel()
    pairs, experts = triton.next_power_of_2(max(n, 16)), triton.next_power_of_2(max(num_experts, 16))
    if pairs * experts > _ALIGN_MAX_CELLS:
        if num_experts > _ALIGN_MAX_EXPERTS:
            return moe_align_block_size(topk_ids, block_m, num_experts)
        return _align_chunked(topk_ids, block_m, num_experts)
    size = padded_size(n, num_experts, block_m)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=topk_ids.device)
    ntp = torch.empty(1, dtype=torch.int32, device=topk_ids.device)
    _align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, expert_ids, ntp, n, size, num_experts,
        BLOCK_M=block_m, PAIRS=pairs, EXPERTS=experts, FILL=64, num_warps=4,
    )  # fmt: skip
    return sorted_ids, expert_ids, ntp


@triton.jit
def _topk_sum_kernel(in_ptr, out_ptr, ids_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr, ABSENT: tl.constexpr):
    # out[m, cols] = sum_j in[m * TOP_K + j, cols], accumulated in float32; with ABSENT the rows of pairs whose
    # id is negative (no GEMM wrote them) are skipped
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        val = tl.load(in_ptr + (m * TOP_K + j).to(tl.int64) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        if ABSENT:  # an unwritten row may hold anything, NaN included: selected away, not multiplied
            val = tl.where(tl.load(ids_ptr + m * TOP_K + j) >= 0, val, 0.0)
        acc += val
    tl.store(out_ptr + m.to(tl.int64) * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def topk_sum(out: torch.Tensor, topk_ids: torch.Tensor, absent: bool, dtype: torch.dtype) -> torch.Tensor:
    """Each token's ``k`` rows of the per-pair output ``out [M * k, H]`` summed in float32 (``_topk_sum_kernel``);
    with ``absent``, the rows of pairs with a negative id are left out (nothing wrote them)."""
    m, k = topk_ids.shape
    hidden = out.shape[1]
    y = torch.empty(m, hidden, dtype=dtype, device=out.device)
    ids = topk_ids.reshape(-1)
    _topk_sum_kernel[(m, triton.cdiv(hidden, 1024))](
        out, y, ids, hidden, TOP_K=k, BLOCK=1024, ABSENT=absent, num_warps=4
    )
    return y


def _weight_desc(w: torch.Tensor, shape: tuple, block: tuple):
    """A TMA descriptor of the expert weights ``w [E, R, K]`` seen as ``shape = (E * L, R / L, K)`` (``L`` = 2
    splits each expert's rows in gate and up halves), or None where TMA cannot serve: no Hopper-class GPU (the
    interpreter emulates it), a Triton without host descriptors, or a layout TMA cannot address (strides not 16-byte
    multiples, or the halves of a padded expert not one stride apart); the kernels then read the same tiles
    through pointers.  ``"tma"`` in a config asks for it (``kernel_config``; ``bench/moe_tune.py`` tries it)."""
    if TensorDescriptor is None or not _tma_capable(w.device) or w.stride(-1) != 1:
        return None
    row = w.stride(1)
    if shape[0] == w.shape[0]:
        lead = w.stride(0)
    elif w.stride(0) == w.shape[1] * row:
        lead = shape[1] * row
    else:
        return None
    if w.data_ptr() % 16 or (row * w.element_size()) % 16 or (lead * w.element_size()) % 16:
        return None
    return TensorDescriptor(w, list(shape), [lead, row, 1], list(block))


@functools.cache
def _tma_capable(device: torch.device) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter runs descriptor loads on CPU tensors
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _grid(tiles: int, persistent: bool, device: torch.device) -> tuple[int]:
    """A GEMM's launch grid: one program per tile of the padded rows, or with ``persistent`` (config
    ``"persistent"``) at most one per multiprocessor, each looping over tiles; fixed by the shapes either way."""
    return (min(tiles, _num_sms(device)) if persistent else tiles,)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: a few programs, so that each walks several tiles
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: Optional[dict] = None,
    absent: bool = False,
    config_experts: Optional[int] = None,
) -> torch.Tensor:
    """The ``MoERunner`` contract (runner.py) with Triton kernels; ``config`` overrides the lookup (tuner), which
    is keyed by ``config_experts`` where given (expert parallelism: the model's expert count; a rank's experts
    carry the load per expert of the whole layer, so the whole layer's tuned tiles fit them) and by ``E`` else.

    ``absent`` (expert parallelism): pairs with an id of ``-1`` are in no run of the alignment (its kernels
    leave them out), so neither GEMM reads or writes them, and the top-k sum skips their rows of the per-pair
    output.  No extra kernel, no host sync: CUDA-graph safe like the rest (until session 35 they went to a
    sentinel expert cut off afterwards: nine small torch kernels a layer, docs/benchmarks.md, session 35).
    """
    m, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if m == 0:
        return torch.zeros_like(x)
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("expert weights must be contiguous in their last dim")
    x = x.contiguous()
    cfg = config or get_config(m, config_experts or num_experts, inter, top_k, x.dtype, _device_name(x.device))
    if "gemv" in cfg:
        return _fused_experts_gemv(x, w13, w2, topk_weights, topk_ids, cfg["gemv"])
    bm, bn, bk, gm = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"], cfg["GROUP_SIZE_M"]
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    sorted_ids, expert_ids, ntp = align_block_size(topk_ids, bm, num_experts)  # absent pairs: in no run
    n = m * top_k
    padded = sorted_ids.numel()
    h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    # the gate/up weights as [E * 2, I, H] (gate rows, then up rows of each expert) for a TMA block of both
    w13_tma = cfg.get("tma") and _weight_desc(w13, (num_experts * 2, inter, hidden), (2, bn, bk))
    persistent = bool(cfg.get("persistent"))
    _gate_up_kernel[_grid(triton.cdiv(padded, bm) * triton.cdiv(inter, bn), persistent, x.device)](
        x, w13_tma or w13, h, sorted_ids, expert_ids, ntp, n, padded, inter, hidden, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, ONE_DOT=bool(cfg.get("one_dot")),
        TMA=bool(w13_tma), PERSISTENT=persistent, **launch,
    )  # fmt: skip
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)  # an absent pair's row stays unwritten
    weights = topk_weights.reshape(-1).float().contiguous()
    down = {**cfg, **cfg.get("down", {})}  # the down GEMM may override N/K tiles, warps and stages
    bn, bk = down["BLOCK_SIZE_N"], down["BLOCK_SIZE_K"]
    launch = dict(num_warps=down["num_warps"], num_stages=down["num_stages"])
    w2_tma = cfg.get("down", {}).get("tma") and _weight_desc(w2, (num_experts, hidden, inter), (1, bn, bk))
    persistent = bool(cfg.get("down", {}).get("persistent"))
    _down_kernel[_grid(triton.cdiv(padded, bm) * triton.cdiv(hidden, bn), persistent, x.device)](
        h, w2_tma or w2, out, weights, sorted_ids, expert_ids, ntp, n, padded, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, TMA=bool(w2_tma), PERSISTENT=persistent,
        **launch,
    )  # fmt: skip
    return topk_sum(out, topk_ids, absent, x.dtype)


def _fused_experts_gemv(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, g: dict
) -> torch.Tensor:
    """``fused_experts`` for a few pairs (``kernel_config.GEMV_MAX_PAIRS``): one GEMV program per (pair, column
    block) for gate/up, then one per (token, column block) that runs the token's ``k`` down GEMVs, weights and
    sums them: no alignment, no per-pair output, no top-k sum kernel.  Ids outside ``[0, E)`` (``-1``: absent
    under expert parallelism) add nothing."""
    m, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    h = torch.empty(m * top_k, inter, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x)  # the decode chain's kernels launch under PDL (fused_dispatch)
    _gate_up_gemv_kernel[(m * top_k, triton.cdiv(inter, g["BLOCK_N"]))](
        x, w13, ids, h, num_experts, inter, hidden, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_N=g["BLOCK_N"], BLOCK_K=g["BLOCK_K"], num_warps=g["num_warps"], num_stages=g["num_stages"],
        USE_PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    y = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
    args = (
        h, w2, ids, weights, y, num_experts, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
    )  # fmt: skip
    grid = (m, triton.cdiv(hidden, g["DOWN_BLOCK_N"]))
    launch = dict(num_warps=g["down_num_warps"], num_stages=g["num_stages"], USE_PDL=pdl, launch_pdl=pdl)
    if g.get("DOWN_UNROLL", 0):
        _down_sum_gemv_unrolled_kernel[grid](
            *args, TOP_K=top_k, BLOCK_N=g["DOWN_BLOCK_N"], BLOCK_K=g["DOWN_BLOCK_K"], **launch
        )
    else:
        _down_sum_gemv_kernel[grid](
            *args,
            TOP_K=top_k,
            TOP_K_P2=triton.next_power_of_2(top_k),
            BLOCK_N=g["DOWN_BLOCK_N"],
            BLOCK_K=g["DOWN_BLOCK_K"],
            **launch,
        )
    return y


@register_moe_runner("triton")
class TritonMoERunner(MoERunner):
    def __call__(self, x, w13, w2, topk_weights, topk_ids, absent=False, config_experts=None):
        return fused_experts(x, w13, w2, topk_weights, topk_ids, absent=absent, config_experts=config_experts)

    def select_experts(self, router_logits, top_k, renormalize, counts=None, rows_slots=None):
        if not topk_triton.fits(router_logits.shape[1], top_k):  # the kernel's shapes: fall back
            return super().select_experts(router_logits, top_k, renormalize, counts, rows_slots)
        return topk_triton.route(router_logits, top_k, "softmax", renormalize, counts=counts, rows_slots=rows_slots)
