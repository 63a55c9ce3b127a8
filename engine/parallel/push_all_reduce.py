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
* **Programs.**  Up to ``ONE_PROGRAM_BYTES`` one program moves and sums the whole
  tensor (the latency path of decode).  Above, up to ``MAX_PROGRAMS`` programs
  each take a chunk: program ``j`` writes its chunk, raises its own flag and waits
  only for the peers' flags of program ``j``, so no program waits for another's
  bytes and the chunks cross the link side by side.  Each program keeps its own
  call counter, flags and part of every slot (``EPOCH[j]``; flag ``(j, r)``;
  bytes ``[j * SUB_BYTES, (j + 1) * SUB_BYTES)`` of a slot, whatever the chunk
  size of the call): program ``j`` runs in every call of more than ``j`` chunks,
  the same calls on every rank, so its counters agree across ranks, and the
  two-slot argument above holds program by program even when consecutive calls
  cut their tensors differently.
* Deterministic: every rank sums rank 0's slot first, then rank 1's, ..., in
  float32, and rounds once, so all ranks hold the same bits (at two ranks the
  one rounding of ``a + b`` NCCL makes).

``all_reduce_rmsnorm_`` is the same exchange followed, in the same program, by
what the next block's input norm would do with the sum: ``x + residual``
(rounded to the activation dtype, the new residual) and its RMSNorm, rounded as
``fused_ops_cuda.rmsnorm`` rounds them.  A TP decode step then has no norm
kernel after its all-reduces (docs/parallel.md, "The all-reduce").

A rank whose peer never arrives spins (as a barrier would); the worker's group
timeout is then the watchdog.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvship.engine.layers.fused_ops_cuda import rmsnorm_row, rmsnorm_warps

# one program's tensor (batch 2 of hidden 4096 in bf16); at 32 KiB one program took 8.5 us against one-shot's 7.7
# and 64 KiB in 16 chunks 5.8 us on two H200s (docs/parallel.md, "The all-reduce")
ONE_PROGRAM_BYTES = 16 << 10
MAX_BYTES = 1 << 20  # the largest tensor (batch 128 x hidden 4096 in bf16): the chunked kernel's
MAX_PROGRAMS = 32  # chunks of a tensor above ONE_PROGRAM_BYTES
CHUNK_BLOCK = 4096  # elements a chunk's program moves a step
MAX_RANKS = 8
SUB_BYTES = MAX_BYTES // MAX_PROGRAMS  # program j's part of a slot (the single program's and the norm kernel's: 0)
FLAG_BYTES = MAX_PROGRAMS * MAX_RANKS * 8  # the flags at the start of a buffer: int64 (program, rank)
# the all-reduce-and-RMSNorm kernel's largest tensor: its program walks the rows one after another, which beat the
# push kernel then the norm kernel at one row of 4096 bf16 (5.5 vs 7.4 us) and lost at two (9.2 vs 8.3 us) on two
# H200s (docs/parallel.md, "The all-reduce")
NORM_MAX_BYTES = 8 << 10
# the sentinel exchange (``all_reduce_sentinel_``): tensors up to MAX_BYTES, cut into programs as the push kernel
# cuts them, in their own region after the flags and slots, two parities of a slot per rank; every byte of a free
# slot is 0xFF
SENTINEL_MAX_BYTES = MAX_BYTES
SENTINEL_SLOT_BYTES = SENTINEL_MAX_BYTES


@triton.jit
def _program_call(EPOCH, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """This program's next call: ``(pid, epoch, slot parity, first element, block offsets)``; bumps its counter
    in ``EPOCH`` (per program, so replayed graphs count and calls cut into other chunk counts keep agreeing)."""
    pid = tl.program_id(0)
    epoch = tl.load(EPOCH + pid) + 1
    tl.store(EPOCH + pid, epoch)
    return pid, epoch, epoch % 2, pid * (BLOCK * STEPS), tl.arange(0, BLOCK)


@triton.jit
def _push_all_reduce_kernel(
    X,
    PEERS,  # int64 [N]: every rank's buffer address, mapped into this process
    EPOCH,  # int64 [MAX_PROGRAMS]: this rank's call counter of each program
    numel,
    rank,
    N: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    SUB_BYTES: tl.constexpr,  # a program's part of a slot: program j only ever writes part j
    FLAG_BYTES: tl.constexpr,
    BLOCK: tl.constexpr,  # elements a step
    STEPS: tl.constexpr,  # steps of a program: its chunk is BLOCK * STEPS elements
):
    pid, epoch, parity, lo, offs = _program_call(EPOCH, BLOCK, STEPS)
    # this rank's chunk into part pid of slot (parity, rank) of every peer's buffer
    slot = FLAG_BYTES + (parity * N + rank) * SLOT_BYTES + pid * SUB_BYTES
    for step in tl.static_range(STEPS):
        idx = lo + step * BLOCK + offs
        m = idx < numel
        x = tl.load(X + idx, mask=m, other=0.0)
        for r in tl.static_range(N):
            if r != rank:
                base = tl.load(PEERS + r).to(tl.pointer_type(tl.int8))
                dst = (base + slot).to(tl.pointer_type(X.dtype.element_ty))
                tl.store(dst + (idx - lo), x, mask=m)
    tl.debug_barrier()  # every thread's writes issued before the flag goes up
    for r in tl.static_range(N):
        if r != rank:
            base = tl.load(PEERS + r).to(tl.pointer_type(tl.int8))
            flag = (base + (pid * N + rank) * 8).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
    mine = tl.load(PEERS + rank).to(tl.pointer_type(tl.int8))
    for r in tl.static_range(N):
        if r != rank:
            flag = (mine + (pid * N + r) * 8).to(tl.pointer_type(tl.int64))
            while tl.atomic_add(flag, 0, sem="acquire", scope="sys") < epoch:  # spin until peer r's chunk is in
                pass
    tl.debug_barrier()
    for step in tl.static_range(STEPS):
        idx = lo + step * BLOCK + offs
        m = idx < numel
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r in tl.static_range(N):
            if r == rank:
                acc += tl.load(X + idx, mask=m, other=0.0).to(tl.float32)
            else:
                part = FLAG_BYTES + (parity * N + r) * SLOT_BYTES + pid * SUB_BYTES
                src = (mine + part).to(tl.pointer_type(X.dtype.element_ty))
                acc += tl.load(src + (idx - lo), mask=m, other=0.0, volatile=True).to(tl.float32)
        tl.store(X + idx, acc.to(X.dtype.element_ty), mask=m)


@triton.jit
def _push_all_reduce_norm_kernel(
    X,  # [rows, n_cols]: this rank's partial sums (left as they are)
    RES,  # [rows, n_cols]: the residual stream
    W,  # [n_cols]: the norm's weight
    Y,  # [rows, n_cols] out: rmsnorm(sum + residual)
    RES_OUT,  # [rows, n_cols] out: sum + residual
    PEERS,
    EPOCH,
    rows,
    n_cols,
    eps,
    rank,
    N: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    FLAG_BYTES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    m = offs < n_cols
    epoch = tl.load(EPOCH) + 1
    tl.store(EPOCH, epoch)
    parity = epoch % 2
    slot = FLAG_BYTES + (parity * N + rank) * SLOT_BYTES
    for row in range(rows):  # this rank's rows into its slot of every peer's buffer
        x = tl.load(X + row * n_cols + offs, mask=m, other=0.0)
        for r in tl.static_range(N):
            if r != rank:
                base = tl.load(PEERS + r).to(tl.pointer_type(tl.int8))
                dst = (base + slot).to(tl.pointer_type(X.dtype.element_ty))
                tl.store(dst + row * n_cols + offs, x, mask=m)
    tl.debug_barrier()
    for r in tl.static_range(N):
        if r != rank:
            base = tl.load(PEERS + r).to(tl.pointer_type(tl.int8))
            flag = (base + rank * 8).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
    mine = tl.load(PEERS + rank).to(tl.pointer_type(tl.int8))
    for r in tl.static_range(N):
        if r != rank:
            flag = (mine + r * 8).to(tl.pointer_type(tl.int64))
            while tl.atomic_add(flag, 0, sem="acquire", scope="sys") < epoch:
                pass
    tl.debug_barrier()
    w = tl.load(W + offs, mask=m, other=0.0)
    for row in range(rows):
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r in tl.static_range(N):  # rank order, as the plain kernel sums
            if r == rank:
                acc += tl.load(X + row * n_cols + offs, mask=m, other=0.0).to(tl.float32)
            else:
                src = (mine + FLAG_BYTES + (parity * N + r) * SLOT_BYTES).to(tl.pointer_type(X.dtype.element_ty))
                acc += tl.load(src + row * n_cols + offs, mask=m, other=0.0, volatile=True).to(tl.float32)
        total = acc.to(X.dtype.element_ty)  # the all-reduce's result, rounded as the plain kernel stores it
        rv = tl.load(RES + row * n_cols + offs, mask=m, other=0.0)
        xv = (total.to(tl.float32) + rv.to(tl.float32)).to(total.dtype)  # as the norm kernel adds a residual
        tl.store(RES_OUT + row * n_cols + offs, xv, mask=m)
        out = rmsnorm_row(xv, w, n_cols, eps)
        tl.store(Y + row * n_cols + offs, out.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _sentinel_send(x, PEERS, base_off, rank, offs, m, N: tl.constexpr, ITYPE: tl.constexpr):
    """Write ``x``'s bits into slot ``base_off + rank`` of every peer; a value whose bits are the sentinel (all
    ones: a NaN) goes as another NaN, so a slot holds the sentinel only while it is free."""
    bits = x.to(ITYPE, bitcast=True)
    bits = tl.where(bits == -1, (1 << (ITYPE.primitive_bitwidth - 1)) - 1, bits)  # sign bit off: still a NaN
    for r in tl.static_range(N):
        if r != rank:
            dst = (tl.load(PEERS + r).to(tl.pointer_type(tl.int8)) + base_off).to(tl.pointer_type(ITYPE))
            tl.store(dst + offs, bits, mask=m)


@triton.jit
def _sentinel_take(src, offs, m, DTYPE: tl.constexpr, ITYPE: tl.constexpr):
    """Spin on local ``src`` until every element of ``offs`` holds a value (not the sentinel), return them as
    ``DTYPE`` in float32 and free the slot (the sentinel back)."""
    v = tl.load(src + offs, mask=m, other=0, volatile=True)
    while tl.sum(((v == -1) & m).to(tl.int32), axis=0) > 0:
        v = tl.load(src + offs, mask=m, other=0, volatile=True)
    tl.store(src + offs, tl.full(offs.shape, -1, ITYPE), mask=m)
    return v.to(DTYPE, bitcast=True).to(tl.float32)


@triton.jit
def _sentinel_all_reduce_kernel(
    X,
    PEERS,
    EPOCH,  # int64 [MAX_PROGRAMS]: this rank's count of sentinel calls of each program (its slot parity)
    numel,
    rank,
    N: tl.constexpr,
    REGION: tl.constexpr,  # byte offset of the sentinel slots in a buffer
    SLOT_BYTES: tl.constexpr,
    SUB_BYTES: tl.constexpr,  # a program's part of a slot: program j only ever writes part j
    ITYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
):
    pid, epoch, parity, lo, offs = _program_call(EPOCH, BLOCK, STEPS)
    for step in tl.static_range(STEPS):
        idx = lo + step * BLOCK + offs
        m = idx < numel
        x = tl.load(X + idx, mask=m, other=0.0)
        part = REGION + (parity * N + rank) * SLOT_BYTES + pid * SUB_BYTES
        _sentinel_send(x, PEERS, part, rank, idx - lo, m, N, ITYPE)
    mine = tl.load(PEERS + rank).to(tl.pointer_type(tl.int8))
    for step in tl.static_range(STEPS):
        idx = lo + step * BLOCK + offs
        m = idx < numel
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r in tl.static_range(N):  # rank order, as the push kernel sums
            if r == rank:
                acc += tl.load(X + idx, mask=m, other=0.0).to(tl.float32)
            else:
                src = (mine + REGION + (parity * N + r) * SLOT_BYTES + pid * SUB_BYTES).to(tl.pointer_type(ITYPE))
                acc += _sentinel_take(src, idx - lo, m, X.dtype.element_ty, ITYPE)
        tl.store(X + idx, acc.to(X.dtype.element_ty), mask=m)


@triton.jit
def _sentinel_all_reduce_norm_kernel(
    X,
    RES,
    W,
    Y,
    RES_OUT,
    PEERS,
    EPOCH,
    rows,
    n_cols,
    rows_per_program,
    eps,
    rank,
    N: tl.constexpr,
    REGION: tl.constexpr,
    SLOT_BYTES: tl.constexpr,
    SUB_BYTES: tl.constexpr,
    ITYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # program pid: rows [pid * rows_per_program, ...) through part pid of a slot, its own call counter
    pid, epoch, parity, _, offs = _program_call(EPOCH, BLOCK, 1)
    m = offs < n_cols
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    for row in range(first, last):
        x = tl.load(X + row * n_cols + offs, mask=m, other=0.0)
        part = (REGION + (parity * N + rank) * SLOT_BYTES + pid * SUB_BYTES
                + (row - first) * n_cols * (X.dtype.element_ty.primitive_bitwidth // 8))  # fmt: skip
        _sentinel_send(x, PEERS, part, rank, offs, m, N, ITYPE)
    mine = tl.load(PEERS + rank).to(tl.pointer_type(tl.int8))
    w = tl.load(W + offs, mask=m, other=0.0)
    for row in range(first, last):
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r in tl.static_range(N):
            if r == rank:
                acc += tl.load(X + row * n_cols + offs, mask=m, other=0.0).to(tl.float32)
            else:
                part = (mine + REGION + (parity * N + r) * SLOT_BYTES + pid * SUB_BYTES).to(tl.pointer_type(ITYPE))
                acc += _sentinel_take(part + (row - first) * n_cols, offs, m, X.dtype.element_ty, ITYPE)
        total = acc.to(X.dtype.element_ty)
        rv = tl.load(RES + row * n_cols + offs, mask=m, other=0.0)
        xv = (total.to(tl.float32) + rv.to(tl.float32)).to(total.dtype)
        tl.store(RES_OUT + row * n_cols + offs, xv, mask=m)
        out = rmsnorm_row(xv, w, n_cols, eps)
        tl.store(Y + row * n_cols + offs, out.to(Y.dtype.element_ty), mask=m)


def sentinel_norm_shape(rows: int, n_cols: int, element_size: int) -> tuple[int, int]:
    """``(programs, rows per program)`` of the sentinel all-reduce with the norm inside: one row a program up to
    ``MAX_PROGRAMS`` rows, then as few more a program as fit; ValueError where the rows do not fit the parts."""
    per = max(1, triton.cdiv(rows, MAX_PROGRAMS))
    if per * n_cols * element_size > SUB_BYTES:
        raise ValueError(
            f"the sentinel all-reduce with the norm inside takes up to {SUB_BYTES} bytes of rows a program, not "
            f"{per} rows of {n_cols} x {element_size} bytes"
        )
    return triton.cdiv(rows, per), per


def sentinel_region(size: int) -> int:
    """Byte offset of the sentinel slots in a rank's buffer (after the push kernels' flags and slots)."""
    return FLAG_BYTES + 2 * size * MAX_BYTES


def buffer_bytes(size: int) -> int:
    """One rank's buffer: the flags, two parities of a slot per rank, then the sentinel slots (two parities per
    rank); ``init_buffer`` gives it its first contents."""
    return sentinel_region(size) + 2 * size * SENTINEL_SLOT_BYTES


def init_buffer(buffer: torch.Tensor, size: int) -> None:
    """A fresh buffer: flags and slots zero, every sentinel slot free (0xFF bytes)."""
    buffer.zero_()
    buffer[sentinel_region(size) :].fill_(0xFF)


def launch_shape(numel: int, element_size: int) -> tuple[int, int, int]:
    """``(programs, BLOCK, STEPS)`` of the push kernel for a tensor of ``numel`` elements: one program over the
    whole tensor up to ``ONE_PROGRAM_BYTES``, else up to ``MAX_PROGRAMS`` chunks of ``STEPS`` blocks of
    ``CHUNK_BLOCK`` elements."""
    if numel * element_size <= ONE_PROGRAM_BYTES:
        return 1, triton.next_power_of_2(max(numel, 16)), 1
    blocks = triton.cdiv(numel, CHUNK_BLOCK)
    steps = triton.cdiv(blocks, MAX_PROGRAMS)
    if CHUNK_BLOCK * steps * element_size > SUB_BYTES:
        raise ValueError(f"the push all-reduce takes up to {MAX_BYTES} bytes, not {numel * element_size}")
    return triton.cdiv(blocks, steps), CHUNK_BLOCK, steps


class PushAllReduce:
    """The push all-reduce of one group over ``buffer`` (this rank's symmetric allocation, zeroed before any peer
    writes into it) whose every rank's address is in ``peers``."""

    def __init__(self, peers: list[int], rank: int, device: torch.device) -> None:
        if len(peers) > MAX_RANKS:
            raise ValueError(f"the push all-reduce takes up to {MAX_RANKS} ranks, not {len(peers)}")
        self.size = len(peers)
        self.rank = rank
        self.peers = torch.tensor(peers, dtype=torch.int64, device=device)
        self.epoch = torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=device)
        self.sentinel_epoch = torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=device)

    @staticmethod
    def fits(t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= MAX_BYTES

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.view(-1)
        programs, block, steps = launch_shape(flat.numel(), flat.element_size())
        _push_all_reduce_kernel[(programs,)](
            flat, self.peers, self.epoch, flat.numel(), self.rank,
            N=self.size, SLOT_BYTES=MAX_BYTES, SUB_BYTES=SUB_BYTES, FLAG_BYTES=FLAG_BYTES, BLOCK=block, STEPS=steps,
            num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
        return t

    @staticmethod
    def fits_sentinel(t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= SENTINEL_MAX_BYTES and t.element_size() in (2, 4)

    def all_reduce_sentinel_(self, t: torch.Tensor) -> torch.Tensor:
        """The same sum as ``all_reduce_`` without flags: each rank writes its tensor's bits into its slot of
        every peer's sentinel region and spins until its own slots hold no sentinel (all-ones bits), then frees
        them.  No release store, no flag, no counter across ranks: one link crossing and the data is its own
        signal.  A value whose bits are the sentinel is a NaN and travels as another NaN (sums with a NaN are
        NaN either way).  Cut into programs as ``all_reduce_`` cuts (``launch_shape``): program ``j`` keeps its
        own call counter and part ``j`` of a slot, two parities each, and writes a parity of its part again only
        after its peers' program ``j`` read and freed it (they did so one call of that program before they could
        read this rank's next one).  Tensors up to ``SENTINEL_MAX_BYTES``."""
        flat = t.view(-1)
        if not self.fits_sentinel(flat):
            raise ValueError(f"the sentinel all-reduce takes up to {SENTINEL_MAX_BYTES} bytes of 2- or 4-byte values")
        programs, block, steps = launch_shape(flat.numel(), flat.element_size())
        _sentinel_all_reduce_kernel[(programs,)](
            flat, self.peers, self.sentinel_epoch, flat.numel(), self.rank,
            N=self.size, REGION=sentinel_region(self.size), SLOT_BYTES=SENTINEL_SLOT_BYTES, SUB_BYTES=SUB_BYTES,
            ITYPE=tl.int16 if flat.element_size() == 2 else tl.int32, BLOCK=block, STEPS=steps,
            num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
        return t

    def fits_sentinel_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``all_reduce_sentinel_rmsnorm_`` takes these: ``fits_norm``'s layout rules, up to
        ``SENTINEL_MAX_BYTES``, rows that ``sentinel_norm_shape`` can place."""
        if x.dim() < 1 or x.numel() == 0 or x.element_size() not in (2, 4):
            return False
        if x.numel() * x.element_size() > SENTINEL_MAX_BYTES:
            return False
        n = x.shape[-1]
        try:
            sentinel_norm_shape(x.numel() // n, n, x.element_size())
        except ValueError:
            return False
        return (
            x.is_contiguous()
            and residual.is_contiguous()
            and residual.shape == x.shape
            and residual.dtype == x.dtype == weight.dtype
            and weight.shape == (n,)
            and weight.is_contiguous()
        )

    def all_reduce_sentinel_rmsnorm_(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``all_reduce_rmsnorm_`` over the sentinel exchange (``all_reduce_sentinel_``), bit-equal to it: one row
        a program (its own counter and part of a slot) up to ``MAX_PROGRAMS`` rows, more rows a program above
        (``sentinel_norm_shape``), so rows are exchanged and normalised side by side."""
        if not self.fits_sentinel_norm(x, residual, weight):
            raise ValueError(
                f"the sentinel all-reduce with the norm inside takes contiguous rows of 2- or 4-byte values, up to "
                f"{SENTINEL_MAX_BYTES} bytes and {SUB_BYTES} bytes of rows a program"
            )
        n = x.shape[-1]
        rows = x.numel() // n
        programs, per = sentinel_norm_shape(rows, n, x.element_size())
        y = torch.empty_like(x)
        res_out = torch.empty_like(x)
        block = triton.next_power_of_2(n)
        _sentinel_all_reduce_norm_kernel[(programs,)](
            x, residual, weight, y, res_out, self.peers, self.sentinel_epoch, rows, n, per, float(eps), self.rank,
            N=self.size, REGION=sentinel_region(self.size), SLOT_BYTES=SENTINEL_SLOT_BYTES, SUB_BYTES=SUB_BYTES,
            ITYPE=tl.int16 if x.element_size() == 2 else tl.int32, BLOCK=block, num_warps=rmsnorm_warps(block),
        )  # fmt: skip
        return y, res_out

    def fits_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``all_reduce_rmsnorm_`` takes these: contiguous rows of one dtype within one slot, the norm's
        weight in that dtype (the norm kernel's output dtype is then the rows')."""
        return (
            x.numel() * x.element_size() <= NORM_MAX_BYTES
            and x.dim() >= 1
            and x.is_contiguous()
            and residual.is_contiguous()
            and residual.shape == x.shape
            and residual.dtype == x.dtype == weight.dtype
            and weight.shape == (x.shape[-1],)
            and weight.is_contiguous()
        )

    def all_reduce_rmsnorm_(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(sum + residual), sum + residual)`` with ``sum`` the all-reduce of ``x`` (new tensors; ``x``
        itself is left as it was).  Bit-equal to ``all_reduce_`` then ``fused_ops_cuda.rmsnorm``.  Its one program
        writes part 0 of a slot, so it takes at most ``SUB_BYTES`` (the product sends it ``NORM_MAX_BYTES``)."""
        if x.numel() * x.element_size() > SUB_BYTES:
            raise ValueError(f"the push all-reduce with the norm inside takes up to {SUB_BYTES} bytes, not "
                             f"{x.numel() * x.element_size()}")  # fmt: skip
        n = x.shape[-1]
        rows = x.numel() // n
        y = torch.empty_like(x)
        res_out = torch.empty_like(x)
        block = triton.next_power_of_2(n)
        _push_all_reduce_norm_kernel[(1,)](
            x, residual, weight, y, res_out, self.peers, self.epoch, rows, n, float(eps), self.rank,
            N=self.size, SLOT_BYTES=MAX_BYTES, FLAG_BYTES=FLAG_BYTES, BLOCK=block, num_warps=rmsnorm_warps(block),
        )  # fmt: skip
        return y, res_out
