"""Merge two partial attention results by their log-sum-exp (natural log).

``o = (o_a * exp(lse_a - m) + o_b * exp(lse_b - m)) / (exp(lse_a - m) + exp(lse_b - m))``
with ``m = max(lse_a, lse_b)``; a part with ``lse = -inf`` (no keys) weighs
nothing.  Where ``b_valid[t]`` is 0 the token takes ``o_a`` unchanged and part
b is never read into the result (a kernel may leave rows it had no keys for
unwritten).  Used by the FlashInfer backend to join the ragged (new tokens)
and paged (cached prefix) halves of an extend.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    o_a,
    lse_a,
    o_b,
    lse_b,
    o,
    b_valid,
    num_heads,
    stride_at,
    stride_ah,
    stride_bt,
    stride_bh,
    stride_ot,
    stride_oh,
    stride_lat,
    stride_lbt,
    HAS_VALID: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < HEAD_DIM
    la = tl.load(lse_a + t * stride_lat + h).to(tl.float32)
    lb = tl.load(lse_b + t * stride_lbt + h).to(tl.float32)
    use_b = lb == lb  # not NaN
    if HAS_VALID:
        use_b = use_b & (tl.load(b_valid + t) != 0)
    lb = tl.where(use_b, lb, float("-inf"))
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    denom = wa + wb
    denom = tl.where(denom > 0, denom, 1.0)
    a = tl.load(o_a + t * stride_at + h * stride_ah + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(o_b + t * stride_bt + h * stride_bh + offs, mask=mask, other=0.0).to(tl.float32)
    out = tl.where(use_b, (a * wa + b * wb) / denom, a)
    tl.store(o + t * stride_ot + h * stride_oh + offs, out.to(o.dtype.element_ty), mask=mask)


def merge_state(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor,
    b_valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``o_*`` / ``out``: ``[T, H, D]``; ``lse_*``: ``[T, H]`` float32 natural-log LSE;
    ``b_valid``: optional ``[T]`` int8/bool, 0 where part b has no keys.  Returns ``out``."""
    t, h, d = o_a.shape
    if t == 0:
        return out
    assert lse_a.stride(1) == 1 and lse_b.stride(1) == 1, "lse must be contiguous over heads"
    valid = b_valid if b_valid is not None else lse_a  # dummy pointer when absent
    _merge_kernel[(t, h)](
        o_a,
        lse_a,
        o_b,
        lse_b,
        out,
        valid,
        h,
        o_a.stride(0),
        o_a.stride(1),
        o_b.stride(0),
        o_b.stride(1),
        out.stride(0),
        out.stride(1),
        lse_a.stride(0),
        lse_b.stride(0),
        HAS_VALID=b_valid is not None,
        HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=1 if d <= 64 else 2,
    )
    return out
