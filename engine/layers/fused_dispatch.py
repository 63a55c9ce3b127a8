"""Where the layers find the Triton CUDA ops, without importing Triton on CPU.

``cuda_fused_ops(t)`` returns ``fused_ops_cuda`` (RMSNorm, SiLU-and-mul, RoPE)
and ``cuda_skinny_gemm(t)`` returns ``skinny_gemm_cuda`` (decode-shaped
matmuls) when ``t`` is a CUDA tensor, Triton imports, and
``KVSHIP_DISABLE_FUSED_OPS`` is not set to 1; otherwise None and the layer runs
its PyTorch code.  Each import is attempted once per process.

``use_pdl(t)`` says whether our Triton kernels on ``t``'s device launch with
programmatic dependent launch (PDL, Hopper and later): a kernel may then be
scheduled while the one before it drains, does what needs no input of that
kernel (address math, the first weight tile of a matmul) and waits on
``griddepcontrol.wait`` before reading any activation or writing anything.
Each such kernel waits in every program, so the wait chains through a run of
PDL kernels.  On by default on Hopper (``KVSHIP_PDL=0`` turns it off): once the
MoE decode kernels and the split-KV decode attention joined the chain, a
Qwen3-30B-A3B decode step ran 8% faster at batch 1 (docs/benchmarks.md).  The
knobs are read once per process, at first use.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Optional

import torch

from kvship.common.envs import ENV

logger = logging.getLogger(__name__)

_STATE: dict[str, Optional[ModuleType]] = {}


def _load(name: str) -> Optional[ModuleType]:
    if name not in _STATE:
        mod: Optional[ModuleType] = None
        if not ENV.DISABLE_FUSED_OPS:
            try:
                mod = importlib.import_module(f"kvship.engine.layers.{name}")
            except ImportError as e:  # triton missing: plain PyTorch layers
                logger.info("%s unavailable (%s); using PyTorch ops", name, e)
                mod = None
        _STATE[name] = mod
    return _STATE[name]


_PDL: dict[int, bool] = {}


def use_pdl(t: torch.Tensor) -> bool:
    """Whether Triton kernels on CUDA tensor ``t``'s device launch with PDL (compute capability >= 9)."""
    if not t.is_cuda:
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    ok = _PDL.get(idx)
    if ok is None:
        ok = (
            ENV.PDL and os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.get_device_capability(idx)[0] >= 9
        )
        _PDL[idx] = ok
    return ok


def cuda_fused_ops(t: torch.Tensor) -> Optional[ModuleType]:
    """The fused-ops module for CUDA tensor ``t``, or None (CPU, no Triton, or disabled)."""
    if not t.is_cuda:
        return None
    return _load("fused_ops_cuda")


def cuda_fp8_kernels(t: torch.Tensor) -> Optional[ModuleType]:
    """The FP8 linear kernels for CUDA tensor ``t``, or None (CPU, no Triton, disabled, or
    ``KVSHIP_FP8_REFERENCE=1``: the FP8 methods then compute with their reference arithmetic)."""
    if not t.is_cuda or ENV.FP8_REFERENCE:
        return None
    return _load("quantization.fp8_kernels")


def cuda_moe_route(t: torch.Tensor) -> Optional[ModuleType]:
    """The one-kernel expert selection (``moe.topk_triton``) for CUDA router logits ``t``, or None."""
    if not t.is_cuda:
        return None
    return _load("moe.topk_triton")


def cuda_skinny_gemm(t: torch.Tensor) -> Optional[ModuleType]:
    """The decode-matmul module for CUDA tensor ``t``, or None (CPU, no Triton, or disabled)."""
    if not t.is_cuda:
        return None
    return _load("skinny_gemm_cuda")
