"""The ``triton`` attention backend: Triton kernels over the KV pools.

The fallback where FlashInfer is absent, and the reference the FlashInfer
backend is measured against.  Keys and values are always read through
``req_to_token``, so any page size works (pages are the allocator's business).

Per step (``init_forward_metadata``, shared by all layers):
* decode: the number of KV splits (a function of the batch size -- of the
  CUDA-graph size it would pad to, graphs on or off, so eager and replayed
  steps compute identically; see ``triton_ops.decode_attention``) and the split
  scratch buffers;
* extend: per-request prefix / extend lengths and packed offsets on the
  device, and the longest extend (host int, sizes the grid).

FP8 KV (``--kv-cache-dtype fp8_e4m3``): the store quantizes with the layer's
scales, the kernels read ``e4m3 * scale``; an extend's own new tokens are read
as stored (FP8), so every read sees what the pool holds.

CUDA graphs: the scratch buffers are allocated once for the largest captured
batch; the kernels read ``req_pool_indices`` / ``seq_lens`` straight from the
graph runner's static input buffers, so replay needs no metadata refresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvship.common.envs import ENV
from kvship.engine.attention.base import (
    AttentionBackend,
    AttentionContext,
    AttentionLayerSpec,
    register_attention_backend,
)
from kvship.engine.attention.triton_ops.decode_attention import (
    ACT_GROUP_SIZE,
    MAX_KV_SPLITS,
    decode_attention,
    decode_attention_quant,
    num_kv_splits,
)
from kvship.engine.attention.triton_ops.extend_attention import extend_attention
from kvship.engine.attention.triton_ops.kv_store import quantize_new_kv, store_kv
from kvship.engine.attention.triton_ops.verify_attention import (
    SPLIT_VERIFY_MAX_TOKENS,
    VERIFY_KV_SPLITS,
    verify_attention,
)
from kvship.engine.forward_batch import ForwardBatch, ForwardMode
from kvship.engine.layers.quantization.base import QuantizedInput


@dataclass
class TritonDecodeMeta:
    num_splits: int
    mid_out: torch.Tensor  # [bs, H, MAX_KV_SPLITS, D] float32
    mid_lse: torch.Tensor  # [bs, H, MAX_KV_SPLITS] float32


def quant_decode_takes(q: torch.Tensor, layer: AttentionLayerSpec, group: int) -> bool:
    """Whether the decode merge can store this layer's output quantized per ``group`` columns (one group a head
    of 128, on CUDA)."""
    return group == ACT_GROUP_SIZE and layer.head_dim == group and q.is_cuda


def run_triton_decode(
    q: torch.Tensor, layer: AttentionLayerSpec, fb: ForwardBatch, meta: TritonDecodeMeta, group: int = 0
) -> torch.Tensor | QuantizedInput:
    """The split-KV decode of ``q`` over this layer's pool (the new keys and values stored already): rows
    ``[T, H * D]`` in ``q``'s dtype; with ``group`` (``quant_decode_takes`` checked), o_proj's ``QuantizedInput``
    from the merge kernel (``decode_attention_quant``)."""
    h, d = layer.num_heads, layer.head_dim
    qh = q.view(-1, h, d)
    pool = fb.kv_pool
    args = (
        pool.get_key_buffer(layer.layer_id),
        pool.get_value_buffer(layer.layer_id),
    )
    rest = (
        fb.req_to_token_pool.req_to_token,
        fb.req_pool_indices,
        fb.seq_lens,
        meta.mid_out,
        meta.mid_lse,
        meta.num_splits,
        layer.scaling,
    )
    scales = dict(k_scale=pool.k_scales[layer.layer_id], v_scale=pool.v_scales[layer.layer_id])
    if group:
        return QuantizedInput(*decode_attention_quant(qh, *args, *rest, **scales), q.dtype)
    out = torch.empty_like(qh)
    decode_attention(qh, *args, out, *rest, **scales)
    return out.view(-1, h * d)


def triton_decode_quant(
    meta: TritonDecodeMeta, q, k, v, layer: AttentionLayerSpec, fb: ForwardBatch, save_kv_cache: bool, group: int
) -> Optional[QuantizedInput]:
    """``AttentionBackend.forward_decode_quant`` of a backend whose decode runs ``run_triton_decode`` with
    ``meta``: the new keys and values stored, then the quantized output; None (nothing run) where it is not
    taken."""
    if not quant_decode_takes(q, layer, group):
        return None
    if save_kv_cache:
        store_kv(fb.kv_pool, layer.layer_id, fb.out_cache_loc, k, v)
    return run_triton_decode(q, layer, fb, meta, group)  # type: ignore[return-value]


class DecodeSplits:
    """Split counts and scratch buffers of the Triton split-KV decode kernel, for any backend that runs it.

    Splits follow the CUDA-graph size a batch pads to (graphs on or off), so an eager step and a replayed
    graph of the same batch run the very same kernels: identical results.
    """

    def __init__(self, ctx: AttentionContext):
        self.num_kv_heads, self.num_heads, self.head_dim = ctx.num_kv_heads, ctx.num_heads, ctx.head_dim
        self.device = ctx.device
        self.num_sms = _device_sm_count(self.device)
        self.graph_sizes = ctx.cuda_graph_bs
        self._cg: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def padded_bs(self, bs: int) -> int:
        """The CUDA-graph size a batch of ``bs`` pads to (itself where none is captured)."""
        return next((b for b in self.graph_sizes if b >= bs), bs)

    def num_splits(self, bs: int) -> int:
        return num_kv_splits(self.padded_bs(bs), self.num_kv_heads, self.num_sms)

    def scratch(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        mid_out = torch.empty(
            (bs, self.num_heads, MAX_KV_SPLITS, self.head_dim), dtype=torch.float32, device=self.device
        )
        mid_lse = torch.empty((bs, self.num_heads, MAX_KV_SPLITS), dtype=torch.float32, device=self.device)
        return mid_out, mid_lse

    def eager_meta(self, bs: int) -> TritonDecodeMeta:
        mid_out, mid_lse = self.scratch(bs)
        return TritonDecodeMeta(self.num_splits(bs), mid_out, mid_lse)

    def init_graph_scratch(self, max_bs: int) -> None:
        self._cg = self.scratch(max_bs)

    def graph_meta(self, bs: int) -> TritonDecodeMeta:
        if self._cg is None:
            raise RuntimeError("init_cuda_graph_state must run before capturing")
        return TritonDecodeMeta(self.num_splits(bs), self._cg[0][:bs], self._cg[1][:bs])


@dataclass
class TritonExtendMeta:
    prefix_lens: torch.Tensor  # [bs] int32
    extend_lens: torch.Tensor  # [bs] int32
    extend_starts: torch.Tensor  # [bs] int32
    max_extend_len: int
    custom_mask: Optional[torch.Tensor] = None  # TARGET_VERIFY: tree masks, uint8, flattened and packed
    mask_starts: Optional[torch.Tensor] = None  # [bs] int64 offsets into custom_mask
    split: Optional["SplitVerify"] = None  # TARGET_VERIFY with few draft tokens: the split-KV path


@dataclass
class SplitVerify:
    """Per draft token (``[n]`` each), what ``verify_attention`` reads; the scratch is made at the first layer
    (under a CUDA graph: during capture, so it is the graph's) and serves every layer of the forward."""

    rows: torch.Tensor  # int64: the request's req_to_token row
    prefix: torch.Tensor  # int32: the request's prefix length
    local: torch.Tensor  # int32: index in its tree
    size: torch.Tensor  # int32: its tree's size
    mask_row: torch.Tensor  # int64: where its row of custom_mask starts
    max_tree: int
    mid_out: Optional[torch.Tensor] = None
    mid_lse: Optional[torch.Tensor] = None


def extend_meta(fb: ForwardBatch, device: torch.device) -> TritonExtendMeta:
    """The Triton extend kernel's per-step tensors for ``fb`` (tree masks included)."""
    ext = (
        list(fb.extend_seq_lens_cpu)
        if fb.extend_seq_lens_cpu is not None
        else [int(x) for x in fb.extend_seq_lens.tolist()]  # type: ignore[union-attr]
    )
    pre = (
        list(fb.extend_prefix_lens_cpu)
        if fb.extend_prefix_lens_cpu is not None
        else [s - e for s, e in zip(fb.seq_lens_cpu, ext)]
    )
    starts = [0] * len(ext)
    for i in range(1, len(ext)):
        starts[i] = starts[i - 1] + ext[i - 1]
    host = torch.tensor([pre, ext, starts], dtype=torch.int32)
    dev = host.to(device, non_blocking=True)
    meta = TritonExtendMeta(dev[0], dev[1], dev[2], max(ext) if ext else 0)
    if fb.tree_masks is not None:
        flat = torch.cat([m.reshape(-1).to(torch.uint8) for m in fb.tree_masks])
        offs, acc = [], 0
        for e in ext:
            offs.append(acc)
            acc += e * e
        meta.custom_mask = flat.to(device, non_blocking=True)
        meta.mask_starts = torch.tensor(offs, dtype=torch.int64).to(device, non_blocking=True)
        n = sum(ext)
        if 0 < n <= SPLIT_VERIFY_MAX_TOKENS and device.type == "cuda" and ENV.SPLIT_VERIFY:
            ext_t = torch.tensor(ext)
            owner = torch.repeat_interleave(torch.arange(len(ext)), ext_t)
            local = torch.arange(n) - torch.tensor(starts)[owner]
            size = ext_t[owner]
            host = torch.stack([torch.tensor(pre)[owner], local, size]).to(torch.int32)
            mask_row = torch.tensor(offs, dtype=torch.int64)[owner] + local * size
            dev_i32 = host.to(device, non_blocking=True)
            rows = fb.req_pool_indices.to(torch.int64)[owner.to(device, non_blocking=True)]
            meta.split = SplitVerify(
                rows,
                dev_i32[0],
                dev_i32[1],
                dev_i32[2],
                mask_row.to(device, non_blocking=True),
                max(ext),
            )
    return meta


def run_extend(
    meta: TritonExtendMeta,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: AttentionLayerSpec,
    fb: ForwardBatch,
) -> torch.Tensor:
    """Our Triton extend kernel over ``meta`` (tree masks included); K/V of the new tokens are already stored
    (on an FP8 pool ``k`` / ``v`` are the stored float8 rows: ``store_new_kv``)."""
    h, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    qh = q.view(-1, h, d)
    out = torch.empty_like(qh)
    ks, vs = fb.kv_pool.scales(layer.layer_id)
    # the new tokens, the output, the layer's pool and the slot table: what both kernels read first
    common = (
        qh,
        k.view(-1, hk, d),
        v.view(-1, hk, d),
        out,
        fb.kv_pool.get_key_buffer(layer.layer_id),
        fb.kv_pool.get_value_buffer(layer.layer_id),
        fb.req_to_token_pool.req_to_token,
    )
    sp = meta.split
    if sp is not None:
        assert meta.custom_mask is not None
        n = qh.shape[0]
        if sp.mid_out is None or sp.mid_out.shape[1:] != (h, VERIFY_KV_SPLITS, d):
            sp.mid_out = torch.empty(n, h, VERIFY_KV_SPLITS, d, dtype=torch.float32, device=q.device)
            sp.mid_lse = torch.empty(n, h, VERIFY_KV_SPLITS, dtype=torch.float32, device=q.device)
        assert sp.mid_lse is not None
        verify_attention(
            *common,
            sp.rows,
            sp.prefix,
            sp.local,
            sp.size,
            sp.mask_row,
            meta.custom_mask,
            sp.mid_out,
            sp.mid_lse,
            sp.max_tree,
            layer.scaling,
            k_scale=ks,
            v_scale=vs,
        )
    else:
        extend_attention(
            *common,
            fb.req_pool_indices,
            meta.prefix_lens,
            meta.extend_lens,
            meta.extend_starts,
            meta.max_extend_len,
            layer.scaling,
            meta.custom_mask,
            meta.mask_starts,
            k_scale=ks,
            v_scale=vs,
        )
    return out.view(-1, h * d)


def store_new_kv(
    fb: ForwardBatch, layer: AttentionLayerSpec, k: torch.Tensor, v: torch.Tensor, save_kv_cache: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store an extend's new K/V (when asked) and return them as the extend kernels read them: as given, or on
    an FP8 pool quantized with the layer's scales (every read sees the stored FP8 values)."""
    if fb.kv_pool.is_fp8:
        return quantize_new_kv(fb.kv_pool, layer.layer_id, fb.out_cache_loc if save_kv_cache else None, k, v)
    if save_kv_cache:
        store_kv(fb.kv_pool, layer.layer_id, fb.out_cache_loc, k, v)
    return k, v


def _device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


@register_attention_backend("triton")
class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, ctx: AttentionContext):
        self.device = ctx.device
        self.splits = DecodeSplits(ctx)
        self.forward_metadata: Optional[object] = None

    # --- metadata ----------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        meta: object
        if fb.forward_mode.is_decode():
            meta = self.splits.eager_meta(fb.batch_size)
        else:
            meta = extend_meta(fb, self.device)
        self.forward_metadata = meta
        fb.attn_metadata = meta

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
        meta: TritonExtendMeta = self.forward_metadata  # type: ignore[assignment]
        k, v = store_new_kv(fb, layer, k, v, save_kv_cache)
        return run_extend(meta, q, k, v, layer, fb)

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
        if save_kv_cache:
            store_kv(fb.kv_pool, layer.layer_id, fb.out_cache_loc, k, v)
        return run_triton_decode(q, layer, fb, self.forward_metadata)  # type: ignore[arg-type, return-value]

    def forward_decode_quant(self, q, k, v, layer, forward_batch, save_kv_cache, group):
        """The merge kernel stores the output as o_proj's FP8 input (``run_triton_decode`` with ``group``)."""
        return triton_decode_quant(self.forward_metadata, q, k, v, layer, forward_batch, save_kv_cache, group)

    # --- CUDA graphs -------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.splits.init_graph_scratch(max_bs)

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
    ) -> None:
        if not forward_mode.is_decode():
            raise ValueError(f"the triton backend captures decode graphs only, not {forward_mode.name}")
        self.forward_metadata = self.splits.graph_meta(bs)

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        forward_mode: ForwardMode,
        seq_lens_cpu: Optional[torch.Tensor] = None,
    ) -> None:
        # The captured kernels read req_pool_indices / seq_lens from the runner's static
        # buffers and the split count depends on bs alone: nothing to refresh.
        if not forward_mode.is_decode():
            raise ValueError(f"the triton backend replays decode graphs only, not {forward_mode.name}")
