"""The model-side attention layer: hands q/k/v to the step's attention backend."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvship.engine.attention.base import AttentionLayerSpec
from kvship.engine.forward_batch import ForwardBatch
from kvship.engine.mem.pools import KVPool


class Attention(nn.Module):
    """Calls ``forward_batch.attn_backend.forward`` with this layer's static spec.

    Model code computes q/k/v (projections, norms, RoPE); where the keys and
    values live and how attention is computed is the backend's business.
    After the backend returns, the layer's K/V are stored: ``forward_batch.layer_done``
    (when set) hears of it.
    """

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.spec = AttentionLayerSpec(
            layer_id=layer_id, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scaling=scaling
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch, save_kv_cache: bool = True
    ) -> torch.Tensor:
        out = forward_batch.attn_backend.forward(q, k, v, self.spec, forward_batch, save_kv_cache)
        if forward_batch.layer_done is not None:
            forward_batch.layer_done(self.spec.layer_id)
        return out

    def rope_and_forward(
        self,
        rotary: nn.Module,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        qk_norm: Optional[tuple[nn.Module, nn.Module]] = None,
        out_group: int = 0,
    ) -> torch.Tensor:
        """RoPE on ``q [T, H, D]`` / ``k [T, Hkv, D]``, then attention with ``v [T, Hkv, D]``; ``qk_norm``
        (Qwen3's per-head ``RMSNorm`` of q and of k) normalises them before the rotation; ``out_group``: the
        output may come as the next projection's ``QuantizedInput`` (``AttentionBackend.forward``).

        On CUDA with the plain KV pool, one kernel normalises (``qk_norm``) and
        rotates q and k and writes the new keys and values into this layer's
        pool buffers (``rotary.rotate_and_store``), and the backend runs with
        ``save_kv_cache=False``; elsewhere the norms, ``rotary(positions, q, k)``,
        then the backend stores them itself.
        """
        s = self.spec
        fb = forward_batch
        pool = fb.kv_pool
        stored = False
        # (an FP8 pool quantizes with its per-layer scales: the backend's store does, not the RoPE kernel)
        if type(pool) is KVPool and not pool.is_fp8 and q.is_cuda and fb.out_cache_loc is not None:
            norm = None
            if qk_norm is not None:
                qn, kn = qk_norm
                norm = (qn.weight, kn.weight, qn.eps) if qn.eps == kn.eps else None
            if qk_norm is None or norm is not None:
                stored = rotary.rotate_and_store(
                    positions,
                    q,
                    k,
                    v,
                    pool.get_key_buffer(s.layer_id),
                    pool.get_value_buffer(s.layer_id),
                    fb.out_cache_loc,
                    norm,
                )
        if not stored:
            if qk_norm is not None:
                q, k = qk_norm[0](q), qk_norm[1](k)
            q, k = rotary(positions, q, k)
        qf = q.reshape(-1, s.num_heads * s.head_dim)
        kf = k.reshape(-1, s.num_kv_heads * s.head_dim)
        # decode reads keys and values from the pool only: no need to copy a strided v
        vf = (
            v.reshape(-1, s.num_kv_heads * s.head_dim)
            if stored and fb.forward_mode.is_decode()
            else v.reshape(-1, s.num_kv_heads * s.head_dim).contiguous()
        )
        out = fb.attn_backend.forward(qf, kf, vf, s, fb, not stored, out_group)
        if fb.layer_done is not None:
            fb.layer_done(s.layer_id)
        return out

    def extra_repr(self) -> str:
        s = self.spec
        return f"layer={s.layer_id}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}"
