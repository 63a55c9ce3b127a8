"""Weight prefetch into L2 while latency-bound kernels run (docs/gpu.md, "Weight prefetch into L2").

A small-batch decode step alternates between kernels that stream weights at
full HBM bandwidth (the GEMVs) and kernels bound by latency (decode attention,
RoPE, norms, the tensor-parallel all-reduce), during which HBM is mostly
idle.  ``L2Prefetcher.issue`` forks a side stream from the current one and
launches ``_l2_prefetch_kernel`` there: it asks the memory system to bring the
next GEMVs' weight bytes into L2 while the main stream runs the latency-bound
kernels, so the GEMV that follows finds (part of) its weights in L2.  A
prefetch reads nothing into registers and writes nothing, so no result can
change; it only moves when bytes leave HBM.  ``join`` puts the side stream
back into the current one (a CUDA graph capture must end joined).

Only imported on CUDA devices of compute capability 9 or more (Hopper's
``cp.async.bulk.prefetch.L2``), through ``l2_prefetch.prefetcher_for``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

# bytes one lane asks for with one bulk prefetch, lanes of one program
CHUNK = 16384
LANES = 32

# MODE 0: one ``cp.async.bulk.prefetch.L2`` per lane and chunk; 1: ``prefetch.global.L2::evict_last`` per 128-byte
# line (the benchmark compares them: bench/l2_prefetch.py)
MODE_BULK = 0
MODE_LINES = 1


@triton.jit
def _l2_prefetch_kernel(addr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    if MODE == 0:
        off = pid.to(tl.int64) * (CHUNK * LANES) + tl.arange(0, LANES).to(tl.int64) * CHUNK
        size = tl.minimum(nbytes - off, CHUNK)
        size = tl.where(size > 0, size, 0) // 16 * 16
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [addr + off, size.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        off = pid.to(tl.int64) * (CHUNK * LANES) + tl.arange(0, CHUNK * LANES // 128).to(tl.int64) * 128
        ok = (off < nbytes).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r",
            [addr + off, ok],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def prefetch_bytes(t: torch.Tensor, start: int, nbytes: int, mode: int = MODE_BULK) -> None:
    """Queue a prefetch of bytes ``[start, start + nbytes)`` of contiguous ``t`` on the current stream."""
    nbytes = min(int(nbytes), t.numel() * t.element_size() - int(start))
    if nbytes <= 0:
        return
    per_program = CHUNK * LANES
    _l2_prefetch_kernel[(triton.cdiv(nbytes, per_program),)](
        t.data_ptr() + int(start), nbytes, CHUNK=CHUNK, LANES=LANES, MODE=mode, num_warps=1
    )


class L2Prefetcher:
    """The side stream of one device's prefetches (module docstring)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.forked = False

    def issue(self, regions: Sequence[tuple[torch.Tensor, int, int]]) -> None:
        """Prefetch ``(tensor, start byte, bytes)`` regions on the side stream once the current stream's work so
        far is done (they then run beside what the current stream queues next)."""
        if not regions:
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for t, start, n in regions:
                prefetch_bytes(t, start, n)
        self.forked = True

    def join(self) -> None:
        """The current stream waits for the prefetches queued so far (before a graph capture ends)."""
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False
