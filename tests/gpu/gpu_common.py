"""Shared helpers of the GPU tests (imported as ``gpu_common``; not a conftest, so the
top-level ``tests/conftest.py`` stays the only module named ``conftest``).

Every GPU test module sets ``pytestmark = [pytest.mark.gpu, requires_cuda]``
(or ``cuda_or_interpreter`` for pure Triton kernel tests, which also run on CPU
under ``TRITON_INTERPRET=1`` when the ``triton`` package is importable).
Without CUDA they are skipped with ``NO_CUDA_REASON`` (``pytest -rs`` prints it).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

NO_CUDA_REASON = (
    "no CUDA device here: GPU tests run on the device machine (bash bench/gpu_suite.sh there; see docs/gpu.md)"
)
HAS_CUDA = torch.cuda.is_available()


def interpreter_mode() -> bool:
    """True on a CPU machine asked to run Triton kernels in the interpreter."""
    return not HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)
cuda_or_interpreter = pytest.mark.skipif(
    not (HAS_CUDA or interpreter_mode()), reason=NO_CUDA_REASON + " (or TRITON_INTERPRET=1 with triton installed)"
)


def kernel_device() -> torch.device:
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")


def requires_flashinfer() -> None:
    """Skip the calling test when flashinfer does not import (reason printed)."""
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed (the device bundle provides it)")
