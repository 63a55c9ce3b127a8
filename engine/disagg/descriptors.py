"""From page lists to transfer descriptors (pure, numpy only).

A request's pages on prefill (``src``) and on decode (``dst``) are two lists of
page indices of equal length, in prompt order.  Positions where both lists
advance by one form a *run*; each run becomes one descriptor per K/V buffer, so
a request whose pages are contiguous on both sides costs ``2 * num_layers``
descriptors however long it is.  Descriptors for all buffers of a request form
one batch (buffer-major: every run of K0, then of K1, ..., then V0 ...; then
the runs of the per-slot features buffer when they travel, ``region_descs``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvship.engine.disagg.base import KVTransferError, TransferDescs


def as_pages(pages: Sequence[int] | np.ndarray) -> np.ndarray:
    """A 1-D int64 copy of ``pages`` (accepts lists, numpy arrays, CPU tensors)."""
    if hasattr(pages, "cpu") and hasattr(pages, "numpy"):
        pages = pages.cpu().numpy()  # type: ignore[union-attr]
    arr = np.array(pages, dtype=np.int64).reshape(-1)
    return arr


def check_pages(pages: np.ndarray, num_pages: int, side: str) -> None:
    """Every page must be a real page of a pool with ``num_pages`` pages (1..num_pages)."""
    if pages.size == 0:
        raise KVTransferError(f"{side}: empty page list")
    lo, hi = int(pages.min()), int(pages.max())
    if lo < 1:
        raise KVTransferError(f"{side}: page {lo} is not allowed (page 0 is the padding page)")
    if hi > num_pages:
        raise KVTransferError(f"{side}: page {hi} is beyond the pool's {num_pages} pages")
    if np.unique(pages).size != pages.size:
        raise KVTransferError(f"{side}: a page appears twice in the request's page list")


def page_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """``[n_runs, 4]`` int64 rows ``(src_start, dst_start, n_pages, position)``.

    ``position`` is the run's first index in the request's page list.
    """
    if src.shape != dst.shape:
        raise KVTransferError(f"page count mismatch: prefill has {src.size} pages, decode registered {dst.size}")
    n = src.size
    if n == 0:
        return np.zeros((0, 4), dtype=np.int64)
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [n]))
    return np.stack([src[starts], dst[starts], ends - starts, starts], axis=1).astype(np.int64)


def single_runs(pages: np.ndarray) -> np.ndarray:
    """Runs of one page list against itself (for walking one side's pages in order)."""
    return page_runs(pages, pages)


def kv_descs(runs: np.ndarray, num_buffers: int, page_bytes: int) -> TransferDescs:
    """One descriptor per run per buffer; region i is buffer i on both sides."""
    r = runs.shape[0]
    bufs = np.repeat(np.arange(num_buffers, dtype=np.int64), r)
    src_off = np.tile(runs[:, 0] * page_bytes, num_buffers)
    dst_off = np.tile(runs[:, 1] * page_bytes, num_buffers)
    length = np.tile(runs[:, 2] * page_bytes, num_buffers)
    return TransferDescs(src_region=bufs, src_off=src_off, dst_region=bufs.copy(), dst_off=dst_off, length=length)


def region_descs(runs: np.ndarray, src_region: int, dst_region: int, page_bytes: int) -> TransferDescs:
    """One descriptor per run of one paged region (the per-slot features: ``page_bytes`` per page)."""
    d = kv_descs(runs, 1, page_bytes)
    return TransferDescs(
        src_region=np.full_like(d.src_region, src_region),
        src_off=d.src_off,
        dst_region=np.full_like(d.dst_region, dst_region),
        dst_off=d.dst_off,
        length=d.length,
    )


def concat_descs(parts: Sequence[TransferDescs]) -> TransferDescs:
    """One batch of every descriptor of ``parts``, in order."""
    return TransferDescs(
        *(
            np.concatenate([getattr(p, f) for p in parts])
            for f in ("src_region", "src_off", "dst_region", "dst_off", "length")
        )
    )


def select_layers(descs: TransferDescs, num_layers: int, first: int, end: int, kv_planes: int = 2) -> TransferDescs:
    """The descriptors of K/V buffers of layers ``[first, end)`` (K of layer i is region i, V is
    ``num_layers + i``; ``kv_planes`` 1: MLA's latent buffers, region i only), in order."""
    layer = descs.src_region % num_layers
    keep = (descs.src_region < kv_planes * num_layers) & (layer >= first) & (layer < end)
    return TransferDescs(
        *(getattr(descs, f)[keep] for f in ("src_region", "src_off", "dst_region", "dst_off", "length"))
    )


def aux_descs(src_region: int, src_slot: int, dst_region: int, dst_slot: int, record_bytes: int) -> TransferDescs:
    one = lambda v: np.array([v], dtype=np.int64)  # noqa: E731
    return TransferDescs(
        src_region=one(src_region),
        src_off=one(src_slot * record_bytes),
        dst_region=one(dst_region),
        dst_off=one(dst_slot * record_bytes),
        length=one(record_bytes),
    )


def check_descs(descs: TransferDescs, local_sizes: Sequence[int], remote_sizes: Sequence[int]) -> None:
    """Refuse descriptors that would read or write outside a registered region."""
    for side, region, off, sizes in (
        ("source", descs.src_region, descs.src_off, local_sizes),
        ("destination", descs.dst_region, descs.dst_off, remote_sizes),
    ):
        if region.size == 0:
            continue
        if region.min() < 0 or region.max() >= len(sizes):
            raise KVTransferError(f"{side} region index out of range")
        limit = np.asarray(sizes, dtype=np.int64)[region]
        if (off < 0).any() or ((off + descs.length) > limit).any():
            raise KVTransferError(f"{side} descriptor outside its registered region")
