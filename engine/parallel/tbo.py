"""Two-batch overlap (``--enable-two-batch-overlap``) of an expert-parallel MoE layer.

docs/parallel.md, "Two-batch overlap".  The layer's ``M`` tokens split in two
micro-batches, ``A = [0, ceil(M/2))`` and ``B`` the rest, each dispatched on
its own; every collective starts with ``async_op=True`` and is waited on only
when its result is needed, so one micro-batch's communication runs while the
other's experts compute:

* ``static`` dispatch: A's and B's rows go out; A computes while B's rows
  travel; A's partials return while B computes; A's sum and all-gather run
  while B's partials return and are summed.
* ``all_reduce`` dispatch: A's experts, A's all-reduce started, B's experts
  (overlapping it), B's all-reduce.

Each micro-batch's tokens get the same computation as in the plain path (the
same experts and weights; only the rows sharing a kernel launch differ), so
greedy tokens are the plain path's.  A one-token step runs the plain path.
Eager steps only: a graph capture runs the plain path (a capture of async
collectives is not measured yet).
"""

from __future__ import annotations

from typing import Callable

import torch

from kvship.engine.distributed.communicator import Communicator
from kvship.engine.parallel.ep_dispatch import StaticDispatch, wait


def halves(m: int) -> tuple[slice, slice]:
    """The micro-batches of ``m`` tokens: the first ``ceil(m/2)``, then the rest."""
    a = -(-m // 2)
    return slice(0, a), slice(a, m)


def overlap_static(d: StaticDispatch, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The ``static`` dispatch of ``x``'s two halves, interleaved (module docstring); ``x`` has >= 2 rows."""
    a, b = halves(x.shape[0])
    sa = d.dispatch(x[a], weights[a], ids[a], async_op=True)
    sb = d.dispatch(x[b], weights[b], ids[b], async_op=True)
    sa = d.experts(sa, async_op=True)  # A computes while B's rows travel
    sb = d.experts(sb, async_op=True)  # B computes while A's partials return
    sa = d.combine(sa, x.dtype, async_op=True)  # A sums while B's partials return
    sb = d.combine(sb, x.dtype, async_op=True)
    return torch.cat([d.result(sa), d.result(sb)])


def overlap_all_reduce(
    comm: Communicator,
    compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The ``all_reduce`` dispatch of ``x``'s two halves: A's all-reduce runs while B's experts compute."""
    a, b = halves(x.shape[0])
    ya = compute(x[a], weights[a], ids[a])
    wa = comm.all_reduce(ya, async_op=True)
    yb = compute(x[b], weights[b], ids[b])
    wb = comm.all_reduce(yb, async_op=True)
    wait(wa)
    wait(wb)
    return torch.cat([ya, yb])
