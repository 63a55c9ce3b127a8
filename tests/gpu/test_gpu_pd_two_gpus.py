"""PD across two GPUs through ``kvship local``: prefill on GPU 0, decode on GPU 1 (issue 15, part 4).

``kvship local --device cuda`` spreads its workers over the visible GPUs (``--gpu-placement spread``,
docs/pd.md "kvship local"): with two GPUs the prefill worker runs on cuda:0 and the decode worker on cuda:1,
so every prompt's KV crosses GPUs (nixl: CUDA IPC over NVLink; mooncake: its tcp protocol without an RDMA
NIC; tcp: staged through host memory).  For each backend:

* the workers report the GPUs placement gave them (``/get_server_info``'s ``device``; ``kvship local``'s log
  names them too);
* greedy 32-token answers to a few prompts, one request at a time (both deployments then batch alike),
  equal a unified ``kvship serve`` on GPU 0 token for token.

The model is a tiny random Llama written by ``transformers`` in bf16 (head dim 64, which every attention
backend takes).  Skipped without two CUDA GPUs.  Run on a 2-GPU device:
``pytest -q tests/gpu/test_gpu_pd_two_gpus.py``.
"""

from __future__ import annotations

import pytest
import torch
from gpu_common import HAS_CUDA, NO_CUDA_REASON
from pd_fixtures import make_prompts, start_local
from server_fixtures import start_server

GPU_COUNT = torch.cuda.device_count() if HAS_CUDA else 0
requires_two_gpus = pytest.mark.skipif(
    GPU_COUNT < 2, reason=NO_CUDA_REASON if not HAS_CUDA else f"{GPU_COUNT} GPU visible; this test needs 2"
)
pytestmark = [pytest.mark.gpu, requires_two_gpus, pytest.mark.timeout(900)]

MAX_NEW = 32
WORKER_FLAGS = [
    "--device",
    "cuda",
    "--dtype",
    "bfloat16",
    "--page-size",
    "16",
    "--max-total-tokens",
    "8192",
    "--context-length",
    "1024",
]
SAMPLING = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def bf16_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama (conftest's builder, a wider shape) saved again in bf16 by ``save_pretrained``."""
    import transformers
    from conftest import build_tiny_model

    path = build_tiny_model(
        str(tmp_path_factory.mktemp("pd_two_gpus")),
        "llama",
        seed=31,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    model = transformers.LlamaForCausalLM.from_pretrained(path)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(4, seed=11, lo=5, hi=300)


@pytest.fixture(scope="module")
def unified_answers(bf16_llama_dir, prompts) -> list[list[int]]:
    """Greedy answers of a unified worker on GPU 0 (the reference), one request at a time."""
    with start_server(["--model-path", bf16_llama_dir, *WORKER_FLAGS], timeout=600) as srv:
        assert srv.get("/get_server_info").json()["device"] == "cuda:0"
        answers = []
        for ids in prompts:
            r = srv.post("/generate", json={"input_ids": ids, "sampling_params": SAMPLING}, timeout=120)
            assert r.status_code == 200, r.text
            answers.append(r.json()["output_ids"])
    assert all(len(a) == MAX_NEW for a in answers)
    return answers


@pytest.mark.parametrize("backend", ["nixl", "mooncake", "tcp"])
def test_pd_with_prefill_on_gpu0_and_decode_on_gpu1_equals_unified(bf16_llama_dir, prompts, unified_answers, backend):
    from kvship.engine.disagg import BackendUnavailableError, get_transfer_backend

    try:
        get_transfer_backend(backend)
    except BackendUnavailableError as e:
        pytest.skip(f"{backend} unavailable here: {e}")
    args = ["--model-path", bf16_llama_dir, "--transfer-backend", backend, *WORKER_FLAGS]
    with start_local(args, timeout=600) as cluster:
        (prefill,), (decode,) = cluster.workers("prefill"), cluster.workers("decode")
        devices = {role: cluster.info(url)["device"] for role, url in (("prefill", prefill), ("decode", decode))}
        assert devices == {"prefill": "cuda:0", "decode": "cuda:1"}, devices
        log = cluster.log("local", n=200)
        assert "prefill-0 on GPU 0" in log and "decode-0 on GPU 1" in log, log
        got = []
        for ids in prompts:
            r = cluster.generate(ids, sampling_params=SAMPLING)
            assert r.status_code == 200, r.text
            got.append(r.json()["output_ids"])
        assert got == unified_answers, f"PD across GPUs ({backend}) differs from unified on GPU 0"
        cluster.wait_free([prefill, decode])
