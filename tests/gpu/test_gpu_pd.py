"""PD on one GPU: prefill and decode schedulers in one process, KV pools in VRAM, each backend.

Prefill's pages go VRAM -> VRAM (nixl: CUDA IPC; mooncake: its tcp protocol
without an RDMA NIC; tcp: staged through host memory); decode then runs its
steps (CUDA graphs on) on the received KV.  Greedy output must equal the
unified scheduler's on the same GPU, and every slot must be free afterwards.
Layer-wise sends (docs/pd.md, "Layer-wise transfer"): the same equality with
every room shipped layer by layer behind CUDA events, and layer 0's KV in
decode's VRAM while prefill's last layer is held.
"""

from __future__ import annotations

import pytest
from gpu_common import requires_cuda
from pd_fixtures import HeldLayer, InProcessPD, layer0_on_decode, make_prompts, unified_greedy

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


# --- layer-wise transfer (docs/pd.md, "Layer-wise transfer"): CUDA events per layer ---------------------
GPU_KW = dict(
    device="cuda",
    dtype="float32",
    page_size=16,
    chunked_prefill_size=32,
    attention_backend="triton",
    max_total_tokens=8192,
)


def _backend_or_skip(backend: str) -> None:
    from kvship.engine.disagg import BackendUnavailableError, get_transfer_backend

    try:
        get_transfer_backend(backend)
    except BackendUnavailableError as e:
        pytest.skip(f"{backend} unavailable here: {e}")


@pytest.mark.parametrize("backend", ["nixl", "mooncake", "tcp"])
def test_layerwise_pd_on_gpu_equals_unified_for_each_backend(tiny_llama_dir, backend):
    _backend_or_skip(backend)
    prompts = make_prompts(12, seed=5, lo=1, hi=100)
    threads = dict(transfer_threads=len(prompts) + 1)  # every room may go layer-wise
    with InProcessPD(tiny_llama_dir, backend=backend, prefill_kv=threads, **GPU_KW) as pd:
        rids = pd.run_registered_first(prompts, MAX_NEW)
        assert [pd.tokens(r) for r in rids] == unified_greedy(tiny_llama_dir, prompts, MAX_NEW, **GPU_KW)
        assert pd.prefill.get_stats()["kv_transfers_layerwise"] == len(prompts)
        pd.wait_idle()


@pytest.mark.parametrize("backend", ["nixl", "tcp"])
def test_layerwise_on_gpu_ships_layer0_while_the_last_layer_waits(tiny_llama_dir, backend):
    _backend_or_skip(backend)
    prompt = make_prompts(1, seed=6, lo=90, hi=90)[0]
    with InProcessPD(tiny_llama_dir, backend=backend, **GPU_KW) as pd:
        with HeldLayer(pd, 1, while_held=lambda: layer0_on_decode(pd, "x", len(prompt))) as hold:
            hold.release.set()  # the check itself is the hold
            room = pd.submit("x", prompt, MAX_NEW, to="decode")
            pd.wait_registered(1)
            pd.submit("x", prompt, MAX_NEW, to="prefill", room=room)
            pd.wait(["x"], timeout=120)
        assert hold.result is True, "layer 0's KV had not reached decode while the last layer waited"
        assert pd.tokens("x") == unified_greedy(tiny_llama_dir, [prompt], MAX_NEW, **GPU_KW)[0]
        pd.wait_idle()
