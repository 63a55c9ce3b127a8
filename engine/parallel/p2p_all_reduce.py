"""All-reduce of small and mid-size tensors over peer-to-peer GPU memory (docs/parallel.md, "The all-reduce").

A decode step of a tensor-parallel model all-reduces two small activations per
layer (``[batch, hidden]``: 8 KiB at batch 1 of the Llama-3.1-8B shape).
NCCL's ring takes about 19 us for one of those on two NVLink-connected H100s,
a quarter of a TP=2 batch-1 step.  Here every rank's tensor goes into a buffer
the other ranks can read (PyTorch symmetric memory: CUDA IPC mappings of one
allocation per rank) and one kernel does the rest:

* **push** (up to ``push_max`` bytes, ``KVSHIP_TP_ALLREDUCE_PUSH_MAX``): our own
  kernel (``push_all_reduce``) writes into the peers' buffers and raises a flag
  there, no barrier round trip; with ``KVSHIP_TP_ALLREDUCE_SENTINEL`` tensors up
  to ``KVSHIP_TP_ALLREDUCE_SENTINEL_MAX`` bytes skip the flag too (the written
  bits are their own signal: ``PushAllReduce.all_reduce_sentinel_``);
* **one-shot** (up to ``one_shot_max`` bytes): the kernel copies this rank's
  tensor into its buffer, meets the peers at a device-side barrier and sums
  every rank's copy in rank order: one read of each peer's bytes, no ring
  steps;
* **two-shot** (up to ``two_shot_max``): reduce-scatter then all-gather over
  the buffers; each rank reads 1/N of every peer's bytes, so it keeps winning
  where one-shot's N-fold reads start to cost;
* NCCL above ``two_shot_max`` (prefill), for a dtype or layout the kernels do
  not take, and wherever a rank cannot map peer memory.

Both kernels sum ranks in the same order on every rank, so every rank holds the
same bits (deterministic), and both run inside CUDA graphs (the buffer is
static, registered once).  The thresholds come from ``bench/all_reduce.py``
on the GPU pair (``THRESHOLDS``); every rank takes the same decision (agreed
over the host group) and a self-check against known sums runs before use.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:  # the push kernel imports Triton: only where a group enables it (CUDA)
    from kvship.engine.parallel.push_all_reduce import PushAllReduce

logger = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (one_shot_max, two_shot_max) in bytes, by group size: where each path stops beating the next one, measured by
# bench/all_reduce.py on two NVLink H200s (docs/parallel.md, "The all-reduce": one-shot wins to 1 MiB, two-shot
# from 2 to 16 MiB, 32 MiB ties NCCL).  Group sizes not measured yet: ``thresholds_for``.
THRESHOLDS = {2: (1 << 20, 16 << 20)}
# group sizes the push kernel runs at: measured and tested on two GPUs only (the kernel takes up to 8 ranks; larger
# groups keep the one-shot kernel until bench/all_reduce.py and the two-GPU test have run on such a machine)
PUSH_GROUP_SIZES = (2,)


def thresholds_for(size: int) -> tuple[int, int]:
    """The measured row for ``size`` ranks; else the 2-rank row with one-shot's limit divided by ``size - 1``
    (one-shot reads every peer's whole tensor, so its reads grow with the peers while two-shot's stay at one
    tensor per rank).  An estimate until ``bench/all_reduce.py --tp-size N`` runs on N GPUs."""
    if size in THRESHOLDS:
        return THRESHOLDS[size]
    one, two = THRESHOLDS[2]
    return max(one // max(size - 1, 1), 64 << 10), two


class P2PAllReduce:
    """Sum a contiguous CUDA tensor over the group, in place, through symmetric memory."""

    def __init__(self, group_name: str, buffer: torch.Tensor, one_shot_max: int, two_shot_max: int) -> None:
        self.group_name = group_name
        self.buffer = buffer  # uint8, this rank's symmetric allocation
        self.one_shot_max = one_shot_max
        self.two_shot_max = min(two_shot_max, buffer.numel())
        self.max_bytes = max(self.one_shot_max, self.two_shot_max)
        self.fused_copy = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
        self.dtypes: tuple[torch.dtype, ...] = DTYPES  # narrowed by the self-check to what the kernels take
        self.push: Optional["PushAllReduce"] = None  # the push kernel (``push_all_reduce``), where enabled
        self.push_max = 0  # bytes up to which it takes the tensors
        self.push_norm = False  # the push kernel also runs the next RMSNorm (``all_reduce_rmsnorm``)
        self.sentinel_max = 0  # bytes up to which tensors take the sentinel exchange (``all_reduce_sentinel_``)
        self.sentinel_norm_max = 0  # bytes up to which the all-reduce with the norm inside takes it

    def fits(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        return (
            t.is_cuda
            and t.dtype in self.dtypes
            and t.is_contiguous()
            and 0 < nbytes <= self.max_bytes
            and (nbytes <= self.one_shot_max or nbytes % 16 == 0)  # two-shot splits the bytes in 16-byte units
            and t.device == self.buffer.device
        )

    def all_reduce_(self, t: torch.Tensor, path: Optional[str] = None) -> torch.Tensor:
        """``path``: ``sentinel``, ``push``, ``one_shot`` or ``two_shot`` to force one (benchmarks); by default
        the size picks."""
        flat = t.view(-1)
        nbytes = flat.numel() * flat.element_size()
        staged = self.buffer[:nbytes].view(t.dtype)
        if path is None:
            if nbytes <= self.push_max and self.push is not None:
                path = "sentinel" if nbytes <= self.sentinel_max and self.push.fits_sentinel(flat) else "push"
            else:
                path = "one_shot" if nbytes <= self.one_shot_max else "two_shot"
        if path == "sentinel":
            self.push.all_reduce_sentinel_(t)
        elif path == "push":
            self.push.all_reduce_(t)
        elif path == "one_shot":
            if self.fused_copy:  # the copy into the buffer happens inside the kernel: one launch
                torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, flat)
            else:
                staged.copy_(flat)
                torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        else:
            staged.copy_(flat)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return t

    @classmethod
    def create(
        cls,
        device_group: Any,
        device: torch.device,
        size: int,
        agree: Callable[[int], int],
        mode: str = "p2p",
        thresholds: Optional[tuple[int, int]] = None,
        push_max: int = 0,
    ) -> Optional["P2PAllReduce"]:
        """The group's peer-memory all-reduce, or None for NCCL.  ``agree(ok)`` is the minimum of ``ok`` over the
        ranks (host group), so a rank that cannot map peer memory takes every rank back to NCCL."""
        if mode != "p2p" or device.type != "cuda" or size < 2:
            return None
        one_max, two_max = thresholds or thresholds_for(size)
        made: Optional[P2PAllReduce] = None
        reason = ""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            for op in ("one_shot_all_reduce_out", "two_shot_all_reduce_out"):
                if not hasattr(torch.ops.symm_mem, op):
                    raise RuntimeError(f"this PyTorch has no symm_mem.{op}")
            buffer = symm_mem.empty(max(one_max, two_max), dtype=torch.uint8, device=device)
        except Exception as e:  # noqa: BLE001 - any failure means NCCL, said once in the log
            buffer, reason = None, f"{type(e).__name__}: {e}"
        if agree(int(buffer is not None)):
            try:
                symm_mem.rendezvous(buffer, device_group.group_name)  # collective: every rank maps the others'
                made = cls(device_group.group_name, buffer, one_max, two_max)
                made._self_check(device_group, size, device, agree)
            except Exception as e:  # noqa: BLE001
                made, reason = None, f"{type(e).__name__}: {e}"
        if not agree(int(made is not None)):
            logger.info("tensor-parallel all-reduce: NCCL (%s)", reason or "a peer cannot use peer-to-peer memory")
            return None
        if push_max > 0 and size in PUSH_GROUP_SIZES:
            made._enable_push(device_group, size, device, agree, push_max)
        logger.info(
            "tensor-parallel all-reduce: one-shot over peer memory up to %d bytes, two-shot up to %d, NCCL above "
            "and for other dtypes (peer memory takes %s)",
            made.one_shot_max,
            made.two_shot_max,
            ", ".join(str(d).removeprefix("torch.") for d in made.dtypes),
        )
        return made

    def _enable_push(
        self, device_group: Any, size: int, device: torch.device, agree: Callable[[int], int], push_max: int
    ) -> None:
        """The push kernel for tensors up to ``push_max`` bytes (collective), kept only where every rank maps the
        buffer and gets exact known sums from it in every dtype the other paths take."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        from kvship.engine.parallel.push_all_reduce import MAX_BYTES, PushAllReduce, init_buffer
        from kvship.engine.parallel.push_all_reduce import buffer_bytes as push_buffer_bytes

        push_max = min(push_max, MAX_BYTES)
        push, reason = None, ""
        try:
            buffer = symm_mem.empty(push_buffer_bytes(size), dtype=torch.uint8, device=device)
            init_buffer(buffer, size)  # no flag a peer could take for a call of this epoch, every sentinel slot free
            handle = symm_mem.rendezvous(buffer, device_group.group_name)
            torch.cuda.synchronize(device)
            push = PushAllReduce(list(handle.buffer_ptrs), dist.get_rank(device_group), device)
            push.buffer = buffer  # kept alive with the group
        except Exception as e:  # noqa: BLE001 - the other paths stay
            push, reason = None, f"{type(e).__name__}: {e}"
        if not agree(int(push is not None)):  # every rank's buffer zeroed and mapped before anyone pushes
            logger.info("tensor-parallel all-reduce: no push kernel (%s)", reason or "a peer could not map it")
            return
        rank = dist.get_rank(device_group)
        ok = True
        for n in (2048, 40000):  # one program, then chunks (the last one partial)
            ramp = torch.arange(n, device=device, dtype=torch.float32) % 7
            for dtype in self.dtypes:
                if n * torch.finfo(dtype).bits // 8 > push_max:
                    continue
                t = (ramp + (rank + 1)).to(dtype)
                push.all_reduce_(t)
                ok = ok and torch.equal(t.float(), ramp * size + size * (size + 1) / 2)
        torch.cuda.synchronize(device)
        if agree(int(ok)):
            self.push, self.push_max = push, push_max
            logger.info("tensor-parallel all-reduce: the push kernel up to %d bytes", push_max)
            self._enable_push_norm(rank, device, agree)
            self._enable_sentinel(rank, size, device, agree)
        else:
            logger.info("tensor-parallel all-reduce: no push kernel (its self-check failed)")

    def _enable_push_norm(self, rank: int, device: torch.device, agree: Callable[[int], int]) -> None:
        """The push kernel's all-reduce-then-RMSNorm (``KVSHIP_TP_ALLREDUCE_NORM``), kept where every rank's
        result equals its own all-reduce followed by the norm kernel, bit for bit (collective)."""
        from kvship.common.envs import ENV
        from kvship.engine.layers.fused_ops_cuda import rmsnorm

        if not ENV.TP_ALLREDUCE_NORM:
            return
        ok = True
        for dtype in (d for d in self.dtypes if d != torch.float32):
            g = torch.Generator(device=device).manual_seed(7 + rank)
            x = torch.randn(2, 1024, device=device, generator=g).to(dtype)
            res = torch.randn(2, 1024, device=device, generator=g).to(dtype)
            w = (torch.rand(1024, device=device, generator=g) + 0.5).to(dtype)
            y, res_out = self.push.all_reduce_rmsnorm_(x, res, w, 1e-6)
            want_y, want_res = rmsnorm(self.push.all_reduce_(x.clone()), w, 1e-6, res)
            ok = ok and torch.equal(y, want_y) and torch.equal(res_out, want_res)
        torch.cuda.synchronize(device)
        self.push_norm = bool(agree(int(ok)))
        logger.info(
            "tensor-parallel all-reduce: the push kernel %s the next RMSNorm",
            "runs" if self.push_norm else "does not run (its self-check failed)",
        )

    def _enable_sentinel(self, rank: int, size: int, device: torch.device, agree: Callable[[int], int]) -> None:
        """The sentinel exchange for the push kernel's tensors up to ``KVSHIP_TP_ALLREDUCE_SENTINEL_MAX`` bytes
        (``KVSHIP_TP_ALLREDUCE_SENTINEL``), kept where every rank's sums equal the push kernel's bit for bit, over
        both slot parities, in one program and chunked, with the norm inside too where that runs (collective)."""
        from kvship.common.envs import ENV
        from kvship.engine.layers.fused_ops_cuda import rmsnorm
        from kvship.engine.parallel.push_all_reduce import NORM_MAX_BYTES, ONE_PROGRAM_BYTES, SENTINEL_MAX_BYTES

        if not ENV.TP_ALLREDUCE_SENTINEL:
            return
        limit = min(ENV.TP_ALLREDUCE_SENTINEL_MAX, SENTINEL_MAX_BYTES, self.push_max)
        # the norm inside: one row as the push kernel's (measured) at the default limit; the raised limit's rows
        norm_limit = NORM_MAX_BYTES if limit <= ONE_PROGRAM_BYTES else limit
        ok, reason = True, ""
        try:
            for i in range(4):  # both parities, twice
                for dtype in self.dtypes:
                    g = torch.Generator(device=device).manual_seed(11 + 97 * rank + i)
                    for n in (2048, 40000):  # one program, then chunks (the last one partial)
                        if n * torch.finfo(dtype).bits // 8 > limit:
                            continue
                        x = torch.randn(n, device=device, generator=g).to(dtype)
                        # every rank makes every call whatever it found so far: a skipped call leaves a peer spinning
                        same = torch.equal(self.push.all_reduce_sentinel_(x.clone()), self.push.all_reduce_(x.clone()))
                        ok = same and ok
                    if self.push_norm and dtype != torch.float32:
                        for rows in (2, 40):  # a program a row; two rows a program (40 > 32 programs)
                            if rows * 1024 * 2 > norm_limit:
                                continue
                            x = torch.randn(rows, 1024, device=device, generator=g).to(dtype)
                            res = torch.randn(rows, 1024, device=device, generator=g).to(dtype)
                            w = (torch.rand(1024, device=device, generator=g) + 0.5).to(dtype)
                            got = self.push.all_reduce_sentinel_rmsnorm_(x, res, w, 1e-6)
                            want = rmsnorm(self.push.all_reduce_(x.clone()), w, 1e-6, res)
                            ok = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and ok
        except Exception as e:  # noqa: BLE001 - e.g. a kernel this Triton cannot build: every rank fails alike
            ok, reason = False, f"{type(e).__name__}: {e}"
        torch.cuda.synchronize(device)
        self.sentinel_max = limit if agree(int(ok)) else 0
        self.sentinel_norm_max = norm_limit if self.sentinel_max and self.push_norm else 0
        logger.info(
            "tensor-parallel all-reduce: the sentinel exchange %s",
            f"takes tensors up to {limit} bytes"
            if self.sentinel_max
            else f"is off (its self-check failed{reason and ': '}{reason})",
        )

    def _self_check(self, device_group: Any, size: int, device: torch.device, agree: Callable[[int], int]) -> None:
        """Every rank contributes a ramp plus rank+1 (small integers, exact in every dtype): the sums must be
        exact, on both paths.  A dtype this PyTorch's kernels do not implement (2.11 has no float16 one-shot) is
        dropped, NCCL keeps it; a wrong sum fails the whole check."""
        import torch.distributed as dist

        rank = dist.get_rank(device_group)  # the rank in this group (a TP group of a PP x TP world is a subgroup)
        ramp = torch.arange(4096, device=device, dtype=torch.float32) % 7
        want = ramp * size + size * (size + 1) / 2
        kept = []
        for dtype in DTYPES:
            ok = True
            for path in ("one_shot", "two_shot"):
                t = (ramp + (rank + 1)).to(dtype)
                try:
                    self.all_reduce_(t, path)
                except NotImplementedError:  # raised at dispatch, before any rank enters the kernel's barrier
                    ok = False
                    break
                if not torch.equal(t.float(), want):
                    raise RuntimeError(f"self-check failed for {dtype} ({path})")
            if agree(int(ok)):
                kept.append(dtype)
        if not kept:
            raise RuntimeError("the peer-memory kernels take none of bfloat16, float16, float32")
        self.dtypes = tuple(kept)
        torch.cuda.synchronize(device)
