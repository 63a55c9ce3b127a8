"""``moe_align_block_size``: token->expert pairs sorted by expert, each expert's run padded to ``block_m``.

For ``topk_ids [M, k]`` (``n = M * k`` pairs, pair ``p`` is token ``p // k``'s
``p % k``-th choice) it returns

* ``sorted_ids`` int32 ``[P]``: pair indices grouped by expert (stable within
  an expert), each expert's run padded with ``n`` up to a multiple of
  ``block_m``; entries past the last run are ``n`` too;
* ``expert_ids`` int32 ``[P // block_m]``: the expert of each block of
  ``block_m`` entries (blocks past the end hold an arbitrary valid id);
* ``num_tokens_post_padded`` int32 ``[1]``: where the last run ends.

``P`` depends only on ``n``, ``E`` and ``block_m`` (the worst case,
``min(n + E * (block_m - 1), n * block_m)`` rounded up to ``block_m``), and
nothing is read back to the host: the outputs have fixed sizes for a
captured batch, so the step runs inside a CUDA graph.  A kernel reading them
skips blocks at or past ``num_tokens_post_padded`` and entries equal to ``n``.
An expert with no pair gets no block.
"""

from __future__ import annotations

import torch


def padded_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """``P``: the fixed length of ``sorted_ids`` for ``num_pairs`` pairs."""
    worst = num_pairs + num_experts * (block_m - 1)
    worst = min(worst, num_pairs * block_m)
    return max(block_m, -(-worst // block_m) * block_m)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs of the module docstring.  A pair whose id is negative (``-1``: an expert another rank holds,
    under expert parallelism) is left out: it is in no run and not counted, so kernels never read it."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    size = padded_size(n, num_experts, block_m)
    # absent pairs take the key num_experts: they sort after every run and are scattered past the end
    key = torch.where(flat >= 0, flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + (block_m - 1)) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = torch.cat([ends - padded, ends.new_full((1,), size)])  # the absent pairs' "run": past the end
    order = torch.sort(key, stable=True).indices
    expert_of = key[order]
    first_of = torch.cumsum(counts, 0) - counts  # index in ``order`` of each expert's first pair
    dest = starts[expert_of] + torch.arange(n, device=dev) - first_of[expert_of]
    sorted_ids = torch.full((size + n,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, size, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, block_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids[:size], expert_ids, ends[-1:].to(torch.int32)
