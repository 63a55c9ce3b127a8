"""Two GPUs: speculative decoding at ``--tp-size 2`` (NCCL, CUDA graphs) through real ``kvship serve`` workers.

Skipped unless CUDA sees at least two GPUs.  One module fixture starts every
worker at once on a tiny random Llama (float32, ``triton`` attention, no
prefix cache; rank 0 on GPU 0, rank 1 on GPU 1):

=====================  ==========================================================
``plain_tp1``          the reference: plain decoding, one GPU
``eagle_tp2``          a random EAGLE head at TP=2: verify graphs and the head's
                       draft graphs capture the target's NCCL collectives
``eagle_tp2_eager``    the same with ``--disable-cuda-graph``
``ngram_tp2``          prompt lookup at TP=2
``draft_tp2``          the target drafting for itself, sharded like the target
=====================  ==========================================================

Each answers one ``/generate`` call of 4 prompts (a captured batch size) with
top-2 logprobs; greedy ids must equal the reference's up to near ties
(``assert_same_greedy`` of ``test_gpu_two_gpus``: float32, 1e-3), the pools
must be full afterwards, and the graph workers' logs must show the captures.

Run on the device: ``pytest -q tests/gpu/test_gpu_spec_tp.py``.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from conftest import build_tiny_model
from gpu_common import requires_cuda
from server_fixtures import enter_together, start_server
from test_gpu_two_gpus import FP32_ENV, assert_same_greedy, generate
from test_spec_eagle import write_random_head

requires_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: runs on the 2-GPU device machine (issue 32)"
)
pytestmark = [pytest.mark.gpu, requires_cuda, requires_two_gpus]

PROMPT_LENS = (5, 17, 29, 40)
COMMON = [
    "--device", "cuda", "--dtype", "float32", "--attention-backend", "triton", "--context-length", "512",
    "--disable-radix-cache", "--max-total-tokens", "4096", "--max-running-requests", "8", "--cuda-graph-max-bs", "8",
    "--page-size", "1",
]  # fmt: skip


def _workers(target: str, head: str) -> dict[str, list[str]]:
    eagle = ["--speculative-algorithm", "eagle", "--speculative-draft-model-path", head]
    return {
        "plain_tp1": [],
        "eagle_tp2": ["--tp-size", "2", *eagle],
        "eagle_tp2_eager": ["--tp-size", "2", "--disable-cuda-graph", *eagle],
        "ngram_tp2": ["--tp-size", "2", "--speculative-algorithm", "ngram"],
        "draft_tp2": ["--tp-size", "2", "--speculative-algorithm", "draft", "--speculative-num-draft-tokens", "4"]
        + ["--speculative-draft-model-path", target],
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(32)
    return [[300 + i] + torch.randint(3, 300, (n - 1,), generator=gen).tolist() for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> dict:
    target = build_tiny_model(str(tmp_path_factory.mktemp("spec_tp_llama")), "llama", seed=32)
    head = write_random_head(str(tmp_path_factory.mktemp("spec_tp_eagle")), target, "eagle", seed=33)
    specs = _workers(target, head)
    managers = [
        start_server(["--model-path", target, *COMMON, *extra], timeout=300, keep_log=True, env=FP32_ENV)
        for extra in specs.values()
    ]
    with contextlib.ExitStack() as stack:
        yield dict(zip(specs, enter_together(stack, managers)))


def _wait_free(srv, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = srv.get("/get_server_info").json()
        if info["free_slots"] == info["total_slots"] or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


@pytest.mark.parametrize("name", ["eagle_tp2", "eagle_tp2_eager", "ngram_tp2", "draft_tp2"])
def test_speculation_at_tp2_gives_tp1_greedy_tokens_on_cuda(workers, prompts, name):
    ref = generate(workers["plain_tp1"], prompts)
    got = generate(workers[name], prompts)
    assert_same_greedy(ref, got, 1e-3, f"{name} vs plain TP=1")
    info = _wait_free(workers[name])
    assert info["tp_size"] == 2 and info["spec_rounds"] > 0
    assert info["free_slots"] == info["total_slots"], info
    if name == "draft_tp2":
        assert info["spec_accept_length"] > 2.0


def test_eagle_tp2_captures_verify_and_draft_graphs_with_nccl(workers):
    graphs, eager = (open(workers[n].log_path, errors="replace").read() for n in ("eagle_tp2", "eagle_tp2_eager"))
    assert "verify graphs" in graphs and "EAGLE draft graphs" in graphs
    assert "EAGLE draft graphs" not in eager
