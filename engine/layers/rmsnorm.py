"""RMSNorm, numerically matching Hugging Face (normalise in float32, scale in the input dtype)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from kvship.engine.layers.fused_dispatch import cuda_fused_ops
from kvship.engine.layers.linear import Linear, _param


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = _param((hidden_size,), dtype)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without ``residual``: ``norm(x)``.  With it: ``(norm(x + residual), x + residual)``."""
        fused = cuda_fused_ops(x)
        if fused is not None:  # one Triton kernel on CUDA (same numerics)
            return fused.rmsnorm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def norm_then_linear(
    norm: nn.Module,
    layer: Linear,
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    keep_normed: bool = False,
    pending: Optional[Any] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A pre-norm block's entry: ``h = norm(x + residual)`` (``norm(x)`` on the first layer, ``residual``
    None), then ``layer(h)``; returns ``(layer(h), x + residual, h if keep_normed)``.  Where the layer's
    quantization method has a kernel for it (``apply_norm_input``; unquantized: on CUDA at batch-1-sized decode,
    ``skinny_gemm_cuda.norm_linear``) one GEMV kernel computes the RMSNorm in its input (no norm kernel, no
    normalised tensor unless asked); elsewhere the norm layer and then the linear layer.

    ``pending``: the communicator whose all-reduce ``x`` still owes (a row-parallel layer's
    ``forward_partial``).  Where it has a kernel that all-reduces and norms in one (``all_reduce_rmsnorm``: the
    push kernel, docs/parallel.md, "The all-reduce") that runs; elsewhere ``x`` is all-reduced first."""
    is_rmsnorm = type(norm).forward is RMSNorm.forward
    if pending is not None:
        fused = None
        if residual is not None and is_rmsnorm:
            fused = pending.all_reduce_rmsnorm(x, residual, norm.weight, norm.eps)
        if fused is not None:
            h, residual_out = fused
            return layer(h), residual_out, h if keep_normed else None
        x = pending.all_reduce(x)
    if is_rmsnorm:
        fused = layer.quant_method.apply_norm_input(layer, x, residual, norm.weight, norm.eps, keep_normed)
        if fused is not None:
            y, residual_out, normed = fused
            return layer.reduce(y), residual_out, normed
    if residual is None:
        h, residual_out = norm(x), x
    else:
        h, residual_out = norm(x, residual)
    return layer(h), residual_out, h if keep_normed else None
