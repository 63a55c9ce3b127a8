"""The process group of one tensor-parallel worker and the collectives its layers use.

``init_tp_group(rank, size, init_method, device, timeout_s)`` joins the group
(NCCL when the model runs on CUDA, gloo on CPU) and, for host-side objects
(the scheduler's inbox), a gloo group over the same ranks.  A ``TPGroup`` is
passed explicitly to whatever needs it (model runner, parallel layers,
scheduler plumbing); there is no module-level group.

Contract: every rank calls the same collectives in the same order.  A
collective that cannot complete (a rank died) raises ``RankLost`` within
``timeout_s`` (gloo usually at once, when the dead peer's sockets close).
``RankLost`` is a ``BaseException``: the scheduler's per-batch error handling
(``except Exception``) lets it through, so the model loop ends, the worker's
requests finish as "the model loop died" (which a router resumes elsewhere),
and the worker exits (docs/parallel.md).
"""

from __future__ import annotations

import datetime
import functools
import logging
import pickle
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from kvship.common.envs import ENV
from kvship.engine.parallel.p2p_all_reduce import P2PAllReduce

logger = logging.getLogger(__name__)

_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RankLost(BaseException):
    """A collective of the worker's group failed: a rank died or timed out.  Fatal for the worker."""


def _collective(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a failing collective's error into ``RankLost``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, OSError, ValueError) as e:  # gloo / NCCL report a lost peer as these
            raise RankLost(f"tensor-parallel collective {fn.__name__} failed: {type(e).__name__}: {e}") from e

    return wrapper


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel worker (``size`` > 1)."""

    rank: int
    size: int
    device_group: Any  # tensors on the model's device: NCCL on CUDA, gloo on CPU
    cpu_group: Any  # host objects: always gloo
    p2p: Optional[P2PAllReduce] = None  # small all-reduces over peer GPU memory (CUDA), else None

    @property
    def is_leader(self) -> bool:
        """Rank 0 owns HTTP, the tokenizer's user side and the inbox."""
        return self.rank == 0

    @_collective
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        if self.p2p is not None and self.p2p.fits(t):
            return self.p2p.all_reduce_(t)
        dist.all_reduce(t, group=self.device_group)
        return t

    @_collective
    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` on every rank -> ``[..., size * n]``, rank order along the last dim."""
        t = t.contiguous()
        out = torch.empty((self.size,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        _all_gather_into(out.view(self.size * t.shape[0], *t.shape[1:]), t, group=self.device_group)
        return out.movedim(0, -2).reshape(*t.shape[:-1], self.size * t.shape[-1])

    @_collective
    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``t`` with rank ``src``'s values, in place; returns ``t``."""
        dist.broadcast(t, src=src, group=self.device_group)
        return t

    @_collective
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank (the others pass None)."""
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=src, group=self.cpu_group)
        if self.rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=src, group=self.cpu_group)
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    @_collective
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (host group)."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    @_collective
    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (host group)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


def init_tp_group(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the worker's process group (blocks until all ``size`` ranks joined, or ``timeout_s``)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout, **kwargs)
    device_group = dist.group.WORLD
    cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    logger.info("tensor-parallel rank %d/%d joined (%s) on %s", rank, size, backend, device)
    group = TPGroup(rank=rank, size=size, device_group=device_group, cpu_group=cpu_group)
    p2p = P2PAllReduce.create(device_group, device, size, agree=group.min_int, mode=ENV.TP_ALLREDUCE)
    return replace(group, p2p=p2p) if p2p is not None else group
