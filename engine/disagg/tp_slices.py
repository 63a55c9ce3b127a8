"""Which KV heads a tensor-parallel rank holds, and which bytes go from a prefill rank to a decode rank.

PD with tensor parallelism (docs/parallel.md, "PD with tensor parallelism"):
a prefill worker at TP=a feeds a decode worker at TP=b, a and b independent.
Every rank has its own KV pool holding only its KV heads (``rank_kv_heads``:
the same split as ``kvship.engine.parallel.layers.head_split``; ranks share a
head when tp > KV heads).  Every decode rank registers each room with every
prefill rank; ``head_slice`` says which heads (if any) prefill rank ``p`` writes
into decode rank ``d`` -- each of ``d``'s heads comes from exactly one prefill
rank that holds it (of several holders, rank ``d mod holders``, spreading the
reads) -- and ``slice_kv_descs`` turns that into the transfer descriptors every
backend (tcp, mooncake, nixl) executes.

Pipeline parallelism (docs/parallel.md, "PD with pipeline parallelism"): a
rank of a pipeline stage holds only its stage's layers, registered as its
K/V buffers (K of its i-th layer is region i, V is ``num_layers + i``).  A
prefill rank writes a decode rank the layers both hold (``shared_layers``):
``map_layers`` keeps those descriptors and points each at the decode rank's
buffer of the same model layer, so the transfer of layer ``l`` comes from the
stage that owns ``l``, its heads sliced across TP as above.

This module is the one place with head-range and layer-range arithmetic; the sender and the
receiver (checksums) use it, the backends only move the byte ranges it yields.

Pool layout (``kvship.engine.mem.pools.KVPool``): each K/V buffer is
``[slots, local_kv_heads, head_dim]``, page ``i`` is slots
``[i * page_size, (i + 1) * page_size)``.  When a slice is all of both ranks'
heads a page is contiguous on both sides and whole pages travel (page runs,
``descriptors.kv_descs``); otherwise one range per token and buffer carries
the slice's heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from kvship.engine.disagg.base import KVTransferError, TransferDescs
from kvship.engine.disagg.descriptors import kv_descs

if TYPE_CHECKING:
    import torch

    from kvship.engine.disagg.wire import KVLayout


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``[src_head, src_head + num_heads)`` of prefill rank ``src_rank`` (its local head
    indices) land in heads ``[dst_head, dst_head + num_heads)`` of decode rank ``dst_rank``."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    num_heads: int


def rank_kv_heads(total_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first global KV head, count) held by ``rank`` of ``tp_size``.

    ``tp_size <= total``: an even block; ``tp_size > total``: one head, shared by
    ``tp_size / total`` consecutive ranks.  KVTransferError when it does not split evenly.
    """
    if total_kv_heads < 1 or tp_size < 1 or not 0 <= rank < tp_size:
        raise KVTransferError(f"bad tensor-parallel KV layout: {total_kv_heads} KV heads, rank {rank} of {tp_size}")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise KVTransferError(f"{total_kv_heads} KV heads do not split over tp size {tp_size}")
        n = total_kv_heads // tp_size
        return rank * n, n
    if tp_size % total_kv_heads:
        raise KVTransferError(f"tp size {tp_size} is not a multiple of the {total_kv_heads} KV heads")
    return rank // (tp_size // total_kv_heads), 1


def plan_head_slices(total_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadSlice]:
    """Where each of decode rank ``dst_rank``'s heads comes from: at most one slice per prefill rank."""
    d0, dn = rank_kv_heads(total_kv_heads, dst_tp, dst_rank)
    ranges = [rank_kv_heads(total_kv_heads, src_tp, p) for p in range(src_tp)]
    out: list[HeadSlice] = []
    for h in range(d0, d0 + dn):
        holders = [p for p, (s0, sn) in enumerate(ranges) if s0 <= h < s0 + sn]
        p = holders[dst_rank % len(holders)]
        src_head = h - ranges[p][0]
        last = out[-1] if out else None
        if last is not None and last.src_rank == p and last.src_head + last.num_heads == src_head:
            out[-1] = HeadSlice(p, dst_rank, last.src_head, last.dst_head, last.num_heads + 1)
        else:
            out.append(HeadSlice(p, dst_rank, src_head, h - d0, 1))
    return out


def head_slice(total_kv_heads: int, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int) -> Optional[HeadSlice]:
    """The heads prefill rank ``src_rank`` writes into decode rank ``dst_rank`` (None: nothing)."""
    for s in plan_head_slices(total_kv_heads, src_tp, dst_tp, dst_rank):
        if s.src_rank == src_rank:
            return s
    return None


def slice_kv_descs(
    runs: np.ndarray,
    num_buffers: int,
    page_size: int,
    head_bytes: int,
    src_heads: int,
    dst_heads: int,
    s: HeadSlice,
) -> TransferDescs:
    """Descriptors moving slice ``s`` of the pages in ``runs`` (``descriptors.page_runs`` rows).

    ``src_heads`` / ``dst_heads`` are the ranks' local KV heads per slot, ``head_bytes`` one
    head's bytes (head_dim * element size).  Region i is K/V buffer i on both sides.
    """
    if s.num_heads == src_heads == dst_heads:
        return kv_descs(runs, num_buffers, page_size * src_heads * head_bytes)
    if s.src_head + s.num_heads > src_heads or s.dst_head + s.num_heads > dst_heads:
        raise KVTransferError(f"head slice {s} does not fit {src_heads} prefill / {dst_heads} decode heads")
    counts = runs[:, 2] * page_size
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    within = np.arange(total, dtype=np.int64) - starts
    src_tok = np.repeat(runs[:, 0] * page_size, counts) + within
    dst_tok = np.repeat(runs[:, 1] * page_size, counts) + within
    src_off = src_tok * (src_heads * head_bytes) + s.src_head * head_bytes
    dst_off = dst_tok * (dst_heads * head_bytes) + s.dst_head * head_bytes
    bufs = np.repeat(np.arange(num_buffers, dtype=np.int64), total)
    return TransferDescs(
        src_region=bufs,
        src_off=np.tile(src_off, num_buffers),
        dst_region=bufs.copy(),
        dst_off=np.tile(dst_off, num_buffers),
        length=np.full(total * num_buffers, s.num_heads * head_bytes, dtype=np.int64),
    )


def shared_layers(src: "KVLayout", dst: "KVLayout") -> Optional[tuple[int, int]]:
    """The model layers ``[lo, hi)`` both ranks hold (their pipeline stages overlap there), or None."""
    lo, hi = max(src.layer_start, dst.layer_start), min(src.layer_end, dst.layer_end)
    return (lo, hi) if lo < hi else None


def map_layers(descs: TransferDescs, src: "KVLayout", dst: "KVLayout") -> Optional[TransferDescs]:
    """``descs`` (K/V buffer regions of ``src``'s pool on both sides, as ``slice_kv_descs`` yields them) cut to
    the layers both ranks hold, each pointed at ``dst``'s buffer of the same model layer; None when the ranks
    share no layer."""
    shared = shared_layers(src, dst)
    if shared is None:
        return None
    if src.layer_start == dst.layer_start and src.num_layers == dst.num_layers:
        return descs  # the same layers: region i is region i
    n = src.num_layers
    if len(descs) and int(descs.src_region.max()) >= src.kv_planes * n:
        raise KVTransferError(f"descriptor region {int(descs.src_region.max())} is no K/V buffer of {n} layers")
    layer = src.layer_start + descs.src_region % n
    keep = (layer >= shared[0]) & (layer < shared[1])
    dst_region = (descs.src_region // n) * dst.num_layers + (layer - dst.layer_start)
    return TransferDescs(
        src_region=descs.src_region[keep],
        src_off=descs.src_off[keep],
        dst_region=dst_region[keep],
        dst_off=descs.dst_off[keep],
        length=descs.length[keep],
    )


def layer_buffers(buffers: Sequence["torch.Tensor"], layout: "KVLayout", lo: int, hi: int) -> list["torch.Tensor"]:
    """The K buffers, then the V buffers (MLA: the latent buffers), of the model layers ``[lo, hi)`` in a pool
    with ``layout`` (the checksum walks these on both sides, so it covers exactly the layers one prefill rank
    wrote)."""
    n, a, b = layout.num_layers, lo - layout.layer_start, hi - layout.layer_start
    if not 0 <= a < b <= n or len(buffers) < layout.kv_planes * n:
        raise KVTransferError(f"layers [{lo}, {hi}) are not held by a pool of layers {layout.layer_start}+{n}")
    return [buf for p in range(layout.kv_planes) for buf in buffers[p * n + a : p * n + b]]
