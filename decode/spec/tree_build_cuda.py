"""The Triton kernel of ``tree_build`` (imported on CUDA only; also runs under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_kernel(parents_ptr, prefix_ptr, pos_ptr, mask_ptr, K: tl.constexpr, KP: tl.constexpr):
    # one program per tree: slot i walks up its parent links K - 1 times, marking each ancestor in row i
    b = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, KP)
    valid = slots < K
    rows = (b * K + slots) * K
    cur = tl.where(valid, slots, -1)
    depth = tl.zeros((KP,), dtype=tl.int64)
    for j in tl.static_range(K):  # clear the rows first: a replay reuses the buffer
        tl.store(mask_ptr + rows + j, tl.zeros((KP,), dtype=tl.uint8), mask=valid)
    tl.debug_barrier()
    for _ in tl.static_range(K):
        alive = cur >= 0
        tl.store(mask_ptr + rows + cur, tl.full((KP,), 1, tl.uint8), mask=alive)
        up = tl.load(parents_ptr + b * K + tl.maximum(cur, 0), mask=alive, other=-1)
        depth += (up >= 0).to(tl.int64)
        cur = up
    prefix = tl.load(prefix_ptr + b).to(tl.int64)
    tl.store(pos_ptr + b * K + slots, prefix + depth, mask=valid)


def tree_kernel_launch(
    parents: torch.Tensor, prefix: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
) -> None:
    b, k = parents.shape
    if b:
        _tree_kernel[(b,)](parents, prefix, positions, mask, K=k, KP=triton.next_power_of_2(k), num_warps=1)
