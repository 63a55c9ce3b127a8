"""``unquantized``: weights kept in the compute dtype (bfloat16, float16, float32).

Its kernels are the engine's dense ones: ``F.linear`` (cuBLAS), on CUDA at
decode batch sizes the skinny GEMV/MMA kernels (``skinny_gemm_cuda``: the
plain product, SiLU-and-mul inside the input, RMSNorm inside the input) where
they apply, ``F.embedding``, and the MoE runners (``torch``, ``triton``) over
the stacked ``w13_weight`` / ``w2_weight``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvship.engine.layers.fused_dispatch import cuda_skinny_gemm
from kvship.engine.layers.quantization.base import QuantMethod, WeightLoader, add_weights, register_quant_method


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x W^T + b``: on CUDA at decode batch sizes our skinny-GEMM kernels where they beat cuBLAS, else F.linear."""
    skinny = cuda_skinny_gemm(x)
    if skinny is not None:
        y = skinny.linear(x, weight, bias)
        if y is not None:
            return y
    return F.linear(x, weight, bias)


@register_quant_method("unquantized")
class UnquantizedMethod(QuantMethod):
    """Weights as the checkpoint has them, in the compute dtype; see the module docstring for its kernels."""

    def create_weights(
        self, layer: nn.Module, weights: dict[str, tuple[int, ...]], dtype: torch.dtype, loader: WeightLoader
    ) -> None:
        add_weights(layer, {name: (shape, dtype) for name, shape in weights.items()}, loader)

    def load(self, layer: nn.Module, name: str, target: torch.Tensor, loaded: torch.Tensor) -> None:
        with torch.no_grad():
            target.copy_(loaded)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, layer.weight, layer.bias)

    def apply_silu_mul_input(self, layer: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
        skinny = cuda_skinny_gemm(x)
        if skinny is None:
            return None
        return skinny.linear(x, layer.weight, layer.bias, act=skinny.ACT_SILU_MUL)

    def apply_norm_input(self, layer, x, residual, norm_weight, eps, keep_normed):
        skinny = cuda_skinny_gemm(x)
        if skinny is None:
            return None
        return skinny.norm_linear(x, residual, norm_weight, eps, layer.weight, layer.bias, keep_normed)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)

    def apply_moe(self, layer, runner, x, topk_weights, topk_ids, absent=False, config_experts=None):
        return runner(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, absent=absent, config_experts=config_experts
        )
