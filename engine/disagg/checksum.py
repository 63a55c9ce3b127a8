"""Optional per-request KV checksum (``--kv-transfer-checksum``).

Prefill computes it over its source pages, puts it in the aux record; decode
recomputes it over the destination pages once the done signal arrived and fails
the request on a mismatch.  Both walk the same byte stream — every K/V buffer in
``KVPool.buffers()`` order, each buffer's pages in prompt order — so the value
does not depend on where the pages sit in either pool.  A swapped, misplaced,
stale or partly written page changes it.

Two algorithms, picked by decode (it says which in its registration) to suit
its pool's device; prefill computes whichever was asked:

* ``crc32`` (CPU pools): ``zlib.crc32`` chained over the page runs, reading the
  tensors' memory in place (no copy; zlib releases the GIL).
* ``wsum64`` (CUDA pools): a weighted sum computed with torch on the device, so
  no bytes leave the GPU: every 32-bit word times an odd per-column weight,
  summed per page, times an odd per-position page weight, folded per buffer.
  Any single corrupted word changes it (odd weights are invertible mod 2^32);
  page swaps change it through the position weights.  Memory-bound, one pass.
"""

from __future__ import annotations

import threading
import zlib
from typing import Sequence

import numpy as np
import torch

from kvship.engine.disagg.descriptors import single_runs

ALGORITHMS = ("crc32", "wsum64")
_SEED = 0x6B76_7368
_FOLD = 0x9E3779B97F4A7C15 - (1 << 64)  # odd 64-bit multiplier as a signed int64

_weights_lock = threading.Lock()
_col_weights: dict[tuple[str, int], torch.Tensor] = {}
_page_weights: dict[str, torch.Tensor] = {}


def default_algorithm(device: torch.device | str) -> str:
    return "wsum64" if torch.device(device).type == "cuda" else "crc32"


def kv_checksum(buffers: Sequence[torch.Tensor], pages: np.ndarray, page_size: int, algorithm: str) -> int:
    """Checksum of ``pages`` (prompt order) across ``buffers``; an unsigned 64-bit int."""
    if algorithm == "crc32":
        return _crc32(buffers, pages, page_size)
    if algorithm == "wsum64":
        return _wsum64(buffers, pages, page_size)
    raise ValueError(f"unknown KV checksum algorithm {algorithm!r}; known: {ALGORITHMS}")


def _page_bytes(buf: torch.Tensor, page_size: int) -> int:
    return page_size * (buf.numel() // buf.shape[0]) * buf.element_size()


def _crc32(buffers: Sequence[torch.Tensor], pages: np.ndarray, page_size: int) -> int:
    runs = single_runs(pages)
    crc = 0
    for buf in buffers:
        pb = _page_bytes(buf, page_size)
        flat = buf.view(-1).view(torch.uint8)
        for start, _, n, _ in runs.tolist():
            chunk = flat[start * pb : (start + n) * pb]
            if chunk.device.type != "cpu":
                chunk = chunk.cpu()
            crc = zlib.crc32(memoryview(chunk.numpy()), crc)
    return crc


def _weights(device: torch.device, words: int, npos: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (str(device), words)
    with _weights_lock:
        col = _col_weights.get(key)
        if col is None:
            g = torch.Generator().manual_seed(_SEED + words)
            col = torch.randint(-(2**31), 2**31 - 1, (words,), generator=g, dtype=torch.int64) | 1
            col = col.to(torch.int32).to(device)
            _col_weights[key] = col
        pw = _page_weights.get(str(device))
        if pw is None or pw.numel() < npos:
            n = max(npos, 1024, 0 if pw is None else 2 * pw.numel())
            g = torch.Generator().manual_seed(_SEED)
            pw = (torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64) | 1).to(device)
            _page_weights[str(device)] = pw
    return col, pw


def _wsum64(buffers: Sequence[torch.Tensor], pages: np.ndarray, page_size: int) -> int:
    runs = single_runs(pages)
    total = None
    for buf in buffers:
        pb = _page_bytes(buf, page_size)
        flat = buf.view(-1).view(torch.uint8)
        if pb % 4 == 0:
            words = flat.view(torch.int32)
            per_page_words = pb // 4
        else:  # odd-sized rows (e.g. 1-byte dtypes with odd head dims): widen bytes
            words = flat.to(torch.int32)
            per_page_words = pb
        col, pw = _weights(buf.device, per_page_words, int(pages.size))
        acc = torch.zeros((), dtype=torch.int64, device=buf.device)
        for start, _, n, pos in runs.tolist():
            block = words[start * per_page_words : (start + n) * per_page_words].view(n, per_page_words)
            per_page = (block * col).sum(dim=1, dtype=torch.int64)
            acc = acc + (per_page * pw[pos : pos + n]).sum()
        total = acc if total is None else total * _FOLD + acc
    if total is None:
        return 0
    return int(total.item()) & 0xFFFFFFFFFFFFFFFF


def kv_checksum_heads(
    buffers: Sequence[torch.Tensor], pages: np.ndarray, page_size: int, head_start: int, num_heads: int, algorithm: str
) -> int:
    """``kv_checksum`` of KV heads ``[head_start, head_start + num_heads)`` of ``pages`` only.

    What a prefill rank sends a decode rank when tensor-parallel sizes differ
    (``kvship.engine.disagg.tp_slices``): both sides checksum the same heads of the
    same pages, wherever those heads sit in their own pools.  All heads: ``kv_checksum``.
    """
    if not buffers or (head_start == 0 and num_heads == buffers[0].shape[1]):
        return kv_checksum(buffers, pages, page_size, algorithm)
    compact = []
    for buf in buffers:
        idx = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64)).to(buf.device)
        paged = buf.view(-1, page_size, buf.shape[1], buf.shape[2]).index_select(0, idx)
        compact.append(paged[:, :, head_start : head_start + num_heads].contiguous().view(-1, num_heads, buf.shape[2]))
    return kv_checksum(compact, np.arange(pages.size, dtype=np.int64), page_size, algorithm)
