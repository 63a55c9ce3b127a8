"""KV memory in two levels, plus the slot allocator.

* ``ReqToTokenPool`` ``[max_reqs, max_context]`` maps a request's token
  positions to KV slots.  A request holds one row from admission to finish.
* ``KVPool`` (``MHATokenToKVPool``) holds K and V per layer, each
  ``[num_slots + page_size, kv_heads, head_dim]``.  Page 0 (slots
  ``0..page_size-1``) is never handed out: padded rows of a batch (CUDA-graph
  replay) write there harmlessly.  An FP8 pool (``--kv-cache-dtype fp8_e4m3``)
  stores ``float8_e4m3fn`` with one fp32 ``k_scale`` / ``v_scale`` per layer:
  store ``q(x) = e4m3(clamp(x / scale, -448, 448))`` (round to nearest even),
  read ``float(q) * scale`` (docs/quantization.md, "FP8 KV cache").
* ``TokenToKVPoolAllocator`` hands out slots in whole pages.  Position ``p`` of a
  request lives in slot ``page * page_size + p % page_size``: a request's
  tokens fill its last page before a new page is taken, so a page is never
  shared by two requests (the radix cache shares only whole pages).

The allocator and ``ReqToTokenPool`` bookkeeping are pure CPU Python: the
scheduler uses them without touching the GPU.  Only the tensors live on the
model's device.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

# --kv-cache-dtype names -> torch dtypes (the model dtypes map through model_config.parse_dtype)
FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}
FP8_E4M3_MAX = 448.0


def kv_cache_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved ``--kv-cache-dtype`` (``fp8_e4m3`` or a model dtype name)."""
    if name in FP8_KV_DTYPES:
        return FP8_KV_DTYPES[name]
    from kvship.engine.model_config import parse_dtype

    return parse_dtype(name)


def is_fp8_kv(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``e4m3(clamp(x / scale, -448, 448))`` in fp32 arithmetic (the FP8 KV store; round to nearest even)."""
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``float(x) * scale`` cast to ``dtype`` (the FP8 KV read); other pools: ``x`` cast to ``dtype``."""
    if not is_fp8_kv(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def num_pages(n: int, page_size: int) -> int:
    """Pages that ``n`` positions starting on a page boundary occupy."""
    return (n + page_size - 1) // page_size


def page_round_up(n: int, page_size: int) -> int:
    """Slots that ``n`` positions starting on a page boundary occupy (whole pages)."""
    return num_pages(n, page_size) * page_size


class ReqToTokenPool:
    """``req_to_token`` on the model's device, and its host mirror.

    ``host`` holds the same table on the CPU (on a CPU device it is the table itself): every write whose
    slots come from the host (the allocator's, the radix cache's) lands in both, so the scheduler reads a
    request's slots back (``read_host``: a finishing request's, prefill's pages to send) with no device
    sync.  A device read would wait for every kernel queued before it, in the overlapped loop the next
    step's forward too (docs/gpu.md, "Performance").  A row written from device values is read from the
    device until it is freed; a pool made with ``host_mirror=False`` (written on the device only, read
    only by kernels: the EAGLE head's branch rows) keeps no mirror.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device, host_mirror: bool = True):
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        if self.device.type == "cpu":
            self.host: Optional[torch.Tensor] = self.req_to_token
        else:
            self.host = torch.zeros((size, max_context_len), dtype=torch.int32) if host_mirror else None
        self._device_rows: set[int] = set()  # rows written from device values: their mirror is stale
        self._free: list[int] = list(range(size - 1, -1, -1))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> Optional[int]:
        """One free row, or None when all are taken."""
        return self._free.pop() if self._free else None

    def free(self, index: int) -> None:
        if not 0 <= index < self.size:
            raise ValueError(f"req pool index {index} out of range")
        if index in self._free:
            raise ValueError(f"req pool index {index} freed twice")
        self._device_rows.discard(index)
        self._free.append(index)

    def write(self, index: int, start: int, slots: torch.Tensor) -> None:
        """Set ``req_to_token[index, start:start+len(slots)] = slots``."""
        end = start + slots.numel()
        if slots.device.type == "cpu" and self.host is not None:
            self.host[index, start:end] = slots
            if self.host is self.req_to_token:
                return
        elif self.host is not None:
            self._device_rows.add(index)
        self.req_to_token[index, start:end] = slots.to(self.device, torch.int32)

    def write_points(
        self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor, on_device: tuple[torch.Tensor, ...]
    ) -> None:
        """``req_to_token[rows[i], cols[i]] = slots[i]``: ``rows``, ``cols``, ``slots`` on the host (the mirror),
        ``on_device`` the same three already on the device (one decode step's new slots)."""
        if self.host is not None:
            self.host[rows, cols] = slots.to(torch.int32)
            if self.host is self.req_to_token:
                return
        rows_d, cols_d, slots_d = on_device
        self.req_to_token[rows_d, cols_d] = slots_d.to(torch.int32)

    def read(self, index: int, start: int, end: int) -> torch.Tensor:
        """The slots on the model's device (int64), for kernels."""
        return self.req_to_token[index, start:end].to(torch.int64)

    def read_host(self, index: int, start: int, end: int) -> torch.Tensor:
        """The slots as an int64 CPU tensor (a copy), from the mirror where it holds them."""
        if self.host is None or index in self._device_rows:
            return self.req_to_token[index, start:end].to("cpu", torch.int64)
        return self.host[index, start:end].to(torch.int64)


class KVPool:
    """Per-layer K and V buffers indexed by KV slot (MHA layout).

    ``k_scales`` / ``v_scales`` (one float per layer, default 1.0) are the FP8
    pool's dequantization scales: a reader computes ``float(buf) * scale``, a
    writer ``quantize_kv(x, scale)`` (``set_kv_buffer`` does).  They are fixed
    at construction (a captured CUDA graph holds them as constants) and are
    part of the PD layout check.  Other dtypes ignore them and keep 1.0.
    """

    def __init__(
        self,
        num_slots: int,
        page_size: int,
        dtype: torch.dtype,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        device: str | torch.device,
        k_scales: Optional[Sequence[float]] = None,
        v_scales: Optional[Sequence[float]] = None,
    ):
        self.is_fp8 = is_fp8_kv(dtype)
        self.k_scales = _layer_scales(k_scales, num_layers, self.is_fp8, "k")
        self.v_scales = _layer_scales(v_scales, num_layers, self.is_fp8, "v")
        self.page_size = page_size
        self.num_slots = (num_slots // page_size) * page_size
        self.dtype = dtype
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_layers = num_layers
        self.device = torch.device(device)
        rows = self.num_slots + page_size
        self.k_buffer = [
            torch.zeros((rows, num_kv_heads, head_dim), dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.v_buffer = [
            torch.zeros((rows, num_kv_heads, head_dim), dtype=dtype, device=self.device) for _ in range(num_layers)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def scales(self, layer_id: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of a layer (1.0, 1.0 on a pool that is not FP8)."""
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new K/V rows (``[n, kv_heads, head_dim]`` or flat ``[n, kv_heads*head_dim]``)."""
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.is_fp8 and k.dtype != self.dtype:
            k = quantize_kv(k, self.k_scales[layer_id])
            v = quantize_kv(v, self.v_scales[layer_id])
        elif k.dtype != self.dtype:
            k = k.to(self.dtype)
            v = v.to(self.dtype)
        # index_copy_ rather than ``buf[loc] = k``: on CPU advanced-index assignment is far slower
        if loc.dtype != torch.int64:
            loc = loc.long()
        kb, vb = self.k_buffer[layer_id], self.v_buffer[layer_id]
        if self.is_fp8:  # index_copy_ has no float8 kernel on every device: copy the bytes
            kb, vb, k, v = kb.view(torch.uint8), vb.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        kb.index_copy_(0, loc, k)
        vb.index_copy_(0, loc, v)

    def buffers(self) -> list[torch.Tensor]:
        """Every K buffer then every V buffer, in layer order (transfer registers these)."""
        return list(self.k_buffer) + list(self.v_buffer)


def _layer_scales(scales: Optional[Sequence[float]], num_layers: int, fp8: bool, name: str) -> list[float]:
    if scales is None or not fp8:
        return [1.0] * num_layers
    out = [float(x) for x in scales]
    if len(out) != num_layers:
        raise ValueError(f"{len(out)} {name}_scale values for {num_layers} layers")
    for i, x in enumerate(out):
        if not (x > 0 and x < float("inf")):
            raise ValueError(f"layer {i}: {name}_scale must be a positive finite number, got {x}")
    return out


class TokenToKVPoolAllocator:
    """Hands out KV slots in whole pages (page_size 1 = per-token slots).

    Rules for callers:
    * ``alloc_extend`` / ``alloc_decode`` need, per request, the slot of its last
      already-allocated token (``last_loc``; -1 when it has none) so a partial
      last page is filled before a new page is taken.
    * ``free`` takes slots and frees the pages they are on; pass every slot a
      request owns on pages nobody else references (the radix cache only keeps
      whole pages, so the request's tail page is always its own).
    * Nothing here touches CUDA: results are int64 CPU tensors.
    """

    def __init__(self, num_slots: int, page_size: int):
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        # page 0 is the padding page; pages are 1..num_pages
        self._free_pages: list[int] = list(range(self.num_pages, 0, -1))
        self._is_free = bytearray(b"\x01" * (self.num_pages + 1))
        self._is_free[0] = 0

    @property
    def total_slots(self) -> int:
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        """Free slots (whole free pages only)."""
        return len(self._free_pages) * self.page_size

    def _take_pages(self, n: int) -> Optional[list[int]]:
        if n > len(self._free_pages):
            return None
        if n == 0:
            return []
        taken = self._free_pages[-n:]
        del self._free_pages[-n:]
        for pg in taken:
            self._is_free[pg] = 0
        taken.reverse()
        return taken

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` fresh slots starting on fresh pages, or None if short."""
        ps = self.page_size
        pages = self._take_pages(num_pages(need_size, ps))
        if pages is None:
            return None
        if ps == 1:
            return torch.tensor(pages, dtype=torch.int64)
        slots = torch.tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)
        # the unused tail of the last page stays owned by the caller (same request)
        return slots.flatten()[:need_size]

    def pages_needed(self, prefix_lens: Sequence[int], seq_lens: Sequence[int]) -> int:
        ps = self.page_size
        return sum(num_pages(s, ps) - num_pages(p, ps) for p, s in zip(prefix_lens, seq_lens))

    def alloc_extend(
        self, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_loc: Sequence[int]
    ) -> Optional[torch.Tensor]:
        """Slots for positions ``prefix_lens[i]..seq_lens[i]-1`` of each request, packed.

        Returns None (allocating nothing) if there are not enough free pages.
        """
        ps = self.page_size
        if ps == 1:
            return self.alloc(sum(s - p for p, s in zip(prefix_lens, seq_lens)))
        pages = self._take_pages(self.pages_needed(prefix_lens, seq_lens))
        if pages is None:
            return None
        out: list[int] = []
        pi = 0
        for p, s, last in zip(prefix_lens, seq_lens, last_loc):
            pos = p
            if p % ps:
                # continue the partially filled last page
                if last < 0:
                    raise ValueError("a request with a partial last page must give its last_loc")
                fill = min(s, (p // ps + 1) * ps) - p
                out.extend(range(last + 1, last + 1 + fill))
                pos += fill
            while pos < s:
                base = pages[pi] * ps
                pi += 1
                n = min(ps, s - pos)
                out.extend(range(base, base + n))
                pos += n
        return torch.tensor(out, dtype=torch.int64)

    def alloc_decode(self, seq_lens: Sequence[int], last_loc: Sequence[int]) -> Optional[torch.Tensor]:
        """One slot per request for position ``seq_lens[i]-1`` (lengths include the new token)."""
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_loc)

    def free(self, slots: torch.Tensor | Sequence[int]) -> None:
        if isinstance(slots, torch.Tensor):
            slots = slots.flatten().tolist()
        if not slots:
            return
        pages = {int(s) // self.page_size for s in slots}
        if 0 in pages:
            raise ValueError("slot on the padding page freed")
        for pg in pages:
            if self._is_free[pg]:
                raise ValueError(f"KV page {pg} freed twice")
            self._is_free[pg] = 1
        self._free_pages.extend(sorted(pages, reverse=True))
