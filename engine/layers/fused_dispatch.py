"""Where the layers find the fused CUDA ops (``fused_ops_cuda``), without importing Triton on CPU.

``cuda_fused_ops(t)`` returns the module when ``t`` is a CUDA tensor, Triton
imports, and ``KVSHIP_DISABLE_FUSED_OPS`` is not set to 1; otherwise None and
the layer runs its PyTorch code.  The import is attempted once per process.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_STATE: dict[str, Optional[ModuleType]] = {}


def _load() -> Optional[ModuleType]:
    if "mod" not in _STATE:
        mod: Optional[ModuleType] = None
        if os.environ.get("KVSHIP_DISABLE_FUSED_OPS", "0") != "1":
            try:
                from kvship.engine.layers import fused_ops_cuda as mod  # noqa: PLC0415
            except ImportError as e:  # triton missing: plain PyTorch layers
                logger.info("fused CUDA ops unavailable (%s); using PyTorch ops", e)
                mod = None
        _STATE["mod"] = mod
    return _STATE["mod"]


def cuda_fused_ops(t: torch.Tensor) -> Optional[ModuleType]:
    """The fused-ops module for CUDA tensor ``t``, or None (CPU, no Triton, or disabled)."""
    if not t.is_cuda:
        return None
    return _load()
