"""Gated activations over a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvship.engine.layers.fused_dispatch import cuda_fused_ops

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedActivation(nn.Module):
    """``act(gate) * up`` where the input is ``[..., 2*d]`` = ``gate || up`` (SwiGLU for silu)."""

    def __init__(self, act: str = "silu"):
        super().__init__()
        if act not in _ACTS:
            raise ValueError(f"unsupported activation '{act}'; known: {sorted(_ACTS)}")
        self.act = _ACTS[act]
        self.is_silu = act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is F.silu:
            fused = cuda_fused_ops(x)
            if fused is not None:  # one Triton kernel on CUDA
                return fused.silu_and_mul(x)
        d = x.shape[-1] // 2
        return self.act(x[..., :d]) * x[..., d:]
