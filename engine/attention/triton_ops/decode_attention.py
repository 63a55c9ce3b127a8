"""Split-KV decode attention in Triton (one new token per request).

Stage 1, grid ``(bs, num_kv_heads, num_splits)``: every program takes the
query heads that share one KV head (padded to a tensor-core tile of at least
16 rows) and one contiguous split of the request's context, reads the keys and
values through ``req_to_token`` and writes an un-normalised partial output
with its log-sum-exp.  Stage 2, grid ``(bs, num_heads)``: merges the splits.

The number of splits is a function of the batch size alone
(:func:`num_kv_splits`), so a CUDA graph captured for ``bs`` stays valid for
any context length: each split simply covers ``ceil(seq_len / num_splits)``
positions.  ``mid_out`` / ``mid_lse`` are scratch buffers sized for the most
splits; under graphs they are allocated once.

Two kernels, not one: folding the merge into stage 1 (the last program of a
request's KV head merging that head's splits behind an atomic counter) measured
1.05-2.0x slower at 1-8 requests on an H200 than stage 2 launched under PDL while
stage 1's programs finish (docs/benchmarks.md, session 31), and was removed.
``merge_splits`` serves the tree verify kernel (``verify_attention``), which
merges a row's prefix splits before its draft tokens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvship.engine.layers.fused_dispatch import use_pdl
from kvship.engine.layers.fused_ops_cuda import pdl_enter
from kvship.engine.layers.quantization.fp8_kernels import _scale_of, _to_e4m3

# the activation group a quantized decode output takes (one head of 128 columns: block-128 FP8 checkpoints)
ACT_GROUP_SIZE = 128

MAX_KV_SPLITS = 16
# stage 1's register cap on an FP8 pool at head dim 128 (``stage1_tile``; H200, docs/benchmarks.md, session 34)
REG_CAP_FP8 = 168


def num_kv_splits(bs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits so that ``bs * num_kv_heads * splits`` programs cover the GPU about six times, rounded down to a
    power of two (1..MAX_KV_SPLITS).  Measured on an H200 (bench/kv_fp8.py --sweep): at 32 requests x 8 KV
    heads two splits ran 1.15-1.25x slower than four or eight; at 8 requests eight was the fastest."""
    work = max(1, bs * num_kv_heads)
    want = max(1, min(MAX_KV_SPLITS, (6 * num_sms + work - 1) // work))
    return 1 << (want.bit_length() - 1)


# splits a merge loads at once: one round trip to L2 per MERGE_CHUNK splits instead of one per split
MERGE_CHUNK = 4


@triton.jit
def merge_splits(
    mid_out,
    mid_lse,
    b,
    heads,
    h_mask,
    offs_d,
    hd_mask,
    num_splits,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr = MERGE_CHUNK,
):
    """Row ``b``'s split partials of ``heads`` as (max, sum of weights, weighted sum of outputs): the output is
    ``acc / l``; more keys merge in as online softmax does. Reads past L1 (``.cg``): other programs wrote them.
    ``CHUNK`` splits a step, loaded as one ``[heads, CHUNK, dim]`` tile: at batch 1 the merge is a chain of
    dependent L2 round trips, so fewer, wider steps shorten it."""
    m_all = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_all = tl.zeros([BLOCK_H], tl.float32)
    acc_all = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offs_c = tl.arange(0, CHUNK)
    for s0 in range(0, num_splits, CHUNK):
        sp = s0 + offs_c
        hs_mask = h_mask[:, None] & (sp < num_splits)[None, :]
        lse_s = tl.load(
            mid_lse + b * stride_lb + heads[:, None] * stride_lh + sp[None, :],
            mask=hs_mask,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        o_s = tl.load(
            mid_out + b * stride_mb + heads[:, None, None] * stride_mh + sp[None, :, None] * stride_ms
            + offs_d[None, None, :],
            mask=hs_mask[:, :, None] & hd_mask[:, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # fmt: skip
        m_new = tl.maximum(m_all, tl.max(lse_s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_all - m_ref)
        w = tl.exp(lse_s - m_ref[:, None])
        l_all = l_all * alpha + tl.sum(w, 1)
        acc_all = acc_all * alpha[:, None] + tl.sum(o_s * w[:, :, None], 1)
        m_all = m_new
    return m_all, l_all, acc_all


@triton.jit
def _e4m3_byte_to_f16(byte):
    """One e4m3 value (the low byte of an int32) as fp16, exactly, with integer operations: its sign, exponent
    and mantissa bits placed in fp16's fields give the value times 2^-8 (the exponent biases are 7 and 15),
    subnormals included.  For Triton's interpreter, which has no PTX; e4m3's NaN (0x7F) comes out as 480."""
    bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
    return (bits.to(tl.int16).to(tl.float16, bitcast=True) * 256.0).to(tl.float16)


@triton.jit
def _e4m3_words_to_f16(w, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PTX: tl.constexpr):
    """A ``[BLOCK_N, BLOCK_D // 4]`` tile of int32 words, four e4m3 values each (the first in the low byte), as the
    ``[BLOCK_N, BLOCK_D]`` fp16 tile they hold.  Loaded as words, the tile is converted where it was loaded, then
    reaches the tensor cores through ``ldmatrix`` as a bf16 tile does; loaded as e4m3, the compiler reads it back
    from shared memory about a byte an instruction in the operands' layout (``stage1_tile``'s ``words``).
    ``PTX``: the GPU's pair conversion (compute capability 8.9 and later); else integer operations."""
    if PTX:
        e0, e1, e2, e3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
            "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            "=h,=h,=h,=h,r",
            [w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    else:
        e0 = _e4m3_byte_to_f16(w & 0xFF)
        e1 = _e4m3_byte_to_f16((w >> 8) & 0xFF)
        e2 = _e4m3_byte_to_f16((w >> 16) & 0xFF)
        e3 = _e4m3_byte_to_f16((w >> 24) & 0xFF)
    # [n, w, j, k] holds byte 2j + k of word w, so the flattened last two dims run e0, e1, e2, e3
    return tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (BLOCK_N, BLOCK_D))


@triton.jit
def _decode_stage1(
    q,
    k_buf,
    v_buf,
    req_to_token,
    req_pool_indices,
    seq_lens,
    mid_out,
    mid_lse,
    sm_scale,
    v_scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_r2t,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    num_splits,
    min_split_len,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_F16: tl.constexpr,
    WORDS_K: tl.constexpr,  # FP8 keys read as int32 words (k_buf and its strides in words)
    WORDS_V: tl.constexpr,  # FP8 values read as int32 words (v_buf and its strides in words)
    PTX_CVT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    pdl_enter(USE_PDL)  # q and the new token's K/V come from the kernels before
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM

    seq_len = tl.load(seq_lens + b).to(tl.int32)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    split_len = tl.maximum((seq_len + num_splits - 1) // num_splits, min_split_len)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    qv = tl.load(
        q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_F16:  # an FP8 pool: e4m3 -> fp16 is one conversion per pair of values (stage1_tile)
        qv = qv.to(tl.float16)
    # scores in base 2 (log2(e) folded into their scale), the values' scale applied once at the end: 2-7% faster
    # than exp and a scale a step (H200, docs/benchmarks.md, session 34)
    score_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offs_b = tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_D // 4)
    w_mask = offs_w < HEAD_DIM // 4
    if WORDS_K:
        k_base = k_buf + kvh * stride_kh + offs_w[None, :]
    else:
        k_base = k_buf + kvh * stride_kh + offs_d[None, :]
    if WORDS_V:
        v_base = v_buf + kvh * stride_vh + offs_w[None, :]
    else:
        v_base = v_buf + kvh * stride_vh + offs_d[None, :]
    r2t_row = req_to_token + row * stride_r2t
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_b
        n_mask = offs_n < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        slot = tl.load(r2t_row + offs_n, mask=n_mask, other=0).to(tl.int64)
        if WORDS_K:
            kw = tl.load(k_base + slot[:, None] * stride_kt, mask=n_mask[:, None] & w_mask[None, :], other=0)
            kb = _e4m3_words_to_f16(kw, BLOCK_N, BLOCK_D, PTX_CVT)
        else:
            kb = tl.load(k_base + slot[:, None] * stride_kt, mask=kv_mask, other=0.0)
        s = tl.dot(qv, tl.trans(kb).to(qv.dtype)).to(tl.float32) * score_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        # the values' load stays after the scores: issued before them it measured 1.7x slower on an FP8 pool
        if WORDS_V:
            vw = tl.load(v_base + slot[:, None] * stride_vt, mask=n_mask[:, None] & w_mask[None, :], other=0)
            vb = _e4m3_words_to_f16(vw, BLOCK_N, BLOCK_D, PTX_CVT)
        else:
            vb = tl.load(v_base + slot[:, None] * stride_vt, mask=kv_mask, other=0.0)
        if KV_FP8:  # e4m3 is exact in the model dtype; the scales multiply the scores (k) and the output (v)
            vb = vb.to(qv.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    has = end > start
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc * (v_scale / safe_l)[:, None]
    lse = tl.where(has & (l_i > 0), m_i * 0.6931471805599453 + tl.log(safe_l), float("-inf"))  # natural log
    tl.store(
        mid_out + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :],
        out,
        mask=h_mask[:, None] & d_mask[None, :],
    )
    tl.store(mid_lse + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_stage2(
    mid_out,
    mid_lse,
    o,
    num_splits,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    oq,
    os,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
    QUANT: tl.constexpr = False,
):
    # QUANT: the output row is stored as the next projection's FP8 input instead (``decode_attention_quant``)
    b = tl.program_id(0)
    h = tl.program_id(1)
    pdl_enter(USE_PDL)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    w = tl.where(s_mask, w, 0.0)
    part = tl.load(
        mid_out + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0, denom, 1.0)
    out = tl.sum(part * w[:, None], 0) / denom
    if QUANT:
        # one 128-column group of the o_proj input: the head's row rounded to the model dtype, then quantized as
        # fp8_kernels.quantize_act quantizes a group (its scale from the group's amax; masked columns are 0)
        v = tl.where(d_mask, out.to(o.dtype.element_ty).to(tl.float32), 0.0)
        sc = _scale_of(tl.max(tl.abs(v), 0))
        tl.store(oq + b * stride_ob + h * HEAD_DIM + offs_d, _to_e4m3(v, sc), mask=d_mask)
        tl.store(os + b * tl.num_programs(1) + h, sc)
    else:
        tl.store(o + b * stride_ob + h * stride_oh + offs_d, out.to(o.dtype.element_ty), mask=d_mask)


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    mid_out: torch.Tensor,
    mid_lse: torch.Tensor,
    num_splits: int,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    launch: "dict | None" = None,
) -> torch.Tensor:
    """Decode attention for ``bs`` requests; writes and returns ``o``.

    Shapes: ``q`` / ``o`` ``[bs, H, D]``; ``k_buf`` / ``v_buf`` ``[slots, Hkv, D]``
    (last dim contiguous); ``mid_out`` ``[>=bs, H, >=num_splits, D]`` float32;
    ``mid_lse`` ``[>=bs, H, >=num_splits]`` float32.  Request ``b`` attends to
    positions ``0..seq_lens[b]-1`` whose slots are
    ``req_to_token[req_pool_indices[b], :seq_lens[b]]``.
    An FP8 pool (``float8_e4m3fn`` buffers) is read as ``e4m3 * k_scale`` /
    ``e4m3 * v_scale`` (docs/quantization.md, "FP8 KV cache").  ``launch`` overrides stage 1's tile
    (:func:`stage1_tile`'s keys; bench/kv_fp8.py ``--sweep``).
    """
    bs, num_heads, head_dim = q.shape
    launch_stage1(
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, mid_out, mid_lse, num_splits, sm_scale,
        k_scale=k_scale, v_scale=v_scale, launch=launch,
    )  # fmt: skip
    _launch_stage2(mid_out, mid_lse, num_splits, q, o.stride(0), o.stride(1), o)
    return o


def _launch_stage2(
    mid_out: torch.Tensor,
    mid_lse: torch.Tensor,
    num_splits: int,
    q: torch.Tensor,
    stride_ob: int,
    stride_oh: int,
    o: torch.Tensor,
    oq: "torch.Tensor | None" = None,
    os_: "torch.Tensor | None" = None,
) -> None:
    """The merge of ``q``'s rows' splits into ``o`` (model dtype), or with ``oq`` into e4m3 ``oq`` and its
    per-head scales ``os_`` (``o`` then only gives the dtype the rows are rounded to)."""
    bs, num_heads, head_dim = q.shape
    pdl = use_pdl(q)
    _decode_stage2[(bs, num_heads)](
        mid_out, mid_lse, o, num_splits, mid_out.stride(0), mid_out.stride(1), mid_out.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), stride_ob, stride_oh, o if oq is None else oq, o if os_ is None else os_,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_S=triton.next_power_of_2(MAX_KV_SPLITS),
        num_warps=4, USE_PDL=pdl, QUANT=oq is not None, launch_pdl=pdl,
    )  # fmt: skip


def decode_attention_quant(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    mid_out: torch.Tensor,
    mid_lse: torch.Tensor,
    num_splits: int,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_attention`` whose merge stores the output as the FP8 input of a block-128 projection (o_proj):
    e4m3 ``[bs, H * D]`` and float32 scales ``[bs, H]``, one 128-column group per head (``D`` must be 128),
    bit-equal to ``decode_attention`` followed by ``fp8_kernels.quantize_act(..., ACT_GROUP, 128)``: the
    o_proj's quantization kernel is gone (docs/quantization.md, "GPU kernels")."""
    bs, num_heads, head_dim = q.shape
    if head_dim != ACT_GROUP_SIZE:
        raise ValueError(f"a quantized decode output takes a head dim of {ACT_GROUP_SIZE}, got {head_dim}")
    launch_stage1(
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, mid_out, mid_lse, num_splits, sm_scale,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    oq = torch.empty((bs, num_heads * head_dim), dtype=torch.float8_e4m3fn, device=q.device)
    os_ = torch.empty((bs, num_heads), dtype=torch.float32, device=q.device)
    _launch_stage2(mid_out, mid_lse, num_splits, q, oq.stride(0), head_dim, q, oq, os_)
    return oq, os_


def stage1_tile(block_d: int, kv_fp8: bool, q_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Stage 1's default tile: keys a step (``block_n``), warps, software-pipeline stages and a cap on the
    registers a thread may take (``maxnreg``).  Three stages on a bf16/fp16 pool (measured 1.16x faster than two
    at 32 requests x 8k context on an H200; docs/benchmarks.md, session 21); on an FP8 pool of a bf16 model 128
    keys a step, three stages and ``dot_f16`` (the fastest of the session-25 sweep: 220 us a layer against 265 us
    for the best bf16-product tile), else two stages.

    ``maxnreg`` (an FP8 pool, head dim 128, bf16 queries): left to itself the compiler gave the FP8 tile 200
    registers a thread (the bf16 tile 106), so 2 programs an SM; the kernel then issued an instruction every 2.3
    cycles on each scheduler with half the DRAM bandwidth idle (Nsight Compute).  Capped at 168 (3 programs an
    SM) it took 197 us a layer at 32 x 8k in a CUDA graph instead of 220, and no longer than before at 1 to 8
    requests.
    A cap of 128 on the bf16 tile gained 6% at 32 x 8k but lost 19% at 8 x 2k, so bf16 keeps the compiler's
    choice (None) (docs/benchmarks.md, session 34).

    ``words`` (FP8 pools with ``dot_f16``; ``True``, ``"k"`` or ``"v"``: both tiles, the keys' or the values'):
    the pages are read as int32 words and converted where they are loaded (``_e4m3_words_to_f16``).  Off: timed
    on an H200 it was slower for the values and both (208-215 us a layer at 32 x 8k against 192), 1-2% faster
    for the keys alone at 32 x 8k and 64 x 2k and equal below (docs/benchmarks.md, session 35).

    ``dot_f16`` (FP8 pools of a bf16 model): the queries, keys, values and probabilities enter the tensor-core
    products as fp16, not bf16 (a float32 model keeps float32).  Every e4m3 value is exact in both; e4m3 -> fp16
    is the GPU's one-instruction conversion while e4m3 -> bf16 goes through more, and fp16 keeps more of a
    probability's bits.  A query element beyond fp16's range (65504) would overflow: attention queries are far
    below it.
    docs/quantization.md, "FP8 KV cache"."""
    if not kv_fp8:
        return {"block_n": 32 if block_d >= 256 else 64, "num_warps": 4, "num_stages": 3, "maxnreg": None,
                "words": False}  # fmt: skip
    f16 = q_dtype == torch.bfloat16
    return {"block_n": 32 if block_d >= 256 else (128 if f16 else 64), "num_warps": 4, "num_stages": 3 if f16 else 2,
            "dot_f16": f16, "maxnreg": REG_CAP_FP8 if f16 and block_d == 128 else None, "words": False}  # fmt: skip


def _words_apply(k_buf: torch.Tensor, v_buf: torch.Tensor, tile: dict) -> bool:
    """Whether ``words`` can read this pool: an FP8 pool with fp16 products whose rows are whole words (head dim
    a multiple of 4, contiguous, every stride a multiple of 4 bytes)."""
    return (
        k_buf.dtype == torch.float8_e4m3fn
        and bool(tile.get("dot_f16"))
        and all(t.shape[-1] % 4 == 0 and t.stride(-1) == 1 and all(x % 4 == 0 for x in t.stride()[:-1])
                for t in (k_buf, v_buf))
    )  # fmt: skip


def _ptx_cvt_e4m3(t: torch.Tensor) -> bool:
    """Whether ``_e4m3_words_to_f16``'s PTX runs for tensors like ``t``: CUDA at compute capability 8.9 or later,
    not Triton's interpreter."""
    return (
        t.is_cuda
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and torch.cuda.get_device_capability(t.device) >= (8, 9)
    )


def launch_stage1(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    mid_out: torch.Tensor,
    mid_lse: torch.Tensor,
    num_splits: int,
    sm_scale: float,
    min_split_len: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    launch: "dict | None" = None,
) -> None:
    """Stage 1 over ``q.shape[0]`` rows, into ``mid_out`` / ``mid_lse``. A row's splits cover at
    least ``min_split_len`` positions each (1: ``ceil(seq_len / num_splits)``, the decode layout)."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    kv_fp8 = k_buf.dtype == torch.float8_e4m3fn
    tile = stage1_tile(block_d, kv_fp8, q.dtype)
    unknown = set(launch or {}) - set(tile)
    if unknown:
        raise ValueError(f"decode_attention: unknown launch keys {sorted(unknown)}; known: {sorted(tile)}")
    tile.update(launch or {})
    pdl = use_pdl(q)
    words = tile["words"]
    if words not in (False, True, "k", "v"):
        raise ValueError(f"decode_attention: launch key 'words' takes false, true, 'k' or 'v', not {words!r}")
    words = bool(words) and _words_apply(k_buf, v_buf, tile)
    words_k = words and tile["words"] in (True, "k")
    words_v = words and tile["words"] in (True, "v")
    if words_k:  # the FP8 pool's bytes as int32 words (their strides in words too)
        k_buf = k_buf.view(torch.int32)
    if words_v:
        v_buf = v_buf.view(torch.int32)
    _decode_stage1[(rows, num_kv_heads, num_splits)](
        q,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_out,
        mid_lse,
        sm_scale * k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        num_splits,
        min_split_len,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=tile["block_n"],
        num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
        maxnreg=tile["maxnreg"],
        USE_PDL=pdl,
        KV_FP8=kv_fp8,
        DOT_F16=bool(tile.get("dot_f16", False)),
        WORDS_K=words_k,
        WORDS_V=words_v,
        PTX_CVT=words and _ptx_cvt_e4m3(q),
        launch_pdl=pdl,
    )
