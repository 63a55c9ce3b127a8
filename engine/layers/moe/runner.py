"""How a fused-MoE layer computes its experts: one ABC, a registry, the torch reference.

A runner computes, for tokens ``x [M, H]`` routed to ``top_k`` experts each,

    out[m] = sum_j  w[m, j] * down_e( silu(gate_e(x[m])) * up_e(x[m]) ),  e = ids[m, j]

with the experts' weights stacked as ``w13 [E, 2I, H]`` (gate rows ``[0, I)``,
up rows ``[I, 2I)``) and ``w2 [E, H, I]``.  ``out`` has ``x``'s dtype.

Runners (``get_moe_runner(name)``):

* ``torch``: a loop over the experts that received tokens (reference; CPU
  and any device; reads routing to the host, so not CUDA-graph safe).
* ``triton``: ``kvship.engine.layers.moe.triton_moe``: token->expert pairs
  sorted and padded per expert (``moe_align_block_size``), a grouped GEMM with
  SiLU-and-mul fused for gate/up, a second for down with the routing weight
  applied, then the top-k sum.  Fixed-size buffers, no host sync: CUDA-graph
  safe.  Imported on first use (needs ``triton``).

Contract: a runner must accept ids of experts that received no token, and
``M == 0``.  With ``absent=True`` (expert parallelism: ``w13``/``w2`` hold only
this rank's experts) an id of ``-1`` marks a pair whose expert lives on another
rank: it adds nothing to ``out`` (docs/parallel.md, "Expert parallelism").
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from kvship.engine.layers.moe.topk import count_routed, select_experts


class MoERunner(ABC):
    """Computes the routed experts' outputs (see the module docstring)."""

    @abstractmethod
    def __call__(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        absent: bool = False,
        config_experts: Optional[int] = None,
    ) -> torch.Tensor:
        """``x [M, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``topk_weights`` float32 ``[M, k]``,
        ``topk_ids`` int ``[M, k]`` -> ``[M, H]`` in ``x.dtype``; with ``absent``, ids of ``-1`` add nothing.
        ``config_experts``: the expert count a kernel-tuned runner looks its configs up under, where it is not
        ``E`` (expert parallelism: the model's, whose load per expert a rank's ``E`` experts carry)."""

    def select_experts(
        self,
        router_logits: torch.Tensor,
        top_k: int,
        renormalize: bool,
        counts: Optional[torch.Tensor] = None,
        rows_slots: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing for this runner's ``__call__`` (``topk.select_experts``'s contract), adding the picks to
        the expert-load ``counts`` when given (``topk.count_routed``); a runner may override it with a fused
        kernel."""
        weights, ids = select_experts(router_logits, top_k, renormalize)
        if counts is not None:
            count_routed(counts, ids, rows_slots)
        return weights, ids


_REGISTRY: dict[str, Callable[[], MoERunner]] = {}
_LAZY_MODULES = {"triton": "kvship.engine.layers.moe.triton_moe"}


def register_moe_runner(name: str) -> Callable[[Callable[[], MoERunner]], Callable[[], MoERunner]]:
    def deco(factory: Callable[[], MoERunner]) -> Callable[[], MoERunner]:
        _REGISTRY[name] = factory
        return factory

    return deco


def moe_runner_names() -> list[str]:
    return sorted(set(_REGISTRY) | set(_LAZY_MODULES))


def get_moe_runner(name: str) -> MoERunner:
    """A runner by name (ValueError for an unknown one; ImportError when its kernels cannot load)."""
    if name not in _REGISTRY and name in _LAZY_MODULES:
        importlib.import_module(_LAZY_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(f"unknown MoE runner '{name}'; known: {moe_runner_names()}")
    return _REGISTRY[name]()


@register_moe_runner("torch")
class TorchMoERunner(MoERunner):
    """Per-expert loop in PyTorch: gather the expert's tokens, two matmuls, scatter-add weighted rows."""

    def __call__(self, x, w13, w2, topk_weights, topk_ids, absent=False, config_experts=None):
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the torch MoE runner reads the routing on the host and cannot be captured in a CUDA graph: "
                "use KVSHIP_MOE_RUNNER=triton (the default on CUDA) or --disable-cuda-graph"
            )
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        inter = w2.shape[2]
        flat_ids = topk_ids.reshape(-1).long()
        # the experts that got at least one token (a host read: this runner is not graph-safe)
        for e in torch.unique(flat_ids).tolist():
            if e < 0:  # absent: held by another rank
                continue
            token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            h = F.linear(x[token], w13[e])
            h = F.silu(h[:, :inter]) * h[:, inter:]
            y = F.linear(h, w2[e]) * topk_weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out
