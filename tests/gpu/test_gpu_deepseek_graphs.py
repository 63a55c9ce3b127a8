"""DeepSeek (MLA) decode in CUDA graphs: ``--attention-backend triton`` replays what eager decode computes.

A tiny random DeepSeek-V3 (tests/deepseek_fixtures.py: q LoRA, YaRN, grouped ``noaux_tc`` routing, shared
experts, a dense first layer) in bfloat16, captured sizes 1, 2, 4, 8:

* through the model runner, graphs on vs ``--disable-cuda-graph``: greedy decode of batches of 1, 3 (padded to
  4) and 8 gives the same tokens step for step, and every decode step replayed a graph;
* through the unified scheduler, plain and with the checkpoint's MTP module drafting (``eagle``): the same
  greedy tokens with graphs as without, the decode graphs replayed in the plain run, the verify and draft graphs
  in the speculative one;
* ``torch_native`` keeps decoding eagerly (no graph runner).

Eager steps split the MLA decode by the graph size a batch pads to (engine/attention/mla_triton.py), so both
runs execute the same kernels.  The graph hooks themselves are CPU-tested under Triton's interpreter
(tests/test_mla_graph.py).
"""

from __future__ import annotations

import gc

import pytest
import torch
from gpu_common import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

GRAPH_BS = [1, 2, 4, 8]
STEPS = 24


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory) -> str:
    from deepseek_fixtures import build_tiny_deepseek
    from test_deepseek_mtp import add_mtp_layer

    path = build_tiny_deepseek(str(tmp_path_factory.mktemp("ds_graphs")), "v3_yarn_grouped", seed=71)
    return add_mtp_layer(path, seed=72)


def _args(path: str, backend: str, graphs: bool, **kw):
    from kvship.engine.config import ServerArgs

    return ServerArgs(
        model_path=path,
        device="cuda",
        dtype="bfloat16",
        attention_backend=backend,
        page_size=1,
        max_total_tokens=8192,
        max_running_requests=8,
        disable_cuda_graph=not graphs,
        cuda_graph_bs=GRAPH_BS,
        cuda_graph_max_bs=8,
        **kw,
    )


def _greedy_batch(runner, driver_cls, bs: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(500 + bs)
    d = driver_cls(runner)
    reqs = [d.new() for _ in range(bs)]
    prompts = [
        torch.randint(3, 384, (int(torch.randint(4, 200, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(bs)
    ]
    logits = d.extend(reqs, prompts)
    out: list[list[int]] = [[] for _ in range(bs)]
    for _ in range(STEPS):
        toks = logits.argmax(-1).tolist()
        for o, t in zip(out, toks):
            o.append(t)
        logits = d.decode(reqs, toks)
    for r in reqs:
        d.free(r)
    return out


def _release(*objs) -> None:
    for o in objs:
        del o
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("merge_uv", ["0", "16"], ids=["einsum_uv", "merge_uv"])
def test_deepseek_triton_decode_graphs_replay_the_eager_tokens(ds_path, kv_driver, monkeypatch, merge_uv):
    # merge_uv: W_UV inside the decode merge kernel (KVSHIP_MLA_MERGE_UV_TOKENS), captured in the graphs too
    from kvship.engine.attention.mla_triton import MLATritonBackend
    from kvship.engine.model_runner import ModelRunner

    monkeypatch.setenv("KVSHIP_MLA_MERGE_UV_TOKENS", merge_uv)
    graph_runner = ModelRunner(_args(ds_path, "triton", graphs=True))
    assert isinstance(graph_runner.attn_backend, MLATritonBackend)
    cgr = graph_runner.cuda_graph_runner
    assert cgr is not None and cgr.batch_sizes == GRAPH_BS
    eager_runner = ModelRunner(_args(ds_path, "triton", graphs=False))
    assert eager_runner.cuda_graph_runner is None
    for bs in (1, 3, 8):
        before = cgr.replays
        got = _greedy_batch(graph_runner, kv_driver, bs)
        assert cgr.replays - before == STEPS, "decode steps did not replay graphs"
        want = _greedy_batch(eager_runner, kv_driver, bs)
        for i, (g, w) in enumerate(zip(got, want)):
            first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
            assert first is None, f"bs {bs} row {i}: graph and eager diverge at step {first}"
    _release(graph_runner, eager_runner)


def _decode_logits(runner, driver_cls, bs: int) -> torch.Tensor:
    """The logits of a greedy decode of ``bs`` requests, every step: ``[STEPS, bs, V]`` (float32, on the host)."""
    gen = torch.Generator().manual_seed(900 + bs)
    d = driver_cls(runner)
    reqs = [d.new() for _ in range(bs)]
    prompts = [torch.randint(3, 384, (7 + 29 * i,), generator=gen).tolist() for i in range(bs)]
    logits = d.extend(reqs, prompts)
    steps = []
    for _ in range(STEPS):
        logits = d.decode(reqs, logits.argmax(-1).tolist())
        steps.append(logits.float().cpu())
    for r in reqs:
        d.free(r)
    return torch.stack(steps)


def test_side_streams_give_the_one_stream_logits_bit_for_bit(ds_path, kv_driver, monkeypatch):
    """The shared experts beside the routed ones and MLA's absorbed query beside its prep kernel, on two streams
    (docs/deepseek.md, "Two streams"), in graphs and eagerly: the same kernels on the same inputs, so the decode
    logits equal those of one stream exactly."""
    from kvship.engine.model_runner import ModelRunner

    got = {}
    for tokens in (0, 16):
        monkeypatch.setenv("KVSHIP_SIDE_STREAM_TOKENS", str(tokens))
        for graphs in (True, False):
            runner = ModelRunner(_args(ds_path, "triton", graphs=graphs))
            got[tokens, graphs] = [_decode_logits(runner, kv_driver, bs) for bs in (1, 3, 8)]
            _release(runner)
    for graphs in (True, False):
        for bs, one, two in zip((1, 3, 8), got[0, graphs], got[16, graphs]):
            assert torch.equal(one, two), f"graphs={graphs} bs {bs}: max |diff| {(one - two).abs().max()}"


def test_deepseek_torch_native_decodes_eagerly(ds_path):
    from kvship.engine.model_runner import ModelRunner

    runner = ModelRunner(_args(ds_path, "torch_native", graphs=True))
    assert runner.cuda_graph_runner is None
    _release(runner)


def _serve(path: str, graphs: bool, prompts, **kw):
    """Greedy tokens of ``prompts`` (all submitted at once) through the unified scheduler, and the scheduler."""
    from pd_fixtures import Collector, run_until_idle

    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner

    sa = _args(path, "triton", graphs, **kw)
    out = Collector()
    sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, out)
    for i, p in enumerate(prompts):
        sched.submit(GenerateRequest(f"r{i}", list(p), SamplingParams(max_new_tokens=20, temperature=0.0)))
    run_until_idle(sched)
    st = sched.get_stats()
    assert st["free_slots"] == st["total_slots"]
    return [out.tokens(f"r{i}") for i in range(len(prompts))], sched


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_deepseek_served_with_graphs_gives_the_eager_greedy_tokens(ds_path, mtp):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 384, (5 + 17 * i,), generator=g).tolist() for i in range(6)]
    spec = (
        dict(
            speculative_algorithm="eagle",
            speculative_draft_model_path=ds_path,
            speculative_num_steps=2,
            speculative_eagle_topk=2,
            speculative_num_draft_tokens=4,
        )
        if mtp
        else {}
    )
    got, sched = _serve(ds_path, True, prompts, **spec)
    if mtp:
        sp = sched.speculator
        assert sp.graphs is not None and sp.graphs.replays > 0, "verify rounds did not replay graphs"
        assert sp.drafter.graphs is not None and sp.drafter.graphs.replays > 0, "draft steps did not replay graphs"
        assert sched.get_stats()["spec_rounds"] > 0
    else:
        assert sched.runner.cuda_graph_runner.replays > 0, "decode steps did not replay graphs"
    _release(sched)
    want, sched = _serve(ds_path, False, prompts, **spec)
    assert sched.runner.cuda_graph_runner is None
    assert got == want
    _release(sched)
