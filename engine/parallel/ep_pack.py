"""Triton kernels of the ``static`` dispatch's packing (docs/parallel.md, "Dispatch").

``ep_dispatch.pack`` places a token block's rows by destination rank with a
device prefix sum (small ``[P, N, k]`` tensors); what moves the bytes is here,
one launch each instead of a chain of index, concatenation and reduction ops
over ``[N*P, H]`` byte rows:

* ``pack_rows``: every send row ``i`` (part ``d = i // P``) gets its float32
  meta row (the token's top-k ids local to rank ``d``, ``-1`` for other ranks'
  experts and for empty rows, then the routing weights) and the token's hidden
  row (zeros for an empty row), written in place into the byte rows the
  exchange sends (the peer-memory exchange's own buffer where there is one).
* ``sum_partials``: token ``t`` of the block = sum over ranks ``d`` with
  ``hit[t, d]`` of the returned partial ``back[row[t, d]]``, in rank order in
  float32, cast once.

Both match the torch reference in ``ep_dispatch`` (the CPU path) bit for bit.  ``local_ids`` maps a rank's
routed ids to its local ones (the ``all_reduce`` dispatch's absent pairs) in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pack_rows_kernel(
    X,
    IDS,
    W,
    INV,
    META_OUT,
    X_OUT,
    lo,
    per,
    per_rank,
    n,
    hidden,
    stride_x,
    stride_ids,
    stride_w,
    stride_meta,
    stride_xout,
    K: tl.constexpr,
    KP2: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0)  # the send row; part d = i // per goes to rank d
    d = i // per
    pair = tl.load(INV + i)  # (token, rank) pair t * n + d, or per * n: an empty row
    valid = pair < per * n
    tok = lo + tl.where(valid, pair // n, 0)
    offs_k = tl.arange(0, KP2)
    mk = offs_k < K
    live = valid.to(tl.int32)  # a scalar mask spread over the block (the interpreter takes no scalar & block)
    mkv = mk & ((offs_k * 0 + live) > 0)
    ids = tl.load(IDS + tok * stride_ids + offs_k, mask=mkv, other=-1).to(tl.int32)
    local = ids - d * per_rank
    inside = (ids >= 0) & (local >= 0) & (local < per_rank)
    lid = tl.where(inside, local, -1).to(tl.float32)
    w = tl.load(W + tok * stride_w + offs_k, mask=mkv, other=0.0).to(tl.float32)
    tl.store(META_OUT + i * stride_meta + offs_k, lid, mask=mk)
    tl.store(META_OUT + i * stride_meta + K + offs_k, w, mask=mk)
    for h0 in range(0, hidden, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        mh = offs < hidden
        v = tl.load(X + tok * stride_x + offs, mask=mh & ((offs * 0 + live) > 0), other=0.0)
        tl.store(X_OUT + i * stride_xout + offs, v, mask=mh)


@triton.jit
def _sum_partials_kernel(
    BACK, ROW, HIT, OUT, n, hidden, stride_back, stride_out, BLOCK_H: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = offs < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for d in range(n):  # rank order, float32
        r = tl.load(ROW + t * n + d)
        h = tl.load(HIT + t * n + d).to(tl.int32)
        acc += tl.load(BACK + r * stride_back + offs, mask=mh & ((offs * 0 + h) > 0), other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_out + offs, acc.to(OUT.dtype.element_ty), mask=mh)


@triton.jit
def _local_ids_kernel(IDS, OUT, numel, start, num_local, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    local = tl.load(IDS + offs, mask=m, other=-1).to(tl.int32) - start
    tl.store(OUT + offs, tl.where((local >= 0) & (local < num_local), local, -1), mask=m)


def local_ids(ids: torch.Tensor, start: int, num_local: int) -> torch.Tensor:
    """``kvship.engine.parallel.ep.local_expert_ids`` in one launch."""
    out = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
    numel = ids.numel()
    if numel:
        block = min(1024, triton.next_power_of_2(numel))
        _local_ids_kernel[(triton.cdiv(numel, block),)](ids.contiguous(), out, numel, start, num_local, BLOCK=block)
    return out


def _block_h(hidden: int) -> int:
    return min(1024, triton.next_power_of_2(max(hidden, 16)))


def pack_rows(
    send: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    inv: torch.Tensor,
    lo: int,
    per: int,
    per_rank: int,
    n: int,
) -> None:
    """Fill the byte rows ``send [n*per, row bytes]`` (module docstring); ``inv [n*per]`` int64 maps each send row
    to its (token, rank) pair ``t * n + d`` of the block starting at token ``lo`` (``per * n``: empty)."""
    k, hidden = ids.shape[1], x.shape[1]
    if send.shape[0] == 0:
        return
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    meta = send.view(torch.float32)  # [R, row bytes / 4]: the first 2k are the meta row
    xout = send[:, 8 * k : 8 * k + hidden * x.element_size()].view(x.dtype)
    _pack_rows_kernel[(send.shape[0],)](
        x, ids, weights, inv, meta, xout, lo, per, per_rank, n, hidden,
        x.stride(0), ids.stride(0), weights.stride(0), meta.stride(0), xout.stride(0),
        K=k, KP2=triton.next_power_of_2(k), BLOCK_H=_block_h(hidden),
    )  # fmt: skip


def sum_partials(back: torch.Tensor, row: torch.Tensor, hit: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[per, H]``: per token, the sum over ranks of its returned partials (module docstring)."""
    per, n = row.shape
    hidden = back.shape[1]
    out = torch.empty((per, hidden), dtype=dtype, device=back.device)
    if per == 0:
        return out
    back = back.contiguous()
    block = _block_h(hidden)
    _sum_partials_kernel[(per, triton.cdiv(hidden, block))](
        back, row.contiguous(), hit.contiguous().view(torch.uint8), out, n, hidden, back.stride(0), out.stride(0),
        BLOCK_H=block,
    )  # fmt: skip
    return out
