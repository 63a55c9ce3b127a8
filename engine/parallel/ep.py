"""MoE layers of a tensor-parallel worker: experts split ``--ep-size`` ways, each expert's width the rest.

Attention, dense MLPs, the router and the vocabulary are tensor-parallel as in
``kvship.engine.parallel.layers``.  The experts of a worker of ``T`` ranks
with ``--ep-size N`` (N divides T) are split two ways (``expert_split``): rank
``r`` holds the expert block ``r // (T/N)`` (``E/N`` experts) and, of each,
the width slice ``r % (T/N)`` (``I/(T/N)`` rows of gate and up, columns of
down).  ``N = T`` is expert parallelism proper (whole experts, E/T per rank);
``N = 1`` splits every expert's width T ways, as a tensor-parallel MLP.

After the attention's all-reduce every rank holds the same hidden states for
every token and computes the same router logits, so every rank knows every
token's top-k.  ``ParallelFusedMoE`` combines the ranks' shares with one of two
dispatches (docs/parallel.md, "Expert parallelism"):

* ``all_reduce`` (default): each rank runs its experts over the pairs routed
  to them (the other pairs are ``-1``, "absent", for the runner), and one
  all-reduce of ``[M, H]`` sums the partial outputs of all ranks.  Fixed
  shapes, no host sync: CUDA-graph safe.  Its traffic is the one all-reduce a
  tensor-parallel MLP costs.
* ``all_to_all`` (needs N = T): rank ``r`` takes the tokens
  ``[r*ceil(M/T), (r+1)*ceil(M/T))``, sends each (token, expert) pair's hidden
  row to the rank holding the expert with ``all_to_all_single`` (the per-rank
  pair counts are exchanged first), that rank runs its experts on what it
  received, the outputs travel back the same way and are weighted and summed
  per token, and an all-gather makes the result whole on every rank again.
  The counts are read on the host, so the communicator does not declare
  ``all_to_all`` capture-safe: while a graph runner captures
  (``Communicator.can_run("all_to_all")`` is False) the layer all-reduces
  instead (same result), so decode graphs all-reduce and eager steps go
  all-to-all.  With N = T the TP communicator is the EP one.
* ``static`` (needs N = T; ``kvship.engine.parallel.ep_dispatch``): the same
  token exchange with the counts kept on the device: fixed-capacity buffers
  sized from ``M`` (a host shape), rows placed by a device prefix sum, equal
  splits.  Capture-safe wherever the communicator declares
  ``all_to_all_equal`` (NCCL), so decode and prefill graphs keep it.

``--enable-two-batch-overlap`` (``kvship.engine.parallel.tbo``) runs the
``all_reduce`` and ``static`` dispatches of an eager step as two micro-batches
whose communication overlaps the other's expert compute.

``check_expert_parallel(config, tp_size, ep_size, dispatch)`` raises a clear
ValueError before any rank starts; ``apply_expert_parallel(model, tp, ep_size,
dispatch)`` swaps every ``FusedMoE`` of a freshly built model for this rank's
``ParallelFusedMoE`` (``build_parallel_model`` calls it before loading: the
loaders never read another rank's experts or width slices).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from kvship.engine.distributed.communicator import Communicator
from kvship.engine.layers.moe.layer import FusedMoE
from kvship.engine.layers.quantization import Shard
from kvship.engine.loaders.lazy import Loaded
from kvship.engine.parallel.ep_dispatch import StaticDispatch
from kvship.engine.parallel.tbo import overlap_all_reduce, overlap_static

EP_DISPATCHES = ("all_reduce", "static", "all_to_all")
WHOLE_EXPERT_DISPATCHES = ("static", "all_to_all")  # tokens travel to whole experts: --ep-size = --tp-size
TBO_DISPATCHES = ("all_reduce", "static")


@dataclass(frozen=True)
class ExpertSplit:
    """One rank's share of a MoE layer: experts ``[start, start + num_local)`` of ``num_experts``, and of each
    the intermediate rows ``[inter_start, inter_start + inter_local)`` of ``intermediate_size``."""

    num_experts: int
    start: int
    num_local: int
    intermediate_size: int
    inter_start: int
    inter_local: int

    def owner(self, expert: int) -> int:
        """The expert-parallel rank (block of experts) holding ``expert``."""
        return expert // self.num_local


def expert_split(num_experts: int, intermediate_size: int, tp_size: int, ep_size: int, rank: int) -> ExpertSplit:
    """Tensor-parallel rank ``rank``'s share: expert block ``rank // (tp/ep)``, width slice ``rank % (tp/ep)``
    (ValueError when the experts or their width do not divide)."""
    if ep_size < 1 or tp_size % ep_size:
        raise ValueError(f"--ep-size {ep_size} must divide --tp-size {tp_size}")
    if num_experts % ep_size:
        raise ValueError(
            f"--ep-size {ep_size} does not divide the model's {num_experts} experts; "
            f"use an ep size that divides {num_experts}"
        )
    moe_tp = tp_size // ep_size
    if intermediate_size % moe_tp:
        raise ValueError(
            f"--tp-size {tp_size} / --ep-size {ep_size} = {moe_tp} does not divide the experts' width "
            f"(moe_intermediate_size {intermediate_size}); raise --ep-size or pick another tp size"
        )
    per, width = num_experts // ep_size, intermediate_size // moe_tp
    return ExpertSplit(num_experts, (rank // moe_tp) * per, per, intermediate_size, (rank % moe_tp) * width, width)


def check_expert_parallel(config: Any, tp_size: int, ep_size: int, dispatch: str = "all_reduce") -> None:
    """ValueError with a clear message unless ``config``'s experts split over ``tp_size`` ranks, ``ep_size``
    ways by expert (startup, before any rank starts)."""
    if dispatch not in EP_DISPATCHES:
        raise ValueError(f"unknown --ep-dispatch '{dispatch}'; known: {list(EP_DISPATCHES)}")
    if config.moe is None:
        if ep_size > 1:
            raise ValueError(
                f"--ep-size {ep_size} needs a Mixture-of-Experts model; {config.architecture} has no experts"
            )
        return
    if dispatch in WHOLE_EXPERT_DISPATCHES and ep_size != tp_size:
        raise ValueError(f"--ep-dispatch {dispatch} needs --ep-size equal to --tp-size ({tp_size}), got {ep_size}")
    expert_split(config.moe.num_experts, config.moe.intermediate_size, tp_size, ep_size, 0)
    shared = config.moe.shared_expert_intermediate_size
    if shared % tp_size:  # Qwen2-MoE's shared expert is a tensor-parallel MLP
        raise ValueError(f"--tp-size {tp_size} does not divide the shared expert's width ({shared})")


def local_expert_ids(ids: torch.Tensor, start: int, num_local: int, kernels: Optional[bool] = None) -> torch.Tensor:
    """``ids [M, k]`` (global or physical expert ids) as ids local to a rank holding ``[start, start + num_local)``,
    ``-1`` (absent) for every other expert: int32.  One Triton launch on CUDA (``ep_pack.local_ids``; the torch
    form is five small kernels, ~340 us of a Qwen3-30B-A3B EP=2 decode step at batch 1); torch ops elsewhere."""
    if ids.is_cuda if kernels is None else kernels:
        from kvship.engine.parallel.ep_pack import local_ids

        return local_ids(ids, start, num_local)
    local = ids - start
    return torch.where((local >= 0) & (local < num_local), local, -1).to(torch.int32)


class ParallelFusedMoE(FusedMoE):
    """``FusedMoE`` holding this rank's share only (``ExpertSplit``); ``forward`` combines every rank's
    (module docstring)."""

    two_batch_overlap = False  # --enable-two-batch-overlap (set by apply_expert_parallel)

    def __init__(self, base: FusedMoE, tp: Communicator, ep_size: int, dispatch: str = "all_reduce", name: str = ""):
        if dispatch not in EP_DISPATCHES:
            raise ValueError(f"unknown expert-parallel dispatch '{dispatch}'; known: {list(EP_DISPATCHES)}")
        split = expert_split(base.num_experts, base.intermediate_size, tp.size, ep_size, tp.rank)
        if dispatch in WHOLE_EXPERT_DISPATCHES and ep_size != tp.size:
            raise ValueError(f"the {dispatch} dispatch needs --ep-size equal to --tp-size")
        if split.inter_local != split.intermediate_size:  # each expert's width split: whole blocks only
            base.quant_method.check_shard(f"{name}.w13_weight", Shard(0, split.inter_start, split.inter_local))
            base.quant_method.check_shard(f"{name}.w2_weight", Shard(1, split.inter_start, split.inter_local))
        super().__init__(
            base.num_experts,
            base.top_k,
            base.hidden_size,
            split.inter_local,
            base.renormalize,
            dtype=base.w13_weight.dtype,
            runner=base.runner_name,
            expert_start=split.start,
            num_local_experts=split.num_local,
            quant_method=base.quant_method,
            routing=base.routing,
        )
        self.tp = tp
        self.ep_size = ep_size
        self.split = split
        self.dispatch = dispatch

    def _load_expert(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        s = self.split
        owned = isinstance(shard_id, tuple) and len(shard_id) == 2 and s.start <= shard_id[0] < s.start + s.num_local
        if owned and s.inter_local != s.intermediate_size:  # this rank's rows of gate/up, columns of down
            where = Shard(1 if shard_id[1] == "down" else 0, s.inter_start, s.inter_local)
            loaded = self.quant_method.shard(self, self.param_name(param), loaded, where)
        super()._load_expert(param, loaded, shard_id)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        runner, weights, ids = self.route(x, router_logits)
        if self.dispatch == "all_to_all" and self.tp.can_run("all_to_all"):  # not while a graph captures
            return self._all_to_all(runner, x, weights, ids)
        # two micro-batches: eager steps of two tokens or more; a graph capture runs the plain path (no
        # communicator declares async collectives or split lists capture-safe: can_run("all_to_all") is "eager")
        overlap = self.two_batch_overlap and x.shape[0] >= 2 and self.tp.can_run("all_to_all")
        if self.dispatch == "static" and self.tp.can_run("all_to_all_equal") and self.tp.can_run("all_gather"):
            # this rank's experts over the rows it received (local ids; absent ones add nothing)
            static = StaticDispatch(self.tp, self.num_local_experts, functools.partial(self._run_local, runner))
            return overlap_static(static, x, weights, ids) if overlap else static(x, weights, ids)
        compute = functools.partial(self._run_global, runner)
        if overlap:
            return overlap_all_reduce(self.tp, compute, x, weights, ids)
        return self.tp.all_reduce(compute(x, weights, ids))

    @property
    def reduce_comm(self) -> Optional[Communicator]:
        """The ``all_reduce`` dispatch (without two-batch overlap) ends with the TP group's all-reduce, which
        ``forward_partial`` leaves to the caller (the next block's norm runs it with its own: docs/parallel.md)."""
        return self.tp if self.dispatch == "all_reduce" and not self.two_batch_overlap else None

    def forward_partial(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.reduce_comm is None:
            raise ValueError(f"the {self.dispatch} dispatch has no partial output to leave to the caller")
        runner, weights, ids = self.route(x, router_logits)
        return self._run_global(runner, x, weights, ids)

    def _run_local(self, runner: Any, x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """This rank's experts over ``x`` routed by local ids (``-1``: absent), weighted: ``[M, H]``."""
        # the kernel configs of the whole layer (docs/parallel.md, "Expert parallelism": tuned tables)
        return self.quant_method.apply_moe(
            self, runner, x, weights, local, absent=True, config_experts=self.num_experts
        )

    def _run_global(self, runner: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the layer over ``x`` routed by (physical) expert ids: the pairs it holds."""
        return self._run_local(runner, x, weights, local_expert_ids(ids, self.expert_start, self.num_local_experts))

    def _all_to_all(self, runner: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n = self.tp.size
        m, hidden = x.shape
        if m == 0:  # the same on every rank: no collective to pair up
            return torch.zeros_like(x)
        k = ids.shape[1]
        per = -(-m // n)
        lo, hi = min(self.tp.rank * per, m), min((self.tp.rank + 1) * per, m)
        # this rank's tokens' pairs, grouped by the rank that holds their expert
        pair_ids = ids[lo:hi].reshape(-1).long()
        dest = pair_ids // self.num_local_experts
        order = torch.argsort(dest, stable=True)
        token = torch.arange(hi - lo, device=x.device).repeat_interleave(k)[order]
        send_counts = torch.bincount(dest, minlength=n)
        recv_counts = torch.empty_like(send_counts)
        self.tp.all_to_all(recv_counts, send_counts)  # counts first
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        received = sum(recv_split)
        send_x = x[lo:hi][token].contiguous()
        recv_x = x.new_empty((received, hidden))
        self.tp.all_to_all(recv_x, send_x, recv_split, send_split)
        send_e = (pair_ids[order] - dest[order] * self.num_local_experts).to(torch.int32)
        recv_e = torch.empty(received, dtype=torch.int32, device=x.device)
        self.tp.all_to_all(recv_e, send_e, recv_split, send_split)
        # every received pair through its (local) expert, unweighted: the sender weights its own pairs
        ones = torch.ones((received, 1), dtype=torch.float32, device=x.device)
        y = self.quant_method.apply_moe(self, runner, recv_x, ones, recv_e.view(-1, 1))
        back = x.new_empty((send_x.shape[0], hidden))
        self.tp.all_to_all(back, y.contiguous(), send_split, recv_split)
        # weighted top-k sum per token in float32 (as the fused runners do), then this rank's block to all
        w = weights[lo:hi].reshape(-1)[order].float()
        mine = torch.zeros((per, hidden), dtype=torch.float32, device=x.device)
        mine.index_add_(0, token, back.float() * w[:, None])
        mine = mine.to(x.dtype)
        # every rank's token block, in rank order: [per, n * hidden] -> [n * per, hidden]
        whole = self.tp.all_gather(mine).view(per, n, hidden).transpose(0, 1).reshape(n * per, hidden)
        return whole[:m]

    def extra_repr(self) -> str:
        where = f"tp_rank={self.tp.rank}/{self.tp.size}, ep_size={self.ep_size}"
        overlap = ", two_batch_overlap" if self.two_batch_overlap else ""
        return f"{super().extra_repr()}, {where}, dispatch={self.dispatch}{overlap}"


def apply_expert_parallel(
    model: nn.Module,
    tp: Communicator,
    ep_size: int = 1,
    dispatch: str = "all_reduce",
    two_batch_overlap: bool = False,
    make: Optional[Callable[[FusedMoE, str], "ParallelFusedMoE"]] = None,
) -> nn.Module:
    """Replace every ``FusedMoE`` of ``model`` by this rank's ``ParallelFusedMoE``, in place (before loading);
    ``make(base, name)`` builds another subclass (EPLB's, ``kvship.engine.parallel.eplb.apply_eplb``)."""
    if two_batch_overlap and dispatch not in TBO_DISPATCHES:
        raise ValueError(f"--enable-two-batch-overlap works with --ep-dispatch {' or '.join(TBO_DISPATCHES)}")
    if make is None:

        def make(base: FusedMoE, name: str) -> ParallelFusedMoE:
            return ParallelFusedMoE(base, tp, ep_size, dispatch, name)

    for name, module in list(model.named_modules()):
        if type(module) is FusedMoE:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            layer = make(module, name)
            layer.two_batch_overlap = two_batch_overlap  # --enable-two-batch-overlap (docs/parallel.md)
            setattr(parent, attr, layer)
    return model
