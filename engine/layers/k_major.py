"""A whole-model pass that re-stores 2-D projection weights K-major (opt-in, CUDA).

``store_weights_k_major_(model)`` changes only the memory order of every
``Linear`` weight (and an untied ``LMHead``'s): the parameter keeps its shape
``[out, in]`` and values, with strides ``(1, out)``, so ``F.linear(x, W)``
becomes the contiguous product ``x @ W^T`` for cuBLAS.  ``ModelRunner``
applies it after loading and before CUDA-graph capture (which records the
weights' addresses) when ``KVSHIP_K_MAJOR_WEIGHTS=1`` on CUDA.

Invariants: no weight loader may run afterwards (loaders expect the checkpoint
layout); peak memory grows by one weight while it is copied.  Measurements:
docs/benchmarks.md ("K-major").
"""

from __future__ import annotations

from torch import nn

from kvship.engine.layers.embedding import LMHead
from kvship.engine.layers.linear import Linear


def store_weights_k_major_(model: nn.Module) -> int:
    """Re-store the weight of every ``Linear`` (and an untied ``LMHead``) K-major, in place; returns the count."""
    n = 0
    for m in model.modules():
        w = getattr(m, "weight", None) if isinstance(m, (Linear, LMHead)) else None
        if isinstance(w, nn.Parameter) and w.dim() == 2 and w.is_contiguous():
            w.data = w.data.t().contiguous().t()
            n += 1
    return n
