"""Where every rank of one worker sits: nodes, tensor/pipeline/expert-parallel coordinates, GPUs.

A ``Topology`` is built first, by the launcher, before any process group or
model exists (``Topology.from_server_args``: SGLang's ``--nnodes``,
``--node-rank``, ``--dist-init-addr`` flags, or torchrun's environment), and
is then only read: process groups per axis come from it
(``kvship.engine.distributed.groups``), and each rank process gets its own
copy (``for_rank``, a ``dataclasses.replace``).

Rank layout (SGLang's): the global rank is ``pp_rank * tp_size + tp_rank``;
node ``n`` holds the consecutive ranks ``[n * ranks_per_node, (n + 1) *
ranks_per_node)``, and the rank of local index ``l`` on a node runs on
``cuda:<base_gpu_id + l>``.  Experts split ``ep_size`` ways inside a TP group
(``kvship.engine.parallel.ep.expert_split``): ``ep_rank = tp_rank // (tp /
ep)``, the width slice ``moe_tp_rank = tp_rank % (tp / ep)``; the EP group of
a rank is the ranks of its stage with its width slice.

Contract: a ``Topology`` that exists is consistent (``__post_init__`` raises
``ValueError`` with one line naming the flags otherwise): the sizes multiply
to the world size, the world splits evenly over the nodes, the node rank is
in range, this process's rank lives on this node, and more than one node
has a ``dist_init_addr``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from kvship.engine.config import ServerArgs


@dataclass(frozen=True)
class RankCoords:
    """One rank's place on every axis."""

    rank: int
    node: int
    local_rank: int  # index on its node (its GPU is base_gpu_id + local_rank)
    tp_rank: int
    pp_rank: int
    ep_rank: int  # expert block it holds
    moe_tp_rank: int  # width slice of each expert it holds


def parse_host_port(addr: str, flag: str = "--dist-init-addr") -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``[::1]:port``) -> (host, port); ValueError naming ``flag`` otherwise."""
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} must be host:port with a port in 1..65535, got '{addr}'")
    return host, int(port)


@dataclass(frozen=True)
class Topology:
    """The layout of one worker's ranks (module docstring) and this process's rank in it."""

    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rank: int = 0  # this process's global rank
    dist_init_addr: Optional[str] = None  # "host:port" of node 0's rendezvous; None: one node, a free local port
    base_gpu_id: int = 0
    torchrun: bool = False  # every rank process was started by torchrun: kvship spawns none

    def __post_init__(self) -> None:
        for flag, v in (("--tp-size", self.tp_size), ("--pp-size", self.pp_size), ("--nnodes", self.nnodes)):
            if v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(
                f"--ep-size {self.ep_size} must divide --tp-size ({self.tp_size}): "
                "experts are split over the tensor-parallel ranks"
            )
        if self.world_size % self.nnodes:
            raise ValueError(
                f"{self.sizes} = {self.world_size} ranks do not split evenly over --nnodes {self.nnodes}; "
                "the world size must be a multiple of the node count"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes} (0..{self.nnodes - 1})"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(
                f"--nnodes {self.nnodes} needs --dist-init-addr host:port (node 0's address, reachable from every node)"
            )
        if self.dist_init_addr:
            parse_host_port(self.dist_init_addr)
        if not 0 <= self.rank < self.world_size or self.coords(self.rank).node != self.node_rank:
            raise ValueError(
                f"rank {self.rank} is not on node {self.node_rank} (node {self.node_rank} holds ranks "
                f"{self.node_ranks.start}..{self.node_ranks.stop - 1} of {self.world_size})"
            )

    # --- sizes ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def sizes(self) -> str:
        """The flags that make the world size, for messages."""
        return f"--tp-size {self.tp_size}" + (f" x --pp-size {self.pp_size}" if self.pp_size > 1 else "")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def moe_tp_size(self) -> int:
        """Ranks that share one expert block, each holding a width slice."""
        return self.tp_size // self.ep_size

    # --- this process --------------------------------------------------------
    @property
    def me(self) -> RankCoords:
        return self.coords(self.rank)

    @property
    def is_leader(self) -> bool:
        """Node 0 rank 0: HTTP, tokenizer, the inbox every rank follows, the bootstrap server."""
        return self.rank == 0

    @property
    def node_ranks(self) -> range:
        """The global ranks on this node."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    @property
    def gpu_id(self) -> int:
        """CUDA: this rank's device index on its node."""
        return self.base_gpu_id + self.me.local_rank

    @property
    def init_host_port(self) -> Optional[tuple[str, int]]:
        return None if not self.dist_init_addr else parse_host_port(self.dist_init_addr)

    def for_rank(self, rank: int) -> "Topology":
        """This topology as rank ``rank`` of this node sees it."""
        return replace(self, rank=rank)

    # --- any rank ------------------------------------------------------------
    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        pp_rank, tp_rank = divmod(rank, self.tp_size)
        node, local = divmod(rank, self.ranks_per_node)
        ep_rank, moe_tp_rank = divmod(tp_rank, self.moe_tp_size)
        return RankCoords(rank, node, local, tp_rank, pp_rank, ep_rank, moe_tp_rank)

    def tp_groups(self) -> list[list[int]]:
        """Every TP group's global ranks (one per pipeline stage), in creation order."""
        return [[p * self.tp_size + t for t in range(self.tp_size)] for p in range(self.pp_size)]

    def pp_groups(self) -> list[list[int]]:
        """Every PP group's global ranks (one per TP rank: the stages it passes through)."""
        return [[p * self.tp_size + t for p in range(self.pp_size)] for t in range(self.tp_size)]

    def ep_groups(self) -> list[list[int]]:
        """Every EP group's global ranks (per stage and width slice: the ranks holding the expert blocks)."""
        m = self.moe_tp_size
        return [
            [p * self.tp_size + e * m + w for e in range(self.ep_size)] for p in range(self.pp_size) for w in range(m)
        ]

    def describe(self) -> str:
        c = self.me
        return (
            f"rank {c.rank}/{self.world_size} (node {c.node}/{self.nnodes}, local {c.local_rank}; tp {c.tp_rank}/"
            f"{self.tp_size}, pp {c.pp_rank}/{self.pp_size}, ep {c.ep_rank}/{self.ep_size})"
        )

    # --- construction --------------------------------------------------------
    @classmethod
    def from_server_args(cls, sa: "ServerArgs") -> "Topology":
        """The topology of ``kvship serve``'s flags, or of torchrun's environment when ``RANK`` and
        ``WORLD_SIZE`` are set (ValueError, one line, when they disagree with the flags)."""
        from kvship.common.envs import ENV

        if ENV.TORCHRUN_RANK is None or ENV.TORCHRUN_WORLD_SIZE is None:  # not started by torchrun
            nodes, node = sa.nnodes, sa.node_rank
            world = sa.tp_size * sa.pp_size
            first = node * (world // nodes) if nodes > 0 else 0  # the node's first rank: its launcher
            return cls(sa.tp_size, sa.pp_size, sa.ep_size, nodes, node, first, sa.dist_init_addr, sa.base_gpu_id)
        return cls._from_torchrun(sa)

    @classmethod
    def _from_torchrun(cls, sa: "ServerArgs") -> "Topology":
        from kvship.common.envs import ENV

        rank, world = ENV.TORCHRUN_RANK, ENV.TORCHRUN_WORLD_SIZE
        addr, port = ENV.TORCHRUN_MASTER_ADDR, ENV.TORCHRUN_MASTER_PORT
        if addr is None or port is None:
            raise ValueError("torchrun's RANK and WORLD_SIZE are set but not MASTER_ADDR and MASTER_PORT")
        if world != sa.tp_size * sa.pp_size:
            sizes = f"--tp-size {sa.tp_size}" + (f" x --pp-size {sa.pp_size}" if sa.pp_size > 1 else "")
            raise ValueError(f"torchrun's WORLD_SIZE {world} is not the worker's {sizes} = {sa.tp_size * sa.pp_size}")
        per_node = ENV.TORCHRUN_LOCAL_WORLD_SIZE or world // max(sa.nnodes, 1)
        if per_node < 1 or world % per_node:
            raise ValueError(f"torchrun's LOCAL_WORLD_SIZE {per_node} does not divide WORLD_SIZE {world}")
        local = ENV.TORCHRUN_LOCAL_RANK
        if local is not None and local != rank % per_node:
            raise ValueError(f"torchrun's LOCAL_RANK {local} is not RANK {rank} mod {per_node} ranks per node")
        init = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
        return cls(
            sa.tp_size,
            sa.pp_size,
            sa.ep_size,
            world // per_node,
            rank // per_node,
            rank,
            init,
            sa.base_gpu_id,
            torchrun=True,
        )
