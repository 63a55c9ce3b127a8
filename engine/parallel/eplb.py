"""Expert-parallel load balancing (EPLB): redundant expert slots, a load-driven placement, live rebalancing.

docs/parallel.md, "Expert load balancing (EPLB)".  With ``--ep-num-redundant-experts R``
(``--ep-size`` = ``--tp-size`` = N > 1) every MoE layer of ``E`` (logical) experts
holds ``S = E + R`` *physical* slots, ``P = S / N`` on each rank (slots
``[r*P, (r+1)*P)`` on rank ``r``).  A *placement* is the logical expert of every
slot (``[S]``); every logical expert has at least one slot, a hot one several.

* ``compute_placement(load, num_slots, num_ranks, previous)``: the replica counts
  (one each, then every extra slot to the expert of the highest load per replica),
  then the replicas, heaviest first, each to the rank of the least load with a free
  slot (a rank not yet holding that expert first): a greedy bin-packing, pure and
  deterministic (the same loads give the same placement).  With ``previous`` a
  rank keeps an expert in the slot that already held it, so a rebalance moves only
  what changed.
* ``EPLBFusedMoE`` (a ``ParallelFusedMoE``): its ``route`` maps every (token,
  expert) pair's logical id to one of the expert's replicas, on the device: token
  ``t``'s ``j``-th pick takes replica ``(t + j) % replicas``; fixed shapes, no host
  sync, so CUDA graphs capture it (the tables are updated in place).
  Both dispatches then run on physical ids as they do on logical ones.  Loading
  writes each checkpoint expert into every local slot that holds it.
* ``EPLBManager`` (made by the model runner, its ``step()`` called before every
  forward, on every rank the same number of times): every
  ``--eplb-rebalance-interval`` steps rank 0 computes the new placements from the
  logical expert load of the window (every rank routes every token, so rank 0's
  counts are the worker's) and broadcasts them; each rank then receives the weights
  of the slots that change from a rank holding that expert in the old placement
  (one ``all_to_all`` of the rows' bytes per layer: weights and their FP8 scales
  travel together), and the routing tables switch.  A layer whose predicted
  rank-load max/mean would improve by less than ``MIN_GAIN`` keeps its placement.  All of it happens between two
  forwards: no request is dropped and, as replicas are exact copies, greedy output
  is unchanged.  ``stats()`` (in ``/get_server_info`` as ``eplb``) gives the
  max/mean physical load per rank before and after each rebalance.
"""

from __future__ import annotations

import heapq
import logging
import time
from typing import Any, Optional, Sequence

import torch
from torch import nn

from kvship.engine.distributed.communicator import Communicator
from kvship.engine.layers.linear import load_checked
from kvship.engine.layers.moe.layer import EXPERT_PARTS, FusedMoE, _layer_index
from kvship.engine.layers.moe.runner import MoERunner
from kvship.engine.layers.moe.topk import count_routed
from kvship.engine.loaders.lazy import Loaded
from kvship.engine.parallel.ep import ParallelFusedMoE, apply_expert_parallel

logger = logging.getLogger(__name__)

# a layer moves weights only when the new placement lowers its predicted rank-load max/mean by this fraction
MIN_GAIN = 0.02


def check_eplb(num_experts: int, num_redundant: int, ep_size: int, tp_size: int) -> None:
    """ValueError (one line) unless ``num_experts + num_redundant`` slots spread evenly over ``ep_size`` ranks."""
    if num_redundant < 0:
        raise ValueError(f"--ep-num-redundant-experts must be >= 0, got {num_redundant}")
    if num_redundant == 0:
        return
    if ep_size < 2 or ep_size != tp_size:
        raise ValueError(f"--ep-num-redundant-experts needs --ep-size = --tp-size > 1 (got {ep_size}, {tp_size})")
    if (num_experts + num_redundant) % ep_size:
        raise ValueError(
            f"--ep-num-redundant-experts {num_redundant}: {num_experts} experts + {num_redundant} = "
            f"{num_experts + num_redundant} slots do not divide by --ep-size {ep_size}"
        )


def replica_counts(load: Sequence[float], num_slots: int, max_replicas: Optional[int] = None) -> list[int]:
    """Replicas per logical expert: one each, then each extra slot to the highest load per replica (ties: the
    lowest expert id), an expert past ``max_replicas`` (one per rank: more gain nothing) only when all are."""
    n = len(load)
    if num_slots < n:
        raise ValueError(f"{num_slots} slots cannot hold {n} experts")
    cap = max_replicas or num_slots
    counts = [1] * n
    heap = [(1 >= cap, -float(load[e]), e) for e in range(n)]
    heapq.heapify(heap)
    for _ in range(num_slots - n):
        _, _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (counts[e] >= cap, -float(load[e]) / counts[e], e))
    return counts


def compute_placement(
    load: Sequence[float], num_slots: int, num_ranks: int, previous: Optional[Sequence[int]] = None
) -> list[int]:
    """The logical expert of each of ``num_slots`` physical slots (``num_slots / num_ranks`` per rank, rank
    ``r`` holding slots ``[r*P, (r+1)*P)``), balancing the per-rank load (module docstring)."""
    e_count = len(load)
    if num_ranks < 1 or num_slots % num_ranks:
        raise ValueError(f"{num_slots} slots do not spread evenly over {num_ranks} ranks")
    if any(x < 0 for x in load):
        raise ValueError("expert loads must be >= 0")
    per = num_slots // num_ranks
    counts = replica_counts(load, num_slots, num_ranks)
    # the replicas, heaviest first (ties: expert id), each carrying an even share of its expert's load
    items = sorted(
        ((float(load[e]) / counts[e], e) for e in range(e_count) for _ in range(counts[e])), key=lambda t: (-t[0], t[1])
    )
    rank_load = [0.0] * num_ranks
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    for share, e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < per]
        fresh = [r for r in free if e not in held[r]] or free  # a second copy on one rank only when forced
        r = min(fresh, key=lambda q: (rank_load[q], len(held[q]), q))
        held[r].append(e)
        rank_load[r] += share
    placement: list[int] = []
    for r in range(num_ranks):
        slots: list[Optional[int]] = [None] * per
        left = sorted(held[r])
        if previous is not None:  # keep an expert in the slot that already holds it (fewer weight moves)
            for j in range(per):
                e = previous[r * per + j]
                if e in left:
                    slots[j] = e
                    left.remove(e)
        it = iter(left)
        placement.extend(s if s is not None else next(it) for s in slots)
    return placement


def rank_loads(placement: Sequence[int], load: Sequence[float], num_ranks: int) -> list[float]:
    """Each rank's share of ``load`` under ``placement``, an expert's load split evenly over its replicas."""
    replicas = [0] * len(load)
    for e in placement:
        replicas[e] += 1
    per = len(placement) // num_ranks
    return [sum(float(load[e]) / replicas[e] for e in placement[r * per : (r + 1) * per]) for r in range(num_ranks)]


def max_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / max(len(values), 1)
    return max(values) / mean if mean > 0 else 1.0


def transfer_plan(old: Sequence[int], new: Sequence[int], num_ranks: int) -> list[tuple[int, int]]:
    """``(source slot, destination slot)`` for every slot whose expert changes: the source holds that expert
    in ``old``, on the destination's rank where it can (a local copy), else the lowest such slot."""
    per = len(old) // num_ranks
    holders: dict[int, list[int]] = {}
    for s, e in enumerate(old):
        holders.setdefault(e, []).append(s)
    plan = []
    for d, e in enumerate(new):
        if old[d] == e:
            continue
        if e not in holders:
            raise ValueError(f"expert {e} has no slot in the old placement")
        same_rank = [s for s in holders[e] if s // per == d // per]
        plan.append(((same_rank or holders[e])[0], d))
    return plan


class EPLBFusedMoE(ParallelFusedMoE):
    """This rank's ``P`` physical slots of one MoE layer with redundant experts (module docstring)."""

    def __init__(
        self,
        base: FusedMoE,
        tp: Communicator,
        ep_size: int,
        dispatch: str = "all_reduce",
        name: str = "",
        num_redundant: int = 1,
    ):
        check_eplb(base.num_experts, num_redundant, ep_size, tp.size)
        if num_redundant < 1:
            raise ValueError("EPLBFusedMoE needs at least one redundant expert")
        logical = base.num_experts
        slots = logical + num_redundant
        # a FusedMoE of S experts (on meta: never allocated) split as usual, this rank holding slots
        # [rank*P, (rank+1)*P); then the logical count again for routing, the expert load and the checkpoint
        with torch.device("meta"):
            wide = FusedMoE(
                slots,
                base.top_k,
                base.hidden_size,
                base.intermediate_size,
                base.renormalize,
                dtype=base.w13_weight.dtype,
                runner=base.runner_name,
                quant_method=base.quant_method,
                routing=base.routing,
            )
        super().__init__(wide, tp, ep_size, dispatch, name)
        self.num_experts = logical
        self.num_slots = slots
        self.placement: list[int] = compute_placement([1.0] * logical, slots, tp.size)
        self._tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (log->phys [E, R+1], replicas [E])
        self._slot_tokens: Optional[torch.Tensor] = None  # pairs routed to each physical slot [S]

    # --- placement -------------------------------------------------------------------------------------------
    def _table_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.num_slots - self.num_experts + 1
        table = torch.zeros((self.num_experts, width), dtype=torch.int64)
        count = torch.zeros(self.num_experts, dtype=torch.int64)
        for s, e in enumerate(self.placement):
            table[e, count[e]] = s
            count[e] += 1
        return table, count

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None or self._tables[0].device != device:
            table, count = self._table_values()
            self._tables = (table.to(device), count.to(device))
        return self._tables

    def set_placement(self, placement: Sequence[int]) -> None:
        """Switch the routing to ``placement`` (the weights must already be where it says); tables in place."""
        if len(placement) != self.num_slots or sorted(set(placement)) != list(range(self.num_experts)):
            raise ValueError("a placement names every logical expert, one per physical slot")
        self.placement = list(placement)
        if self._tables is not None:
            table, count = self._table_values()
            with torch.inference_mode():
                self._tables[0].copy_(table)
                self._tables[1].copy_(count)

    def physical_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Logical ``ids [M, k]`` -> physical slots: token ``t``'s ``j``-th pick takes replica ``(t + j) %
        replicas`` (by token, so an expert that is every token's first pick still spreads); same dtype."""
        table, count = self.tables(ids.device)
        m, k = ids.shape
        flat = ids.reshape(-1).long()
        turn = (torch.arange(m, device=ids.device)[:, None] + torch.arange(k, device=ids.device)).reshape(-1)
        phys = table[flat, turn % count[flat]]
        return phys.view(ids.shape).to(ids.dtype)

    def slot_load(self) -> torch.Tensor:
        """Pairs routed to each physical slot since the last rebalance: int64 ``[S]`` on CPU."""
        if self._slot_tokens is None:
            return torch.zeros(self.num_slots, dtype=torch.int64)
        return self._slot_tokens.cpu()

    def reset_slot_load_(self) -> None:
        if self._slot_tokens is not None:
            with torch.inference_mode():
                self._slot_tokens.zero_()

    def reset_expert_load_(self) -> None:  # after warm-up and capture: the slot counts start then too
        super().reset_expert_load_()
        self.reset_slot_load_()

    # --- FusedMoE hooks --------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor, router_logits: torch.Tensor) -> tuple[MoERunner, torch.Tensor, torch.Tensor]:
        runner, weights, ids = super().route(x, router_logits)  # logical ids, counted in the expert load
        phys = self.physical_ids(ids)
        slots = self._slot_tokens
        if slots is None or slots.device != phys.device:
            slots = self._slot_tokens = torch.zeros(self.num_slots, dtype=torch.int64, device=phys.device)
        count_routed(slots, phys, self._rows_slots)
        return runner, weights, phys

    def _load_expert(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in EXPERT_PARTS):
            raise ValueError(f"expert weights load with shard (expert, 'gate'|'up'|'down'), got {shard_id!r}")
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside this layer's {self.num_experts} experts")
        name = self.param_name(param)
        if not name.startswith(EXPERT_PARTS[part]):
            raise ValueError(f"'{part}' weights do not belong in this parameter")
        for j in range(self.num_local_experts):  # every local slot holding this expert gets a copy
            if self.placement[self.expert_start + j] != expert:
                continue
            target = param.data[j]
            if part != "down":
                start = 0 if part == "gate" else self.intermediate_size
                target = self.quant_method.rows(name, target, start, self.intermediate_size)
            load_checked(self, name, target, loaded, f"expert {expert} {part}")

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the layer, each ``[P, ...]`` by slot (weights, FP8 scales); ValueError if one is not."""
        tensors = [p.data for _, p in self.named_parameters(recurse=False)]
        tensors += [b for _, b in self.named_buffers(recurse=False)]
        if any(t.dim() == 0 or t.shape[0] != self.num_local_experts for t in tensors):
            raise ValueError("EPLB moves per-expert tensors only; this layer's quantization keeps a shared one")
        if not all(t.is_contiguous() for t in tensors):  # the byte rows of move_to must alias the tensors
            raise ValueError("EPLB moves contiguous expert weights only")
        return tensors

    def move_to(self, new: Sequence[int]) -> tuple[int, int]:
        """Move the weights (and scales) so this rank's slots hold ``new``'s experts, on every rank at once
        (one all_to_all of row bytes), then switch the routing.  Returns (slots moved, bytes this rank got)."""
        old = self.placement
        plan = transfer_plan(old, new, self.tp.size)
        if not plan:
            self.set_placement(new)
            return 0, 0
        per, me, n = self.num_local_experts, self.tp.rank, self.tp.size
        params = self.slot_tensors()
        # each slot's bytes over every parameter of the layer: weights and FP8 scales travel together
        rows = [t.reshape(per, -1).view(torch.uint8) for t in params]
        widths = [r.shape[1] for r in rows]
        # both sides order a (source rank, destination rank) pair's transfers by destination slot
        by_dst = sorted(plan, key=lambda t: t[1])
        sends = [[t for t in by_dst if t[0] // per == me and t[1] // per == d] for d in range(n)]
        recvs = [[t for t in by_dst if t[1] // per == me and t[0] // per == s] for s in range(n)]
        src_local = [t[0] - me * per for ts in sends for t in ts]
        device = params[0].device
        index = torch.tensor(src_local, dtype=torch.long, device=device)
        send = torch.cat([r.index_select(0, index) for r in rows], dim=1) if src_local else None
        width = sum(widths)
        send = send if send is not None else torch.empty((0, width), dtype=torch.uint8, device=device)
        got = sum(len(ts) for ts in recvs)
        recv = torch.empty((got, width), dtype=torch.uint8, device=device)
        self.tp.all_to_all(recv, send.contiguous(), [len(ts) for ts in recvs], [len(ts) for ts in sends])
        dst_local = torch.tensor([t[1] - me * per for ts in recvs for t in ts], dtype=torch.long, device=device)
        if got:
            with torch.no_grad():
                off = 0
                for r, w in zip(rows, widths):
                    r.index_copy_(0, dst_local, recv[:, off : off + w])
                    off += w
        self.set_placement(new)
        return len(plan), got * width

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, slots={self.num_slots} ({self.num_local_experts} here)"


def apply_eplb(
    model: nn.Module, tp: Communicator, ep_size: int, dispatch: str, num_redundant: int, two_batch_overlap: bool = False
) -> nn.Module:
    """Replace every ``FusedMoE`` of ``model`` by this rank's ``EPLBFusedMoE``, in place (before loading)."""
    return apply_expert_parallel(
        model,
        tp,
        ep_size,
        dispatch,
        two_batch_overlap,
        make=lambda base, name: EPLBFusedMoE(base, tp, ep_size, dispatch, name, num_redundant),
    )


class EPLBManager:
    """Counts the model runner's forwards and rebalances every ``interval`` of them (module docstring)."""

    def __init__(self, model: nn.Module, tp: Communicator, interval: int):
        if interval < 0:
            raise ValueError(f"--eplb-rebalance-interval must be >= 0, got {interval}")
        self.layers: list[tuple[int, EPLBFusedMoE]] = [
            (_layer_index(n), m) for n, m in model.named_modules() if isinstance(m, EPLBFusedMoE)
        ]
        if not self.layers:
            raise ValueError("--ep-num-redundant-experts: the model has no expert-parallel MoE layer")
        self.tp = tp
        self.interval = interval
        self.steps = 0
        self.rebalances = 0
        self.moved_slots_total = 0
        self.last: Optional[dict[str, Any]] = None
        self._base = {i: m.expert_load().clone() for i, m in self.layers}  # logical load at the window's start
        for _, m in self.layers:  # the routing tables exist before any CUDA graph is captured
            m.slot_tensors()  # movable: refused at start-up, not at the first rebalance
            m.tables(m.w13_weight.device)

    def step(self) -> None:
        """Before each forward: every ``interval``-th call rebalances (0: never)."""
        self.steps += 1
        if self.interval and self.steps % self.interval == 0:
            self.rebalance()

    def window_load(self) -> dict[int, list[int]]:
        """Logical load per layer since the last rebalance (all of it where the counters were reset since)."""
        out = {}
        for i, m in self.layers:
            now = m.expert_load()
            out[i] = (now if bool((now < self._base[i]).any()) else now - self._base[i]).tolist()
        return out

    def rebalance(self) -> Optional[dict[str, Any]]:
        """Agree on new placements (rank 0's), move the weights, switch the tables; on every rank at once."""
        t0 = time.perf_counter()
        plan = None
        window = self.window_load()
        if self.tp.rank == 0:
            plan = {}
            for i, m in self.layers:
                load = window[i]
                if sum(load) == 0:  # an idle window keeps the placement
                    continue
                new = compute_placement(load, m.num_slots, self.tp.size, m.placement)
                now = max_over_mean(rank_loads(m.placement, load, self.tp.size))
                if max_over_mean(rank_loads(new, load, self.tp.size)) < now * (1 - MIN_GAIN):
                    plan[i] = new  # else not worth moving weights for
        plan = self.tp.broadcast_object(plan, src=0)
        n = self.tp.size
        before, after, moved, nbytes = [], [], 0, 0
        for i, m in self.layers:
            if i not in plan:
                continue
            measured = m.slot_load().tolist()
            per = m.num_local_experts
            before.append(max_over_mean([sum(measured[r * per : (r + 1) * per]) for r in range(n)]))
            after.append(max_over_mean(rank_loads(plan[i], window[i], n)))
            k, b = m.move_to(plan[i])
            moved, nbytes = moved + k, nbytes + b
        for i, m in self.layers:
            m.reset_slot_load_()
            self._base[i] = m.expert_load().clone()  # a copy: on CPU .cpu() is the counter itself
        self.rebalances += 1
        self.moved_slots_total += moved
        self.last = {
            "step": self.steps,
            "layers": len(before),
            "moved_slots": moved,
            "received_bytes": nbytes,
            "seconds": round(time.perf_counter() - t0, 6),
            "rank_load_max_over_mean_before": max(before, default=1.0),
            "rank_load_max_over_mean_after": max(after, default=1.0),
        }
        logger.info(
            "EPLB rebalance %d at step %d: %d layers, %d slots moved (%.2f MiB in on rank %d), rank load max/mean "
            "%.3f -> %.3f (worst layer), %.1f ms",
            self.rebalances,
            self.steps,
            len(before),
            moved,
            nbytes / 2**20,
            self.tp.rank,
            self.last["rank_load_max_over_mean_before"],
            self.last["rank_load_max_over_mean_after"],
            1e3 * self.last["seconds"],
        )
        return self.last

    def stats(self) -> dict[str, Any]:
        """For ``/get_server_info``: the settings, the last rebalance and the measured rank load since it."""
        n = self.tp.size
        now = []
        for _, m in self.layers:
            load, per = m.slot_load().tolist(), m.num_local_experts
            now.append(max_over_mean([sum(load[r * per : (r + 1) * per]) for r in range(n)]))
        return {
            "num_redundant_experts": self.layers[0][1].num_slots - self.layers[0][1].num_experts,
            "rebalance_interval": self.interval,
            "steps": self.steps,
            "rebalances": self.rebalances,
            "moved_slots_total": self.moved_slots_total,
            "last_rebalance": self.last,
            "rank_load_max_over_mean": max(now, default=1.0),
            "placement": {i: list(m.placement) for i, m in self.layers},
        }
