"""Expert selection: router logits -> (weights, expert ids) per token.

``select_experts(router_logits, top_k, renormalize)``: softmax over the
experts (in float32), the ``top_k`` largest probabilities, divided by their
sum when ``renormalize`` (Mixtral always; Qwen-MoE when ``norm_topk_prob``).
Returns float32 weights ``[M, top_k]`` and int32 ids ``[M, top_k]``; no host
synchronisation, so it runs inside a CUDA graph.
"""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
