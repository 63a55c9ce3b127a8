"""The ``static`` expert-parallel dispatch: tokens to their experts' ranks and back, counts kept on the device.

docs/parallel.md, "Dispatch" (``--ep-dispatch static``).  With ``N`` ranks,
``M`` tokens and ``L`` experts per rank (physical experts: an expert-load
balancer's placement maps the router's ids to these before dispatch), rank
``r`` owns the token block ``[r*P, (r+1)*P)`` with ``P = ceil(M/N)`` (padded
with empty rows past ``M``).  Every size below follows from ``M`` (a host
shape), so no value is read on the host and the whole exchange can be captured
in a CUDA graph:

1. ``pack``: a token goes once to every rank holding at least one of its
   top-k experts (``hit [P, N]``).  A prefix sum of ``hit`` over the block's
   tokens gives each token its slot in that rank's part of the send buffer
   (``N*P`` rows); rank ``d``'s part holds its tokens in block order, then
   empty rows.  The capacity ``P`` per destination is the worst case (every
   token of the block to one rank): nothing ever overflows.  A row is bytes:
   a float32 ``[2k]`` meta row (the token's top-k ids local to the
   destination, ``-1`` "absent" for experts of other ranks and for empty rows,
   then its routing weights) followed by the token's ``[H]`` hidden row (and
   padding to 8 bytes), so one exchange carries both.
2. ``all_to_all_single`` with equal splits sends part ``d`` to rank ``d``.
3. ``compute``: the receiving rank runs its experts over the ``N*P`` received
   rows with the layer's runner (absent pairs add nothing, empty rows are all
   absent), weighting by the routing weights: each row comes out as the token's
   partial sum over that rank's experts, as the ``all_reduce`` dispatch computes
   it.
4. ``combine``: the same equal-split exchange brings every partial back to the
   slot it left from; the owner gathers, per token, the partial of each rank
   (zero where the token did not go), sums them over ranks in rank order in
   float32 and casts once.
5. An all-gather of the ``[P, H]`` blocks gives every rank the whole ``[M, H]``
   (attention is tensor-parallel: every rank needs every token's output).

Numerics: the per-rank partials are the ones the ``all_reduce`` dispatch makes;
only the cross-rank sum differs (float32 in rank order here, the collective's
own order and dtype there): equal in float32 at two ranks (a + b = b + a),
within float32 rounding at more, and more accurate in bfloat16.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from kvship.engine.distributed.communicator import Communicator, RankLost


@dataclass
class Packed:
    """One rank's side of a ``static`` dispatch of ``m`` tokens (``per`` rows per destination)."""

    m: int
    per: int
    send: torch.Tensor  # uint8 [n*per, row bytes]: rank d's rows at [d*per, (d+1)*per) (``split_rows``)
    row: torch.Tensor  # [per, n] int64: the send row each (token, rank) used, clamped into range
    hit: torch.Tensor  # [per, n] bool: the token went to that rank


def block(m: int, n: int, rank: int) -> tuple[int, int, int]:
    """Rank ``rank``'s tokens ``[lo, hi)`` of ``m`` and the block size ``ceil(m/n)``."""
    per = -(-m // n)
    return min(rank * per, m), min((rank + 1) * per, m), per


def use_kernels(x: torch.Tensor) -> bool:
    """The byte moving of ``pack`` / ``unpack`` by the Triton kernels of ``ep_pack`` (CUDA; the interpreter in
    tests), else by torch ops."""
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def pack(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    n: int,
    rank: int,
    per_rank: int,
    out: Optional[torch.Tensor] = None,
    kernels: Optional[bool] = None,
) -> Packed:
    """Step 1 (module docstring): this rank's tokens, their rows placed by destination with a device prefix sum.
    ``ids`` are the experts' (physical) ids, ``per_rank`` experts on each rank (rank ``d`` holds
    ``[d*per_rank, (d+1)*per_rank)``).  ``out``: uint8 ``[n*per, row bytes]`` to pack into (the peer-memory
    exchange's own buffer); ``kernels``: force the Triton or the torch path (default ``use_kernels``)."""
    m, hidden = x.shape
    k = ids.shape[1]
    lo, hi, per = block(m, n, rank)
    rows = hi - lo
    dev = x.device
    # the block padded to ``per`` tokens: a padded token routes nowhere
    idb = torch.full((per, k), -1, dtype=torch.int64, device=dev)
    idb[:rows] = ids[lo:hi].long()
    owner = torch.where(idb >= 0, idb.div(per_rank, rounding_mode="floor"), -1)  # [per, k]
    ranks = torch.arange(n, device=dev)
    on = owner.unsqueeze(1) == ranks.view(1, n, 1)  # [per, n, k]: pair j of token t lives on rank d
    hit = on.any(-1)  # [per, n]
    # the token's place among the rank's tokens (device prefix sum), scanned along the innermost dim: CUDA scans
    # an outer dim of ``[per, n]`` with one thread per column, ``per`` steps in a row (220 us at 4096 tokens)
    slot = hit.t().contiguous().long().cumsum(1).t() - 1
    pair = torch.arange(per * n, device=dev).view(per, n)  # (t, d) -> t*n + d
    # every (token, rank) a distinct target: hits at d*per + slot, misses past the buffer (never sent)
    target = torch.where(hit, ranks.view(1, n) * per + slot, n * per + pair)
    inv = torch.full((2 * n * per,), per * n, dtype=torch.int64, device=dev)
    inv.scatter_(0, target.reshape(-1), pair.reshape(-1))
    inv = inv[: n * per]  # send row -> its (t, d) pair, or per*n: empty
    row = target.clamp(max=n * per - 1)
    if use_kernels(x) if kernels is None else kernels:
        send = (
            out
            if out is not None
            else torch.empty((n * per, row_bytes(k, hidden, x.dtype)), dtype=torch.uint8, device=dev)
        )
        from kvship.engine.parallel.ep_pack import pack_rows  # Triton: CUDA (and the interpreter in tests)

        pack_rows(send, x, ids, weights, inv, lo, per, per_rank, n)
        return Packed(m, per, send, row, hit)
    xb = x.new_zeros((per + 1, hidden))  # + one zero row that empty send rows read
    xb[:rows] = x[lo:hi]
    wb = torch.zeros((per, k), dtype=torch.float32, device=dev)
    wb[:rows] = weights[lo:hi].float()
    send_x = xb.index_select(0, inv.div(n, rounding_mode="floor"))  # empty rows read the zero row ``per``
    local = torch.where(on, idb.unsqueeze(1) - ranks.view(1, n, 1) * per_rank, -1)  # [per, n, k]
    meta = torch.cat([local.float(), wb.unsqueeze(1).expand(per, n, k)], dim=-1).reshape(per * n, 2 * k)
    empty = torch.full((1, 2 * k), -1.0, dtype=torch.float32, device=dev)
    empty[:, k:] = 0.0  # an empty row: every id absent, weight 0
    send_meta = torch.cat([meta, empty]).index_select(0, inv)
    parts = [send_meta.view(torch.uint8), send_x.view(torch.uint8)]
    pad = row_bytes(k, hidden, x.dtype) - 8 * k - hidden * x.element_size()
    if pad:  # keep every row's start 8-byte aligned, so both parts view back in place
        parts.append(torch.zeros((n * per, pad), dtype=torch.uint8, device=dev))
    send = torch.cat(parts, dim=1)
    if out is not None:
        out.copy_(send)
        send = out
    return Packed(m, per, send, row, hit)


def row_bytes(k: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of one send row: the float32 meta row ``[2k]``, the hidden row, padding to a multiple of 8."""
    size = 8 * k + hidden * torch.empty((), dtype=dtype).element_size()
    return -(-size // 8) * 8


def split_rows(
    recv: torch.Tensor, k: int, hidden: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 3's inputs from the received byte rows: (hidden rows ``[R, H]``, float32 weights ``[R, k]``, int32
    local ids ``[R, k]``), each contiguous."""
    meta = recv[:, : 8 * k].view(torch.float32)
    width = hidden * torch.empty((), dtype=dtype).element_size()
    rows = recv[:, 8 * k : 8 * k + width].view(dtype).contiguous()
    return rows, meta[:, k:].contiguous(), meta[:, :k].to(torch.int32)


def unpack(p: Packed, back: torch.Tensor, dtype: torch.dtype, kernels: Optional[bool] = None) -> torch.Tensor:
    """Step 4's sum: the token block ``[per, H]`` from the returned partials ``back [n*per, H]``."""
    if use_kernels(back) if kernels is None else kernels:
        from kvship.engine.parallel.ep_pack import sum_partials

        return sum_partials(back, p.row, p.hit, dtype)
    parts = back.index_select(0, p.row.reshape(-1)).view(p.row.shape[0], p.row.shape[1], -1)  # [per, n, H]
    parts = torch.where(p.hit.unsqueeze(-1), parts.float(), 0.0)
    return parts.sum(1).to(dtype)


def wait(work: Any) -> None:
    """Complete an async collective's handle (a failing one is ``RankLost``, as the communicator's own ops)."""
    try:
        work.wait()
    except (RuntimeError, OSError, ValueError) as e:
        raise RankLost(f"async collective failed: {type(e).__name__}: {e}") from e


class StaticDispatch:
    """The ``static`` dispatch of one MoE layer over ``comm`` (module docstring); ``compute(x, weights, local
    ids) -> [R, H]`` runs this rank's experts (absent ids ``-1``).  ``begin``/``finish`` split each exchange so
    two micro-batches can interleave (``kvship.engine.parallel.tbo``); ``__call__`` runs them in a row."""

    def __init__(self, comm: Communicator, per_rank: int, compute: Callable[..., torch.Tensor]):
        self.comm = comm
        self.per_rank = per_rank
        self.compute = compute

    # the stages, each returning the state the next one takes; ``async_op`` leaves the collective running
    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, async_op: bool = False) -> tuple:
        n, k = self.comm.size, ids.shape[1]
        per = -(-x.shape[0] // n)
        # packed straight into the peer-memory exchange's buffer where there is one (not for overlapped
        # micro-batches: the second would overwrite the first's rows while they may still be in flight)
        out = None if async_op else self.comm.send_buffer(n * per, row_bytes(k, x.shape[1], x.dtype))
        p = pack(x, weights, ids, n, self.comm.rank, self.per_rank, out=out)
        recv = torch.empty_like(p.send)
        work = self.comm.all_to_all(recv, p.send, async_op=async_op)
        return p, recv, (ids.shape[1], x.shape[1], x.dtype), [work] if async_op else []

    def experts(self, state: tuple, async_op: bool = False) -> tuple:
        p, recv, layout, works = state
        for w in works:
            wait(w)
        y = self.compute(*split_rows(recv, *layout)).contiguous()
        back = torch.empty_like(y)
        work = self.comm.all_to_all(back, y, async_op=async_op)
        return p, back, [work] if async_op else []

    def combine(self, state: tuple, dtype: torch.dtype, async_op: bool = False) -> tuple:
        p, back, works = state
        for w in works:
            wait(w)
        mine = unpack(p, back, dtype)
        whole = mine.new_empty((self.comm.size * p.per, mine.shape[1]))
        work = self.comm.all_gather_into(whole, mine, async_op=async_op)
        return p, whole, [work] if async_op else []

    @staticmethod
    def result(state: tuple) -> torch.Tensor:
        p, whole, works = state
        for w in works:
            wait(w)
        return whole[: p.m]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:  # the same on every rank: no collective to pair up
            return torch.zeros_like(x)
        state = self.dispatch(x, weights, ids)
        return self.result(self.combine(self.experts(state), x.dtype))
