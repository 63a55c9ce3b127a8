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


def smollm2_or_tiny_llama(tmp_path_factory, name: str, seed: int) -> str:
    """The model GPU equality tests run: the SmolLM2 GGUF (``KVSHIP_SMOLLM2_GGUF``, else the embedded one;
    real weights, so greedy choices are not near-ties), else a tiny random Llama written by transformers."""
    path = os.environ.get("KVSHIP_SMOLLM2_GGUF")
    if path:
        return path
    try:
        from kvship.engine.embedded import embedded_model_path

        return embedded_model_path()
    except FileNotFoundError:
        from conftest import build_tiny_model

        return build_tiny_model(
            str(tmp_path_factory.mktemp(name)),
            "llama",
            seed=seed,
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
        )
