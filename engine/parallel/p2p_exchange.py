"""Equal-split all-to-all and all-gather over peer GPU memory (docs/parallel.md, "Dispatch": the exchange).

The MoE ``static`` dispatch (``kvship.engine.parallel.ep_dispatch``) moves
every layer's rows with two equal-split all-to-alls and one all-gather.  Over
NCCL those go through ``all_to_all_single`` (grouped sends and receives) and
the ring all-gather.  Here they go through one buffer per rank that every
other rank of the group maps (PyTorch symmetric memory, registered once, as
the peer-memory all-reduce's):

1. this rank's bytes are copied into its own buffer;
2. a device-side barrier: every rank's bytes are in place;
3. this rank **pulls** what it receives straight from the peers' buffers, one
   copy per peer (the copy engines read over NVLink; no SM does the moving);
4. a second barrier: every peer has finished reading this rank's buffer, so
   the next exchange may overwrite it.

Sizes follow from host shapes and nothing is read on the host, so it runs
inside CUDA graphs (``all_to_all_equal`` and ``all_gather`` are capture-safe
on NCCL already; this keeps them so).  Tensors larger than the buffer, async
calls (two-batch overlap) and groups whose ranks cannot map each other's
memory take NCCL; every rank takes the same decision (agreed over the host
group) after a self-check of known bytes through both ops.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)

# One rank's buffer: a static MoE exchange of M tokens moves about M * (2 * hidden + 8 * top_k) bytes out
# (Qwen3-30B-A3B: 17 MB at 4096 tokens), so 64 MiB covers prefill chunks up to ~15k tokens of that shape.
CAPACITY = 64 << 20


class P2PExchange:
    """A group's all-to-all (equal splits) and all-gather through symmetric memory (module docstring)."""

    def __init__(self, handle: Any, buffer: torch.Tensor, rank: int, size: int) -> None:
        self.handle = handle
        self.buffer = buffer  # uint8, this rank's symmetric allocation
        self.rank = rank
        self.size = size
        self.capacity = buffer.numel()
        # every rank's buffer, mapped into this process (a view of peer memory; slicing is free)
        self.peers = [handle.get_buffer(r, (self.capacity,), torch.uint8) for r in range(size)]

    def fits(self, *tensors: torch.Tensor) -> bool:
        """Contiguous CUDA tensors on the buffer's device whose bytes fit the buffer."""
        return all(
            t.is_cuda and t.is_contiguous() and t.device == self.buffer.device and self._nbytes(t) <= self.capacity
            for t in tensors
        )

    def fits_all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> bool:
        """``fits`` and equal splits: the same bytes in and out, a multiple of the group size."""
        n = self._nbytes(inp)
        return self.fits(out, inp) and self._nbytes(out) == n and n % self.size == 0

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    @staticmethod
    def _bytes(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    def all_to_all_(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """``out``'s block ``s`` <- rank ``s``'s block ``rank`` of ``inp`` (equal blocks along the bytes)."""
        src, dst = self._bytes(inp), self._bytes(out)
        chunk = src.numel() // self.size
        if src.numel() != dst.numel() or chunk * self.size != src.numel():
            raise ValueError(f"all_to_all over peer memory needs equal splits: {src.numel()} -> {dst.numel()} bytes")
        if src.data_ptr() != self.buffer.data_ptr():  # else packed in place (``send_buffer``)
            self.buffer[: src.numel()].copy_(src)
        self.handle.barrier(channel=0)
        mine = slice(self.rank * chunk, (self.rank + 1) * chunk)
        for step in range(self.size):  # every rank starts with another peer: the reads spread over the links
            s = (self.rank + step) % self.size
            from_peer = src[mine] if s == self.rank else self.peers[s][mine]
            dst[s * chunk : (s + 1) * chunk].copy_(from_peer)
        self.handle.barrier(channel=0)
        return out

    def all_gather_(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """``out [size * n, ...]`` <- every rank's ``inp [n, ...]`` in rank order."""
        src, dst = self._bytes(inp), self._bytes(out)
        n = src.numel()
        if dst.numel() != n * self.size:
            raise ValueError(f"all_gather over peer memory: {n} bytes per rank into {dst.numel()}")
        self.buffer[:n].copy_(src)
        self.handle.barrier(channel=0)
        for step in range(self.size):
            s = (self.rank + step) % self.size
            dst[s * n : (s + 1) * n].copy_(src if s == self.rank else self.peers[s][:n])
        self.handle.barrier(channel=0)
        return out

    @classmethod
    def create(
        cls, device_group: Any, device: torch.device, size: int, agree: Callable[[int], int], capacity: int = CAPACITY
    ) -> Optional["P2PExchange"]:
        """The group's exchange, or None for NCCL; collective (every rank of the group calls it together).
        ``agree(ok)`` is the minimum of ``ok`` over the ranks (host group)."""
        if device.type != "cuda" or size < 2:
            return None
        made: Optional[P2PExchange] = None
        reason = ""
        buffer = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buffer = symm_mem.empty(capacity, dtype=torch.uint8, device=device)
        except Exception as e:  # noqa: BLE001 - any failure means NCCL, said once in the log
            reason = f"{type(e).__name__}: {e}"
        if agree(int(buffer is not None)):
            try:
                import torch.distributed as dist

                handle = symm_mem.rendezvous(buffer, device_group.group_name)  # collective
                made = cls(handle, buffer, dist.get_rank(device_group), size)
                made._self_check(device)
            except Exception as e:  # noqa: BLE001
                made, reason = None, f"{type(e).__name__}: {e}"
        if not agree(int(made is not None)):
            logger.info("expert-parallel exchange: NCCL (%s)", reason or "a peer cannot use peer-to-peer memory")
            return None
        logger.info("expert-parallel exchange: over peer memory up to %d bytes a rank, NCCL above", capacity)
        return made

    def _self_check(self, device: torch.device) -> None:
        """Known bytes through both ops: block ``d`` of rank ``r`` is filled with ``r * size + d``."""
        n, r = self.size, self.rank
        blocks = torch.arange(n, device=device, dtype=torch.int32) + r * n
        inp = blocks.repeat_interleave(1024).view(n, 1024)
        out = torch.empty_like(inp)
        self.all_to_all_(out, inp)
        want = (torch.arange(n, device=device, dtype=torch.int32) * n + r).repeat_interleave(1024).view(n, 1024)
        gathered = torch.empty((n, 1024), device=device, dtype=torch.int32)
        self.all_gather_(gathered, inp[0].contiguous())
        want_gather = (torch.arange(n, device=device, dtype=torch.int32) * n).repeat_interleave(1024).view(n, 1024)
        if not (torch.equal(out, want) and torch.equal(gathered, want_gather)):
            raise RuntimeError("self-check of the peer-memory exchange failed")
        torch.cuda.synchronize(device)
