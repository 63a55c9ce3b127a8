"""Split-KV MLA decode in Triton: absorbed attention straight over the latent pool (docs/deepseek.md).

``mla_decode(q, latent, req_to_token, req_pool_indices, seq_lens, kv_lora_rank, scale, num_splits)``:

* ``q [B, H, R + P]``: absorbed queries (``[q_nope @ W_UK | q_pe]``); ``latent [slots, 1, R + P]`` one
  layer's buffer of ``MLAKVPool``; request ``b``'s positions ``0..seq_lens[b]-1`` live at slots
  ``req_to_token[req_pool_indices[b], :]``.
* Stage 1, grid ``(B, ceil(H / BLOCK_H), num_splits)``: each program takes ``BLOCK_H`` heads of one request
  and one contiguous part of its context, loads each latent row ONCE for all those heads, and keeps an online
  softmax: scores ``q_c . c + q_pe . k_pe`` (two MMAs), values ``c`` (the row's first ``R`` columns).  It
  writes its normalised partial output and log-sum-exp.
* Stage 2, grid ``(B, H)``: merges the parts by their log-sum-exp (``_mla_merge_splits``, which the split-KV
  absorbed extend shares).

Returns ``[B, H, R]`` in ``q``'s dtype; the model applies ``W_UV`` after it.  Accumulation is float32.
An FP8 latent pool (``--kv-cache-dtype fp8_e4m3``) is read as ``float(e4m3) * kv_scale``, the layer's scale
a kernel argument (a constant of a captured graph, as the pool fixes it at construction); the extends read it
so too, and the decompressed extend dequantizes the ``c`` rows it gathers before ``kv_b_proj``.
Parts past a short request's length are empty (log-sum-exp ``-inf``) and weigh nothing.

``MLATritonBackend`` (``--attention-backend triton`` for MLA models) runs decode through it, and extends
through the kernels of kvship.engine.attention.mla_triton_extend: prefill / prefix-cached extends decompressed
(``kv_b_proj`` of the request's latent rows as one GEMM, then a causal flash kernel), verify and draft extends
absorbed over the latent pool (tree masks for TARGET_VERIFY); absorbed extends of at most
``SPLIT_EXTEND_MAX_EXT`` new tokens per request split the prefix over several programs (``MLAExtendSplits``).

Splits and CUDA graphs (``MLADecodeSplits``): a decode batch that pads to a CUDA-graph size
(``AttentionContext.cuda_graph_bs``, given also when graphs are off) splits its contexts by
``graph_decode_splits`` of that padded size, the head count and the SM count only -- never by a sequence
length -- so an eager step and a replayed graph of the same batch run the very same kernels, and a graph
captured once holds for every context length.  Larger batches split by their longest context
(``decode_splits``).  Under graphs the partial outputs / log-sum-exps live in scratch allocated once
(``init_cuda_graph_state``) and the kernels read ``req_pool_indices`` / ``seq_lens`` straight from the graph
runner's static buffers: replay refreshes nothing.  Only DECODE is captured through these hooks; the
speculative verify graphs (kvship.decode.spec.graphs) hand ``forward_extend`` the Triton extend metadata
(``TritonExtendMeta``) over their own static buffers.

Splits of the absorbed extend (``MLAExtendSplits``) follow the same rule: ``graph_extend_splits`` of the padded
batch size, the longest extend (tokens per request), the head count and the SM count -- the absorbed kernel's
``(request, row block, head block)`` programs times the splits fill the SMs -- never a context length, each
program finding its chunk from the device-side lengths.  A verify graph (``TritonExtendMeta``: its request count
is the graph size) takes that count and the static scratch ``init_verify_cuda_graph_state`` allocates for the
largest verify graph; an eager verify round of a batch that pads to a graph size takes the same count (its own
scratch, made at the first layer), so eager and replayed rounds run the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from kvship.common.envs import ENV
from kvship.engine.attention.base import AttentionContext
from kvship.engine.attention.mla import Decompress, MLALayerSpec, MLATorchBackend
from kvship.engine.attention.mla_triton_extend import (
    _mla_merge_splits,
    absorbed_programs,
    dot_precision,
    merged_row,
    mla_extend_absorbed,
    mla_extend_decompressed,
    split_scratch_size,
)
from kvship.engine.attention.triton_backend import TritonExtendMeta, extend_meta
from kvship.engine.forward_batch import ForwardBatch, ForwardMode
from kvship.engine.layers.fused_dispatch import use_pdl
from kvship.engine.layers.fused_ops_cuda import pdl_enter

# heads one decode program takes (``mla_decode``'s ``block_h``): the split count counts programs by it
DECODE_BLOCK_H = 16
# the most splits ``graph_decode_splits`` gives
MAX_GRAPH_SPLITS = 16


@triton.jit
def _mla_decode_part(
    Q,
    QPE,
    KV,
    R2T,
    RPI,
    SEQ,
    O_PART,
    LSE_PART,
    stride_qb,
    stride_qh,
    stride_pb,
    stride_ph,
    stride_kv,
    stride_r2t,
    num_heads,
    scale,
    kv_scale,
    R: tl.constexpr,
    P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    seq = tl.load(SEQ + b).to(tl.int32)
    row = tl.load(RPI + b).to(tl.int64)
    per = tl.cdiv(seq, NUM_SPLITS)
    start = s * per
    end = tl.minimum(start + per, seq)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    rmask = offs_r < R
    pmask = offs_p < P
    q_base = Q + b.to(tl.int64) * stride_qb + heads[:, None].to(tl.int64) * stride_qh
    p_base = QPE + b.to(tl.int64) * stride_pb + heads[:, None].to(tl.int64) * stride_ph
    # products in the queries' dtype (bf16 tensor cores on a GPU; float32 stays float32), fp32 accumulators
    q_c = tl.load(q_base + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_p = tl.load(p_base + offs_p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        slot = tl.load(R2T + row * stride_r2t + pos, mask=nmask, other=0).to(tl.int64)
        kv_row = KV + slot[:, None] * stride_kv
        # the stored row (model dtype, or e4m3: exact in the queries' dtype); the layer's dequantization scale
        # (1.0 unless FP8) multiplies the scores and the output instead of every element
        c = tl.load(kv_row + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0).to(q_c.dtype)
        pe = tl.load(kv_row + R + offs_p[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0).to(q_c.dtype)
        qk = tl.dot(q_c, tl.trans(c), input_precision=DOT_PREC) + tl.dot(q_p, tl.trans(pe), input_precision=DOT_PREC)
        qk = tl.where(nmask[None, :], qk * (scale * kv_scale), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PREC)
        m_i = m_new

    has = l_i > 0
    out = acc * kv_scale / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    part = (b.to(tl.int64) * num_heads + heads.to(tl.int64)) * NUM_SPLITS + s
    tl.store(O_PART + part[:, None] * R + offs_r[None, :], out, mask=hmask[:, None] & rmask[None, :])
    tl.store(LSE_PART + part, lse, mask=hmask)


# value rows of W_UV one merge-and-project program takes (``_mla_merge_uv``)
MERGE_UV_BLOCK_V = 16


@triton.jit
def _mla_merge_uv(
    O_PART,
    LSE_PART,
    W,
    OUT,
    num_heads,
    stride_wh,
    stride_wv,
    stride_ob,
    stride_oh,
    R: tl.constexpr,
    V: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Stage 2 with ``W_UV`` after it, one program per (request, head) row ``bh`` and ``BLOCK_V`` value rows: the
    row's parts merged as ``_mla_merge_splits`` merges them and rounded to the output dtype as it stores them,
    then ``W_UV[h] [V, R]``'s rows times that row (float32 sums), stored as ``OUT [B, H, V]``.  The weight rows
    are loaded before the wait on the attention kernel (PDL): they never depend on it."""
    bh = tl.program_id(0).to(tl.int64)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    b = bh // num_heads
    h = bh % num_heads
    v_ok = offs_v < V
    w = tl.load(
        W + h * stride_wh + offs_v[:, None].to(tl.int64) * stride_wv + offs_r[None, :],
        mask=v_ok[:, None] & (offs_r < R)[None, :],
        other=0.0,
    )
    pdl_enter(USE_PDL)
    o = merged_row(O_PART, LSE_PART, bh, R, NUM_SPLITS, BLOCK_R).to(OUT.dtype.element_ty).to(tl.float32)
    y = tl.sum(w.to(tl.float32) * o[None, :], axis=1)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_v, y.to(OUT.dtype.element_ty), mask=v_ok)


def mla_decode(
    q: torch.Tensor,
    latent: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    num_splits: int = 8,
    block_h: int = DECODE_BLOCK_H,
    block_n: int = 64,
    scratch: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    kv_scale: float = 1.0,
    num_warps: int = 4,
    num_stages: int = 2,
    q_pe: Optional[torch.Tensor] = None,
    w_uv: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Absorbed MLA decode (module docstring): ``[B, H, kv_lora_rank]`` in ``q``'s dtype.

    ``w_uv``: the heads' ``W_UV`` as ``[H, V, kv_lora_rank]`` (rows contiguous): the merge kernel applies it
    (``_mla_merge_uv``) and the result is ``[B, H, V]``, the merged rows rounded to ``q``'s dtype first as the
    plain merge stores them, then float32 sums (in another order than a GEMM's).

    ``q_pe``: the rope part of the queries ``[B, H, P]`` as its own tensor; ``q`` is then ``[B, H, R]`` (the
    absorbed ``q_nope``).  Either may be a strided view (rows contiguous): nothing is copied to join them.

    ``kv_scale``: the layer's dequantization scale; an FP8 (``float8_e4m3fn``) latent buffer is read as
    ``float(e4m3) * kv_scale`` (docs/deepseek.md, "FP8 latent cache"), any other as ``float(x) * kv_scale``.

    ``scratch``: preallocated flat float32 buffers for the partial outputs (at least ``B * H * num_splits *
    kv_lora_rank`` values) and log-sum-exps (at least ``B * H * num_splits``), so that a CUDA graph allocates
    no scratch of its own; None: allocated here."""
    bs, num_heads, dim = q.shape
    r = kv_lora_rank
    if q_pe is None:
        q, q_pe = q[..., :r], q[..., r:]
    elif dim != r or q_pe.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"with q_pe given, q must be [B, H, {r}] and q_pe [B, H, rope dims]; got {q.shape}, {q_pe.shape}"
        )
    p = q_pe.shape[-1]
    dim = r + p
    if latent.shape[-1] != dim or p <= 0:
        raise ValueError(f"latent rows of {latent.shape[-1]} values do not match queries of {dim} = {r} + rope dims")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    kv = latent.reshape(latent.shape[0], dim)
    if kv.stride(-1) != 1:
        raise ValueError("the latent buffer's rows must be contiguous")
    parts = bs * num_heads * num_splits
    if scratch is None:
        o_part = torch.empty((bs, num_heads, num_splits, r), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((bs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        o_flat, lse_flat = scratch
        if o_flat.dtype != torch.float32 or lse_flat.dtype != torch.float32:
            raise ValueError("the decode scratch buffers must be float32")
        if o_flat.numel() < parts * r or lse_flat.numel() < parts:
            raise ValueError(
                f"decode scratch of {o_flat.numel()} / {lse_flat.numel()} values is short of {parts * r} / {parts} "
                f"({bs} requests x {num_heads} heads x {num_splits} splits)"
            )
        o_part = o_flat.reshape(-1)[: parts * r].view(bs, num_heads, num_splits, r)
        lse_part = lse_flat.reshape(-1)[:parts].view(bs, num_heads, num_splits)
    if w_uv is not None and (
        w_uv.dim() != 3 or w_uv.shape[0] != num_heads or w_uv.shape[2] != r or w_uv.stride(2) != 1
    ):
        raise ValueError(f"w_uv must be [{num_heads}, V, {r}] with contiguous rows, got {tuple(w_uv.shape)}")
    out = torch.empty((bs, num_heads, r if w_uv is None else w_uv.shape[1]), dtype=q.dtype, device=q.device)
    if bs == 0:
        return out
    block_r, block_p = triton.next_power_of_2(r), max(triton.next_power_of_2(p), 16)
    grid = (bs, triton.cdiv(num_heads, block_h), num_splits)
    _mla_decode_part[grid](
        q,
        q_pe,
        kv,
        req_to_token,
        req_pool_indices,
        seq_lens,
        o_part,
        lse_part,
        q.stride(0),
        q.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv.stride(0),
        req_to_token.stride(0),
        num_heads,
        scale,
        float(kv_scale),
        R=r,
        P=p,
        NUM_SPLITS=num_splits,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_P=block_p,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if w_uv is None:
        _mla_merge_splits[(bs * num_heads,)](o_part, lse_part, out, R=r, NUM_SPLITS=num_splits, BLOCK_R=block_r)
        return out
    v = w_uv.shape[1]
    pdl = use_pdl(q)
    _mla_merge_uv[(bs * num_heads, triton.cdiv(v, MERGE_UV_BLOCK_V))](
        o_part, lse_part, w_uv, out, num_heads, w_uv.stride(0), w_uv.stride(1), out.stride(0), out.stride(1),
        R=r, V=v, NUM_SPLITS=num_splits, BLOCK_R=block_r, BLOCK_V=MERGE_UV_BLOCK_V, USE_PDL=pdl, num_warps=8,
        launch_pdl=pdl,
    )  # fmt: skip
    return out


# context tokens per decode split worth a program of its own: shorter contexts take fewer splits (a split
# shorter than this costs a program and a merge term for little parallel work)
TOKENS_PER_SPLIT = 128


def decode_splits(max_seq_len: int, max_splits: int = 8) -> int:
    """``mla_decode``'s ``num_splits`` for a batch whose longest context is ``max_seq_len``: a power of two,
    one per ``TOKENS_PER_SPLIT`` tokens, at most ``max_splits``."""
    want = triton.cdiv(max(max_seq_len, 1), TOKENS_PER_SPLIT)
    return min(triton.next_power_of_2(want), max_splits)


def graph_decode_splits(bs: int, num_heads: int, num_sms: int) -> int:
    """``mla_decode``'s ``num_splits`` for a batch that pads to the CUDA-graph size ``bs``: enough ``(request,
    head block, split)`` programs for one per SM, rounded up to a power of two, at most ``MAX_GRAPH_SPLITS``.
    No sequence length enters, so a graph captured with it holds for any context; splits past a short context
    are empty (log-sum-exp ``-inf``) and weigh nothing in the merge.  (Not tuned on a GPU yet.)"""
    programs = max(1, bs * triton.cdiv(num_heads, DECODE_BLOCK_H))
    return min(triton.next_power_of_2(triton.cdiv(max(num_sms, 1), programs)), MAX_GRAPH_SPLITS)


# absorbed extends (verify rounds, draft extends, short turns) of at most this many new tokens per request take
# the split-KV absorbed kernel where the split rule gives it more than one split; longer extends have programs
# enough in the single pass (one per 16 (token, head) rows), so they keep it
SPLIT_EXTEND_MAX_EXT = 16


def graph_extend_splits(bs: int, max_ext: int, num_heads: int, num_sms: int) -> int:
    """``mla_extend_absorbed``'s ``num_splits`` for ``bs`` requests (the CUDA-graph size a batch pads to) of at
    most ``max_ext`` new tokens: enough ``(request, row block, head block, split)`` programs for one per SM,
    rounded up to a power of two, at most ``MAX_GRAPH_SPLITS`` -- ``graph_decode_splits``' rule over the absorbed
    kernel's programs (``absorbed_programs``), and 2 where the programs outnumber the SMs by at most 4x: on an
    H200 two splits ran 3.9-4x faster than the single pass there (DeepSeek-V3's 128 heads at batch 8, 4 or 8
    tokens; docs/deepseek.md, "Split count of the absorbed extend"), and the cap keeps the scratch under
    ``8 x SMs`` programs' partials.  No context length enters, so a captured verify graph holds for any; chunks
    past a short context are empty and weigh nothing in the merge."""
    sms = max(num_sms, 1)
    programs = max(1, absorbed_programs(bs, num_heads, max_ext))
    splits = min(triton.next_power_of_2(triton.cdiv(sms, programs)), MAX_GRAPH_SPLITS)
    return 2 if splits == 1 and programs <= 4 * sms else splits


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 8 off CUDA (Triton's interpreter, in tests)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


@dataclass
class MLADecodeMeta:
    """Per-step state of the split-KV decode, shared by every layer of the forward."""

    num_splits: int
    # ``mla_decode``'s scratch (flat float32 partial outputs, log-sum-exps); None: allocated per call
    scratch: Optional[tuple[torch.Tensor, torch.Tensor]] = None


class MLADecodeSplits:
    """The split count of every decode batch and the scratch CUDA graphs capture against (module docstring).

    Invariant: a batch of ``bs <= max(ctx.cuda_graph_bs)`` requests takes ``graph_decode_splits`` of the size it
    pads to, eager or captured, so both run the same kernels; a larger batch (or any batch where no graph size
    exists) takes ``decode_splits`` of its longest context, and is never captured."""

    def __init__(self, ctx: AttentionContext):
        self.num_heads = ctx.num_heads
        # a partial output row holds kv_lora_rank values; the latent row (ctx.head_dim) is never shorter
        self.row_width = ctx.head_dim
        self.num_sms = device_sm_count(ctx.device)
        self.graph_sizes = ctx.cuda_graph_bs
        self.device = ctx.device
        self._scratch: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._scratch_bs = 0

    def padded_bs(self, bs: int) -> int:
        """The CUDA-graph size a batch of ``bs`` pads to (itself where none is captured)."""
        return next((b for b in self.graph_sizes if b >= bs), bs)

    def graph_stable(self, bs: int) -> bool:
        """Whether a batch of ``bs`` pads to a CUDA-graph size (then its splits depend on that size alone)."""
        return bool(self.graph_sizes) and bs <= self.graph_sizes[-1]

    def graph_splits(self, bs: int) -> int:
        return graph_decode_splits(self.padded_bs(bs), self.num_heads, self.num_sms)

    def num_splits(self, bs: int, seq_lens_cpu: Sequence[int]) -> int:
        """The splits of an eager decode step of ``bs`` requests (``seq_lens_cpu`` read only past the graphs)."""
        if self.graph_stable(bs):
            return self.graph_splits(bs)
        return decode_splits(max(seq_lens_cpu, default=1))

    def init_graph_scratch(self, max_bs: int) -> None:
        """Scratch for captures of up to ``max_bs`` requests (each at its own split count), allocated once."""
        parts = max((b * self.graph_splits(b) for b in range(1, max_bs + 1) if self.graph_stable(b)), default=0)
        if parts == 0:
            raise ValueError(f"no CUDA-graph batch size ({self.graph_sizes}) covers a batch of up to {max_bs}")
        rows = parts * self.num_heads
        self._scratch = (
            torch.empty(rows * self.row_width, dtype=torch.float32, device=self.device),
            torch.empty(rows, dtype=torch.float32, device=self.device),
        )
        self._scratch_bs = max_bs

    def graph_meta(self, bs: int) -> MLADecodeMeta:
        """The metadata a decode graph of ``bs`` requests captures (the graph scratch, its split count)."""
        if self._scratch is None:
            raise RuntimeError("init_cuda_graph_state must run before capturing")
        if bs > self._scratch_bs or not self.graph_stable(bs):
            raise ValueError(
                f"a decode graph of {bs} requests is outside the captured sizes {self.graph_sizes} "
                f"(graph state for up to {self._scratch_bs})"
            )
        return MLADecodeMeta(self.graph_splits(bs), self._scratch)


class MLAExtendSplits:
    """The split count of every absorbed extend and the scratch the verify graphs capture against.

    Invariant (as ``MLADecodeSplits``'): an extend of ``bs <= max(ctx.cuda_graph_bs)`` requests with at most
    ``SPLIT_EXTEND_MAX_EXT`` new tokens each takes ``graph_extend_splits`` of the size ``bs`` pads to and its
    longest extend, eager or captured, so an eager verify round and a replayed verify graph of the same batch
    (trees padded to the graphs' size) run the same kernels; a larger batch also caps it by its longest context
    (``decode_splits``: one split per ``TOKENS_PER_SPLIT`` tokens).  One split: the single-pass kernel.
    ``enabled`` False (``KVSHIP_SPLIT_VERIFY=0``): always one."""

    def __init__(self, ctx: AttentionContext, decode: MLADecodeSplits, enabled: bool = True):
        self.decode = decode  # the graph sizes, the padding rule, the SM count
        self.num_heads = ctx.num_heads
        self.row_width = ctx.head_dim  # a partial output row holds kv_lora_rank values, never more
        self.device = ctx.device
        self.enabled = enabled
        self._scratch: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def graph_splits(self, bs: int, max_ext: int) -> int:
        """The splits of ``bs`` requests of at most ``max_ext`` new tokens by the graph rule (no context length)."""
        if not self.enabled or not 1 <= max_ext <= SPLIT_EXTEND_MAX_EXT:
            return 1
        return graph_extend_splits(self.decode.padded_bs(bs), max_ext, self.num_heads, self.decode.num_sms)

    def num_splits(self, bs: int, max_ext: int, seq_lens_cpu: Sequence[int]) -> int:
        """The splits of an eager extend (``seq_lens_cpu`` read only past the graphs)."""
        splits = self.graph_splits(bs, max_ext)
        if splits == 1 or self.decode.graph_stable(bs):
            return splits
        return min(splits, decode_splits(max(seq_lens_cpu, default=1), MAX_GRAPH_SPLITS))

    def init_graph_scratch(self, max_bs: int, tokens_per_request: int) -> None:
        """Static scratch for verify graphs of up to ``max_bs`` requests of ``tokens_per_request`` tokens (each
        size at its own split count), allocated once; none where no such graph splits."""
        need = (0, 0)
        for b in range(1, max_bs + 1):
            padded = self.decode.padded_bs(b)
            splits = self.graph_splits(padded, tokens_per_request)
            if splits > 1:
                size = split_scratch_size(padded * tokens_per_request, self.num_heads, splits, self.row_width)
                need = max(need, size)
        self._scratch = None
        if need[0]:
            self._scratch = (
                torch.empty(need[0], dtype=torch.float32, device=self.device),
                torch.empty(need[1], dtype=torch.float32, device=self.device),
            )

    def graph_scratch(
        self, tokens: int, num_heads: int, splits: int, kv_lora_rank: int
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The static scratch where it holds a forward of ``tokens`` x ``num_heads`` x ``splits``; else None (the
        kernel allocates its own: a graph captured so keeps it in its memory pool)."""
        if self._scratch is None:
            return None
        n_out, n_lse = split_scratch_size(tokens, num_heads, splits, kv_lora_rank)
        if self._scratch[0].numel() < n_out or self._scratch[1].numel() < n_lse:
            return None
        return self._scratch


@dataclass
class MLAExtendMeta:
    """Per-step tensors of the Triton MLA extends (shared by every layer of the forward)."""

    ext: TritonExtendMeta  # prefix / extend lengths, query starts, tree masks
    kv_starts: torch.Tensor  # [bs] int32: where request b's rows start in the packed decompressed K / V
    kv_slots: torch.Tensor  # [sum(seq_lens)] int64: every request's slots, prefix then new (position order)
    # the absorbed kernel's splits (MLAExtendSplits; 1: single pass) and its scratch, made at the first layer
    num_splits: int = 1
    scratch: Optional[tuple[torch.Tensor, torch.Tensor]] = None


def mla_extend_meta(fb: ForwardBatch) -> MLAExtendMeta:
    """``MLAExtendMeta`` for an extend batch (``extend_meta``'s tensors plus the decompression gather)."""
    r2t = fb.req_to_token_pool.req_to_token
    device = r2t.device
    seq = [int(x) for x in fb.seq_lens_cpu]
    starts = [0] * len(seq)
    for i in range(1, len(seq)):
        starts[i] = starts[i - 1] + seq[i - 1]
    owner = torch.repeat_interleave(torch.arange(len(seq)), torch.tensor(seq, dtype=torch.int64))
    pos = torch.arange(int(owner.numel())) - torch.tensor(starts, dtype=torch.int64)[owner]
    rows = fb.req_pool_indices.to(device=device, dtype=torch.int64)[owner.to(device)]
    return MLAExtendMeta(
        ext=extend_meta(fb, device),
        kv_starts=torch.tensor(starts, dtype=torch.int32).to(device),
        kv_slots=r2t[rows, pos.to(device)].to(torch.int64),
    )


class MLATritonBackend(MLATorchBackend):
    """``--attention-backend triton`` for MLA models: decode through ``mla_decode`` (split-KV over the latent
    pool; CUDA graphs of decode: module docstring), extends through ``mla_extend_decompressed`` (prefill,
    prefix-cached extends) and ``mla_extend_absorbed`` (verify with its tree masks, draft extends; split-KV for
    short extends, ``MLAExtendSplits``)."""

    supports_cuda_graph = True
    # decode steps may run ``mla_prep.mla_decode_prep`` (norm, rotary, latent store in one kernel) and hand
    # ``forward_decode_prepped`` the absorbed queries and the rotated ``q_pe`` apart (docs/deepseek.md)
    fused_decode_prep = True

    def __init__(self, ctx: AttentionContext):
        super().__init__(ctx)
        self.splits = MLADecodeSplits(ctx)
        self.extend_splits = MLAExtendSplits(ctx, self.splits, enabled=ENV.SPLIT_VERIFY)
        # this step's metadata (an eager step's, a capture's, or the verify graphs' TritonExtendMeta)
        self.forward_metadata: Optional[object] = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        meta: object
        if fb.forward_mode.is_decode():
            # the kernel reads req_to_token and seq_lens itself; the metadata is its number of splits
            meta = MLADecodeMeta(self.splits.num_splits(fb.batch_size, fb.seq_lens_cpu))
        else:
            meta = mla_extend_meta(fb)
            meta.num_splits = self.extend_splits.num_splits(fb.batch_size, meta.ext.max_extend_len, fb.seq_lens_cpu)
        self.forward_metadata = meta
        fb.attn_metadata = meta

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        fb = forward_batch
        self._store(fb, layer, k, save_kv_cache)
        qv = q.view(-1, layer.num_heads, layer.latent_dim)
        return self.forward_decode_prepped(qv[..., : layer.kv_lora_rank], qv[..., layer.kv_lora_rank :], layer, fb)

    def forward_decode_prepped(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        layer: MLALayerSpec,
        forward_batch: ForwardBatch,
        w_uv: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Decode after ``mla_decode_prep`` stored the new latent rows: ``q_lat [B, H, R]`` and ``q_pe [B, H, P]``
        (strided views, rows contiguous) -> ``[B, H, R]``; with ``w_uv [H, V, R]`` the merge applies it:
        ``[B, H, V]`` (``mla_decode``)."""
        fb = forward_batch
        meta: MLADecodeMeta = self.forward_metadata  # type: ignore[assignment]
        return mla_decode(
            q_lat,
            fb.kv_pool.get_latent_buffer(layer.layer_id),
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            layer.kv_lora_rank,
            layer.scaling,
            num_splits=meta.num_splits,
            scratch=meta.scratch,
            kv_scale=fb.kv_pool.latent_scale(layer.layer_id),
            q_pe=q_pe,
            w_uv=w_uv,
        )

    def forward_extend(self, q, k, v, layer: MLALayerSpec, forward_batch: ForwardBatch, save_kv_cache=True):
        """Absorbed: ``q [T, H, latent_dim]`` -> ``[T, H, kv_lora_rank]`` (causal, or the verify tree masks);
        split-KV where ``MLAExtendSplits`` gives more than one split."""
        fb = forward_batch
        meta = self.forward_metadata
        buf = self._store(fb, layer, k, save_kv_cache)
        qv = q.view(-1, layer.num_heads, layer.latent_dim).contiguous()
        scratch: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        if isinstance(meta, TritonExtendMeta):
            # the verify graphs' metadata over their static buffers: splits by the graph size (its request count)
            # and the static scratch of init_verify_cuda_graph_state
            e = meta
            splits = self.extend_splits.graph_splits(int(e.prefix_lens.shape[0]), e.max_extend_len)
            if splits > 1:
                scratch = self.extend_splits.graph_scratch(qv.shape[0], layer.num_heads, splits, layer.kv_lora_rank)
        else:
            e = meta.ext  # type: ignore[union-attr]
            splits = meta.num_splits  # type: ignore[union-attr]
            if splits > 1:
                if meta.scratch is None:  # type: ignore[union-attr]
                    n_out, n_lse = split_scratch_size(qv.shape[0], layer.num_heads, splits, layer.kv_lora_rank)
                    meta.scratch = (  # type: ignore[union-attr]
                        torch.empty(n_out, dtype=torch.float32, device=qv.device),
                        torch.empty(n_lse, dtype=torch.float32, device=qv.device),
                    )
                scratch = meta.scratch  # type: ignore[union-attr]
        return mla_extend_absorbed(
            qv,
            buf,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            e.prefix_lens,
            e.extend_lens,
            e.extend_starts,
            e.max_extend_len,
            layer.kv_lora_rank,
            layer.scaling,
            tree_mask=e.custom_mask,
            mask_starts=e.mask_starts,
            kv_scale=fb.kv_pool.latent_scale(layer.layer_id),
            num_splits=splits,
            scratch=scratch,
        )

    def forward_extend_decompressed(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        layer: MLALayerSpec,
        forward_batch: ForwardBatch,
        decompress: Decompress,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Decompressed: ``q [T, H, d_nope + d_rope]`` -> ``[T, H, d_v]``; ``decompress`` (``kv_b_proj``) runs
        once over all the batch's latent rows, the kernel reads ``k_pe`` from the pool."""
        fb = forward_batch
        meta: MLAExtendMeta = self.forward_metadata  # type: ignore[assignment]
        buf = self._store(fb, layer, latent, save_kv_cache)
        r = layer.kv_lora_rank
        # every request's rows (prefix + new) as stored, dequantized over an FP8 pool, before kv_b_proj
        c = fb.kv_pool.read_latent(layer.layer_id, meta.kv_slots, q.dtype)[:, 0, :r]
        k_nope, v = decompress(c)
        e = meta.ext
        return mla_extend_decompressed(
            q.contiguous(),
            k_nope,
            v,
            buf,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            e.prefix_lens,
            e.extend_lens,
            e.extend_starts,
            meta.kv_starts,
            e.max_extend_len,
            r,
            layer.scaling,
            kv_scale=fb.kv_pool.latent_scale(layer.layer_id),
        )

    # --- CUDA graphs (decode; the speculative verify graphs bring their own metadata) ---------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.splits.init_graph_scratch(max_bs)

    def init_verify_cuda_graph_state(self, max_bs: int, tokens_per_request: int) -> None:
        """The split-KV absorbed kernel's static scratch for verify graphs of up to ``max_bs`` requests of
        ``tokens_per_request`` tokens (kvship.decode.spec.graphs calls it before capturing)."""
        self.extend_splits.init_graph_scratch(max_bs, tokens_per_request)

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode,
    ) -> None:
        if not forward_mode.is_decode():
            raise ValueError(f"the triton MLA backend captures decode graphs only, not {forward_mode.name}")
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
        # The captured kernels read req_pool_indices / seq_lens from the runner's static buffers and the split
        # count depends on bs alone: nothing to refresh (no live sequence length is read on the host).
        if not forward_mode.is_decode():
            raise ValueError(f"the triton MLA backend replays decode graphs only, not {forward_mode.name}")
