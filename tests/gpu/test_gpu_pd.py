"""PD on one GPU: prefill and decode schedulers in one process, KV pools in VRAM, each backend.

Prefill's pages go VRAM -> VRAM (nixl: CUDA IPC; mooncake: its tcp protocol
without an RDMA NIC; tcp: staged through host memory); decode then runs its
steps (CUDA graphs on) on the received KV.  Greedy output must equal the
unified scheduler's on the same GPU, and every slot must be free afterwards.
"""

from __future__ import annotations

import pytest
from gpu_common import requires_cuda
from pd_fixtures import InProcessPD, make_prompts, unified_greedy

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.timeout(600)]

MAX_NEW = 16


@pytest.mark.parametrize("backend", ["nixl", "mooncake", "tcp"])
def test_pd_on_gpu_equals_unified_for_each_backend(tiny_llama_dir, backend):
    from kvship.engine.disagg import BackendUnavailableError, get_transfer_backend

    try:
        get_transfer_backend(backend)
    except BackendUnavailableError as e:
        pytest.skip(f"{backend} unavailable here: {e}")
    kw = dict(
        device="cuda",
        dtype="float32",
        page_size=16,
        chunked_prefill_size=32,
        attention_backend="triton",
        max_total_tokens=8192,
    )
    prompts = make_prompts(32, seed=3, lo=1, hi=100)
    rids = [f"g{i}" for i in range(len(prompts))]
    with InProcessPD(tiny_llama_dir, backend=backend, decode_kv=dict(checksum=True), **kw) as pd:
        for rid, p in zip(rids, prompts):
            pd.submit(rid, p, MAX_NEW)
        pd.wait(rids, timeout=120)
        expected = unified_greedy(tiny_llama_dir, prompts, MAX_NEW, **kw)
        assert all(pd.finish(r)["type"] in ("stop", "length") for r in rids), [pd.finish(r) for r in rids]
        assert [pd.tokens(r) for r in rids] == expected
        assert pd.decode.runner.cuda_graph_runner is not None, "decode should replay CUDA graphs here"
        pd.wait_idle()
