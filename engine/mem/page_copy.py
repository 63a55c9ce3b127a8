"""Page copies between the host KV tier and the device pool by a kernel (``--hicache-io-backend kernel``;
docs/cache.md, "Copies").

``copy_pages(dsts, dst_pages, srcs, src_pages, page_rows)`` copies, for every buffer pair ``(dst, src)``, the
rows of page ``src_pages[i]`` of ``src`` into page ``dst_pages[i]`` of ``dst`` (a page = ``page_rows``
consecutive rows of a buffer ``[rows, ...]``; ``page_rows`` 1 copies single slots).  One launch moves every pair
(up to ``MAX_PAIRS``; more take more launches), each program looping over (page, chunk) items.

On CUDA one side is the pinned host pool: the kernel reads or writes it in place through its device mapping
(pinned memory is mapped into the device's address space), so a scattered set of pages crosses the bus in one
launch with no staging buffer, no host-side gather or scatter and no per-page copy call; the host thread only
launches.  ``programs`` bounds the grid (each program keeps several 16-byte accesses in flight), which also bounds
the SMs a copy takes from concurrent kernels.  Off CUDA (tests) Triton's interpreter runs the same kernel.

The rows are moved as 32-bit words when a row's bytes allow it (``_words``), else as bytes: the copy never looks
at the values, so any dtype (bf16, fp16, fp32, float8) moves bit for bit.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

# buffers one launch takes (a layer's K and V: 2; an MLA layer's latent row: 1)
MAX_PAIRS = 2
# words of one program's chunk (16 KiB of 32-bit words: 8 x 16-byte accesses per thread of 4 warps)
DEFAULT_BLOCK = 4096
# programs of one launch on CUDA, and warps of each: the H200 sweeps (bench/hicache_loadback.py --sweep, --sweep-small;
# docs/benchmarks.md) gave 49-51 GB/s from 16 to 528 programs of 4 warps and the least slowdown of a GEMV beside it
# at 16 (1.17x); 4 programs of 8 warps move 47.5 GB/s (86% of a pinned copy) and slow it 1.09x
DEFAULT_PROGRAMS = 4
DEFAULT_WARPS = 8


@triton.jit
def _copy_pages(
    DST0,
    SRC0,
    DST1,
    SRC1,
    DST_PAGES,
    SRC_PAGES,
    n_pages,
    PAGE: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
    PAIRS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    for item in range(pid, n_pages * CHUNKS, nprog):
        i = item // CHUNKS
        c = item - i * CHUNKS
        s = tl.load(SRC_PAGES + i).to(tl.int64) * PAGE
        d = tl.load(DST_PAGES + i).to(tl.int64) * PAGE
        o = c * BLOCK + offs
        m = o < PAGE
        x0 = tl.load(SRC0 + s + o, mask=m)
        if PAIRS == 2:
            x1 = tl.load(SRC1 + s + o, mask=m)
        tl.store(DST0 + d + o, x0, mask=m)
        if PAIRS == 2:
            tl.store(DST1 + d + o, x1, mask=m)


def _words(buf: torch.Tensor) -> torch.Tensor:
    """``buf`` (contiguous) flat as 32-bit words when its rows' bytes and its address allow, else as bytes."""
    flat = buf.reshape(-1).view(torch.uint8)
    row_bytes = flat.numel() // buf.shape[0]
    if row_bytes % 4 == 0 and buf.data_ptr() % 4 == 0:
        return flat.view(torch.int32)
    return flat


def page_copy_supported(buf: torch.Tensor) -> bool:
    """Whether ``copy_pages`` can address ``buf``'s rows (contiguous: a row's place is its index x its size)."""
    return buf.is_contiguous() and buf.dim() >= 2


def copy_pages(
    dsts: Sequence[torch.Tensor],
    dst_pages: torch.Tensor,
    srcs: Sequence[torch.Tensor],
    src_pages: torch.Tensor,
    page_rows: int,
    programs: int = DEFAULT_PROGRAMS,
    block: int = DEFAULT_BLOCK,
    warps: int = DEFAULT_WARPS,
) -> None:
    """``dsts[j]``'s page ``dst_pages[i]`` = ``srcs[j]``'s page ``src_pages[i]`` for every ``i`` and ``j``.

    ``dst_pages`` / ``src_pages``: int64 (or int32) page numbers on the device the kernel runs on (CUDA: the
    current device; the host buffers are pinned), same length.  Each ``dsts[j]`` / ``srcs[j]`` pair has the same
    dtype and row shape; every buffer is contiguous.  Runs on the current stream and returns at once."""
    if len(dsts) != len(srcs) or not dsts:
        raise ValueError(f"copy_pages: {len(dsts)} destination buffers for {len(srcs)} sources")
    n = int(dst_pages.numel())
    if int(src_pages.numel()) != n:
        raise ValueError(f"copy_pages: {n} destination pages for {src_pages.numel()} source pages")
    if page_rows < 1:
        raise ValueError(f"copy_pages: page_rows must be >= 1, got {page_rows}")
    if n == 0:
        return
    launches = []
    for d, s in zip(dsts, srcs):
        if d.dtype != s.dtype or d.shape[1:] != s.shape[1:]:
            raise ValueError(f"copy_pages: rows {tuple(d.shape[1:])} {d.dtype} <- {tuple(s.shape[1:])} {s.dtype}")
        if not (page_copy_supported(d) and page_copy_supported(s)):
            raise ValueError("copy_pages: buffers must be contiguous with at least 2 dimensions")
        wd, ws = _words(d), _words(s)
        if wd.dtype != ws.dtype:  # one side's address is not word aligned: both as bytes
            wd, ws = d.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8)
        per_row = wd.numel() // d.shape[0]
        last = launches[-1] if launches else None
        if last is not None and len(last[1]) < MAX_PAIRS and last[0] == (per_row, wd.dtype):
            last[1].append((wd, ws))  # the same row size and word type: one launch takes both
        else:
            launches.append(((per_row, wd.dtype), [(wd, ws)]))
    for (per_row, _), pairs in launches:
        page = per_row * page_rows
        blk = min(block, triton.next_power_of_2(page))
        chunks = triton.cdiv(page, blk)
        (d0, s0), (d1, s1) = pairs[0], pairs[-1]
        _copy_pages[(max(1, min(programs, n * chunks)),)](
            d0,
            s0,
            d1,
            s1,
            dst_pages,
            src_pages,
            n,
            PAGE=page,
            CHUNKS=chunks,
            BLOCK=blk,
            PAIRS=len(pairs),
            num_warps=warps,
        )
