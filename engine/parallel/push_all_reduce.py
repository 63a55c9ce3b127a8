"""A one-kernel all-reduce of small tensors that pushes over peer GPU memory (docs/parallel.md, "The all-reduce").

PyTorch's one-shot kernel (``p2p_all_reduce``) copies a rank's tensor into its
own buffer, meets the peers at a barrier (a signal to every peer and a wait for
theirs) and then reads every peer's copy across the link: two link round trips
before the sum.  A TP decode step of batch 1 spends ~7 us in each of its
all-reduces that way.  Here each rank **writes** its tensor straight into a slot
of every peer's buffer, then raises a flag in every peer's buffer (a release
store at system scope, after the writes), waits for the flags of its peers in
its own buffer (spinning on local memory, an acquire load), and sums the slots
it received in rank order in float32: one link crossing before the sum.

* **Epochs.**  Every rank keeps a device counter of its calls (int64; the
  kernel increments it, so a replayed CUDA graph counts too).  A peer's flag
  for call ``e`` is ``e``; a rank waits until each flag is ``>= e``.  Every
  rank runs the same all-reduces in the same order (the communicator's
  contract), so the counters agree.
* **Two slots.**  Call ``e`` writes the slots of parity ``e % 2``.  A rank
  reaches call ``e + 2`` (the same slots) only after it saw every peer's flag of
  call ``e + 1``, which a peer raises only after its call ``e`` (which read those
  slots) has finished: no write overtakes a read.
* One program moves and sums the whole tensor (up to ``MAX_BYTES``): the latency
  path of decode; larger tensors take the other paths.
* Deterministic: every rank sums rank 0's slot first, then rank 1's, ..., in
  float32, and rounds once, so all ranks hold the same bits (at two ranks the
  one rounding of ``a + b`` NCCL makes).

A rank whose peer never arrives spins (as a barrier would); the worker's group
timeout is then the watchdog.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BYTES = 32 << 10  # one program's tensor: batch 8 x hidden 2048 or batch 4 x hidden 4096 in bf16
FLAG_BYTES = 256  # the flags at the start of a buffer: one int64 per rank (8 ranks), padded


@triton.jit
def _push_all_reduce_kernel(
    X,
    PEERS,  # int64 [N]: every rank's buffer address, mapped into this process
    EPOCH,  # int64 [1]: this rank's call counter
    numel,
    rank,
    N: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    FLAG_BYTES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    m = offs < numel
    epoch = tl.load(EPOCH) + 1
    tl.store(EPOCH, epoch)
    parity = epoch % 2
    x = tl.load(X + offs, mask=m, other=0.0)
    # this rank's tensor into slot (parity, rank) of every peer's buffer
    slot = FLAG_BYTES + (parity * N + rank) * SLOT_BYTES
    for r in tl.static_range(N):
        if r != rank:
            base = tl.load(PEERS + r).to(tl.pointer_type(tl.int8))
            dst = (base + slot).to(tl.pointer_type(X.dtype.element_ty))
            tl.store(dst + offs, x, mask=m)
    tl.debug_barrier()  # every thread's writes issued before the flag goes up
    for r in tl.static_range(N):
        if r != rank:
            base = tl.load(PEERS + r).to(tl.pointer_type(tl.int8))
            flag = (base + rank * 8).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
    mine = tl.load(PEERS + rank).to(tl.pointer_type(tl.int8))
    for r in tl.static_range(N):
        if r != rank:
            flag = (mine + r * 8).to(tl.pointer_type(tl.int64))
            while tl.atomic_add(flag, 0, sem="acquire", scope="sys") < epoch:  # spin until peer r's slot is in
                pass
    tl.debug_barrier()
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(N):
        if r == rank:
            acc += x.to(tl.float32)
        else:
            src = (mine + FLAG_BYTES + (parity * N + r) * SLOT_BYTES).to(tl.pointer_type(X.dtype.element_ty))
            acc += tl.load(src + offs, mask=m, other=0.0, volatile=True).to(tl.float32)
    tl.store(X + offs, acc.to(X.dtype.element_ty), mask=m)


def buffer_bytes(size: int) -> int:
    """One rank's buffer: the flags, then two parities of a slot per rank."""
    return FLAG_BYTES + 2 * size * MAX_BYTES


class PushAllReduce:
    """The push all-reduce of one group over ``buffer`` (this rank's symmetric allocation, zeroed before any peer
    writes into it) whose every rank's address is in ``peers``."""

    def __init__(self, peers: list[int], rank: int, device: torch.device) -> None:
        self.size = len(peers)
        self.rank = rank
        self.peers = torch.tensor(peers, dtype=torch.int64, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)

    @staticmethod
    def fits(t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= MAX_BYTES

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.view(-1)
        block = triton.next_power_of_2(max(flat.numel(), 16))
        _push_all_reduce_kernel[(1,)](
            flat, self.peers, self.epoch, flat.numel(), self.rank,
            N=self.size, SLOT_BYTES=MAX_BYTES, FLAG_BYTES=FLAG_BYTES, BLOCK=block,
            num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
        return t
