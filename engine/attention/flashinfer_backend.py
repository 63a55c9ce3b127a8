"""The ``flashinfer`` attention backend (paged KV, any page size).

The KV pool's per-layer buffers ``[slots, Hkv, D]`` are viewed as FlashInfer's
NHD paged cache ``[slots / page_size, page_size, Hkv, D]``.  Page lists are
built on the GPU from ``req_to_token`` by a Triton kernel
(``triton_ops.kv_indices``); index pointers and last-page lengths come from
the host-side lengths the ForwardBatch already carries, so planning needs no
device-to-host sync.

Per step (``init_forward_metadata``), planned once and reused by every layer:
* decode of a batch whose graph size is in ``TRITON_DECODE_BS``: our Triton
  split-KV kernel and its merge kernel (``triton_ops.decode_attention``; nothing
  to plan: it reads ``req_to_token`` / ``seq_lens`` on the GPU);
* other decode batches: ``BatchDecodeWithPagedKVCacheWrapper`` over each
  request's pages (tensor-core kernels when ``num_heads / num_kv_heads >= 4``,
  except for graph sizes in ``CUDA_CORE_DECODE_BS``; planned without KV split
  for graph sizes in ``NO_SPLIT_DECODE_BS``);
* extend without any cached prefix: ``BatchPrefillWithRaggedKVCacheWrapper``
  over the new tokens (causal);
* extend with a cached prefix: the ragged pass over the new tokens plus
  ``BatchPrefillWithPagedKVCacheWrapper`` over the prefix pages (non-causal),
  joined by their log-sum-exp (``triton_ops.merge_state``);
* extend over an FP8 pool (``--kv-cache-dtype fp8_e4m3``): one causal
  ``BatchPrefillWithPagedKVCacheWrapper`` pass over every page of the
  request (prefix and the new tokens, stored first), so every read sees the
  stored FP8 values.  FP8 decode and prefill pass the layer's ``k_scale`` /
  ``v_scale`` to ``run`` (FlashInfer folds them into the softmax scale and
  the output; docs/quantization.md, "FP8 KV cache").

Head dims: FlashInfer's kernels take ``backend_choice.FLASHINFER_HEAD_DIMS`` only; the constructor refuses
any other before it touches a kernel (``--attention-backend auto`` never picks this backend for one).

Invariant: every kernel choice depends on the CUDA-graph size a batch pads to
(``AttentionContext.cuda_graph_bs``), never on its context lengths, so an
eager step and a replayed graph of the same requests run the same kernels.

All wrappers share one float workspace buffer per device.  CUDA graphs: one
decode wrapper per captured batch size, all pointing at shared fixed index
buffers; replay rebuilds the page list in place and re-plans on the host.

Knobs (read once, in the constructor, through ``ENV``; unset = the constant
here): ``FLASHINFER_TRITON_DECODE_BS``, ``FLASHINFER_CUDA_CORE_DECODE_BS``,
``FLASHINFER_NO_SPLIT_BS``, each a range ``"lo-hi"`` (or ``"n"``) of batch
sizes, or ``"none"``.  Why the defaults are what they are: docs/benchmarks.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import flashinfer
import torch

from kvship.common.envs import ENV
from kvship.engine.attention.backend_choice import flashinfer_head_dim_error, flashinfer_head_dim_ok
from kvship.engine.attention.base import (
    AttentionBackend,
    AttentionContext,
    AttentionLayerSpec,
    register_attention_backend,
)
from kvship.engine.attention.triton_backend import (
    DecodeSplits,
    TritonDecodeMeta,
    TritonExtendMeta,
    extend_meta,
    run_extend,
    run_triton_decode,
    store_new_kv,
    triton_decode_quant,
)
from kvship.engine.attention.triton_ops.kv_indices import build_kv_indices
from kvship.engine.attention.triton_ops.kv_store import store_kv
from kvship.engine.attention.triton_ops.merge_state import merge_state
from kvship.engine.forward_batch import ForwardBatch, ForwardMode
from kvship.engine.mem.pools import is_fp8_kv

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 256 * 1024 * 1024
# Batch-size ranges ("lo-hi", "n", or "none"), by CUDA-graph size (the size a batch pads to):
# decode on FlashInfer's CUDA-core kernel even for GQA models (ENV.FLASHINFER_CUDA_CORE_DECODE_BS)
CUDA_CORE_DECODE_BS = "2-16"
# decode planned without splitting a request's KV across thread blocks (FlashInfer's disable_split_kv: no
# merge kernel, less parallelism for long contexts; ENV.FLASHINFER_NO_SPLIT_BS)
NO_SPLIT_DECODE_BS = "none"
# decode on our Triton split-KV kernel and its merge kernel (no host plan) instead of FlashInfer's decode + merge
# kernels (ENV.FLASHINFER_TRITON_DECODE_BS).  The merge runs as a second kernel: under PDL it launches while the
# splits finish, and two kernels measured 1.05-2.0x faster than the merge folded into the split kernel at 1-8
# requests (docs/benchmarks.md, session 31)
TRITON_DECODE_BS = "1-8"


def _bs_range(knob: Optional[str], default: str) -> tuple[int, int]:
    """``(lo, hi)`` of a batch-size range knob (``default`` where unset); ``lo > hi`` for none."""
    spec = (default if knob is None else knob).strip()
    if spec.lower() in ("", "none"):
        return (1, 0)  # empty range
    try:
        lo, _, hi = spec.partition("-")
        return (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"KVSHIP_FLASHINFER_*_BS ranges look like '2-16', '4' or 'none', not {spec!r}") from None


_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def workspace_buffer(device: torch.device) -> torch.Tensor:
    """The float workspace shared by every FlashInfer wrapper on ``device`` (zeroed once)."""
    buf = _WORKSPACES.get(device)
    if buf is None:
        buf = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _WORKSPACES[device] = buf
    return buf


def paged_layout(lens: list[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Host ``(indptr [n+1] int32, last_page_len [n] int32, total_pages)`` for token counts ``lens``.

    A request with no tokens has no pages and ``last_page_len`` 0 (FlashInfer
    then sees a KV length of 0).
    """
    pages = [(n + page_size - 1) // page_size for n in lens]
    indptr = [0] * (len(lens) + 1)
    for i, p in enumerate(pages):
        indptr[i + 1] = indptr[i] + p
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages)]
    return torch.tensor(indptr, dtype=torch.int32), torch.tensor(last, dtype=torch.int32), indptr[-1]


@dataclass
class FlashInferDecodeMeta:
    wrapper: "flashinfer.BatchDecodeWithPagedKVCacheWrapper"


@dataclass
class FlashInferExtendMeta:
    has_prefix: bool
    prefix_token_mask: Optional[torch.Tensor] = None  # [T] int8: 1 where the token's request has a prefix
    paged_only: bool = False  # FP8 pool: one causal paged pass over prefix + new tokens


@register_attention_backend("flashinfer")
class FlashInferAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, ctx: AttentionContext):
        if not flashinfer_head_dim_ok(ctx.head_dim):  # first: nothing below may touch a kernel for it
            raise ValueError(flashinfer_head_dim_error(ctx.head_dim))
        self.device = ctx.device
        if self.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        self.num_heads = ctx.num_heads
        self.num_kv_heads = ctx.num_kv_heads
        self.head_dim = ctx.head_dim
        self.sm_scale = self.head_dim**-0.5
        self.q_dtype = ctx.dtype
        if self.q_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"the flashinfer attention backend runs bfloat16/float16 models, not {self.q_dtype}; "
                "use --dtype bfloat16 or another attention backend"
            )
        self.kv_dtype = ctx.kv_dtype
        self.kv_fp8 = is_fp8_kv(ctx.kv_dtype)
        self.page_size = ctx.page_size
        self.use_tensor_cores = ctx.gqa_group >= 4
        self.cuda_core_decode_bs = _bs_range(ENV.FLASHINFER_CUDA_CORE_DECODE_BS, CUDA_CORE_DECODE_BS)
        self.no_split_decode_bs = _bs_range(ENV.FLASHINFER_NO_SPLIT_BS, NO_SPLIT_DECODE_BS)
        self.triton_decode_bs = _bs_range(ENV.FLASHINFER_TRITON_DECODE_BS, TRITON_DECODE_BS)
        self.triton_splits = DecodeSplits(ctx)
        self.workspace = workspace_buffer(self.device)
        # eager decode: one wrapper per kernel kind (tensor cores or not), made on first use
        self._decode_wrappers: dict[bool, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        self.ragged_wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.paged_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.req_to_token_pool = ctx.req_to_token_pool
        self.forward_metadata: Optional[object] = None
        # CUDA-graph state
        self._cg_indptr: Optional[torch.Tensor] = None
        self._cg_last: Optional[torch.Tensor] = None
        self._cg_indices: Optional[torch.Tensor] = None
        self._cg_wrappers: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}

    def triton_decode_for(self, bs: int) -> bool:
        """Whether decode batches of ``bs`` requests (the graph size for a replay) run the Triton kernel."""
        lo, hi = self.triton_decode_bs
        return lo <= bs <= hi

    def tensor_cores_for(self, bs: int) -> bool:
        """Whether decode batches of ``bs`` requests run FlashInfer's tensor-core kernel."""
        lo, hi = self.cuda_core_decode_bs
        return self.use_tensor_cores and not lo <= bs <= hi

    def _decode_wrapper(self, bs: int) -> flashinfer.BatchDecodeWithPagedKVCacheWrapper:
        tc = self.tensor_cores_for(bs)
        w = self._decode_wrappers.get(tc)
        if w is None:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tc, backend="fa2")
            self._decode_wrappers[tc] = w
        return w

    # --- planning ----------------------------------------------------------
    def _plan_decode(
        self,
        wrapper,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: list[int],
        indices_out: Optional[torch.Tensor],
    ) -> None:
        indptr, last, total = paged_layout(seq_lens_cpu, self.page_size)
        # pinned: a copy from pageable memory may wait for the stream, i.e. for the step still running on the
        # GPU, which would stall the overlap scheduler's launch of the next step
        indptr, last = indptr.pin_memory(), last.pin_memory()
        indptr_dev = indptr.to(self.device, non_blocking=True)
        if indices_out is None:
            indices_out = torch.empty(max(total, 1), dtype=torch.int32, device=self.device)
        elif total > indices_out.numel():
            raise ValueError(f"decode batch needs {total} KV pages; the CUDA-graph buffer holds {indices_out.numel()}")
        build_kv_indices(req_to_token, req_pool_indices, seq_lens, indptr_dev, indices_out, self.page_size)
        lo, hi = self.no_split_decode_bs
        # the choice depends on the (graph) batch size only, so a replay and an eager step plan the same kernel
        wrapper.plan(
            indptr,
            indices_out[:total],
            last,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            q_data_type=self.q_dtype,
            kv_data_type=self.kv_dtype,
            sm_scale=self.sm_scale,
            disable_split_kv=lo <= len(seq_lens_cpu) <= hi,
        )

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        meta: object
        # the kernel choice follows the graph size a batch pads to: an eager step and a replay compute alike
        if fb.forward_mode.is_decode() and self.triton_decode_for(self.triton_splits.padded_bs(fb.batch_size)):
            meta = self.triton_splits.eager_meta(fb.batch_size)
        elif fb.forward_mode.is_decode():
            wrapper = self._decode_wrapper(fb.batch_size)
            self._plan_decode(
                wrapper,
                fb.req_to_token_pool.req_to_token,
                fb.req_pool_indices,
                fb.seq_lens,
                list(fb.seq_lens_cpu),
                None,
            )
            meta = FlashInferDecodeMeta(wrapper)
        elif fb.tree_masks is not None:  # TARGET_VERIFY: draft trees run on our Triton extend with their masks
            meta = extend_meta(fb, self.device)
        else:
            meta = self._plan_extend(fb)
        self.forward_metadata = meta
        fb.attn_metadata = meta

    def _plan_extend(self, fb: ForwardBatch) -> FlashInferExtendMeta:
        ext = (
            list(fb.extend_seq_lens_cpu)
            if fb.extend_seq_lens_cpu is not None
            else [int(x) for x in fb.extend_seq_lens.tolist()]
        )  # type: ignore[union-attr]
        pre = (
            list(fb.extend_prefix_lens_cpu)
            if fb.extend_prefix_lens_cpu is not None
            else [s - e for s, e in zip(fb.seq_lens_cpu, ext)]
        )
        qo_indptr = [0] * (len(ext) + 1)
        for i, e in enumerate(ext):
            qo_indptr[i + 1] = qo_indptr[i] + e
        qo = torch.tensor(qo_indptr, dtype=torch.int32)
        if self.kv_fp8:
            self._plan_paged(fb, qo, [p + e for p, e in zip(pre, ext)], causal=True)
            return FlashInferExtendMeta(False, paged_only=True)
        self.ragged_wrapper.plan(
            qo,
            qo,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            causal=True,
            sm_scale=self.sm_scale,
            q_data_type=self.q_dtype,
            kv_data_type=self.q_dtype,
        )
        has_prefix = any(p > 0 for p in pre)
        if has_prefix:
            self._plan_paged(fb, qo, pre, causal=False)
            # rows of requests without a prefix have no paged keys: the merge ignores their paged output
            mask = torch.repeat_interleave(
                torch.tensor([p > 0 for p in pre], dtype=torch.int8), torch.tensor(ext, dtype=torch.int64)
            )
            return FlashInferExtendMeta(True, mask.to(self.device, non_blocking=True))
        return FlashInferExtendMeta(False)

    def _plan_paged(self, fb: ForwardBatch, qo: torch.Tensor, kv_lens: list[int], causal: bool) -> None:
        """Plan the paged prefill wrapper: the new tokens (``qo`` indptr) over the first ``kv_lens[i]`` positions
        of each request (causal: the last new token sees them all, FlashInfer aligns the mask bottom-right)."""
        indptr, last, total = paged_layout(kv_lens, self.page_size)
        indptr_dev = indptr.to(self.device, non_blocking=True)
        indices = torch.empty(max(total, 1), dtype=torch.int32, device=self.device)
        lens_dev = torch.tensor(kv_lens, dtype=torch.int32).to(self.device, non_blocking=True)
        build_kv_indices(
            fb.req_to_token_pool.req_to_token, fb.req_pool_indices, lens_dev, indptr_dev, indices, self.page_size
        )
        self.paged_wrapper.plan(
            qo,
            indptr,
            indices[:total],
            last,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            causal=causal,
            sm_scale=self.sm_scale,
            q_data_type=self.q_dtype,
            kv_data_type=self.kv_dtype,
        )

    def _kv_scales(self, fb: ForwardBatch, layer_id: int) -> dict:
        """``run``'s k_scale / v_scale keywords for an FP8 pool (none otherwise: the calls stay as they were)."""
        if not self.kv_fp8:
            return {}
        ks, vs = fb.kv_pool.scales(layer_id)
        return {"k_scale": ks, "v_scale": vs}

    # --- compute -----------------------------------------------------------
    def _paged_cache(self, fb: ForwardBatch, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = fb.kv_pool.get_key_buffer(layer_id)
        v = fb.kv_pool.get_value_buffer(layer_id)
        ps = self.page_size
        return (k.view(-1, ps, k.shape[-2], k.shape[-1]), v.view(-1, ps, v.shape[-2], v.shape[-1]))

    def _check_layer(self, layer: AttentionLayerSpec) -> None:
        if abs(layer.scaling - self.sm_scale) > 1e-12 * max(1.0, self.sm_scale):
            raise ValueError(
                f"layer {layer.layer_id} uses attention scaling {layer.scaling}, the flashinfer "
                f"backend planned with {self.sm_scale}"
            )

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
        meta: FlashInferExtendMeta = self.forward_metadata  # type: ignore[assignment]
        self._check_layer(layer)
        k, v = store_new_kv(fb, layer, k, v, save_kv_cache)
        h, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        qh = q.view(-1, h, d)
        kh = k.view(-1, hk, d)
        vh = v.view(-1, hk, d)
        if isinstance(meta, TritonExtendMeta):
            return run_extend(meta, q, k, v, layer, fb)
        if meta.paged_only:
            cache = self._paged_cache(fb, layer.layer_id)
            return self.paged_wrapper.run(qh, cache, **self._kv_scales(fb, layer.layer_id)).view(-1, h * d)
        if not meta.has_prefix:
            return self.ragged_wrapper.run(qh, kh, vh).view(-1, h * d)
        o_new, lse_new = self.ragged_wrapper.run(qh, kh, vh, return_lse=True, lse_base="ln")
        o_pre, lse_pre = self.paged_wrapper.run(
            qh, self._paged_cache(fb, layer.layer_id), return_lse=True, lse_base="ln"
        )
        out = torch.empty_like(qh)
        merge_state(o_new, lse_new, o_pre, lse_pre, out, meta.prefix_token_mask)
        return out.view(-1, h * d)

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
        meta: FlashInferDecodeMeta = self.forward_metadata  # type: ignore[assignment]
        self._check_layer(layer)
        if save_kv_cache:
            store_kv(fb.kv_pool, layer.layer_id, fb.out_cache_loc, k, v)
        h, d = layer.num_heads, layer.head_dim
        if isinstance(meta, TritonDecodeMeta):
            return run_triton_decode(q, layer, fb, meta)  # type: ignore[return-value]
        cache = self._paged_cache(fb, layer.layer_id)
        out = meta.wrapper.run(q.view(-1, h, d), cache, **self._kv_scales(fb, layer.layer_id))
        return out.view(-1, h * d)

    def forward_decode_quant(self, q, k, v, layer, forward_batch, save_kv_cache, group):
        """Where this step decodes with the Triton split-KV kernel (small batches): its merge stores o_proj's
        FP8 input (``triton_decode_quant``); FlashInfer's own decode returns rows (None here)."""
        meta = self.forward_metadata
        if not isinstance(meta, TritonDecodeMeta):
            return None
        self._check_layer(layer)
        return triton_decode_quant(meta, q, k, v, layer, forward_batch, save_kv_cache, group)

    # --- CUDA graphs -------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed index buffers for graphs of up to ``max_bs`` requests of any length the pool allows."""
        max_context_len = self.req_to_token_pool.max_context_len
        max_pages = (max_context_len + self.page_size - 1) // self.page_size
        self._cg_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._cg_last = torch.zeros(max_bs, dtype=torch.int32, device=self.device)
        self._cg_indices = torch.zeros(max_bs * max_pages, dtype=torch.int32, device=self.device)
        # page lists are built here, then plan() copies them into the wrappers' fixed buffer
        self._cg_indices_scratch = torch.zeros_like(self._cg_indices)
        lo, hi = self.triton_decode_bs
        if lo <= hi and lo <= max_bs:
            self.triton_splits.init_graph_scratch(min(max_bs, hi))

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
    ) -> None:
        if not forward_mode.is_decode():
            raise ValueError(f"the flashinfer backend captures decode graphs only, not {forward_mode.name}")
        if self._cg_indices is None or self._cg_indptr is None or self._cg_last is None:
            raise RuntimeError("init_cuda_graph_state must run before capturing")
        if self.triton_decode_for(bs):
            # reads req_pool_indices / seq_lens from the graph runner's static buffers: no replay refresh
            self.forward_metadata = self.triton_splits.graph_meta(bs)
            return
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.tensor_cores_for(bs),
            paged_kv_indptr_buffer=self._cg_indptr[: bs + 1],
            paged_kv_indices_buffer=self._cg_indices,
            paged_kv_last_page_len_buffer=self._cg_last[:bs],
            backend="fa2",
        )
        self._cg_wrappers[bs] = wrapper
        seq_cpu = [int(x) for x in seq_lens[:bs].tolist()]
        r2t = self.req_to_token_pool.req_to_token
        self._plan_decode(wrapper, r2t, req_pool_indices[:bs], seq_lens[:bs], seq_cpu, self._cg_indices_scratch)
        self.forward_metadata = FlashInferDecodeMeta(wrapper)

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        forward_mode: ForwardMode,
        seq_lens_cpu: Optional[torch.Tensor] = None,
    ) -> None:
        if not forward_mode.is_decode():
            raise ValueError(f"the flashinfer backend replays decode graphs only, not {forward_mode.name}")
        if self.triton_decode_for(bs):
            self.forward_metadata = self.triton_splits.graph_meta(bs)
            return
        wrapper = self._cg_wrappers.get(bs)
        if wrapper is None:
            raise ValueError(f"no CUDA graph was captured for batch size {bs}")
        if seq_lens_cpu is None:
            raise ValueError("the flashinfer backend needs seq_lens_cpu to re-plan a replayed graph")
        seq_cpu = [int(x) for x in seq_lens_cpu[:bs].tolist()]
        r2t = self.req_to_token_pool.req_to_token
        self._plan_decode(wrapper, r2t, req_pool_indices[:bs], seq_lens[:bs], seq_cpu, self._cg_indices_scratch)
        self.forward_metadata = FlashInferDecodeMeta(wrapper)
