"""Expert selection in one Triton kernel: router logits -> (weights, ids), one program per token.

``route(logits, top_k, scoring, renormalize, ...)`` does what ``topk.select_experts`` (softmax, top-k, optional
renormalisation) and ``DeepseekRouter.select`` (softmax or sigmoid, the correction bias, group-limited choice,
``routed_scaling_factor``) do with PyTorch ops, in place of their ~6 small kernels per MoE layer (softmax, the
two of ``torch.topk``, the renormalisation, the scaling, the int32 cast): at decode batches each of them is a
few microseconds of a step that is mostly launch latency (docs/benchmarks.md, DeepSeek-V2-Lite profile).

Numerics: float32 throughout; Triton's ``exp`` (the GPU's ``ex2.approx``, a few ulp from PyTorch's ``expf``) and
a softmax sum in another order than PyTorch's, so weights agree to about 1e-6 relative, not bit for bit.  The experts are taken
largest first by repeated arg-max (the lowest index among equal scores); ``torch.topk`` leaves the order of
equal scores unspecified.  Grouped choice (``n_group > 1``): groups ranked by their largest score
(``group_limited_greedy``, the others' scores set to 0 as the PyTorch path does) or by the sum of their two
largest biased scores (``noaux_tc``, the others' experts excluded).  Used on CUDA (``fused_dispatch``); the
kernel also runs under Triton's interpreter (tests).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvship.engine.layers.fused_dispatch import use_pdl
from kvship.engine.layers.fused_ops_cuda import pdl_enter

SCORING = {"softmax": 0, "sigmoid": 1}
# topk_method codes (deepseek_config.GroupedRouting)
GREEDY, GROUP_LIMITED_GREEDY, NOAUX_TC = 0, 1, 2
METHODS = {"greedy": GREEDY, "group_limited_greedy": GROUP_LIMITED_GREEDY, "noaux_tc": NOAUX_TC}
# the widest router this kernel takes (experts of one row in one tile)
MAX_EXPERTS = 1024


@triton.jit
def _route_kernel(
    LOGITS,
    BIAS,
    W_OUT,
    ID_OUT,
    COUNTS,
    SLOTS,
    stride_l,
    num_experts,
    scale,
    renorm_eps,
    TOP_K: tl.constexpr,
    SCORE: tl.constexpr,
    METHOD: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COUNT: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pdl_enter(USE_PDL)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    x = tl.load(LOGITS + row * stride_l + e, mask=valid, other=float("-inf")).to(tl.float32)
    if SCORE == 0:
        m = tl.max(x, 0)
        p = tl.where(valid, tl.exp(x - m), 0.0)
        scores = p / tl.sum(p, 0)
    else:
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    neg = float("-inf")
    if METHOD == 2:
        choice = tl.where(valid, scores + tl.load(BIAS + e, mask=valid, other=0.0).to(tl.float32), neg)
    else:
        choice = tl.where(valid, scores, neg)
    if N_GROUP > 1:
        grp = e // GROUP_SIZE
        gi = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_G], neg, tl.float32)
        for g in tl.static_range(N_GROUP):
            ing = (grp == g) & valid
            v1 = tl.max(tl.where(ing, choice, neg), 0)
            if METHOD == 2 and GROUP_SIZE > 1:  # the sum of the group's two largest biased scores
                i1 = tl.argmax(tl.where(ing, choice, neg), 0)
                v = v1 + tl.max(tl.where(ing & (e != i1), choice, neg), 0)
            else:
                v = v1
            gscore = tl.where(gi == g, v, gscore)
        keep = tl.zeros([BLOCK_E], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            gbest = tl.argmax(gscore, 0)
            keep = keep | (grp == gbest)
            gscore = tl.where(gi == gbest, neg, gscore)
        keep = keep & valid
        if METHOD == 2:
            choice = tl.where(keep, choice, neg)
        else:  # group_limited_greedy: the other groups' scores become 0 (and so do their weights, if chosen)
            scores = tl.where(keep, scores, 0.0)
            choice = tl.where(valid, scores, neg)
    ks = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(choice, 0)
        wv = tl.sum(tl.where(e == best, scores, 0.0), 0)
        w = tl.where(ks == i, wv, w)
        ids = tl.where(ks == i, best.to(tl.int32), ids)
        choice = tl.where(e == best, neg, choice)
    if RENORM:
        w = w / (tl.sum(w, 0) + renorm_eps)
    w = w * scale
    tl.store(W_OUT + row * TOP_K + ks, w, mask=ks < TOP_K)
    tl.store(ID_OUT + row * TOP_K + ks, ids, mask=ks < TOP_K)
    if COUNT:  # the expert load (topk.count_routed): one per pick; a row writing KV slot 0 is padding
        add = tl.full([BLOCK_K], 1, tl.int64)
        if HAS_SLOTS:
            add = add * (tl.load(SLOTS + row) != 0).to(tl.int64)
        tl.atomic_add(COUNTS + ids, add, mask=ks < TOP_K, sem="relaxed")


@triton.jit
def _router_logits_kernel(
    X,
    W,
    OUT,
    m,
    num_experts,
    hidden,
    stride_x,
    stride_w,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # BLOCK_E experts of every row: float32 products of the rows (any float dtype) and the float32 weights
    pid = tl.program_id(0)
    pdl_enter(USE_PDL)
    rows = tl.arange(0, BLOCK_M)
    ex = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        x = tl.load(
            X + rows[:, None] * stride_x + k[None, :], mask=(rows[:, None] < m) & (k[None, :] < hidden), other=0.0
        )
        w = tl.load(
            W + ex[:, None].to(tl.int64) * stride_w + k[None, :],
            mask=(ex[:, None] < num_experts) & (k[None, :] < hidden),
            other=0.0,
        )
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(
        OUT + rows[:, None] * num_experts + ex[None, :], acc, mask=(rows[:, None] < m) & (ex[None, :] < num_experts)
    )


# the most rows ``router_logits`` takes (decode batches; larger ones are a GEMM for cuBLAS)
LOGITS_MAX_ROWS = 16


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """``x [M, H] @ weight[E, H]^T`` in float32 (a router's logits, ``F.linear(x.float(), weight)``) in one kernel
    for decode batches of at most ``LOGITS_MAX_ROWS`` rows, in place of the float32 copy of ``x`` and cuBLAS's
    two GEMV kernels; None for larger batches or layouts it does not take.  The float32 sums run in another
    order than cuBLAS's (about 1e-6 relative)."""
    m, hidden = x.shape
    if m == 0 or m > LOGITS_MAX_ROWS or x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.dtype != torch.float32:
        return None
    e = weight.shape[0]
    out = torch.empty((m, e), dtype=torch.float32, device=x.device)
    block_m = max(triton.next_power_of_2(m), 2)
    block_e = 2 if block_m <= 4 else 1
    pdl = use_pdl(x)
    _router_logits_kernel[(triton.cdiv(e, block_e),)](
        x, weight, out, m, e, hidden, x.stride(0), weight.stride(0),
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_K=256, USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out


@triton.jit
def _router_logits_norm_kernel(
    X,
    R,
    NW,
    W,
    OUT,
    H_OUT,
    R_OUT,
    m,
    num_experts,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_w,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # the block's residual add and RMSNorm over whole rows in one tile (rounded as _rmsnorm_kernel rounds: the sum
    # to the rows' dtype, the normalised row to it, times the weight in float32, to it), then BLOCK_E experts'
    # float32 logits of the normalised rows; program 0 also stores the normalised rows and the new residual
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    ex = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < hidden
    dt = X.dtype.element_ty
    # the router's and the norm's weights stream in before the wait on the previous kernel (they never depend on it)
    w = tl.load(W + ex[:, None].to(tl.int64) * stride_w + ks[None, :], mask=(ex[:, None] < num_experts) & k_ok[None, :],
                other=0.0)  # fmt: skip
    nw = tl.load(NW + ks, mask=k_ok, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    mk = row_ok[:, None] & k_ok[None, :]
    xv = tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=mk, other=0.0)
    rv = tl.load(R + rows[:, None] * stride_r + ks[None, :], mask=mk, other=0.0)
    sv = (xv.to(tl.float32) + rv.to(tl.float32)).to(dt)
    s32 = sv.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s32 * s32, axis=1) / hidden + eps)
    hv = (nw[None, :] * (s32 * rstd[:, None]).to(dt).to(tl.float32)).to(dt)
    if pid == 0:
        tl.store(R_OUT + rows[:, None] * hidden + ks[None, :], sv, mask=mk)
        tl.store(H_OUT + rows[:, None] * hidden + ks[None, :], hv, mask=mk)
    acc = tl.sum(hv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(OUT + rows[:, None] * num_experts + ex[None, :], acc, mask=row_ok[:, None] & (ex[None, :] < num_experts))


# the most rows ``router_logits_normed`` takes, and the most elements of its tile of whole rows (larger decode
# batches and wider rows norm apart)
NORMED_MAX_ROWS = 4
NORMED_MAX_TILE = 16384


def router_logits_normed(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The pre-MoE block's ``h = RMSNorm(x + residual)`` and the router's float32 logits of ``h`` in one kernel:
    ``(logits [M, E], h, x + residual)``, new tensors, for decode batches of at most ``NORMED_MAX_ROWS`` rows;
    None for larger batches or layouts it does not take (the caller norms apart).  ``h`` and the sum are rounded
    as the RMSNorm kernel rounds them; its sum of squares runs in another order (``h`` within one rounding step
    of the RMSNorm kernel's), the logits as ``router_logits``'s."""
    m, hidden = x.shape
    if (
        m == 0
        or m > NORMED_MAX_ROWS
        or residual.shape != x.shape
        or residual.dtype != x.dtype
        or x.stride(-1) != 1
        or residual.stride(-1) != 1
        or weight.stride(-1) != 1
        or weight.dtype != torch.float32
        or norm_weight.shape != (hidden,)
        or not norm_weight.is_contiguous()
    ):
        return None
    block_m, block_k = max(triton.next_power_of_2(m), 2), triton.next_power_of_2(hidden)
    if block_m * block_k > NORMED_MAX_TILE:
        return None
    e = weight.shape[0]
    out = torch.empty((m, e), dtype=torch.float32, device=x.device)
    h = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
    res = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
    pdl = use_pdl(x)
    _router_logits_norm_kernel[(triton.cdiv(e, 2),)](
        x, residual, norm_weight, weight, out, h, res, m, e, hidden, float(eps), x.stride(0), residual.stride(0),
        weight.stride(0), BLOCK_M=block_m, BLOCK_E=2, BLOCK_K=block_k, USE_PDL=pdl, num_warps=8, launch_pdl=pdl,
    )  # fmt: skip
    return out, h, res


def route(
    logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
    renorm_eps: float = 0.0,
    topk_method: str = "greedy",
    n_group: int = 1,
    topk_group: int = 1,
    correction_bias: Optional[torch.Tensor] = None,
    scale: float = 1.0,
    counts: Optional[torch.Tensor] = None,
    rows_slots: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [M, E]`` -> float32 weights and int32 ids ``[M, top_k]`` (module docstring; ``fits`` says whether
    a router can take this kernel).  With ``counts`` (int64 ``[E]``) the same kernel adds the picks to the
    expert load as ``topk.count_routed(counts, ids, rows_slots)`` does."""
    m, e = logits.shape
    if not fits(e, top_k, n_group):
        raise ValueError(f"route: {e} experts, top_k {top_k}, {n_group} groups do not fit the kernel")
    method = METHODS[topk_method]
    if method == NOAUX_TC and correction_bias is None:
        raise ValueError("route: noaux_tc needs the correction bias")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((m, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((m, top_k), dtype=torch.int32, device=logits.device)
    if m == 0:
        return weights, ids
    grouped = method != GREEDY and n_group > 1
    pdl = use_pdl(logits)
    _route_kernel[(m,)](
        logits,
        correction_bias if correction_bias is not None else logits,
        weights,
        ids,
        ids if counts is None else counts,
        ids if rows_slots is None else rows_slots,
        logits.stride(0),
        e,
        float(scale),
        float(renorm_eps),
        TOP_K=top_k,
        SCORE=SCORING[scoring],
        METHOD=method,
        N_GROUP=n_group if grouped else 1,
        TOPK_GROUP=topk_group if grouped else 1,
        GROUP_SIZE=e // n_group if grouped else e,
        RENORM=renormalize,
        BLOCK_E=triton.next_power_of_2(e),
        BLOCK_G=max(2, triton.next_power_of_2(n_group)),
        BLOCK_K=triton.next_power_of_2(top_k),
        COUNT=counts is not None,
        HAS_SLOTS=rows_slots is not None,
        USE_PDL=pdl,
        num_warps=4 if e <= 256 else 8,
        launch_pdl=pdl,
    )
    return weights, ids


def fits(num_experts: int, top_k: int, n_group: int = 1) -> bool:
    """Whether ``route`` takes this router: at most ``MAX_EXPERTS`` experts in whole groups, ``top_k`` no larger
    than the experts."""
    return 0 < top_k <= num_experts <= MAX_EXPERTS and n_group >= 1 and num_experts % n_group == 0
