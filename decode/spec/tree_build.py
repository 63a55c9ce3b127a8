"""A verify forward's tree arrays from the trees' parent slots, on the device.

For ``B`` trees of ``K`` slots each (slot 0 the root; ``parents [B, K]``
int32, ``parents[:, 0] == -1``, every other slot's parent an earlier slot) and
the tokens already cached per tree (``prefix [B]``), ``build_tree_arrays``
writes

* ``positions [B * K]`` int64: ``prefix + depth`` of each slot;
* ``mask [B * K * K]`` uint8: ``mask[b, i, j] = 1`` when slot ``j`` is slot
  ``i`` or one of its ancestors (the tree part of the verify attention mask;
  every slot also sees the cached prefix).

These are ``DraftTree.positions`` and ``DraftTree.mask`` (``tree.py``), the
host versions, which stay the reference (``build_tree_arrays_reference``).
On CUDA one Triton program per tree computes them (``_tree_kernel``: a
slot's ancestors by ``K - 1`` vectorised steps up the parent links), inside
the verify CUDA graph: a replay copies only the parents.  The verifier's walk
(first child / next sibling, ``tree.py``) runs on the host with the accepted
path, so it is not built here.
"""

from __future__ import annotations

import torch


def build_tree_arrays_reference(parents: torch.Tensor, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [B * K] int64, mask [B * K * K] uint8)`` in torch ops (CPU, and the kernel's reference)."""
    b, k = parents.shape
    par = parents.long()
    cur = torch.arange(k, device=parents.device).expand(b, k).clone()  # each slot's walk position
    mask = torch.zeros((b, k, k), dtype=torch.uint8, device=parents.device)
    depth = torch.zeros((b, k), dtype=torch.int64, device=parents.device)
    rows = torch.arange(b, device=parents.device)[:, None].expand(b, k)
    cols = torch.arange(k, device=parents.device).expand(b, k)
    for _ in range(k):
        alive = cur >= 0
        mask[rows[alive], cols[alive], cur[alive]] = 1
        up = torch.where(alive, par.gather(1, cur.clamp(min=0)), torch.full_like(cur, -1))
        depth += (up >= 0).long()
        cur = up
    positions = prefix.long()[:, None] + depth
    return positions.reshape(-1), mask.reshape(-1)


def build_tree_arrays(parents: torch.Tensor, prefix: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> None:
    """Write ``positions`` / ``mask`` (flat, at least ``B * K`` / ``B * K * K``) for ``parents [B, K]``
    (contiguous int32) and ``prefix [B]`` (int32): the Triton kernel on CUDA, torch ops elsewhere."""
    b, k = parents.shape
    if not parents.is_cuda:
        pos, m = build_tree_arrays_reference(parents, prefix)
        positions[: b * k].copy_(pos)
        mask[: b * k * k].copy_(m)
        return
    from kvship.decode.spec.tree_build_cuda import tree_kernel_launch

    tree_kernel_launch(parents, prefix, positions, mask)
