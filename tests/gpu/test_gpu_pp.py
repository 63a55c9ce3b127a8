"""Two GPUs: pipeline parallelism through real ``kvship serve`` workers (issue 32, part 3).

Skipped unless CUDA sees at least two GPUs.  One module fixture starts every
worker at once (tiny random Llama of 4 layers, so they share the GPUs: stage
0 on GPU 0, stage 1 on GPU 1); each answers one ``/generate`` call of
``len(PROMPT_LENS)`` prompts with the top-2 logprobs:

=========================  ====================================================
``--pp-size 2``            against ``--pp-size 1``, float32 and bfloat16: the
                           hidden states sent between the stages over NCCL,
                           decode CUDA graphs of each stage's layers (stage 1's
                           read the received residual stream from its static
                           buffer), the last stage's tokens sent back
``--pp-size 2`` eager      ``--disable-cuda-graph``: the graphs replay as eager
``--pp-layer-partition``   ``1,3`` (an uneven split) against ``--pp-size 1``
=========================  ====================================================

Comparisons use ``assert_same_greedy`` of ``test_gpu_two_gpus`` (ids equal
until a near-tie of the reference; the micro-batches of a PP worker are
smaller batches than PP=1's, so their rounding may differ).  ``/get_server_info``
reports the pipeline counters: more than one micro-batch was in flight.

Run on the device: ``pytest -q tests/gpu/test_gpu_pp.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import build_tiny_model
from gpu_common import requires_cuda
from server_fixtures import enter_together, start_server
from test_gpu_two_gpus import FP32_ENV, TIE_TOL, assert_same_greedy, generate

requires_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: runs on the 2-GPU device machine (issue 32)"
)
pytestmark = [pytest.mark.gpu, requires_cuda, requires_two_gpus]

PROMPT_LENS = (5, 17, 29, 40, 9, 12, 33, 3)
COMMON = [
    "--device", "cuda", "--attention-backend", "triton", "--context-length", "512", "--disable-radix-cache",
    "--max-total-tokens", "4096", "--max-running-requests", "8", "--cuda-graph-max-bs", "8",
]  # fmt: skip
WORKERS = {
    "fp32_pp1": ("float32", []),
    "fp32_pp2": ("float32", ["--pp-size", "2"]),
    "fp32_pp2_eager": ("float32", ["--pp-size", "2", "--disable-cuda-graph"]),
    "fp32_pp2_1_3": ("float32", ["--pp-size", "2", "--pp-layer-partition", "1,3"]),
    "bf16_pp1": ("bfloat16", []),
    "bf16_pp2": ("bfloat16", ["--pp-size", "2"]),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(32)
    return [[300 + i] + torch.randint(3, 300, (n - 1,), generator=gen).tolist() for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> dict:
    path = build_tiny_model(str(tmp_path_factory.mktemp("pp_gpu_llama")), "llama", seed=32, num_hidden_layers=4)
    managers = [
        start_server(
            ["--model-path", path, "--dtype", dtype, *COMMON, *extra],
            timeout=300,
            keep_log=True,
            env=FP32_ENV if dtype == "float32" else None,
        )
        for dtype, extra in WORKERS.values()
    ]
    with contextlib.ExitStack() as stack:
        yield dict(zip(WORKERS, enter_together(stack, managers)))


@pytest.mark.parametrize(
    "ref, got",
    [
        ("fp32_pp1", "fp32_pp2"),
        ("fp32_pp1", "fp32_pp2_eager"),
        ("fp32_pp1", "fp32_pp2_1_3"),
        ("fp32_pp2_eager", "fp32_pp2"),
        ("bf16_pp1", "bf16_pp2"),
    ],
)
def test_pp2_on_two_gpus_gives_pp1_greedy_tokens(workers, prompts, ref, got):
    dtype = "float32" if ref.startswith("fp32") else "bfloat16"
    assert_same_greedy(generate(workers[ref], prompts), generate(workers[got], prompts), TIE_TOL[dtype], got)


def test_pp2_worker_keeps_several_micro_batches_in_flight(workers, prompts):
    generate(workers["fp32_pp2"], prompts)
    info = workers["fp32_pp2"].get("/get_server_info").json()
    assert info["pp_size"] == 2 and info["pp_max_in_flight"] >= 2, info
