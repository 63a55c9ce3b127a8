"""CUDA-graph decode replays exactly what eager decode computes.

For each backend, a runner with graphs (captured sizes 1, 2, 4, 8, 16, 24,
32, 48, 64) and one with ``--disable-cuda-graph`` prefill the same prompts and
then decode 64 greedy tokens; the tokens must be equal one for one.  Batch
sizes 1 and 64 replay their own graphs, 3 and 17 are padded (to 4 and 24).
The model is the SmolLM2 GGUF (real weights, so greedy choices are not
near-ties) where present, else a tiny random model.
"""

from __future__ import annotations

import gc

import pytest
import torch
from gpu_common import requires_cuda, requires_flashinfer, smollm2_or_tiny_llama

from kvship.engine.config import ServerArgs
from kvship.engine.forward_batch import ForwardMode
from kvship.engine.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu, requires_cuda]

GRAPH_BS = [1, 2, 4, 8, 16, 24, 32, 48, 64]
STEPS = 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return smollm2_or_tiny_llama(tmp_path_factory, "graph_model", seed=21)


def make_runner(model_path: str, backend: str, graphs: bool, page_size: int = 1, max_bs: int = 64) -> ModelRunner:
    return ModelRunner(
        ServerArgs(
            model_path=model_path,
            device="cuda",
            dtype="bfloat16",
            attention_backend=backend,
            page_size=page_size,
            max_total_tokens=16384,
            max_running_requests=max_bs,
            context_length=1024,
            disable_cuda_graph=not graphs,
            cuda_graph_bs=GRAPH_BS,
            cuda_graph_max_bs=max_bs,
        )
    )


def greedy_batch(runner: ModelRunner, driver_cls, bs: int, steps: int = STEPS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1000 + bs)
    vocab = runner.model_config.vocab_size
    d = driver_cls(runner)
    reqs = [d.new() for _ in range(bs)]
    prompts = [
        torch.randint(3, vocab, (int(torch.randint(4, 40, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(bs)
    ]
    logits = d.extend(reqs, prompts)
    out: list[list[int]] = [[] for _ in range(bs)]
    for _ in range(steps):
        toks = logits.argmax(-1).tolist()
        for o, t in zip(out, toks):
            o.append(t)
        logits = d.decode(reqs, toks)
    for r in reqs:
        d.free(r)
    return out


def _release(*runners) -> None:
    for r in runners:
        del r
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", ["flashinfer", "triton", "flashinfer+triton-decode"])
def test_cuda_graph_replay_equals_eager_token_for_token(model_path, kv_driver, backend, monkeypatch):
    if backend.startswith("flashinfer"):
        requires_flashinfer()
    if backend == "flashinfer+triton-decode":  # batches up to 8 on the Triton one-kernel decode
        monkeypatch.setenv("KVSHIP_FLASHINFER_TRITON_DECODE_BS", "1-8")
        backend = "flashinfer"
    graph_runner = make_runner(model_path, backend, graphs=True)
    cgr = graph_runner.cuda_graph_runner
    assert cgr is not None and cgr.batch_sizes == GRAPH_BS
    eager_runner = make_runner(model_path, backend, graphs=False)
    assert eager_runner.cuda_graph_runner is None
    for bs in (1, 3, 17, 64):
        before = cgr.replays
        got = greedy_batch(graph_runner, kv_driver, bs)
        assert cgr.replays - before == STEPS, "decode steps did not replay graphs"
        want = greedy_batch(eager_runner, kv_driver, bs)
        for i, (g, w) in enumerate(zip(got, want)):
            first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
            assert first is None, f"bs {bs} row {i}: graph and eager diverge at step {first}"
    _release(graph_runner, eager_runner)


def test_batches_graphs_cannot_take_run_eagerly(model_path, kv_driver):
    requires_flashinfer()
    runner = make_runner(model_path, "flashinfer", graphs=True, max_bs=8)
    cgr = runner.cuda_graph_runner
    assert cgr is not None and cgr.max_bs == 8
    before = cgr.replays
    out = greedy_batch(runner, kv_driver, 12, steps=4)  # larger than any captured graph
    assert cgr.replays == before and len(out) == 12 and all(len(o) == 4 for o in out)
    d = kv_driver(runner)
    req = d.new()
    d.extend([req], [[5, 6, 7]])  # extends never replay
    assert cgr.replays == before
    assert not cgr.can_run(
        type("FB", (), {"forward_mode": ForwardMode.EXTEND, "batch_size": 1, "logits_indices": None})()
    )
    d.free(req)
    _release(runner)


def test_page_size_16_graph_replay_equals_eager(model_path, kv_driver):
    requires_flashinfer()
    graph_runner = make_runner(model_path, "flashinfer", graphs=True, page_size=16, max_bs=24)
    eager_runner = make_runner(model_path, "flashinfer", graphs=False, page_size=16, max_bs=24)
    assert greedy_batch(graph_runner, kv_driver, 17, steps=32) == greedy_batch(eager_runner, kv_driver, 17, steps=32)
    _release(graph_runner, eager_runner)


@pytest.mark.parametrize("graphs", [True, False])
def test_pdl_and_fused_rope_store_keep_greedy_tokens(model_path, kv_driver, monkeypatch, graphs):
    """Programmatic dependent launch of our Triton kernels (on by default, ``KVSHIP_PDL=0`` off) and the fused RoPE + KV
    store change no token: 64 greedy steps at batch 3 (a padded graph) and 17 with both on equal those with
    both off."""
    requires_flashinfer()
    from kvship.engine.layers import fused_dispatch
    from kvship.engine.layers.rotary import RotaryEmbedding

    fused_calls = []
    real = RotaryEmbedding.rotate_and_store

    def spy(self, *a, **kw):
        done = real(self, *a, **kw)
        fused_calls.append(done)
        return done

    monkeypatch.setattr(RotaryEmbedding, "rotate_and_store", spy)

    def run(flag: str) -> list[list[int]]:
        monkeypatch.setenv("KVSHIP_PDL", flag)
        monkeypatch.setenv("KVSHIP_FUSE_ROPE_KV_STORE", flag)
        fused_dispatch._PDL.clear()
        try:
            runner = make_runner(model_path, "flashinfer", graphs=graphs)
            out = [greedy_batch(runner, kv_driver, bs) for bs in (3, 17)]
            _release(runner)
            return out
        finally:
            fused_dispatch._PDL.clear()

    on = run("1")
    assert fused_calls and all(fused_calls), "the fused RoPE + KV store did not run"
    assert fused_dispatch.use_pdl(torch.empty(1, device="cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    fused_calls.clear()
    off = run("0")
    assert fused_calls and not any(fused_calls)
    assert on == off


@requires_cuda
def test_capture_survives_garbage_whose_finalizer_is_capture_unsafe(model_path, kv_driver, monkeypatch):
    """Cyclic garbage whose finalizer does CUDA work a capture forbids (here it synchronizes the device, as a
    pinned buffer's free or a transfer engine's deregistration does CUDA work) becomes garbage inside every
    capture, with a collection due at nearly every allocation: the collector stays off while the graphs are
    captured (``cuda_graph_runner.collector_paused``), so the decode and prefill graphs capture, their
    finalizers run after, and the graphs replay the eager tokens.  Without the guard the first capture fails."""

    class CudaFinalizer:
        ran = 0

        def __init__(self):
            self.me = self  # a cycle: only the collector frees it

        def __del__(self):
            CudaFinalizer.ran += 1
            torch.cuda.synchronize()  # forbidden while a stream captures (global capture mode)

    eager = make_runner(model_path, "triton", graphs=False)
    want = greedy_batch(eager, kv_driver, 3, steps=8)
    _release(eager)
    begin = torch.cuda.CUDAGraph.capture_begin

    def begin_and_drop_garbage(self, *args, **kwargs):
        begin(self, *args, **kwargs)
        CudaFinalizer()  # garbage from the first statement of the capture on

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", begin_and_drop_garbage)
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        runner = make_runner(model_path, "triton", graphs=True)
    finally:
        gc.set_threshold(*thresholds)
        monkeypatch.undo()
    gc.collect()
    assert runner.cuda_graph_runner is not None and runner.prefill_graph_runner is not None
    assert CudaFinalizer.ran >= len(runner.cuda_graph_runner.graphs) and gc.isenabled()
    assert greedy_batch(runner, kv_driver, 3, steps=8) == want
    _release(runner)
