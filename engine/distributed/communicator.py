"""Collectives over one group of ranks (one axis of the topology), behind one interface.

``Communicator`` is the contract the parallel layers, the MoE dispatch, the
scheduler I/O and the PD transfer layer use; its backends are
``NcclCommunicator`` (tensors on CUDA; tensors up to 1 MiB may take the
one-shot peer-memory all-reduce, ``p2p_all_reduce``) and
``GlooCommunicator`` (CPU tensors).  Both carry host objects (pickled) over a
gloo group of the same ranks.

Contract:

* Every rank of the group calls the same ops in the same order; ranks are
  group ranks (``0..size-1``), not global ones.
* A collective that cannot complete (a rank died) raises ``RankLost`` within
  the group's timeout (gloo usually at once, when the dead peer's sockets
  close).  ``RankLost`` is a ``BaseException``: per-batch error handling
  (``except Exception``) lets it through, so the model loop ends and the
  worker exits (docs/parallel.md).
* ``CAPTURE_SAFE`` names the ops that may run inside a CUDA-graph capture.
  A graph runner captures inside ``graph_capture()``; while it is open,
  ``can_run(op)`` is False for the other ops, and a caller with a choice
  (the MoE dispatch) takes a safe path.  Host-object ops are never safe.
* ``async_op=True`` (``all_reduce``, ``all_gather_into``, ``all_to_all``)
  returns the collective's work handle instead of waiting (two-batch overlap,
  docs/parallel.md); no backend declares async collectives capture-safe.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import pickle
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from kvship.engine.parallel.p2p_all_reduce import P2PAllReduce
from kvship.engine.parallel.p2p_exchange import P2PExchange

logger = logging.getLogger(__name__)

_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# all_to_all: split sizes passed from the host; all_to_all_equal: the same op with equal splits (no lists), whose
# shapes are fixed by the caller's buffers (the MoE ``static`` dispatch, docs/parallel.md "Dispatch")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_equal", "send", "recv", "broadcast")


class RankLost(BaseException):
    """A collective of the worker's group failed: a rank died or timed out.  Fatal for the worker."""


def _collective(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a failing collective's error into ``RankLost``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, OSError, ValueError) as e:  # gloo / NCCL report a lost peer as these
            raise RankLost(f"collective {fn.__name__} failed: {type(e).__name__}: {e}") from e

    return wrapper


class Communicator(ABC):
    """One group of ranks (module docstring).  ``ranks``: the group's global ranks, in group-rank order
    (None: the group is the whole world, or a test double without a process group)."""

    backend: ClassVar[str]
    CAPTURE_SAFE: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        rank: int,
        size: int,
        device_group: Any = None,
        cpu_group: Any = None,
        ranks: Optional[Sequence[int]] = None,
    ):
        self.rank = rank
        self.size = size
        self.device_group = device_group  # tensors on the model's device
        self.cpu_group = cpu_group if cpu_group is not None else device_group  # host objects: gloo
        self.ranks = tuple(ranks) if ranks is not None else None
        self._capturing = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"

    @property
    def is_leader(self) -> bool:
        """Group rank 0 (of the TP group of stage 0: the worker's leader, which owns HTTP and the inbox)."""
        return self.rank == 0

    def _global(self, group_rank: int) -> int:
        return group_rank if self.ranks is None else self.ranks[group_rank]

    # --- CUDA-graph capture ----------------------------------------------------
    @classmethod
    def capture_safe(cls, op: str) -> bool:
        """Whether ``op`` may run inside a CUDA-graph capture on this backend."""
        if op not in OPS:
            raise ValueError(f"unknown communicator op '{op}'; known: {list(OPS)}")
        return op in cls.CAPTURE_SAFE

    def can_run(self, op: str) -> bool:
        """``op`` may run now: not capturing, or ``op`` is capture-safe."""
        return not self._capturing or self.capture_safe(op)

    @contextlib.contextmanager
    def graph_capture(self) -> Iterator[None]:
        """Open while a graph runner captures (``can_run`` answers for the capture)."""
        before, self._capturing = self._capturing, True
        try:
            yield
        finally:
            self._capturing = before

    # --- tensors (device group) ------------------------------------------------
    @_collective
    def all_reduce(self, t: torch.Tensor, async_op: bool = False) -> Any:
        """Sum ``t`` over the ranks, in place; returns ``t`` (``async_op``: the work handle; ``t`` holds the sum
        once it completes)."""
        work = dist.all_reduce(t, group=self.device_group, async_op=async_op)
        return work if async_op else t

    def all_reduce_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The all-reduce of ``x`` fused with the RMSNorm that follows it: ``(rmsnorm(sum + residual) * weight, sum
        + residual)`` as new tensors, rounded as ``all_reduce`` then ``RMSNorm(sum, residual)`` round them; or
        None where this backend has no kernel for it (the caller then all-reduces and norms apart)."""
        return None

    @_collective
    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` on every rank -> ``[..., size * n]``, rank order along the last dim."""
        t = t.contiguous()
        out = torch.empty((self.size,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        _all_gather_into(out.view(self.size * t.shape[0], *t.shape[1:]), t, group=self.device_group)
        return out.movedim(0, -2).reshape(*t.shape[:-1], self.size * t.shape[-1])

    @_collective
    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False) -> Any:
        """``out [size * n, ...]`` <- every rank's ``t [n, ...]`` in rank order along dim 0; returns ``out``
        (``async_op``: the work handle)."""
        work = _all_gather_into(out, t.contiguous(), group=self.device_group, async_op=async_op)
        return work if async_op else out

    @_collective
    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """``[size * n, ...]`` on every rank -> this rank's block ``[n, ...]`` of the sum over ranks."""
        t = t.contiguous()
        out = t.new_empty((t.shape[0] // self.size,) + tuple(t.shape[1:]))
        dist.reduce_scatter_tensor(out, t, group=self.device_group)
        return out

    @_collective
    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Optional[list[int]] = None,
        in_splits: Optional[list[int]] = None,
        async_op: bool = False,
    ) -> Any:
        """Rows of ``inp`` go to the ranks in order (``in_splits`` rows each, default equal), ``out`` receives
        ``out_splits`` rows from each; returns ``out`` (``async_op``: the work handle).  Without split lists it
        is the ``all_to_all_equal`` op (capture-safe where the backend declares it)."""
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.device_group, async_op=async_op)
        return work if async_op else out

    @_collective
    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        dist.send(t.contiguous(), dst=self._global(dst), group=self.device_group, tag=tag)

    @_collective
    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        """Start sending ``t`` (contiguous) to group rank ``dst``; returns the work handle.  ``t`` must stay
        alive and unchanged until the handle completes (``wait``).  ``tag`` separates channels between the
        same ranks on gloo (NCCL ignores it: keep one channel per direction on a device group)."""
        return dist.isend(t, dst=self._global(dst), group=self.device_group, tag=tag)

    @_collective
    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> Any:
        """Start filling ``t`` from group rank ``src``; returns the work handle (``wait`` before reading ``t``: on
        NCCL that makes the current stream wait, on gloo the host)."""
        return dist.irecv(t, src=self._global(src), group=self.device_group, tag=tag)

    @_collective
    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Fill ``t`` from group rank ``src``; returns ``t``."""
        dist.recv(t, src=self._global(src), group=self.device_group, tag=tag)
        return t

    @_collective
    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``t`` with group rank ``src``'s values, in place; returns ``t``."""
        dist.broadcast(t, src=self._global(src), group=self.device_group)
        return t

    # --- host objects (gloo group) ---------------------------------------------
    @_collective
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Group rank ``src``'s picklable ``obj`` on every rank (the others pass None)."""
        root = self._global(src)
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=root, group=self.cpu_group)
        if self.rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=root, group=self.cpu_group)
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    @_collective
    def isend_object(self, obj: Any, dst: int, tag: int) -> list[Any]:
        """Start sending picklable ``obj`` to group rank ``dst`` over the host group without waiting for it;
        returns the work handles (they hold the buffers: keep them until they complete).  Pair with
        ``recv_object(src, tag)`` on ``dst``; objects on one (pair, tag) arrive in the order sent."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        peer = self._global(dst)
        return [
            (dist.isend(size, dst=peer, group=self.cpu_group, tag=tag), size),
            (dist.isend(data, dst=peer, group=self.cpu_group, tag=tag), data),
        ]

    @_collective
    def recv_object(self, src: int, tag: int) -> Any:
        """The next object group rank ``src`` sent with ``isend_object(obj, <this rank>, tag)`` (blocks)."""
        peer = self._global(src)
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src=peer, group=self.cpu_group, tag=tag)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src=peer, group=self.cpu_group, tag=tag)
        return pickle.loads(data.numpy().tobytes())

    @_collective
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in group-rank order."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    @_collective
    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def send_buffer(self, rows: int, row_bytes: int) -> Optional[torch.Tensor]:
        """Where to build the rows of the next equal-split ``all_to_all`` (uint8 ``[rows, row_bytes]``): the
        peer-memory exchange's own buffer where it would take them (no copy in), else None (any tensor)."""
        return None

    def enable_peer_exchange(self, device: torch.device) -> bool:
        """Collective: move this group's equal-split all-to-alls and all-gathers to peer GPU memory where the
        backend can (the MoE ``static`` dispatch's exchange, docs/parallel.md "Dispatch"); whether it did."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Release backend resources this communicator owns (not the process groups)."""


class GlooCommunicator(Communicator):
    """CPU tensors over gloo (the tests' backend); nothing runs inside a CUDA-graph capture."""

    backend = "gloo"
    CAPTURE_SAFE = frozenset()

    def close(self) -> None:
        pass


class NcclCommunicator(Communicator):
    """CUDA tensors over NCCL; host objects over a gloo group of the same ranks.

    NCCL kernels with shapes fixed on the host are captured into CUDA graphs (all_reduce, all_gather,
    reduce_scatter, broadcast, send, recv, and all_to_all_equal: ``all_to_all_single`` with equal splits, whose
    buffers the caller sizes from host shapes).  ``all_to_all`` with split lists is not declared safe: its
    callers pass split sizes read from the device on the host.  ``p2p``: all-reduces of tensors it ``fits`` go
    one-shot or two-shot over peer GPU memory (default; ``KVSHIP_TP_ALLREDUCE=nccl`` turns it off), captured as
    well."""

    backend = "nccl"
    CAPTURE_SAFE = frozenset(
        {"all_reduce", "all_gather", "reduce_scatter", "all_to_all_equal", "broadcast", "send", "recv"}
    )

    def __init__(self, *args: Any, p2p: Optional[P2PAllReduce] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.p2p = p2p
        self.exchange: Optional[P2PExchange] = None
        self.peer_memory = True  # False where the group spans nodes (groups.init_distributed)

    def enable_peer_exchange(self, device: torch.device) -> bool:
        from kvship.common.envs import ENV

        if self.exchange is None and self.peer_memory and ENV.EP_EXCHANGE == "p2p":
            self.exchange = P2PExchange.create(self.device_group, device, self.size, agree=self.min_int)
        return self.exchange is not None

    def send_buffer(self, rows: int, row_bytes: int) -> Optional[torch.Tensor]:
        if self.exchange is None or rows * row_bytes > self.exchange.capacity or (rows * row_bytes) % self.size:
            return None
        return self.exchange.buffer[: rows * row_bytes].view(rows, row_bytes)

    @_collective
    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: Optional[list[int]] = None,
        in_splits: Optional[list[int]] = None,
        async_op: bool = False,
    ) -> Any:
        if self.exchange is not None and out_splits is None and in_splits is None and not async_op:
            if self.exchange.fits_all_to_all(out, inp):
                return self.exchange.all_to_all_(out, inp)
        return super().all_to_all(out, inp, out_splits, in_splits, async_op)

    @_collective
    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False) -> Any:
        if self.exchange is not None and not async_op:
            t = t.contiguous()
            if self.exchange.fits(out, t) and out.numel() == t.numel() * self.size:
                return self.exchange.all_gather_(out, t)
        return super().all_gather_into(out, t, async_op)

    @_collective
    def all_reduce_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        p2p = self.p2p
        if p2p is None or p2p.push is None or not p2p.push_norm or not x.is_cuda or x.device != p2p.buffer.device:
            return None
        nbytes = x.numel() * x.element_size()
        if nbytes <= p2p.sentinel_norm_max and p2p.push.fits_sentinel_norm(x, residual, weight):
            return p2p.push.all_reduce_sentinel_rmsnorm_(x, residual, weight, eps)
        if nbytes <= p2p.push_max and p2p.push.fits_norm(x, residual, weight):
            return p2p.push.all_reduce_rmsnorm_(x, residual, weight, eps)
        return None

    @_collective
    def all_reduce(self, t: torch.Tensor, async_op: bool = False) -> Any:
        if async_op:  # a work handle to wait on: NCCL's (the one-shot kernel has none)
            return dist.all_reduce(t, group=self.device_group, async_op=True)
        if self.p2p is not None and self.p2p.fits(t):
            return self.p2p.all_reduce_(t)
        dist.all_reduce(t, group=self.device_group)
        return t

    def close(self) -> None:
        self.p2p = None
        self.exchange = None
