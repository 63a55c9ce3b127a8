"""The host-memory tier of the prefix cache (``--hicache-size-gb`` / ``--hicache-ratio``; docs/cache.md).

``HostKVPool`` holds, per layer, a host copy of each of the device pool's
buffers of that layer (``layer_buffers``): K and V for a ``KVPool``, the one
latent row of an ``MLAKVPool`` (DeepSeek; docs/deepseek.md), in the device
pool's layout and dtype (an FP8 pool's bytes are copied as they are, so its
scales stay valid), pinned when the device pool is on CUDA.  Host slots come
from their own page allocator, so host and device pages have the same size.

``HostTier`` is what the radix cache talks to:

* ``write_policy`` (``--hicache-write-policy``): ``write_back`` (the radix
  cache copies a device page to host when it evicts it) or ``write_through``
  (it copies the page when the page is cached; evicting it later copies
  nothing).  The tier's copies are the same for both.
* ``write_back(gpu_slots)`` copies those device slots to freshly allocated
  host slots and returns them (None when the host pool is full: the caller
  evicts host pages first, or drops the KV, or, for a write-through copy,
  skips it).  It gathers the device rows at once (on the current stream) and
  leaves the rest to the copy thread: the scheduler does not wait for it.
* ``load_back(host_slots, gpu_slots)`` queues a copy of host slots into
  device slots; the caller may free the host slots at once (the tier keeps
  them unused until the copy has read them).
* ``start_loads()`` starts the queued copies, layer by layer, and returns a
  ``LayerLoads`` (None when none are queued): the forward that reads the
  loaded pages calls ``wait(layer_id)`` before each layer's attention and
  ``finish()`` after the forward.
* ``free(host_slots)`` returns host pages (while load-backs are queued, when
  they start).
* ``sync_writes()`` waits for the write-backs in flight (before the host pool
  is read on the scheduler thread: the shared tier's saves).

Asynchronous load-back (docs/cache.md, "Load-back").  One copy thread per
tier runs the started batches in order; for each layer it gathers the host
rows of every queued pair and writes them into the device pool, then marks
the layer ready.  On CUDA the writes are issued on a side stream that first
waits for everything queued on the forward's stream before ``start_loads``
(so a reused device slot is written only after earlier kernels read it), and
a layer is ready once its CUDA event is recorded: ``wait`` makes the
forward's stream wait for that event, so the request waits only for the
layers it reaches, the first one first.  On CPU ``wait`` blocks until the
copy thread has written the layer.

Kernel I/O (``--hicache-io-backend kernel``, the default on CUDA; docs/cache.md, "Copies"): no copy thread runs.
``start_loads`` launches one ``page_copy.copy_pages`` kernel per layer on the side stream (after the forward
stream's work so far), reading the pinned host pool in place, and records each layer's event; a write-back is
the same kernel on the current stream, writing the pinned host pool in place.  It does not wait for the loads
beside it: host slots a started or queued load may still read are held (``_held``, per load ticket) until that
load is ``settled``, and only a write-back that finds the pool short while slots are held orders the current
stream behind the loads (``drain``: stream waits only) and takes them.  The rules below hold with "handed to the
copy thread" read as "launched".  ``sync_writes`` waits for the last write-back's event.

Copy-engine I/O (``--hicache-io-backend dma``) is kernel I/O with ``dma_copy.copy_pages`` (one batch of copy-engine
descriptors per layer) in place of the kernel, except that the copy thread issues the load-backs' batches
(``LayerLoads.run``): handing the engines their descriptors takes driver time per page run, which the scheduler
thread should not spend.  Write-backs are issued on the scheduler thread in the current stream's order, as kernel
I/O's are.

Tickets: ``load_back`` returns one per queued copy; ``load_state(ticket)`` says whether it is queued, started
(its ``LayerLoads``) or done, whoever started it.  A started batch is ``settled`` once ``finish`` ran (the
current stream waits for it), or, on a worker of one rank, once its copies are done on the device; the ranks
of a multi-rank worker (``lockstep``) schedule in lockstep, so there only ``finish``, which each rank runs at
the same point, counts.  The radix cache keeps the device pages a load-back fills locked until it is settled.

Ordering rules callers rely on:

* A page loaded back is read only by a forward that ``wait``s for it
  (the scheduler's launcher attaches the ``LayerLoads`` of the loads queued
  at admission to the next extend forward and ``finish``es it after).
* The copy thread runs write-backs and load-backs in the order they were
  handed to it.  Host slots freed while load-backs that read them are still
  queued return to the allocator only when those loads are handed over, so a
  later write-back into them runs after the loads read them; a write-back
  that finds the host pool short while such slots wait starts and finishes
  the loads first (``drain``).
* A write-back of device slots that a queued or the last started load-back
  writes first completes the loads (``drain``; kernel I/O never meets one:
  the radix cache keeps those pages locked, so none is evicted): a device
  page is read for write-back only once loaded.
* A write-back's device gather is issued on the device's current stream
  (after every kernel queued before it, before any queued after it); the
  copy thread waits for its event before it writes the host pool.  A
  write-through copy is the same call, made when the scheduler hands a
  request's computed pages to the cache after the forward that wrote them.
* A copy that fails (a bug, a device error) raises ``RuntimeError`` in
  every ``wait`` / ``finish`` / ``drain`` / ``write_back`` / ``sync_writes``
  after it, and every later copy of the thread fails: the pools would hold
  wrong KV, so the worker stops rather than serve them.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import queue
import threading
from typing import Any, Optional

import torch

from kvship.engine.mem import dma_copy
from kvship.engine.mem.mla_pool import MLAKVPool
from kvship.engine.mem.pools import KVPool, TokenToKVPoolAllocator

GIB = 1 << 30
WRITE_POLICIES = ("write_back", "write_through")  # --hicache-write-policy (docs/cache.md, "Tiers")
IO_BACKENDS = ("auto", "kernel", "dma", "copy")  # --hicache-io-backend (docs/cache.md, "Copies")
# the backends that copy in place between the pinned host pool and the device pool (no staging; host pages held
# per load ticket; write-backs in the current stream's order)
IN_PLACE_BACKENDS = ("kernel", "dma")


def layer_buffers(pool) -> list[list[torch.Tensor]]:
    """Per layer, the buffers that hold a slot's KV rows: ``[K, V]`` of a ``KVPool``, ``[latent]`` of an
    ``MLAKVPool``, and the host copies of either (``HostKVPool``)."""
    if isinstance(pool, HostKVPool):
        return pool.layers
    if isinstance(pool, MLAKVPool):
        return [[b] for b in pool.kv_buffer]
    if isinstance(pool, KVPool):
        return [[k, v] for k, v in zip(pool.k_buffer, pool.v_buffer)]
    raise TypeError(f"no KV buffers known for a {type(pool).__name__}")


def buffers_per_layer(pool) -> int:
    """2 (K and V) for a ``KVPool``, 1 (the latent row) for an ``MLAKVPool``."""
    return 1 if isinstance(pool, MLAKVPool) else 2


def host_pool_slots(device_pool, size_gb: float = 0.0, ratio: float = 0.0) -> int:
    """Host slots for ``--hicache-size-gb`` (bytes / bytes per token) or ``--hicache-ratio`` (x device slots).

    0 when both are 0 (the tier is off).  A size that holds less than one page is an error.
    """
    if size_gb < 0 or ratio < 0:
        raise ValueError("--hicache-size-gb and --hicache-ratio must be >= 0")
    if size_gb and ratio:
        raise ValueError("give --hicache-size-gb or --hicache-ratio, not both")
    if not size_gb and not ratio:
        return 0
    ps = device_pool.page_size
    if size_gb:
        per_token = bytes_per_token(device_pool)
        slots = int(size_gb * GIB // per_token)
    else:
        slots = int(device_pool.num_slots * ratio)
    slots = slots // ps * ps
    if slots < ps:
        raise ValueError(
            f"the host KV tier must hold at least one page ({ps} tokens, "
            f"{bytes_per_token(device_pool) * ps} bytes); raise --hicache-size-gb / --hicache-ratio"
        )
    return slots


def bytes_per_token(pool) -> int:
    """KV bytes of one token in ``pool`` (a ``KVPool`` or an ``MLAKVPool``), every layer and buffer."""
    elem = torch.empty((), dtype=pool.dtype).element_size()
    return buffers_per_layer(pool) * pool.num_layers * pool.num_kv_heads * pool.head_dim * elem


class HostKVPool:
    """Per layer, one host buffer ``[num_slots + page_size, kv_heads, head_dim]`` (page 0 unused) for each of
    the device pool's buffers of that layer (``layers[layer]`` in ``layer_buffers`` order).  A ``KVPool``'s
    copies are also ``k_buffer`` / ``v_buffer``, an ``MLAKVPool``'s ``kv_buffer``."""

    def __init__(self, device_pool, num_slots: int):
        self.page_size = device_pool.page_size
        self.num_slots = num_slots // self.page_size * self.page_size
        self.num_layers = device_pool.num_layers
        self.dtype = device_pool.dtype
        pin = device_pool.device.type == "cuda"
        shape = (self.num_slots + self.page_size, device_pool.num_kv_heads, device_pool.head_dim)
        # FP8 pools' rows move as bytes (``_raw``): index_copy_ has no float8 kernel everywhere
        self.layers = [
            [torch.zeros(shape, dtype=self.dtype, pin_memory=pin) for _ in per_layer]
            for per_layer in layer_buffers(device_pool)
        ]
        if len(self.layers[0]) == 2:
            self.k_buffer = [bufs[0] for bufs in self.layers]
            self.v_buffer = [bufs[1] for bufs in self.layers]
        else:
            self.kv_buffer = [bufs[0] for bufs in self.layers]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A view ``index_copy_`` / ``index_select`` accept (FP8 as bytes)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _pages(slots: torch.Tensor, page_size: int) -> Optional[torch.Tensor]:
    """The page numbers of ``slots`` (int64 CPU) when they are whole pages, each page's slots in order (what
    the page allocators hand out), else None.  Copies then move one page per index instead of one slot (a page
    is contiguous in every buffer): far fewer, larger rows for the host-side gathers and scatters."""
    n = slots.numel()
    if page_size <= 1 or n == 0 or n % page_size:
        return None
    per = slots.view(-1, page_size)
    first = per[:, 0]
    if bool((first % page_size).any()) or not torch.equal(per, first[:, None] + torch.arange(page_size)):
        return None
    return first // page_size


def _by_page(buf: torch.Tensor, page_size: int) -> Optional[torch.Tensor]:
    """``buf [slots, ...]`` as ``[pages, page_size, ...]`` (None when its slots are not whole pages)."""
    return buf.unflatten(0, (-1, page_size)) if buf.shape[0] % page_size == 0 else None


def _copy_rows(dst: torch.Tensor, dst_idx, src: torch.Tensor, src_idx, page_size: int, paged: bool) -> None:
    """``dst[dst_idx] = src[src_idx]`` by pages (``paged``: the indices are page numbers) or by slots."""
    if paged:
        dv, sv = _by_page(dst, page_size), _by_page(src, page_size)
        if dv is not None and sv is not None:
            dv.index_copy_(0, dst_idx, sv.index_select(0, src_idx))
            return
        dst_idx = (dst_idx[:, None] * page_size + torch.arange(page_size, device=dst_idx.device)).flatten()
        src_idx = (src_idx[:, None] * page_size + torch.arange(page_size, device=src_idx.device)).flatten()
    dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))


def copy_pages(*args, **kwargs) -> None:
    """``kvship.engine.mem.page_copy.copy_pages`` (Triton), imported on first use: a worker without Triton runs
    the copy or dma backend and never needs it."""
    from kvship.engine.mem.page_copy import copy_pages as kernel

    kernel(*args, **kwargs)


def _copy_in_place(io_backend: str, device, dsts, dst_idx: torch.Tensor, srcs, src_idx: torch.Tensor, rows: int):
    """One in-place copy of pages (``rows`` per page) between the pools on ``device``: ``kernel`` launches
    ``copy_pages`` with the indices (int64 CPU) moved to the device, ``dma`` hands the copy engines one batch
    (``dma_copy``)."""
    if io_backend == "dma":
        dma_copy.copy_pages(dsts, dst_idx, srcs, src_idx, rows)
        return
    idx = _to_device(torch.stack([dst_idx, src_idx]), device)
    copy_pages(dsts, idx[0], srcs, idx[1], rows)


def _to_device(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Index rows (int64 CPU) on ``device`` for a kernel, copied without blocking the host on CUDA."""
    if device.type != "cuda":
        return idx.to(device)
    return idx.pin_memory().to(device, non_blocking=True)


def resolve_io_backend(io_backend: str, device: torch.device) -> str:
    """``--hicache-io-backend``: ``auto`` is ``kernel`` on CUDA and ``copy`` elsewhere."""
    if io_backend not in IO_BACKENDS:
        raise ValueError(f"unknown host KV tier I/O backend {io_backend!r} (one of {IO_BACKENDS})")
    if io_backend == "auto":
        return "kernel" if device.type == "cuda" else "copy"
    return io_backend


def _check_in_place_io(io_backend: str, device_pool, host_pool: "HostKVPool") -> None:
    """Refuse ``--hicache-io-backend kernel`` / ``dma`` at startup where it cannot run: buffers it cannot address,
    or a device / Triton / CUDA runtime that cannot move pinned host memory (one page copied there and back and
    compared)."""
    bufs = [b for bufs in layer_buffers(device_pool) for b in bufs] + [b for bufs in host_pool.layers for b in bufs]
    if not all(b.is_contiguous() and b.dim() >= 2 for b in bufs):
        raise ValueError(
            f"--hicache-io-backend {io_backend} needs contiguous KV buffers; use --hicache-io-backend copy"
        )
    try:
        dev = device_pool.device
        probe = torch.arange(2 * 64, dtype=torch.int32).view(2, 64)
        host = probe.pin_memory() if dev.type == "cuda" else probe.clone()
        on_dev = torch.zeros_like(probe, device=dev)
        one = torch.ones(1, dtype=torch.int64)
        _copy_in_place(io_backend, dev, [on_dev], one, [host], one, 1)
        back = torch.zeros_like(probe).pin_memory() if dev.type == "cuda" else torch.zeros_like(probe)
        _copy_in_place(io_backend, dev, [back], one - 1, [on_dev], one, 1)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ok = torch.equal(back[0], probe[1]) and torch.equal(on_dev[1].cpu(), probe[1])
    except Exception as e:  # noqa: BLE001 - any failure of the probe is the refusal's reason
        raise ValueError(
            f"--hicache-io-backend {io_backend} cannot copy between host and device memory here ({e}); "
            "use --hicache-io-backend copy"
        ) from e
    if not ok:
        raise ValueError(
            f"--hicache-io-backend {io_backend} copied wrong bytes in its startup check; use --hicache-io-backend copy"
        )


class LayerLoads:
    """One started batch of host -> device copies, ready layer by layer (see the module docstring)."""

    def __init__(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], num_layers: int, device: torch.device, io: str = "copy"
    ):
        self.pairs = pairs  # (host slots, device slots), int64 CPU
        self.io = io  # the tier's I/O backend: ``dma`` batches are issued by the copy thread (``run``)
        self.num_layers = num_layers
        self.cuda = device.type == "cuda"
        self._ready = [threading.Event() for _ in range(num_layers)]  # the copy thread wrote (CPU) / queued it
        self._events: list = [None] * num_layers  # CUDA: recorded on the side stream after the layer's copies
        self.error: Optional[BaseException] = None
        self.finished = False  # ``finish`` ran
        # CUDA: the side stream starts after the work queued on the forward's stream so far (reused slots)
        self.after = torch.cuda.current_stream(device).record_event() if self.cuda else None

    def wait(self, layer_id: int) -> None:
        """Block (CPU) or order the current stream (CUDA) until layer ``layer_id``'s rows are in the pool;
        a layer the pool does not have waits for every layer."""
        if not 0 <= layer_id < self.num_layers:
            self.finish()
            return
        self._ready[layer_id].wait()
        if self.error is not None:
            raise RuntimeError(f"host KV load-back failed: {self.error}") from self.error
        if self.cuda:
            torch.cuda.current_stream().wait_event(self._events[layer_id])

    def done(self) -> bool:
        """Whether every layer's rows are in the pool now (CUDA: the copies ran on the device), without waiting;
        a failed copy raises, as ``wait`` does."""
        if not all(ev.is_set() for ev in self._ready):
            return False
        if self.error is not None:
            raise RuntimeError(f"host KV load-back failed: {self.error}") from self.error
        return not self.cuda or all(ev is None or ev.query() for ev in self._events)

    def finish(self) -> None:
        """Wait for every layer (after the forward, and before anything else reads the loaded pages)."""
        for layer in range(self.num_layers):
            self.wait(layer)
        self.finished = True  # the current stream is ordered after every copy (CPU: they are written)

    def run(self, pool: "HostKVPool", device_pool, stream) -> None:
        """The copy thread's part: every layer in order, marking each ready.  ``dma``: the copy engines' batches
        are issued here (``launch``), off the scheduler thread: building and handing over the descriptors costs
        host time per page run, which the scheduler thread does not pay."""
        if self.io == "dma":
            self.launch(pool, device_pool, stream, "dma")
            return
        try:
            if stream is not None:
                stream.wait_event(self.after)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                ps = pool.page_size
                host, dst, paged = self._indices(ps)
                dst = dst.to(device_pool.device)
                dev_layers = layer_buffers(device_pool)
                staging = None
                if stream is not None:  # CUDA: every layer's rows gathered into one pinned buffer, then sent
                    first = _raw(pool.layers[0][0])
                    rows = host.numel() * (ps if paged else 1)
                    shape = (self.num_layers, len(pool.layers[0]), rows, *first.shape[1:])
                    staging = torch.empty(shape, dtype=first.dtype, pin_memory=True)
                for layer in range(self.num_layers):
                    for j, (dbuf, hbuf) in enumerate(zip(dev_layers[layer], pool.layers[layer])):
                        if staging is None:
                            _copy_rows(_raw(dbuf), dst, _raw(hbuf), host, ps, paged)
                            continue
                        # (the gather of the next layer runs while this one crosses the bus)
                        stage = staging[layer, j]
                        if paged:
                            torch.index_select(_by_page(_raw(hbuf), ps), 0, host, out=_by_page(stage, ps))
                        else:
                            torch.index_select(_raw(hbuf), 0, host, out=stage)
                        rows_dev = stage.to(device_pool.device, non_blocking=True)
                        if paged and _by_page(_raw(dbuf), ps) is not None:
                            _by_page(_raw(dbuf), ps).index_copy_(0, dst, _by_page(rows_dev, ps))
                        elif paged:
                            slots = (dst[:, None] * ps + torch.arange(ps, device=dst.device)).flatten()
                            _raw(dbuf).index_copy_(0, slots, rows_dev)
                        else:
                            _raw(dbuf).index_copy_(0, dst, rows_dev)
                    if stream is not None:
                        self._events[layer] = stream.record_event()
                    self._ready[layer].set()
        except BaseException as e:  # the forward's wait raises it
            self.error = e
        finally:
            for ev in self._ready:
                ev.set()

    def _indices(self, ps: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Every pair's host and device indices, joined: page numbers when both sides are whole pages (one row
        per page; ``paged`` True), else slots."""
        host = torch.cat([h for h, _ in self.pairs])
        dst = torch.cat([d for _, d in self.pairs])
        hp, dp = _pages(host, ps), _pages(dst, ps)
        if hp is not None and dp is not None:
            return hp, dp, True
        return host, dst, False

    def launch(self, pool: "HostKVPool", device_pool, stream, io_backend: str = "kernel") -> None:
        """The in-place I/O path (``--hicache-io-backend kernel`` / ``dma``), on the caller's thread: per layer one
        ``copy_pages`` launch (or one copy-engine batch) on ``stream`` (after ``self.after``), reading the pinned
        host pool in place, each layer's event recorded after it.  Only launches: nothing here waits for the
        device."""
        try:
            ps = pool.page_size
            host, dst, paged = self._indices(ps)
            dev_layers = layer_buffers(device_pool)
            if stream is not None:
                stream.wait_event(self.after)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                idx = torch.stack([host, dst])  # the copy engines take host page numbers, the kernel device ones
                if io_backend == "dma":
                    runs = dma_copy.page_runs(dst.numpy(), host.numpy())  # the same for every layer: once
                    copy = functools.partial(dma_copy.copy_pages, runs=runs)
                else:
                    idx, copy = _to_device(idx, device_pool.device), copy_pages
                for layer in range(self.num_layers):
                    copy(dev_layers[layer], idx[1], pool.layers[layer], idx[0], ps if paged else 1)
                    if stream is not None:
                        self._events[layer] = stream.record_event()
                    self._ready[layer].set()
        except BaseException as e:  # the forward's wait raises it
            self.error = e
        finally:
            for ev in self._ready:
                ev.set()

    def fail(self, error: BaseException) -> None:
        """Mark every layer failed with ``error`` (the copy thread could not run it)."""
        self.error = error
        for ev in self._ready:
            ev.set()


class HostWrite:
    """One write-back's second half, run by the copy thread: wait until the device -> host copy into the
    staging buffer is done (CUDA event), then scatter the staged rows into the host pool's slots."""

    def __init__(self, staging: torch.Tensor, dst: torch.Tensor, paged: bool, event) -> None:
        self.staging = staging  # [buffers, n, ...]: every (layer, buffer) pair's rows in layer_buffers order
        self.dst = dst  # host page numbers (paged) or slots, int64 CPU
        self.paged = paged
        self.event = event  # CUDA: recorded after the copies into staging; None on CPU (staging is filled)
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def run(self, pool: "HostKVPool", device_pool, stream) -> None:
        try:
            if self.event is not None:
                self.event.synchronize()
            ps = pool.page_size
            host_bufs = [b for bufs in pool.layers for b in bufs]
            for i, hbuf in enumerate(host_bufs):
                h = _by_page(_raw(hbuf), ps) if self.paged else None
                if h is not None:
                    h.index_copy_(0, self.dst, self.staging[i].unflatten(0, (-1, ps)))
                else:
                    slots = (self.dst[:, None] * ps + torch.arange(ps)).flatten() if self.paged else self.dst
                    _raw(hbuf).index_copy_(0, slots, self.staging[i])
        except BaseException as e:  # the next wait on the tier raises it
            self.error = e
        finally:
            self.staging = None
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.staging = None
        self.done.set()


class _CopyThread:
    """Runs started ``LayerLoads`` one after the other (a daemon thread, started on first use)."""

    def __init__(self, pool: "HostKVPool", device_pool):
        self.pool = pool
        self.device_pool = device_pool
        dev = device_pool.device
        cuda = dev.type == "cuda"
        # the device's index ("cuda" alone names the current device: pin it now, the thread has its own)
        self.index = (dev.index if dev.index is not None else torch.cuda.current_device()) if cuda else None
        self.stream = torch.cuda.Stream(self.index) if cuda else None
        self.jobs: "queue.SimpleQueue[LayerLoads]" = queue.SimpleQueue()
        self.thread: Optional[threading.Thread] = None

    def submit(self, loads: LayerLoads) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="kvship-hicache-load", daemon=True)
            self.thread.start()
        self.jobs.put(loads)

    def _loop(self) -> None:
        setup_error: Optional[BaseException] = None
        if self.index is not None:
            try:
                torch.cuda.set_device(self.index)
            except BaseException as e:  # every load then fails with it (its waits raise): never a hang
                setup_error = e
        while True:
            job = self.jobs.get()
            if setup_error is not None:
                job.fail(setup_error)
                continue
            job.run(self.pool, self.device_pool, self.stream)
            if job.error is not None:  # a failed copy leaves the host or device pool wrong: every later one fails
                setup_error = job.error


class HostTier:
    """Host pool + its allocator + the copies between it and the device pool (see the module docstring)."""

    def __init__(
        self,
        device_pool,
        num_slots: int,
        write_policy: str = "write_back",
        io_backend: str = "auto",
        lockstep: bool = False,
    ):
        """``device_pool``: a ``KVPool`` or an ``MLAKVPool``; ``write_policy``: one of ``WRITE_POLICIES``;
        ``io_backend``: one of ``IO_BACKENDS`` (``kernel``: ``copy_pages`` launches, no copy thread)."""
        if num_slots < device_pool.page_size:
            raise ValueError("the host KV tier needs at least one page")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown host KV tier write policy {write_policy!r} (one of {WRITE_POLICIES})")
        self.write_policy = write_policy
        self.io_backend = resolve_io_backend(io_backend, device_pool.device)
        self.device_pool = device_pool
        self.pool = HostKVPool(device_pool, num_slots)
        self._in_place = self.io_backend in IN_PLACE_BACKENDS
        if self._in_place:
            _check_in_place_io(self.io_backend, device_pool, self.pool)
        self._last_write = None  # kernel I/O on CUDA: an event after the last write-back's launches
        self.allocator = TokenToKVPoolAllocator(self.pool.num_slots, device_pool.page_size)
        self.device = device_pool.device
        self.bytes_written = 0  # device -> host
        self.pages_written = 0  # device -> host, in pages (write-back and write-through copies alike)
        self.bytes_loaded = 0  # host -> device
        self._queued: list[tuple[torch.Tensor, torch.Tensor]] = []  # load-backs not started yet
        self._running: Optional[LayerLoads] = None  # the last started batch (the thread runs them in order)
        # load-back tickets (``load_back``'s return): the started batches not yet seen done, oldest first, each
        # with the last ticket it holds; every ticket up to ``_done_upto`` is copied
        self.lockstep = lockstep  # a rank of a multi-rank worker (``settled``)
        self._tickets = 0
        self._started: collections.deque = collections.deque()
        self._done_upto = 0
        self._writes: list[HostWrite] = []  # write-backs handed to the copy thread, not yet seen done
        self._deferred: list[torch.Tensor] = []  # host slots freed while a queued load still reads them
        # kernel I/O: host slots freed while started or queued load-backs may read them, each with the last
        # ticket then; they return once that ticket is done, so a write-back never waits for the loads
        self._held: list[tuple[int, torch.Tensor]] = []
        self._copier = _CopyThread(self.pool, device_pool)

    @property
    def total_slots(self) -> int:
        return self.allocator.total_slots

    def write_back(self, gpu_slots: torch.Tensor) -> Optional[torch.Tensor]:
        """Copy ``gpu_slots`` (int64 CPU) to new host slots; None when the host pool is short.

        The device rows are gathered now, on the device's current stream (after the kernels that wrote them,
        before any that overwrite them), into one staging buffer (pinned on CUDA); the copy thread then waits
        for that copy and scatters the rows into the host pool, in order with the load-backs it runs, so the
        scheduler does not wait (module docstring, "Ordering rules").  Device slots that a load-back not yet
        finished is still writing are first waited for (``drain``)."""
        self._check()
        if self._in_place:
            return self._write_back_in_place(gpu_slots)
        if self._loading_into(gpu_slots):
            self.drain()
        n = int(gpu_slots.numel())
        host_slots = self.allocator.alloc(n)
        if host_slots is None and self._deferred:  # pages that queued loads still read: start and finish them
            self.drain()
            host_slots = self.allocator.alloc(n)
        if host_slots is None:
            return None
        dev = self.device_pool
        ps = self.pool.page_size
        gp, hp = _pages(gpu_slots, ps), _pages(host_slots, ps)
        paged = gp is not None and hp is not None
        src, dst = (gp, hp) if paged else (gpu_slots, host_slots)
        src = src.to(self.device)
        dev_bufs = [b for bufs in layer_buffers(dev) for b in bufs]
        first = _raw(self.pool.layers[0][0])
        cuda = self.device.type == "cuda"
        staging = torch.empty((len(dev_bufs), n, *first.shape[1:]), dtype=first.dtype, pin_memory=cuda)
        for i, dbuf in enumerate(dev_bufs):
            d = _by_page(_raw(dbuf), ps) if paged else None
            if d is not None:
                rows = d.index_select(0, src).flatten(0, 1)
            else:
                slots = (src[:, None] * ps + torch.arange(ps, device=src.device)).flatten() if paged else src
                rows = _raw(dbuf).index_select(0, slots)
            staging[i].copy_(rows, non_blocking=cuda)
        event = torch.cuda.current_stream(self.device).record_event() if cuda else None
        job = HostWrite(staging, dst, paged, event)
        self._writes = [w for w in self._writes if not w.done.is_set()] + [job]
        self._copier.submit(job)
        self.bytes_written += n * bytes_per_token(dev)
        self.pages_written += n // self.pool.page_size
        return host_slots

    def _write_back_in_place(self, gpu_slots: torch.Tensor) -> Optional[torch.Tensor]:
        """``write_back`` by ``copy_pages`` (or the copy engines) in the current stream's order, straight into the
        pinned host pool.  It does not wait for the load-backs running beside it: the device pages it reads are none they write (the radix
        cache keeps a page locked until its load is done) and the host pages it writes are none they read
        (those come back from ``_held`` once their loads are done).  Only when the pool is short while such
        pages wait does the current stream wait for the loads (``drain``: stream waits only), then take them."""
        self._release_held()
        n = int(gpu_slots.numel())
        host_slots = self.allocator.alloc(n)
        if host_slots is None and self._held:
            self.drain()
            for _, slots in self._held:
                self.allocator.free(slots)
            self._held = []
            host_slots = self.allocator.alloc(n)
        if host_slots is None:
            return None
        ps = self.pool.page_size
        gp, hp = _pages(gpu_slots, ps), _pages(host_slots, ps)
        paged = gp is not None and hp is not None
        src, dst = (gp, hp) if paged else (gpu_slots, host_slots)
        dev_bufs = [b for bufs in layer_buffers(self.device_pool) for b in bufs]
        host_bufs = [b for bufs in self.pool.layers for b in bufs]
        _copy_in_place(self.io_backend, self.device, host_bufs, dst, dev_bufs, src, ps if paged else 1)
        if self.device.type == "cuda":
            self._last_write = torch.cuda.current_stream(self.device).record_event()
        self.bytes_written += n * bytes_per_token(self.device_pool)
        self.pages_written += n // ps
        return host_slots

    def _loading_into(self, gpu_slots: torch.Tensor) -> bool:
        """Whether a queued load-back, or the last started one (the current stream may not be ordered after it
        yet), writes any of ``gpu_slots``."""
        dsts = [d for _, d in self._queued]
        if self._running is not None:
            dsts += [d for _, d in self._running.pairs]
        return bool(dsts) and bool(torch.isin(gpu_slots, torch.cat(dsts)).any())

    def sync_writes(self) -> None:
        """Wait until every write-back handed to the copy thread is in the host pool (before the host pool is
        read on this thread: the shared tier's saves); raises if one failed."""
        for w in self._writes:
            w.done.wait()
        self._check()
        self._writes = []
        if self._last_write is not None:  # kernel I/O: the launches write the host pool in place
            self._last_write.synchronize()
            self._last_write = None

    def _check(self) -> None:
        """Raise the failure of an earlier copy (the pools may hold wrong KV: the worker must stop)."""
        for w in self._writes:
            if w.done.is_set() and w.error is not None:
                raise RuntimeError(f"host KV write-back failed: {w.error}") from w.error

    def load_back(self, host_slots: torch.Tensor, gpu_slots: torch.Tensor) -> int:
        """Queue a copy of ``host_slots`` into ``gpu_slots`` (same length, int64 CPU); ``start_loads`` runs it.
        Returns its ticket (``load_state``)."""
        if host_slots.numel() != gpu_slots.numel():
            raise ValueError(f"load_back: {host_slots.numel()} host slots for {gpu_slots.numel()} device slots")
        self._queued.append((host_slots.clone(), gpu_slots.clone()))
        self.bytes_loaded += int(host_slots.numel()) * bytes_per_token(self.device_pool)
        self._tickets += 1
        return self._tickets

    def settled(self, loads: LayerLoads) -> bool:
        """Whether what reads or reuses ``loads``' pages from now on comes after its copies: it was finished
        (the current stream waits for them), or, on a worker of one rank, its copies are done (raises a failed
        copy's error).  The ranks of a multi-rank worker schedule in lockstep: there only ``finish``, which
        every rank runs at the same point, counts, never a device's own timing."""
        return loads.finished or (not self.lockstep and loads.done())

    def load_state(self, ticket: int) -> Any:
        """Where load-back ``ticket`` is: ``"queued"`` (not started), its started ``LayerLoads`` while that may
        still be copying, or ``"done"``.  Whoever started it (``start_loads``, or ``drain`` / a write-back short
        of host pages, which also wait for it) the answer is the same."""
        while self._started and self.settled(self._started[0][0]):
            self._done_upto = self._started.popleft()[1]
        if ticket <= self._done_upto:
            return "done"
        for loads, last in self._started:
            if ticket <= last:
                return loads
        return "queued"

    def has_queued(self) -> bool:
        """Load-backs are queued that no ``start_loads`` has started yet."""
        return bool(self._queued)

    def start_loads(self) -> Optional[LayerLoads]:
        """Start the queued load-backs on the copy thread; their ``LayerLoads`` (None when none were queued)."""
        if not self._queued:
            return None
        loads = LayerLoads(self._queued, self.pool.num_layers, self.device, self.io_backend)
        self._queued = []
        self._running = loads
        self._started.append((loads, self._tickets))
        if self.io_backend == "kernel":  # launches cost the scheduler thread little: no copy thread
            loads.launch(self.pool, self.device_pool, self._copier.stream, self.io_backend)
        else:  # copy, and dma's batches (issued in order by the copy thread, in place like kernel's launches)
            self._copier.submit(loads)
        # host slots freed while these loads were queued: every copy handed to the thread from now on runs
        # after these loads have read them
        for slots in self._deferred:
            self.allocator.free(slots)
        self._deferred = []
        return loads

    def drain(self) -> None:
        """Complete every queued and started load-back (the thread runs batches in order: the last one ends
        last).  On CUDA the current stream is ordered after them."""
        self.start_loads()
        if self._running is not None:
            self._running.finish()
            self._running = None
        if self.io_backend == "copy":  # kernel I/O: write-backs run on the current stream, already in order
            self.sync_writes()

    def free(self, host_slots: torch.Tensor) -> None:
        """Return host pages; while load-backs are queued (not yet handed to the copy thread) they may read
        them, so the pages return when those loads start (kernel I/O: once they are done)."""
        if self._in_place:
            self._release_held()
            if self._queued or self.load_state(self._tickets) != "done":
                self._held.append((self._tickets, host_slots))
            else:
                self.allocator.free(host_slots)
        elif self._queued:
            self._deferred.append(host_slots)
        else:
            self.allocator.free(host_slots)

    def _release_held(self) -> None:
        """Kernel I/O: return the held host pages whose load-backs are done."""
        if not self._held:
            return
        keep = []
        for ticket, slots in self._held:
            if self.load_state(ticket) == "done":
                self.allocator.free(slots)
            else:
                keep.append((ticket, slots))
        self._held = keep

    def available_size(self) -> int:
        self._release_held()
        return self.allocator.available_size()


def host_tier_for(server_args, model_runner) -> Optional[HostTier]:
    """The host tier of a worker's scheduler (None when ``--hicache-*`` are 0).

    Every rank of a multi-rank worker schedules the same slots, so the host pool takes the smallest
    size any rank can hold (``model_runner.groups``, as the device pool does).
    """
    size_gb, ratio = server_args.hicache_size_gb, server_args.hicache_ratio
    if not size_gb and not ratio:
        return None
    pool = model_runner.kv_pool
    slots = host_pool_slots(pool, size_gb, ratio)
    groups = model_runner.groups
    if groups is not None:
        slots = groups.world.min_int(slots)
    lockstep = groups is not None and groups.world.size > 1  # replicated schedulers (kvship.engine.scheduler.io)
    return HostTier(pool, slots, server_args.hicache_write_policy, server_args.hicache_io_backend, lockstep=lockstep)
