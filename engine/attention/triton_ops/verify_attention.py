"""Split-KV verify attention for short draft trees (speculative decoding's TARGET_VERIFY).

A verify forward has a few draft tokens per request over a long cached
prefix. The masked extend kernel (``extend_attention``) gives each query
block one program per head that walks the whole prefix: at batch 1 with a
handful of draft tokens that is a few dozen programs on a GPU of 132 SMs,
each reading the prefix alone (on an H100, 1.1 ms a forward of the
Llama-3.1-8B shape at a 512-token prefix against 0.3 ms for a decode step's
attention; docs/benchmarks.md). Here every draft token is a row of its own:

* Stage 1 is the decode kernel's (``decode_attention._decode_stage1``): rows
  are the draft tokens, each reading its request's prefix
  (``req_to_token[row, :prefix]``) in splits whose layout depends on the
  prefix's length alone (``MIN_SPLIT_LEN``, ``VERIFY_KV_SPLITS``), into
  ``mid_out`` / ``mid_lse``.
* Stage 2 (``_verify_merge``, grid ``(tokens, kv_heads)``) merges a row's
  splits and then attends to the tree itself: the request's draft tokens'
  K/V as this forward computed them (``k_new`` / ``v_new``, rows
  ``[token - local, token - local + size)``), allowed by the token's row of
  the tree mask (ancestors and itself).

Every prefix is read once per draft token instead of once per query block,
so the caller keeps the extend kernel for many tokens
(``SPLIT_VERIFY_MAX_TOKENS``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvship.engine.attention.triton_ops.decode_attention import launch_stage1, merge_splits
from kvship.engine.attention.triton_ops.extend_attention import kv_is_fp8

# at most this many draft tokens in a forward take the split path (beyond it the extend kernel, which reads each
# prefix once per query block, not once per token, has programs enough to fill the GPU)
SPLIT_VERIFY_MAX_TOKENS = 256
# the split layout of a token's prefix depends on its length alone: MIN_SPLIT_LEN positions or more per split,
# over at most VERIFY_KV_SPLITS splits (the grid; splits past the prefix end at once). An eager verify and a
# graph replay of the same token (whatever the batch, its padding or tree sizes) then sum in the same order.
VERIFY_KV_SPLITS = 16
MIN_SPLIT_LEN = 64


@triton.jit
def _verify_merge(
    q,
    k_new,
    v_new,
    o,
    mid_out,
    mid_lse,
    tok_local,
    tok_size,
    tok_mask_row,
    custom_mask,
    sm_scale,
    v_scale,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    hd_mask = h_mask[:, None] & d_mask[None, :]

    # the prefix: stage 1's splits as (max, sum of weights, weighted sum)
    m_i, l_i, acc = merge_splits(
        mid_out, mid_lse, t, heads, h_mask, offs_d, hd_mask, num_splits,
        stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, BLOCK_H, BLOCK_D,
    )  # fmt: skip

    # the tree: this request's draft tokens that the mask row allows (the token itself always)
    local = tl.load(tok_local + t)
    size = tl.load(tok_size + t)
    first = t - local
    mrow = tl.load(tok_mask_row + t)
    offs_t = tl.arange(0, BLOCK_T)
    in_tree = offs_t < size
    allowed = tl.load(custom_mask + mrow + offs_t, mask=in_tree, other=0) != 0
    rows = (first + offs_t).to(tl.int64)
    kv_mask = in_tree[:, None] & d_mask[None, :]
    qv = tl.load(q + t * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=hd_mask, other=0.0)
    kb = tl.load(k_new + rows[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(qv, tl.trans(kb).to(qv.dtype)).to(tl.float32) * sm_scale
    s = tl.where(allowed[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the token sees itself
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    vb = tl.load(v_new + rows[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if KV_FP8:  # e4m3 is exact in the model dtype; the scales multiply the scores (k) and the sums (v)
        vb = vb.to(qv.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb).to(tl.float32) * v_scale
    l_i = l_i * alpha + tl.sum(p, 1)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o + t * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(o.dtype.element_ty), mask=hd_mask)


def verify_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    o: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    tok_rows: torch.Tensor,
    tok_prefix: torch.Tensor,
    tok_local: torch.Tensor,
    tok_size: torch.Tensor,
    tok_mask_row: torch.Tensor,
    custom_mask: torch.Tensor,
    mid_out: torch.Tensor,
    mid_lse: torch.Tensor,
    max_tree: int,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of ``n`` draft tokens over their prefixes and trees; writes and returns ``o``.

    Shapes: ``q`` / ``o`` ``[n, H, D]``; ``k_new`` / ``v_new`` ``[n, Hkv, D]`` (this forward's K/V of the
    same tokens, a request's tree contiguous in order); ``k_buf`` / ``v_buf`` the layer's pool ``[slots, Hkv,
    D]``. Per token (int tensors ``[n]``): its request's ``req_to_token`` row, prefix length, index in its
    tree, the tree's size, and where its row of the flat uint8 ``custom_mask`` starts. ``mid_out``
    ``[>= n, H, VERIFY_KV_SPLITS, D]`` / ``mid_lse`` ``[>= n, H, VERIFY_KV_SPLITS]`` float32 scratch; ``max_tree``
    at least the largest tree size.  An FP8 pool: the pool and ``k_new`` / ``v_new`` are ``float8_e4m3fn`` (as
    stored), read as ``e4m3 * k_scale`` / ``e4m3 * v_scale``.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    block_h = max(16, triton.next_power_of_2(group))
    block_d = triton.next_power_of_2(head_dim)
    if n == 0:
        return o
    num_splits = VERIFY_KV_SPLITS
    launch_stage1(
        q, k_buf, v_buf, req_to_token, tok_rows, tok_prefix, mid_out, mid_lse, num_splits, sm_scale,
        min_split_len=MIN_SPLIT_LEN, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    _verify_merge[(n, num_kv_heads)](
        q,
        k_new,
        v_new,
        o,
        mid_out,
        mid_lse,
        tok_local,
        tok_size,
        tok_mask_row,
        custom_mask,
        sm_scale * k_scale,
        v_scale,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        o.stride(0),
        o.stride(1),
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_T=max(16, triton.next_power_of_2(max_tree)),
        KV_FP8=kv_is_fp8(k_buf, k_new),
        num_warps=4,
    )
    return o
