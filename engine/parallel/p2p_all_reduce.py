"""One-shot all-reduce of small tensors over peer-to-peer GPU memory (docs/parallel.md, "The all-reduce").

A decode step of a tensor-parallel model all-reduces two small activations per
layer (``[batch, hidden]``: 8 KiB at batch 1 of the Llama-3.1-8B shape).
NCCL's ring takes about 19 us for one of those on two NVLink-connected H100s,
a quarter of a TP=2 batch-1 step.  Here every rank copies its tensor into a
buffer the other ranks can read (PyTorch symmetric memory: CUDA IPC mappings
of one allocation per rank), waits on a device-side barrier, and sums all
ranks' copies in one kernel (``symm_mem.one_shot_all_reduce``): one read of
each peer's bytes over NVLink, no ring steps.  It runs inside CUDA graphs.

Opt-in (``KVSHIP_TP_ALLREDUCE=p2p``) until it has been measured on a GPU pair:
its first two-GPU run stopped at a fault in the self-check itself (a bfloat16
``arange`` cannot hold 4096 distinct values), and the session's device time
was spent.  ``P2PAllReduce.create`` returns None (the group keeps NCCL)
unless asked for, on CPU, at one rank, or when this PyTorch or machine cannot
map peer memory; every rank takes the same decision (agreed over the host
group), and a self-check against known sums runs before it is used.  Tensors
above ``max_bytes`` keep NCCL's all-reduce (prefill).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)

# the one-shot kernel reads every peer's whole tensor: it wins while the transfer is latency-bound
DEFAULT_MAX_BYTES = 1 << 20
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class P2PAllReduce:
    """Sum a small contiguous CUDA tensor over the group, in place, through symmetric memory."""

    def __init__(self, group_name: str, buffer: torch.Tensor) -> None:
        self.group_name = group_name
        self.buffer = buffer  # uint8, this rank's symmetric allocation
        self.max_bytes = buffer.numel()

    def fits(self, t: torch.Tensor) -> bool:
        return (
            t.is_cuda
            and t.dtype in DTYPES
            and t.is_contiguous()
            and 0 < t.numel() * t.element_size() <= self.max_bytes
            and t.device == self.buffer.device
        )

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.view(-1)
        staged = self.buffer[: flat.numel() * flat.element_size()].view(t.dtype)
        staged.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return t

    @classmethod
    def create(
        cls,
        device_group: Any,
        device: torch.device,
        size: int,
        agree: Callable[[int], int],
        mode: str = "p2p",
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> Optional["P2PAllReduce"]:
        """The group's P2P all-reduce, or None for NCCL.  ``agree(ok)`` is the minimum of ``ok`` over the ranks
        (host group), so a rank that cannot map peer memory takes every rank back to NCCL."""
        if mode != "p2p" or device.type != "cuda" or size < 2:
            return None
        made: Optional[P2PAllReduce] = None
        reason = ""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
                raise RuntimeError("this PyTorch has no symm_mem.one_shot_all_reduce_out")
            buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        except Exception as e:  # noqa: BLE001 - any failure means NCCL, said once in the log
            buffer, reason = None, f"{type(e).__name__}: {e}"
        if agree(int(buffer is not None)):
            try:
                symm_mem.rendezvous(buffer, device_group.group_name)  # collective: every rank maps the others'
                made = cls(device_group.group_name, buffer)
                made._self_check(size, device)
            except Exception as e:  # noqa: BLE001
                made, reason = None, f"{type(e).__name__}: {e}"
        if not agree(int(made is not None)):
            logger.info("tensor-parallel all-reduce: NCCL (%s)", reason or "a peer cannot use peer-to-peer memory")
            return None
        logger.info("tensor-parallel all-reduce: one-shot over peer memory up to %d bytes, NCCL above", max_bytes)
        return made

    def _self_check(self, size: int, device: torch.device) -> None:
        """Every rank contributes a ramp plus rank+1 (small integers, exact in every dtype): the sums must be
        exact."""
        import torch.distributed as dist

        rank = dist.get_rank()
        ramp = torch.arange(4096, device=device, dtype=torch.float32) % 7
        for dtype in DTYPES:
            t = (ramp + (rank + 1)).to(dtype)
            self.all_reduce_(t)
            want = ramp * size + size * (size + 1) / 2
            if not torch.equal(t.float(), want):
                raise RuntimeError(f"self-check failed for {dtype}")
        torch.cuda.synchronize(device)
