"""The fused-MoE Triton kernels' own tests (``tests/gpu/``), run on the CPU in Triton's interpreter.

``tests/gpu`` skips its Triton kernel tests on a machine without CUDA unless ``TRITON_INTERPRET=1`` is set
(``gpu_common.cuda_or_interpreter``), and that flag must be set before ``triton`` is imported, so CI runs them
here in a child pytest: the alignment kernels, routing, the grouped GEMMs (pointer, one-MMA, TMA and persistent
forms, against the torch runner and against each other) and expert parallelism's dispatch over gloo, in float32.
On a GPU machine ``tests/gpu`` runs the same tests natively.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/gpu/test_gpu_moe.py", "tests/gpu/test_gpu_moe_align.py", "tests/gpu/test_gpu_ep.py"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu runs these kernels natively")
def test_moe_kernel_tests_pass_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    # the interpreter runs most of them (the CUDA-graph and Qwen3-30B-A3B-sized cases need CUDA)
    assert passed and int(passed.group(1)) >= 50, tail


FP8_FILES = ["tests/test_quantization_fp8_kernels.py", "tests/gpu/test_gpu_fp8_moe.py"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu runs these kernels natively")
def test_fp8_kernel_tests_pass_in_the_triton_interpreter():
    """The FP8 linear kernels (decode tiles, in-kernel input quantization, split K, the GEMM) and the FP8 fused-MoE
    kernels, against the reference arithmetic on inputs the interpreter quantizes exactly (its float8 downcast
    is wrong where rounding carries into the next binade; docs/quantization.md)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FP8_FILES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 30, tail
