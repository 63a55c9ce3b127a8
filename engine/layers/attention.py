"""The model-side attention layer: hands q/k/v to the step's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from kvship.engine.attention.base import AttentionLayerSpec
from kvship.engine.forward_batch import ForwardBatch


class Attention(nn.Module):
    """Calls ``forward_batch.attn_backend.forward`` with this layer's static spec.

    Model code computes q/k/v (projections, norms, RoPE); where the keys and
    values live and how attention is computed is the backend's business.
    """

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.spec = AttentionLayerSpec(layer_id=layer_id, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                       head_dim=head_dim, scaling=scaling)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch,
                save_kv_cache: bool = True) -> torch.Tensor:
        return forward_batch.attn_backend.forward(q, k, v, self.spec, forward_batch, save_kv_cache)

    def extra_repr(self) -> str:
        s = self.spec
        return f"layer={s.layer_id}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}"
