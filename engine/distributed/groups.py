"""Joining the worker's process group and building one communicator per axis from the topology.

``init_distributed(topology, device, timeout_s)`` joins the world group
(NCCL when the model runs on CUDA, gloo on CPU) at the topology's rendezvous
and returns ``ProcessGroups``: the world, TP, PP and EP communicators of this
rank.  Every rank creates every group in the same order (torch.distributed's
rule); an axis of size 1 has no communicator (None), and an axis that spans
the whole world reuses the world's groups (one NCCL communicator, as before
the topology existed).

``ProcessGroups`` is handed to the model runner, the scheduler's I/O, the MoE
dispatch and the speculator when they are built; nothing holds a
module-level group.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from kvship.common.envs import ENV
from kvship.engine.distributed.communicator import Communicator, GlooCommunicator, NcclCommunicator
from kvship.engine.distributed.topology import Topology
from kvship.engine.parallel.p2p_all_reduce import P2PAllReduce

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's communicators, one per axis (None where the axis has one rank)."""

    topology: Topology
    world: Communicator
    tp: Optional[Communicator]
    pp: Optional[Communicator]
    ep: Optional[Communicator]
    # the pipeline's sampled-ids channel (last stage -> stage 0): on NCCL a device group of its own beside ``pp``,
    # so its receives never queue behind the hidden-state sends on one NCCL stream (``StageLink``); else ``pp``
    pp_ids: Optional[Communicator] = None

    @property
    def is_leader(self) -> bool:
        return self.topology.is_leader

    def communicators(self) -> list[Communicator]:
        seen: dict[int, Communicator] = {}
        for c in (self.world, self.tp, self.pp, self.ep, self.pp_ids):
            if c is not None:
                seen.setdefault(id(c), c)
        return list(seen.values())

    @contextlib.contextmanager
    def graph_capture(self) -> Iterator[None]:
        """Every communicator in capture mode (``Communicator.graph_capture``) while a graph runner captures."""
        with contextlib.ExitStack() as stack:
            for c in self.communicators():
                stack.enter_context(c.graph_capture())
            yield


def init_method(topology: Topology, fallback_port: Optional[int] = None) -> str:
    """The rendezvous URL: torchrun's own (``env://``: its agent may already hold the store), ``--dist-init-addr``,
    else loopback at ``fallback_port``."""
    if topology.torchrun:
        return "env://"
    hp = topology.init_host_port
    if hp is None:
        if fallback_port is None:
            raise ValueError("one node without --dist-init-addr needs a local port for its rendezvous")
        return f"tcp://127.0.0.1:{fallback_port}"
    host, port = hp
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _new_group(ranks: list[int], backend: Optional[str], timeout: datetime.timedelta) -> Any:
    return dist.new_group(ranks, backend=backend, timeout=timeout)


def init_distributed(topology: Topology, url: str, device: torch.device, timeout_s: float) -> ProcessGroups:
    """Join the world group as ``topology.rank`` (blocks until every rank joined, or ``timeout_s``), then build
    the axis groups."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    world_size = topology.world_size
    dist.init_process_group(
        backend, init_method=url, rank=topology.rank, world_size=world_size, timeout=timeout, **kwargs
    )
    world_device = dist.group.WORLD
    world_cpu = world_device if backend == "gloo" else _new_group(list(range(world_size)), "gloo", timeout)
    logger.info("%s joined (%s) on %s", topology.describe(), backend, device)

    def make(ranks: list[int], group_rank: int, device_group: Any, cpu_group: Any) -> Communicator:
        whole = len(ranks) == world_size
        if backend == "gloo":
            return GlooCommunicator(group_rank, len(ranks), device_group, cpu_group, None if whole else ranks)
        return NcclCommunicator(group_rank, len(ranks), device_group, cpu_group, None if whole else ranks)

    world = make(list(range(world_size)), topology.rank, world_device, world_cpu)

    def axis(groups: list[list[int]]) -> Optional[Communicator]:
        """Create every group of one axis (all ranks, same order); this rank's communicator."""
        if len(groups[0]) == world_size:  # also at world size 1 (a forced group: tests, benchmarks)
            return world
        if len(groups[0]) == 1:
            return None
        mine = None
        for ranks in groups:
            device_group = _new_group(ranks, backend, timeout)
            cpu_group = device_group if backend == "gloo" else _new_group(ranks, "gloo", timeout)
            if topology.rank in ranks:
                mine = make(ranks, ranks.index(topology.rank), device_group, cpu_group)
        return mine

    tp = axis(topology.tp_groups())
    pp = axis(topology.pp_groups())
    pp_ids = pp
    if pp is not None and backend == "nccl":  # a second device group per PP group (every rank, same order)
        for ranks in topology.pp_groups():
            device_group = _new_group(ranks, backend, timeout)
            if topology.rank in ranks:
                whole = len(ranks) == world_size
                pp_ids = NcclCommunicator(
                    ranks.index(topology.rank), len(ranks), device_group, pp.cpu_group, None if whole else ranks
                )
    ep = tp if topology.ep_size == topology.tp_size else axis(topology.ep_groups())
    if isinstance(tp, NcclCommunicator):  # the TP all-reduce's small-tensor path (docs/parallel.md)
        mode = tp_all_reduce_mode(topology, ENV.TP_ALLREDUCE)
        tp.peer_memory = tp_all_reduce_mode(topology, "p2p") == "p2p"  # one host: its ranks can map each other
        tp.p2p = P2PAllReduce.create(
            tp.device_group, device, tp.size, agree=tp.min_int, mode=mode, push_max=ENV.TP_ALLREDUCE_PUSH_MAX
        )
    return ProcessGroups(topology, world, tp, pp, ep, pp_ids)


def tp_all_reduce_mode(topology: Topology, mode: str) -> str:
    """``mode`` (``KVSHIP_TP_ALLREDUCE``), or ``nccl`` where this rank's TP group spans nodes: peer GPU memory
    maps only within a host, so such a group does not even try (every rank of the group takes the same view)."""
    per_node = topology.ranks_per_node
    nodes = {r // per_node for r in next(g for g in topology.tp_groups() if topology.rank in g)}
    return "nccl" if len(nodes) > 1 else mode


def solo_groups(topology: Topology, communicator: Communicator) -> ProcessGroups:
    """``ProcessGroups`` whose TP (and EP, when it spans TP) axis is ``communicator``: tests and benchmarks that
    build a group by hand (a subgroup of a bigger world, or a rank double without any process group)."""
    ep = communicator if topology.ep_size == topology.tp_size else None
    return ProcessGroups(topology, communicator, communicator, None, ep)
