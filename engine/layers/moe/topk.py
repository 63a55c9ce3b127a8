"""Expert selection: router logits -> (weights, expert ids) per token.

``select_experts(router_logits, top_k, renormalize)``: softmax over the
experts (in float32), the ``top_k`` largest probabilities, divided by their
sum when ``renormalize`` (Mixtral always; Qwen-MoE when ``norm_topk_prob``).
Returns float32 weights ``[M, top_k]`` and int32 ids ``[M, top_k]``; no host
synchronisation, so it runs inside a CUDA graph.  On CUDA one Triton kernel
does it all (``moe.topk_triton.route``).

``count_routed(counts, ids, rows_slots)``: the expert-load counter update
(``FusedMoE``, docs/parallel.md "Expert load"), device ops only.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvship.engine.layers.fused_dispatch import cuda_moe_route


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    fused = cuda_moe_route(router_logits)
    if fused is not None and fused.fits(router_logits.shape[-1], top_k):  # one kernel (moe.topk_triton)
        return fused.route(router_logits, top_k, "softmax", renormalize)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def count_routed(counts: torch.Tensor, ids: torch.Tensor, rows_slots: Optional[torch.Tensor] = None) -> None:
    """Add one to ``counts [E]`` (int64) per pick in ``ids [M, k]``; with ``rows_slots`` (a CUDA graph's static
    KV-slot buffer, read at every replay) rows writing slot 0 are padding and add nothing."""
    flat = ids.reshape(-1).long()
    if rows_slots is None:  # eager forwards have no padding rows
        add = torch.ones_like(flat)
    else:
        real = (rows_slots[: ids.shape[0]] != 0).long()
        add = real.unsqueeze(1).expand(-1, ids.shape[1]).reshape(-1)
    counts.scatter_add_(0, flat, add)
