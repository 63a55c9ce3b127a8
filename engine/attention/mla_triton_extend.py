"""Triton MLA extend and tree-verify kernels (docs/deepseek.md, "Triton kernels").

Both attend the new tokens of each request (packed: request ``b``'s ``ext_lens[b]`` queries start at
``q_starts[b]``) over its ``prefix_lens[b] + ext_lens[b]`` positions, which live at slots
``req_to_token[req_pool_indices[b], :]`` of the latent pool (the new tokens' rows already stored).  Every
prefix position is visible; among the new tokens, query ``i`` sees new token ``j`` when ``j <= i`` (causal) or,
with a tree mask, when ``mask[mask_starts[b] + i * ext_lens[b] + j]`` is non-zero (the packed uint8 masks of
``triton_backend.extend_meta``).  Online softmax in float32.  Every latent value read from the pool is
``float(x) * kv_scale`` (``kv_scale`` the layer's dequantization scale: an FP8 ``float8_e4m3fn`` pool's, 1.0
otherwise; docs/deepseek.md, "FP8 latent cache").

* ``mla_extend_absorbed`` (verify, draft extends): queries ``[T, H, R + P]`` (``[q_nope @ W_UK | q_pe]``) over
  the latent rows (keys: the whole row; values: its first ``R`` columns) -> ``[T, H, R]``; ``W_UV`` after it.
  Grid ``(B, ceil(max_ext / BLOCK_M), ceil(H / BLOCK_H))``: one program's rows are ``BLOCK_M`` tokens times
  ``BLOCK_H`` heads, which share every latent row it loads (as in the split-KV decode).  With ``num_splits > 1``
  it runs split-KV instead (below).
* Split-KV absorbed extend (``mla_extend_absorbed(..., num_splits=S)``, S a power of two > 1; verify rounds and
  other short extends, where the single pass has too few programs for a long prefix).  Stage 1
  (``_mla_extend_absorbed_part``), grid ``(ceil(max_ext / BLOCK_M) * ceil(H / BLOCK_H), S, B)``: the same rows
  as the single pass, over one contiguous chunk of the request's ``prefix_lens[b] + ext_lens[b]`` positions
  (chunk ``s`` of ``ceil(len / S)``, computed in the kernel from the device-side lengths, so a captured graph
  holds for any context; chunks past a short request's end are empty), the new tokens under the same causal /
  tree-mask visibility; it writes each (token, head) row's normalised partial output and log-sum-exp in
  float32 (``-inf`` where the chunk holds nothing the row may see: such a part weighs nothing, never NaN).
  Stage 2 (``_mla_merge_splits``, the decode's merge, grid ``(T * H,)``) merges them by log-sum-exp.  Products
  in the queries' dtype with float32 accumulators, ``kv_scale`` on the scores and the output (as the decode).
* ``mla_extend_decompressed`` (prefill and prefix-cached extends): queries ``[T, H, d_nope + P]`` over per-head
  keys ``[k_nope | k_pe]`` and values ``v``: ``k_nope`` / ``v`` ``[S, H, d]`` are ``kv_b_proj`` of the requests'
  latent rows, packed per request from ``kv_starts[b]`` (prefix then new, in position order); ``k_pe`` (shared
  by the heads) is read from the pool through ``req_to_token`` -> ``[T, H, d_v]``.  Grid
  ``(B, ceil(max_ext / BLOCK_M), H)`` (keys differ per head).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _visible(pos, pre, offs_m, ext, MASK, mask_start, HAS_MASK: tl.constexpr):
    """[BLOCK_M, BLOCK_N]: may new token ``offs_m`` see position ``pos`` (module docstring)."""
    j = pos - pre
    if HAS_MASK:
        in_new = (j[None, :] >= 0) & (offs_m[:, None] < ext) & (j[None, :] < ext)
        bits = tl.load(MASK + mask_start + offs_m[:, None] * ext + j[None, :], mask=in_new, other=0)
        return (j[None, :] < 0) | (bits != 0)
    else:
        return j[None, :] <= offs_m[:, None]


@triton.jit
def _online_step(qk, m_i, l_i, acc, vals, DOT_PREC: tl.constexpr):
    """One block of the online softmax; rows with nothing visible yet (max ``-inf``) stay empty, not NaN."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(qk - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, vals, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _mla_extend_absorbed_kernel(
    Q,
    KV,
    OUT,
    R2T,
    RPI,
    PRE,
    EXT,
    QST,
    MASK,
    MST,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_r2t,
    scale,
    kv_scale,
    num_heads,
    R: tl.constexpr,
    P: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # one program: BLOCK_M new tokens x BLOCK_H heads as BLOCK_M * BLOCK_H rows, so each latent row it loads
    # serves all those queries (the heads share it)
    b = tl.program_id(0)
    mb = tl.program_id(1)
    hb = tl.program_id(2)
    ext = tl.load(EXT + b).to(tl.int32)
    if mb * BLOCK_M >= ext:
        return
    pre = tl.load(PRE + b).to(tl.int32)
    q0 = tl.load(QST + b).to(tl.int64)
    row = tl.load(RPI + b).to(tl.int64)
    mask_start = tl.load(MST + b).to(tl.int64)  # a placeholder's first value without a mask: never used

    rows = tl.arange(0, BLOCK_M * BLOCK_H)
    offs_m = mb * BLOCK_M + rows // BLOCK_H  # each row's new token
    h = (hb * BLOCK_H + rows % BLOCK_H).to(tl.int64)  # and head
    mmask = (offs_m < ext) & (h < num_heads)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    rmask = offs_r < R
    pmask = offs_p < P
    q_base = Q + (q0 + offs_m[:, None]).to(tl.int64) * stride_qt + h[:, None] * stride_qh
    q_c = tl.load(q_base + offs_r[None, :], mask=mmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
    q_p = tl.load(q_base + R + offs_p[None, :], mask=mmask[:, None] & pmask[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_R], dtype=tl.float32)
    # causal: no key past this block's last query; a tree may look anywhere among its own tokens
    end = pre + ext if HAS_MASK else pre + tl.minimum(ext, (mb + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        slot = tl.load(R2T + row * stride_r2t + pos, mask=nmask, other=0).to(tl.int64)
        kv_row = KV + slot[:, None] * stride_kv
        c = tl.load(kv_row + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        pe = tl.load(kv_row + R + offs_p[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0).to(tl.float32)
        c = c * kv_scale
        pe = pe * kv_scale
        qk = tl.dot(q_c, tl.trans(c), input_precision=DOT_PREC) + tl.dot(q_p, tl.trans(pe), input_precision=DOT_PREC)
        ok = _visible(pos, pre, offs_m, ext, MASK, mask_start, HAS_MASK) & nmask[None, :] & mmask[:, None]
        qk = tl.where(ok, qk * scale, float("-inf"))
        m_i, l_i, acc = _online_step(qk, m_i, l_i, acc, c, DOT_PREC)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptr = OUT + (q0 + offs_m[:, None]).to(tl.int64) * stride_ot + h[:, None] * stride_oh + offs_r[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=mmask[:, None] & rmask[None, :])


@triton.jit
def _mla_extend_absorbed_part(
    Q,
    KV,
    O_PART,
    LSE_PART,
    R2T,
    RPI,
    PRE,
    EXT,
    QST,
    MASK,
    MST,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_r2t,
    scale,
    kv_scale,
    num_heads,
    R: tl.constexpr,
    P: tl.constexpr,
    HAS_MASK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # stage 1 of the split-KV absorbed extend (module docstring): the single pass's rows (BLOCK_M new tokens x
    # BLOCK_H heads) over chunk s of the request's positions; the (row block, head block) programs of one chunk
    # are adjacent in launch order, so they read its latent rows while they are in L2
    num_hb = tl.cdiv(num_heads, BLOCK_H)
    mb = tl.program_id(0) // num_hb
    hb = tl.program_id(0) % num_hb
    s = tl.program_id(1)
    b = tl.program_id(2)
    ext = tl.load(EXT + b).to(tl.int32)
    if mb * BLOCK_M >= ext:
        return
    pre = tl.load(PRE + b).to(tl.int32)
    q0 = tl.load(QST + b).to(tl.int64)
    row = tl.load(RPI + b).to(tl.int64)
    mask_start = tl.load(MST + b).to(tl.int64)  # a placeholder's first value without a mask: never used

    rows = tl.arange(0, BLOCK_M * BLOCK_H)
    offs_m = mb * BLOCK_M + rows // BLOCK_H  # each row's new token
    h = (hb * BLOCK_H + rows % BLOCK_H).to(tl.int64)  # and head
    mmask = (offs_m < ext) & (h < num_heads)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    rmask = offs_r < R
    pmask = offs_p < P
    q_base = Q + (q0 + offs_m[:, None]).to(tl.int64) * stride_qt + h[:, None] * stride_qh
    # products in the queries' dtype (bf16 tensor cores on a GPU; float32 stays float32), fp32 accumulators
    q_c = tl.load(q_base + offs_r[None, :], mask=mmask[:, None] & rmask[None, :], other=0.0)
    q_p = tl.load(q_base + R + offs_p[None, :], mask=mmask[:, None] & pmask[None, :], other=0.0)

    # chunk s of the request's positions (the same chunks for every row block); causal: no key past this
    # block's last query; a tree may look anywhere among its own tokens
    per = tl.cdiv(pre + ext, NUM_SPLITS)
    start = s * per
    last = pre + ext if HAS_MASK else pre + tl.minimum(ext, (mb + 1) * BLOCK_M)
    end = tl.minimum(start + per, last)
    m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_R], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        slot = tl.load(R2T + row * stride_r2t + pos, mask=nmask, other=0).to(tl.int64)
        kv_row = KV + slot[:, None] * stride_kv
        # the stored row (model dtype, or e4m3: exact in the queries' dtype); the layer's dequantization scale
        # multiplies the scores and the output instead of every element
        c = tl.load(kv_row + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0).to(q_c.dtype)
        pe = tl.load(kv_row + R + offs_p[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0).to(q_c.dtype)
        qk = tl.dot(q_c, tl.trans(c), input_precision=DOT_PREC) + tl.dot(q_p, tl.trans(pe), input_precision=DOT_PREC)
        ok = _visible(pos, pre, offs_m, ext, MASK, mask_start, HAS_MASK) & nmask[None, :] & mmask[:, None]
        qk = tl.where(ok, qk * (scale * kv_scale), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: stays empty, not NaN
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PREC)
        m_i = m_new

    has = l_i > 0
    out = acc * kv_scale / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    part = ((q0 + offs_m).to(tl.int64) * num_heads + h) * NUM_SPLITS + s
    tl.store(O_PART + part[:, None] * R + offs_r[None, :], out, mask=mmask[:, None] & rmask[None, :])
    tl.store(LSE_PART + part, lse, mask=mmask)


@triton.jit
def _mla_merge_splits(
    O_PART,
    LSE_PART,
    OUT,
    R: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Stage 2 of the split-KV decode and absorbed extend, one program per (query, head) row ``bh``: its
    ``NUM_SPLITS`` normalised parts (``O_PART [rows, NUM_SPLITS, R]``) weighted by their log-sum-exps into
    ``OUT [rows, R]``.  Empty parts (``-inf``) weigh nothing; a row with no part at all gets zeros, not NaN."""
    bh = tl.program_id(0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    out = merged_row(O_PART, LSE_PART, bh, R, NUM_SPLITS, BLOCK_R)
    tl.store(OUT + bh * R + offs_r, out.to(OUT.dtype.element_ty), mask=offs_r < R)


@triton.jit
def merged_row(O_PART, LSE_PART, bh, R: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr):
    """Row ``bh``'s ``NUM_SPLITS`` parts merged by their log-sum-exps: float32 ``[BLOCK_R]`` (``_mla_merge_splits``,
    which stores it in the output dtype; columns past ``R`` are 0)."""
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_r = tl.arange(0, BLOCK_R)
    lse = tl.load(LSE_PART + bh * NUM_SPLITS + offs_s)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every part empty: no -inf - -inf
    w = tl.where(lse > float("-inf"), tl.exp(lse - m), 0.0)
    parts = tl.load(
        O_PART + (bh * NUM_SPLITS + offs_s)[:, None] * R + offs_r[None, :], mask=(offs_r < R)[None, :], other=0.0
    )
    den = tl.sum(w, 0)
    return tl.sum(parts * w[:, None], 0) / tl.where(den > 0, den, 1.0)


@triton.jit
def _mla_extend_decompressed_kernel(
    Q,
    KN,
    V,
    KV,
    OUT,
    R2T,
    RPI,
    PRE,
    EXT,
    QST,
    KST,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_r2t,
    scale,
    kv_scale,
    R: tl.constexpr,
    DN: tl.constexpr,
    P: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    mb = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    ext = tl.load(EXT + b).to(tl.int32)
    if mb * BLOCK_M >= ext:
        return
    pre = tl.load(PRE + b).to(tl.int32)
    q0 = tl.load(QST + b).to(tl.int64)
    k0 = tl.load(KST + b).to(tl.int64)
    row = tl.load(RPI + b).to(tl.int64)

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < ext
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_p = tl.arange(0, BLOCK_P)
    offs_dv = tl.arange(0, BLOCK_DV)
    dnmask = offs_dn < DN
    pmask = offs_p < P
    dvmask = offs_dv < DV
    q_base = Q + (q0 + offs_m[:, None]).to(tl.int64) * stride_qt + h * stride_qh
    q_n = tl.load(q_base + offs_dn[None, :], mask=mmask[:, None] & dnmask[None, :], other=0.0).to(tl.float32)
    q_p = tl.load(q_base + DN + offs_p[None, :], mask=mmask[:, None] & pmask[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    end = pre + tl.minimum(ext, (mb + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        packed = (k0 + pos).to(tl.int64)
        kn = tl.load(
            KN + packed[:, None] * stride_kt + h * stride_kh + offs_dn[None, :],
            mask=nmask[:, None] & dnmask[None, :],
            other=0.0,
        ).to(tl.float32)
        slot = tl.load(R2T + row * stride_r2t + pos, mask=nmask, other=0).to(tl.int64)
        pe = tl.load(
            KV + slot[:, None] * stride_kv + R + offs_p[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0
        ).to(tl.float32)
        pe = pe * kv_scale
        v = tl.load(
            V + packed[:, None] * stride_vt + h * stride_vh + offs_dv[None, :],
            mask=nmask[:, None] & dvmask[None, :],
            other=0.0,
        ).to(tl.float32)
        qk = tl.dot(q_n, tl.trans(kn), input_precision=DOT_PREC) + tl.dot(q_p, tl.trans(pe), input_precision=DOT_PREC)
        ok = ((pos - pre)[None, :] <= offs_m[:, None]) & nmask[None, :] & mmask[:, None]
        qk = tl.where(ok, qk * scale, float("-inf"))
        m_i, l_i, acc = _online_step(qk, m_i, l_i, acc, v, DOT_PREC)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptr = OUT + (q0 + offs_m[:, None]).to(tl.int64) * stride_ot + h * stride_oh + offs_dv[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=mmask[:, None] & dvmask[None, :])


def dot_precision(dtype: torch.dtype):
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``: ``ieee`` for float32 (Triton's default on a GPU is
    TF32, 10 mantissa bits: a float32 model must not lose them), the default otherwise."""
    return "ieee" if dtype == torch.float32 else None


def _dot_block(n: int) -> int:
    return max(triton.next_power_of_2(n), 16)


def _latent_rows(latent: torch.Tensor, dim: int) -> torch.Tensor:
    kv = latent.reshape(latent.shape[0], -1)
    if kv.shape[1] != dim:
        raise ValueError(f"latent rows of {kv.shape[1]} values do not match {dim} = kv_lora_rank + rope dims")
    if kv.stride(-1) != 1:
        raise ValueError("the latent buffer's rows must be contiguous")
    return kv


def absorbed_tiles(num_heads: int, max_ext: int, max_rows: int = 16) -> tuple[int, int]:
    """``(block_m, block_h)`` of ``mla_extend_absorbed``'s programs (single pass and split alike): heads per
    program all of them up to 16; tokens per program enough for 16 rows (``tl.dot``'s minimum), up to
    ``max_rows`` rows, no more than the longest extend needs."""
    block_h = min(triton.next_power_of_2(num_heads), 16)
    block_m = max(16 // block_h, min(triton.next_power_of_2(max(max_ext, 1)), max(max_rows // block_h, 1)))
    return block_m, block_h


def absorbed_programs(bs: int, num_heads: int, max_ext: int, max_rows: int = 16) -> int:
    """``(request, row block, head block)`` programs of ``mla_extend_absorbed`` for ``bs`` requests of at most
    ``max_ext`` new tokens (each split multiplies them)."""
    block_m, block_h = absorbed_tiles(num_heads, max_ext, max_rows)
    return bs * triton.cdiv(max(max_ext, 1), block_m) * triton.cdiv(num_heads, block_h)


def split_scratch_size(tokens: int, num_heads: int, num_splits: int, kv_lora_rank: int) -> tuple[int, int]:
    """Float32 values of the split-KV absorbed extend's scratch: partial outputs, log-sum-exps."""
    parts = tokens * num_heads * num_splits
    return parts * kv_lora_rank, parts


def _check_lens(q: torch.Tensor, ext_lens: torch.Tensor, prefix_lens: torch.Tensor, q_starts: torch.Tensor) -> int:
    bs = ext_lens.shape[0]
    if prefix_lens.shape[0] != bs or q_starts.shape[0] != bs:
        raise ValueError(f"{bs} requests but {prefix_lens.shape[0]} prefix lengths / {q_starts.shape[0]} starts")
    return bs


def mla_extend_absorbed(
    q: torch.Tensor,
    latent: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    ext_lens: torch.Tensor,
    q_starts: torch.Tensor,
    max_ext: int,
    kv_lora_rank: int,
    scale: float,
    tree_mask: Optional[torch.Tensor] = None,
    mask_starts: Optional[torch.Tensor] = None,
    max_rows: int = 16,
    block_n: int = 32,
    kv_scale: float = 1.0,
    num_splits: int = 1,
    scratch: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Absorbed extend / tree verify (module docstring): ``[T, H, kv_lora_rank]`` in ``q``'s dtype.
    ``max_rows`` (a power of two) bounds the (token, head) rows of one program: 16 by default, the decode
    kernel's tile (16 rows of ``kv_lora_rank`` float32 accumulators); not tuned on a GPU yet.  ``kv_scale``: the
    layer's dequantization scale (module docstring).

    ``num_splits``: 1 runs the single-pass kernel; a power of two > 1 the split-KV kernel and its merge (module
    docstring).  ``scratch``: preallocated flat float32 buffers for the split path's partial outputs and
    log-sum-exps (at least ``split_scratch_size(T, H, num_splits, kv_lora_rank)`` values each), so that a CUDA
    graph allocates none of its own; None: allocated here.  Unused with one split."""
    t, num_heads, dim = q.shape
    r, p = kv_lora_rank, dim - kv_lora_rank
    if p <= 0:
        raise ValueError(f"queries of {dim} values leave no rope dims after kv_lora_rank {r}")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    kv = _latent_rows(latent, dim)
    bs = _check_lens(q, ext_lens, prefix_lens, q_starts)
    if (tree_mask is None) != (mask_starts is None):
        raise ValueError("tree_mask and mask_starts go together")
    out = torch.empty((t, num_heads, r), dtype=q.dtype, device=q.device)
    if bs == 0 or t == 0 or max_ext == 0:
        return out
    has_mask = tree_mask is not None
    block_m, block_h = absorbed_tiles(num_heads, max_ext, max_rows)
    row_blocks, head_blocks = triton.cdiv(max_ext, block_m), triton.cdiv(num_heads, block_h)
    mask_args = (
        tree_mask if has_mask else q,  # unread without a mask
        mask_starts if has_mask else q_starts,
    )
    if num_splits == 1:
        _mla_extend_absorbed_kernel[(bs, row_blocks, head_blocks)](
            q,
            kv,
            out,
            req_to_token,
            req_pool_indices,
            prefix_lens,
            ext_lens,
            q_starts,
            *mask_args,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            kv.stride(0),
            req_to_token.stride(0),
            scale,
            float(kv_scale),
            num_heads,
            R=r,
            P=p,
            HAS_MASK=has_mask,
            BLOCK_M=block_m,
            BLOCK_H=block_h,
            BLOCK_N=block_n,
            BLOCK_R=_dot_block(r),
            BLOCK_P=_dot_block(p),
            DOT_PREC=dot_precision(q.dtype),
        )
        return out

    n_out, n_lse = split_scratch_size(t, num_heads, num_splits, r)
    if scratch is None:
        o_part = torch.empty(n_out, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(n_lse, dtype=torch.float32, device=q.device)
    else:
        o_flat, lse_flat = scratch
        if o_flat.dtype != torch.float32 or lse_flat.dtype != torch.float32:
            raise ValueError("the split extend's scratch buffers must be float32")
        if o_flat.numel() < n_out or lse_flat.numel() < n_lse:
            raise ValueError(
                f"split extend scratch of {o_flat.numel()} / {lse_flat.numel()} values is short of {n_out} / {n_lse} "
                f"({t} tokens x {num_heads} heads x {num_splits} splits)"
            )
        o_part, lse_part = o_flat.reshape(-1)[:n_out], lse_flat.reshape(-1)[:n_lse]
    if q.stride(-1) != 1:
        q = q.contiguous()
    _mla_extend_absorbed_part[(row_blocks * head_blocks, num_splits, bs)](
        q,
        kv,
        o_part,
        lse_part,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        ext_lens,
        q_starts,
        *mask_args,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        req_to_token.stride(0),
        scale,
        float(kv_scale),
        num_heads,
        R=r,
        P=p,
        HAS_MASK=has_mask,
        NUM_SPLITS=num_splits,
        BLOCK_M=block_m,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=_dot_block(r),
        BLOCK_P=_dot_block(p),
        DOT_PREC=dot_precision(q.dtype),
    )
    _mla_merge_splits[(t * num_heads,)](o_part, lse_part, out, R=r, NUM_SPLITS=num_splits, BLOCK_R=_dot_block(r))
    return out


def mla_extend_decompressed(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    v: torch.Tensor,
    latent: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    ext_lens: torch.Tensor,
    q_starts: torch.Tensor,
    kv_starts: torch.Tensor,
    max_ext: int,
    kv_lora_rank: int,
    scale: float,
    block_m: int = 16,
    block_n: int = 32,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Decompressed causal extend (module docstring): ``[T, H, d_v]`` in ``q``'s dtype; ``k_pe`` read from the
    pool as ``float(x) * kv_scale`` (``k_nope`` / ``v`` come from already dequantized rows)."""
    t, num_heads, dq = q.shape
    dn, dv = k_nope.shape[-1], v.shape[-1]
    p = dq - dn
    if p <= 0 or k_nope.shape[:2] != v.shape[:2] or k_nope.shape[1] != num_heads:
        raise ValueError(
            f"queries [T, {num_heads}, {dq}] do not fit keys {tuple(k_nope.shape)} and values {tuple(v.shape)}"
        )
    kv = _latent_rows(latent, kv_lora_rank + p)
    bs = _check_lens(q, ext_lens, prefix_lens, q_starts)
    if kv_starts.shape[0] != bs:
        raise ValueError(f"{bs} requests but {kv_starts.shape[0]} kv starts")
    out = torch.empty((t, num_heads, dv), dtype=q.dtype, device=q.device)
    if bs == 0 or t == 0 or max_ext == 0:
        return out
    if k_nope.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decompressed keys and values need contiguous last dims")
    grid = (bs, triton.cdiv(max_ext, block_m), num_heads)
    _mla_extend_decompressed_kernel[grid](
        q,
        k_nope,
        v,
        kv,
        out,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        ext_lens,
        q_starts,
        kv_starts,
        q.stride(0),
        q.stride(1),
        k_nope.stride(0),
        k_nope.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        kv.stride(0),
        req_to_token.stride(0),
        scale,
        float(kv_scale),
        R=kv_lora_rank,
        DN=dn,
        P=p,
        DV=dv,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_DN=_dot_block(dn),
        BLOCK_P=_dot_block(p),
        BLOCK_DV=_dot_block(dv),
        DOT_PREC=dot_precision(q.dtype),
    )
    return out
