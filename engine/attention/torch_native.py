"""Reference attention backend in plain PyTorch (CPU and GPU).

Keys and values are always read back from the KV pool through
``req_to_token``, so what this backend computes is exactly what the pool
holds: a wrong slot mapping shows up as wrong logits.  Over an FP8 pool the
attention runs in fp32 on ``float(e4m3) * scale`` (q converted up, the output
cast back to the model dtype): the reference the FP8 paths of the GPU
backends are tested against (every read, the new tokens' own K/V included,
sees the FP8-rounded values).  Page size does not
matter here (slots come from ``req_to_token``; pages are the allocator's
business).

Per step (``init_forward_metadata``, shared by all layers):
* extend: for each request, its slot indices ``[seq_len]`` and, when it has a
  cached prefix, a causal mask ``[extend_len, seq_len]`` offset by the prefix;
  a TARGET_VERIFY batch uses its ``tree_masks`` instead of causality among the
  new tokens.
  Attention runs one ``scaled_dot_product_attention`` per request.
* decode: one padded gather index ``[bs, max_len]`` and a key mask
  ``[bs, 1, 1, max_len]``; all requests run in one batched SDPA call.
GQA uses SDPA's ``enable_gqa`` (no K/V repetition).

CUDA graphs are not supported (per-request Python loops and data-dependent
shapes); the graph hooks raise a RuntimeError that says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from kvship.engine.attention.base import (
    AttentionBackend,
    AttentionContext,
    AttentionLayerSpec,
    register_attention_backend,
)
from kvship.engine.forward_batch import ForwardBatch, ForwardMode
from kvship.engine.mem.pools import dequantize_kv


def _store_and_get_kv(
    fb: ForwardBatch, layer: AttentionLayerSpec, k: torch.Tensor, v: torch.Tensor, save_kv_cache: bool
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Write the new tokens' K/V at ``out_cache_loc`` (when asked); the layer's K and V buffers and scales."""
    if save_kv_cache:
        fb.kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
    ks, vs = fb.kv_pool.scales(layer.layer_id)
    return fb.kv_pool.get_key_buffer(layer.layer_id), fb.kv_pool.get_value_buffer(layer.layer_id), ks, vs


def _compute_dtype(fb: ForwardBatch, q: torch.Tensor) -> torch.dtype:
    """The model dtype, or float32 over an FP8 pool: the reference reads ``e4m3 * scale`` unrounded."""
    return torch.float32 if fb.kv_pool.is_fp8 else q.dtype


@dataclass
class _ExtendMeta:
    starts: list[int]  # offset of each request in the packed new tokens
    ext_lens: list[int]
    slots: list[torch.Tensor]  # [seq_len] int64 per request
    masks: list[Optional[torch.Tensor]]  # [ext_len, seq_len] bool (True = attend) or None (plain causal)


@dataclass
class _DecodeMeta:
    slots: torch.Tensor  # [bs, max_len] int64 (padding rows point at slot 0)
    mask: torch.Tensor  # [bs, 1, 1, max_len] bool


@register_attention_backend("torch_native")
class TorchNativeAttnBackend(AttentionBackend):
    supports_cuda_graph = False

    def __init__(self, ctx: AttentionContext):
        pass  # everything it needs comes with each ForwardBatch

    # --- metadata ----------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        r2t = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode():
            fb.attn_metadata = self._decode_meta(r2t, fb)
        else:
            fb.attn_metadata = self._extend_meta(r2t, fb)

    @staticmethod
    def _decode_meta(r2t: torch.Tensor, fb: ForwardBatch) -> _DecodeMeta:
        max_len = max(fb.seq_lens_cpu)
        rows = r2t.index_select(0, fb.req_pool_indices.to(r2t.device))[:, :max_len].to(torch.int64)
        ar = torch.arange(max_len, device=rows.device)
        mask = ar[None, :] < fb.seq_lens.to(rows.device)[:, None]
        rows = torch.where(mask, rows, torch.zeros_like(rows))
        return _DecodeMeta(slots=rows, mask=mask[:, None, None, :])

    @staticmethod
    def _extend_meta(r2t: torch.Tensor, fb: ForwardBatch) -> _ExtendMeta:
        if fb.extend_seq_lens_cpu is not None:
            ext_lens = list(fb.extend_seq_lens_cpu)
        else:
            ext_lens = [int(x) for x in fb.extend_seq_lens.tolist()]  # type: ignore[union-attr]
        if fb.extend_prefix_lens_cpu is not None:
            prefix_lens = list(fb.extend_prefix_lens_cpu)
        else:
            prefix_lens = [s - e for s, e in zip(fb.seq_lens_cpu, ext_lens)]
        req_idx = fb.req_pool_indices.tolist()
        starts, slots, masks = [], [], []
        off = 0
        for i, (e, p) in enumerate(zip(ext_lens, prefix_lens)):
            s = p + e
            if s != fb.seq_lens_cpu[i]:
                raise ValueError(f"request {i}: prefix {p} + extend {e} != seq_len {fb.seq_lens_cpu[i]}")
            starts.append(off)
            off += e
            slots.append(r2t[req_idx[i], :s].to(torch.int64))
            if fb.tree_masks is not None:  # TARGET_VERIFY: the whole prefix, then the draft tree's own mask
                tree = fb.tree_masks[i].to(r2t.device)
                masks.append(torch.cat([torch.ones((e, p), dtype=torch.bool, device=r2t.device), tree], dim=1))
            elif p == 0 or e == 0:
                masks.append(None)
            else:
                q_pos = torch.arange(p, s, device=r2t.device)
                k_pos = torch.arange(s, device=r2t.device)
                masks.append(k_pos[None, :] <= q_pos[:, None])
        return _ExtendMeta(starts=starts, ext_lens=ext_lens, slots=slots, masks=masks)

    # --- compute -----------------------------------------------------------
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        fb = forward_batch
        meta: _ExtendMeta = fb.attn_metadata
        k_buf, v_buf, ks, vs = _store_and_get_kv(fb, layer, k, v, save_kv_cache)
        h, d = layer.num_heads, layer.head_dim
        cdt = _compute_dtype(fb, q)
        qh = q.view(-1, h, d).to(cdt)
        out = torch.empty_like(qh)
        for start, e, slots, mask in zip(meta.starts, meta.ext_lens, meta.slots, meta.masks):
            if e == 0:
                continue
            qi = qh[start : start + e].transpose(0, 1).unsqueeze(0)  # [1, h, e, d]
            ki = dequantize_kv(k_buf.index_select(0, slots), ks, cdt).transpose(0, 1).unsqueeze(0)  # [1, kvh, s, d]
            vi = dequantize_kv(v_buf.index_select(0, slots), vs, cdt).transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=layer.scaling, enable_gqa=True
            )
            out[start : start + e] = oi[0].transpose(0, 1)
        return out.view(-1, h * d).to(q.dtype)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        fb = forward_batch
        meta: _DecodeMeta = fb.attn_metadata
        k_buf, v_buf, k_scale, v_scale = _store_and_get_kv(fb, layer, k, v, save_kv_cache)
        h, d = layer.num_heads, layer.head_dim
        bs, max_len = meta.slots.shape
        flat = meta.slots.reshape(-1)
        shape = (bs, max_len, layer.num_kv_heads, d)
        cdt = _compute_dtype(fb, q)
        ks = dequantize_kv(k_buf.index_select(0, flat), k_scale, cdt).view(shape).transpose(1, 2)
        vs = dequantize_kv(v_buf.index_select(0, flat), v_scale, cdt).view(shape).transpose(1, 2)
        qs = q.view(bs, h, 1, d).to(cdt)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.mask, scale=layer.scaling, enable_gqa=True)
        return out.reshape(bs, h * d).to(q.dtype)

    # --- CUDA graphs: not supported by this backend ----------------------------
    def _no_graphs(self) -> RuntimeError:
        return RuntimeError(
            "the torch_native attention backend does not support CUDA graphs "
            "(supports_cuda_graph = False); run with --disable-cuda-graph or pick "
            "--attention-backend flashinfer/triton"
        )

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise self._no_graphs()

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
    ) -> None:
        raise self._no_graphs()

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        forward_mode: ForwardMode,
        seq_lens_cpu: Optional[torch.Tensor] = None,
    ) -> None:
        raise self._no_graphs()
