"""Multi-head Latent Attention over the latent KV pool (DeepSeek; docs/deepseek.md).

The pool (``kvship.engine.mem.mla_pool.MLAKVPool``) holds per token and layer
one latent row ``[c (kv_lora_rank) | k_pe (qk_rope_head_dim)]``.  With
``W_UK [H, d_nope, r]`` and ``W_UV [H, d_v, r]`` the two halves of
``kv_b_proj``, head ``h`` of a token's key is ``[W_UK[h] c | k_pe]`` and its
value ``W_UV[h] c``.  Two exact ways to attend:

* **decompressed** (``forward_extend_decompressed``; prefill and extend):
  ``kv_b_proj`` turns every latent row of the request (cached prefix + new)
  into per-head keys ``[S, H, d_nope + d_rope]`` and values ``[S, H, d_v]``;
  causal attention with queries ``[T, H, d_nope + d_rope]`` gives ``[T, H, d_v]``.
* **absorbed** (``forward_decode``, ``forward_extend``; decode, verify):
  the model folds ``W_UK`` into the query (``q_lat[h] = q_nope[h] @ W_UK[h]``)
  and passes ``q = [q_lat | q_pe]`` ``[N, H, latent_dim]``; attention runs as
  MQA with ONE key head (the latent row) and one value head (its first
  ``kv_lora_rank`` columns), straight over the pool, and returns
  ``[N, H, kv_lora_rank]``; the model applies ``W_UV`` after it.

Contract of an MLA backend (besides ``AttentionBackend``'s per-step metadata
rules): ``k`` is the new tokens' latent rows ``[N, latent_dim]`` (``v`` is
unused: the values live in the latent); with ``save_kv_cache`` the backend
stores them at ``out_cache_loc`` before reading; every read goes through
``req_to_token``; outputs are in ``q``'s dtype.  Over an FP8 latent pool
(``kv_pool.is_fp8``) the store quantizes with the layer's scale and every read
computes with ``float(e4m3) * scale`` -- the new tokens' own rows included,
read back from the pool, so an extend sees what later decode steps see (the
base contract; docs/deepseek.md, "FP8 latent cache").  The reference
dequantizes into ``q``'s dtype (``MLAKVPool.read_latent``).

``MLATorchBackend`` (``torch_native``) is the reference, on CPU and GPU: the
torch_native backend's per-step metadata (slot lists, causal / tree masks),
attention by ``scaled_dot_product_attention``.  No CUDA graphs (its metadata
is built from host lengths every step): decode runs eagerly.
``triton`` (kvship.engine.attention.mla_triton) decodes with a split-KV
Triton kernel over the latent pool, captured in CUDA graphs (its split count
depends on the graph size a batch pads to, never on a sequence length), and
extends / verifies with the Triton kernels of
kvship.engine.attention.mla_triton_extend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from kvship.engine.attention.torch_native import TorchNativeAttnBackend
from kvship.engine.forward_batch import ForwardBatch

# c [S, kv_lora_rank] -> (k_nope [S, H, d_nope], v [S, H, d_v]): the layer's kv_b_proj
Decompress = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class MLALayerSpec:
    """Static shape of one MLA layer, given to the backend on every call."""

    layer_id: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scaling: float

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


class MLATorchBackend(TorchNativeAttnBackend):
    """The MLA reference (module docstring); metadata as ``TorchNativeAttnBackend`` builds it."""

    supports_cuda_graph = False

    @staticmethod
    def _store(fb: ForwardBatch, layer: MLALayerSpec, latent: torch.Tensor, save: bool) -> torch.Tensor:
        """Store the new latent rows (when asked; over an FP8 pool quantized); the layer's buffer as stored."""
        if save:
            fb.kv_pool.set_latent(layer.layer_id, fb.out_cache_loc, latent)
        return fb.kv_pool.get_latent_buffer(layer.layer_id)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: Optional[torch.Tensor],
        layer: MLALayerSpec,  # type: ignore[override]
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Absorbed: ``q [B, H, latent_dim]`` over each request's latent rows -> ``[B, H, kv_lora_rank]``."""
        fb = forward_batch
        meta = fb.attn_metadata  # the torch_native decode metadata: padded slots + key mask
        self._store(fb, layer, k, save_kv_cache)
        bs, max_len = meta.slots.shape
        lat = fb.kv_pool.read_latent(layer.layer_id, meta.slots.reshape(-1), q.dtype)
        lat = lat.view(bs, 1, max_len, layer.latent_dim)
        qs = q.view(bs, layer.num_heads, 1, layer.latent_dim)
        out = F.scaled_dot_product_attention(
            qs, lat, lat[..., : layer.kv_lora_rank], attn_mask=meta.mask, scale=layer.scaling, enable_gqa=True
        )
        return out.view(bs, layer.num_heads, layer.kv_lora_rank)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: Optional[torch.Tensor],
        layer: MLALayerSpec,  # type: ignore[override]
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Absorbed, for new tokens packed per request: ``q [T, H, latent_dim]`` -> ``[T, H, kv_lora_rank]``
        (causal over prefix + new tokens, or the TARGET_VERIFY tree masks)."""
        fb = forward_batch
        meta = fb.attn_metadata  # the torch_native extend metadata: per-request slots + masks
        self._store(fb, layer, k, save_kv_cache)
        r = layer.kv_lora_rank
        out = q.new_empty((q.shape[0], layer.num_heads, r))
        for start, e, slots, mask in zip(meta.starts, meta.ext_lens, meta.slots, meta.masks):
            if e == 0:
                continue
            qi = q[start : start + e].view(e, layer.num_heads, -1).transpose(0, 1).unsqueeze(0)  # [1, H, e, D]
            lat = fb.kv_pool.read_latent(layer.layer_id, slots, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, 1, s, D]
            oi = F.scaled_dot_product_attention(
                qi, lat, lat[..., :r], attn_mask=mask, is_causal=mask is None, scale=layer.scaling, enable_gqa=True
            )
            out[start : start + e] = oi[0].transpose(0, 1)
        return out

    def forward_extend_decompressed(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        layer: MLALayerSpec,
        forward_batch: ForwardBatch,
        decompress: Decompress,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Decompressed: ``q [T, H, d_nope + d_rope]``, new latent rows ``[T, latent_dim]`` -> ``[T, H, d_v]``;
        each request's latent rows (prefix + new) go through ``decompress`` (the layer's ``kv_b_proj``)."""
        fb = forward_batch
        meta = fb.attn_metadata  # the torch_native extend metadata: per-request slots + masks
        self._store(fb, layer, latent, save_kv_cache)
        r, h = layer.kv_lora_rank, layer.num_heads
        out = q.new_empty((q.shape[0], h, layer.v_head_dim))
        for start, e, slots, mask in zip(meta.starts, meta.ext_lens, meta.slots, meta.masks):
            if e == 0:
                continue
            lat = fb.kv_pool.read_latent(layer.layer_id, slots, q.dtype)[:, 0]  # [s, latent_dim]
            k_nope, v = decompress(lat[:, :r])
            k_pe = lat[:, None, r:].expand(-1, h, -1)
            key = torch.cat([k_nope, k_pe], dim=-1)  # [s, H, d_nope + d_rope]
            qi = q[start : start + e].transpose(0, 1).unsqueeze(0)  # [1, H, e, D]
            oi = F.scaled_dot_product_attention(
                qi,
                key.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=layer.scaling,
            )
            out[start : start + e] = oi[0].transpose(0, 1)
        return out
