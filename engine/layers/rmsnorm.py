"""RMSNorm, numerically matching Hugging Face (normalise in float32, scale in the input dtype)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvship.engine.layers.fused_dispatch import cuda_fused_ops
from kvship.engine.layers.linear import _param


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
