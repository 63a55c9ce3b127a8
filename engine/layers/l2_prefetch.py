"""Which weight bytes a small-batch decode layer prefetches into L2, and when (docs/gpu.md, "Weight prefetch
into L2").

A decoder layer reads its weights in a fixed order (qkv, o, gate/up, down) and
has latency-bound windows between some of them: the input norm (and the
all-reduce it owes under tensor parallelism), RoPE with decode attention, the
post-attention norm (and its all-reduce).  ``plan_windows`` assigns each
window a byte budget of the weights read after it, continuing where the window
before it stopped, so no byte is asked for twice.  ``prefetcher_for`` gives the
device's side-stream prefetcher (``l2_prefetch_cuda``) where the knob is on and
the GPU has Hopper's bulk prefetch, else None (every other device, CPU tests).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvship.common.envs import ENV

# token rows up to which a forward prefetches (decode batches; larger steps are bound by their GEMMs' math)
MAX_ROWS = 16

MiB = 1 << 20

Region = tuple[torch.Tensor, int, int]  # (contiguous tensor, start byte, bytes)

_PREFETCHERS: dict[int, Optional[object]] = {}


def prefetcher_for(device: torch.device) -> Optional[object]:
    """The ``L2Prefetcher`` of CUDA ``device``, or None (knob off, not CUDA, compute capability below 9, Triton's
    interpreter)."""
    if device.type != "cuda" or not ENV.L2_PREFETCH:
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PREFETCHERS:
        pf = None
        import os

        if torch.cuda.get_device_capability(idx)[0] >= 9 and os.environ.get("TRITON_INTERPRET", "0") != "1":
            from kvship.engine.layers.l2_prefetch_cuda import L2Prefetcher

            pf = L2Prefetcher(torch.device("cuda", idx))
        _PREFETCHERS[idx] = pf
    return _PREFETCHERS[idx]


def window_budgets() -> tuple[int, int]:
    """Bytes a norm window (with its all-reduce) and the attention window prefetch (knobs)."""
    return int(ENV.L2_PREFETCH_NORM_MB * MiB), int(ENV.L2_PREFETCH_ATTN_MB * MiB)


def plan_windows(weights: Sequence[Optional[torch.Tensor]], windows: Sequence[tuple[int, int]]) -> list[list[Region]]:
    """``weights``: the tensors a layer reads, in order (None: absent, skipped); ``windows``: ``(index of the
    first weight read after the window, byte budget)`` in the layer's order.  Each window prefetches up to its
    budget from the first byte no earlier window asked for, never from a weight read before it; returns each
    window's regions."""
    done = [0] * len(weights)  # bytes of each weight an earlier window covers
    plans: list[list[Region]] = []
    for first, budget in windows:
        regions: list[Region] = []
        for i in range(first, len(weights)):
            if budget <= 0:
                break
            w = weights[i]
            if w is None:
                continue
            size = w.numel() * w.element_size()
            take = min(budget, size - done[i])
            if take > 0:
                regions.append((w, done[i], take))
                done[i] += take
                budget -= take
        plans.append(regions)
    return plans


def prefetchable(w: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``w`` where its bytes are one contiguous block on a CUDA device, else None."""
    if w is None or not isinstance(w, torch.Tensor) or not w.is_cuda or not w.is_contiguous():
        return None
    return w
