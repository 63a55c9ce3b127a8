"""FP8 (e4m3) arithmetic shared by the FP8 methods, the checkpoint writer and the tests.

The CPU reference of every FP8 method is quantize-dequantize (QDQ): weights dequantised to
fp32, activations quantised to FP8 and dequantised in fp32, one fp32 matmul,
the output cast to the model dtype.  docs/quantization.md ("Reference
arithmetic") states it step by step; the GPU kernels must match it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# smallest amax a scale is made from (an all-zero group gets scale EPS / FP8_MAX, never 0)
ACT_EPS = 1e-10
WEIGHT_EPS = 1e-12


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / scale, -448, 448)`` rounded to e4m3 (round-to-nearest-even), in fp32 then cast."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


# --- activations -----------------------------------------------------------------------------------
def qdq_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """Activations quantised per token and per group of ``group`` consecutive columns (the last group may be
    shorter), dequantised: fp32, ``x``'s shape.  Scale of a group: ``max(amax, 1e-10) / 448``."""
    xf = x.float()
    k = xf.shape[-1]
    pad = (-k) % group
    g = F.pad(xf, (0, pad)).view(*xf.shape[:-1], (k + pad) // group, group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp_(min=ACT_EPS) / amax.new_full((), FP8_MAX)  # a tensor divisor: a true division on CUDA too
    deq = to_fp8(g, scale).float() * scale
    return deq.view(*xf.shape[:-1], k + pad)[..., :k]


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations quantised per token: (e4m3, fp32 scales ``[..., 1]``), one scale per row:
    ``max(amax, 1e-10) / 448``."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp_(min=ACT_EPS) / amax.new_full((), FP8_MAX)
    return to_fp8(xf, scale), scale


def qdq_tokens(x: torch.Tensor) -> torch.Tensor:
    """Activations quantised per token (``quantize_tokens``), dequantised: fp32."""
    q, scale = quantize_tokens(x)
    return q.float() * scale


def qdq_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Activations quantised with the checkpoint's static per-tensor ``input_scale``, dequantised: fp32."""
    s = input_scale.float()
    return to_fp8(x, s).float() * s


# --- weights ----------------------------------------------------------------------------------------
def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> (e4m3 ``[out, in]``, fp32 scale ``[out]``): scale ``max(amax_row, 1e-12) / 448``."""
    wf = w.float()
    scale = wf.abs().amax(dim=-1).clamp_(min=WEIGHT_EPS) / FP8_MAX
    return to_fp8(wf, scale[:, None]), scale


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` -> (e4m3, fp32 scalar scale ``max(amax, 1e-12) / 448``)."""
    wf = w.float()
    scale = wf.abs().amax().clamp_(min=WEIGHT_EPS) / FP8_MAX
    return to_fp8(wf, scale), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> (e4m3 ``[out, in]``, fp32 ``weight_scale_inv [ceil(out/bn), ceil(in/bk)]``): one scale
    ``max(amax_block, 1e-12) / 448`` per ``bn x bk`` block (edge blocks may be partial)."""
    bn, bk = block
    out, inp = w.shape
    wf = F.pad(w.float(), (0, (-inp) % bk, 0, (-out) % bn))
    rows, cols = wf.shape[0] // bn, wf.shape[1] // bk
    blocks = wf.view(rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_(min=WEIGHT_EPS) / FP8_MAX
    q = to_fp8(blocks, scale[:, None, :, None]).view(rows * bn, cols * bk)[:out, :inp]
    return q.contiguous(), scale


def expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Block scales ``[ceil(out/bn), ceil(in/bk)]`` repeated over their blocks: fp32 ``shape``."""
    bn, bk = block
    full = scale.float().repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
    return full[: shape[0], : shape[1]]


def dequant_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 ``q * weight_scale_inv`` (each block times its scale)."""
    (out, inp), (bn, bk) = q.shape, block
    if out % bn or inp % bk:  # partial edge blocks
        return q.float() * expand_blocks(scale, (out, inp), block)
    w = q.float().view(out // bn, bn, inp // bk, bk)
    return w.mul_(scale.float()[:, None, :, None]).view(out, inp)


def dequant_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale`` with one scale per output row (``scale`` ``[out]``, ``[out, 1]`` or a scalar)."""
    s = scale.float().reshape(-1)
    return q.float().mul_(s[:, None] if s.numel() > 1 else s)


def qdq_linear(
    x_deq: torch.Tensor, w_deq: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype
) -> torch.Tensor:
    """The GEMM of the reference: fp32 ``x_deq @ w_deq^T (+ bias in fp32)``, cast to ``out_dtype``."""
    b = bias.float() if bias is not None else None
    return F.linear(x_deq, w_deq, b).to(out_dtype)
