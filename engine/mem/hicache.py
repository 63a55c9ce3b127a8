"""The host-memory tier of the prefix cache (``--hicache-size-gb`` / ``--hicache-ratio``; docs/cache.md).

``HostKVPool`` holds K and V per layer in host memory, in the device pool's
layout and dtype (an FP8 pool's bytes are copied as they are, so its scales
stay valid), pinned when the device pool is on CUDA.  Host slots come from
their own page allocator, so host and device pages have the same size.

``HostTier`` is what the radix cache talks to:

* ``write_back(gpu_slots)`` copies those device slots to freshly allocated
  host slots and returns them (None when the host pool is full: the caller
  evicts host pages first, or drops the KV).
* ``load_back(host_slots, gpu_slots)`` copies host slots into device slots.
* ``free(host_slots)`` returns host pages.

Ordering rule callers rely on: both copies are issued on the device's current
stream, so a write-back reads the device slots after every kernel queued
before it has written them, and a load-back lands before any later kernel
reads the slots.  The copies are synchronous with respect to the host here
(a write-back waits for its data; a load-back is queued on the stream before
the forward that reads it): docs/cache.md, "What is not done yet".
"""

from __future__ import annotations

from typing import Optional

import torch

from kvship.engine.mem.pools import KVPool, TokenToKVPoolAllocator

GIB = 1 << 30


def host_pool_slots(device_pool: KVPool, size_gb: float = 0.0, ratio: float = 0.0) -> int:
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


def bytes_per_token(pool: KVPool) -> int:
    elem = torch.empty((), dtype=pool.dtype).element_size()
    return 2 * pool.num_layers * pool.num_kv_heads * pool.head_dim * elem


class HostKVPool:
    """K and V per layer in host memory, ``[num_slots + page_size, kv_heads, head_dim]`` (page 0 unused)."""

    def __init__(self, device_pool: KVPool, num_slots: int):
        self.page_size = device_pool.page_size
        self.num_slots = num_slots // self.page_size * self.page_size
        self.num_layers = device_pool.num_layers
        self.dtype = device_pool.dtype
        pin = device_pool.device.type == "cuda"
        shape = (self.num_slots + self.page_size, device_pool.num_kv_heads, device_pool.head_dim)
        # bytes (uint8 views) for FP8 pools: index_copy_ has no float8 kernel everywhere
        self.k_buffer = [torch.zeros(shape, dtype=self.dtype, pin_memory=pin) for _ in range(self.num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=self.dtype, pin_memory=pin) for _ in range(self.num_layers)]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A view ``index_copy_`` / ``index_select`` accept (FP8 as bytes)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class HostTier:
    """Host pool + its allocator + the copies between it and the device pool (see the module docstring)."""

    def __init__(self, device_pool: KVPool, num_slots: int):
        if num_slots < device_pool.page_size:
            raise ValueError("the host KV tier needs at least one page")
        self.device_pool = device_pool
        self.pool = HostKVPool(device_pool, num_slots)
        self.allocator = TokenToKVPoolAllocator(self.pool.num_slots, device_pool.page_size)
        self.device = device_pool.device
        self.bytes_written = 0  # device -> host
        self.bytes_loaded = 0  # host -> device

    @property
    def total_slots(self) -> int:
        return self.allocator.total_slots

    def available_size(self) -> int:
        return self.allocator.available_size()

    def write_back(self, gpu_slots: torch.Tensor) -> Optional[torch.Tensor]:
        """Copy ``gpu_slots`` (whole pages, int64 CPU) to new host slots; None when the host pool is short."""
        n = int(gpu_slots.numel())
        host_slots = self.allocator.alloc(n)
        if host_slots is None:
            return None
        src = gpu_slots.to(self.device)
        dev = self.device_pool
        for layer in range(self.pool.num_layers):
            for dbuf, hbuf in (
                (dev.k_buffer[layer], self.pool.k_buffer[layer]),
                (dev.v_buffer[layer], self.pool.v_buffer[layer]),
            ):
                rows = _raw(dbuf).index_select(0, src).cpu()  # waits for the kernels that wrote them
                _raw(hbuf).index_copy_(0, host_slots, rows)
        self.bytes_written += n * bytes_per_token(dev)
        return host_slots

    def load_back(self, host_slots: torch.Tensor, gpu_slots: torch.Tensor) -> None:
        """Copy ``host_slots`` into ``gpu_slots`` (same length, int64 CPU)."""
        if host_slots.numel() != gpu_slots.numel():
            raise ValueError(f"load_back: {host_slots.numel()} host slots for {gpu_slots.numel()} device slots")
        dst = gpu_slots.to(self.device)
        dev = self.device_pool
        cuda = self.device.type == "cuda"
        for layer in range(self.pool.num_layers):
            for dbuf, hbuf in (
                (dev.k_buffer[layer], self.pool.k_buffer[layer]),
                (dev.v_buffer[layer], self.pool.v_buffer[layer]),
            ):
                rows = _raw(hbuf).index_select(0, host_slots)
                if cuda:
                    rows = rows.pin_memory().to(self.device, non_blocking=True)
                _raw(dbuf).index_copy_(0, dst, rows)
        self.bytes_loaded += int(host_slots.numel()) * bytes_per_token(dev)

    def free(self, host_slots: torch.Tensor) -> None:
        self.allocator.free(host_slots)


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
    return HostTier(pool, slots)
