"""Overlap scheduling on CUDA: the scheduler's chained decode gives the synchronous loop's tokens.

One ``ModelRunner`` (SmolLM2 where present, CUDA graphs, flashinfer when it
loads, else triton) serves two schedulers in turn, one with
``--disable-overlap-schedule`` and one with the default overlap.  Every request
is submitted at once and decodes up to 64 greedy tokens (batch 17: lengths
40..64, so the batch shrinks while steps are chained), so both loops run the
same batch sizes step by step and must agree token for token.  Afterwards
every KV slot is free.  A third run stops requests on a token taken from the
synchronous output: each ends at that token's first occurrence (the extra
chained step of a stopped request is dropped) and the slots are freed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch
from gpu_common import requires_cuda

from kvship.engine.config import ServerArgs
from kvship.engine.io_struct import GenerateRequest, SamplingParams
from kvship.engine.model_runner import ModelRunner
from kvship.engine.scheduler import Scheduler

pytestmark = [pytest.mark.gpu, requires_cuda]

STEPS = 64


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = os.environ.get("KVSHIP_SMOLLM2_GGUF")
    if not path:
        try:
            from kvship.engine.embedded import embedded_model_path

            path = embedded_model_path()
        except FileNotFoundError:
            from conftest import build_tiny_model

            path = build_tiny_model(
                str(tmp_path_factory.mktemp("overlap_model")),
                "llama",
                seed=5,
                hidden_size=256,
                intermediate_size=512,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
            )
    backend = "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"
    sa = ServerArgs(
        model_path=path,
        device="cuda",
        dtype="bfloat16",
        attention_backend=backend,
        max_total_tokens=16384,
        max_running_requests=32,
        context_length=1024,
        cuda_graph_max_bs=32,
    )
    return ModelRunner(sa)


def serve(runner: ModelRunner, reqs: list[GenerateRequest], overlap: bool) -> tuple[dict, Scheduler]:
    chunks: list = []
    sa = dataclasses.replace(
        runner.server_args, disable_overlap_schedule=not overlap, disable_radix_cache=True, sampling_backend="torch"
    )
    sched = Scheduler(sa, runner, None, chunks.extend)
    assert (sched.overlap is not None) == overlap
    for r in reqs:
        sched.submit(dataclasses.replace(r))
    for _ in range(10 * STEPS):
        sched.step()
        if sched.idle():
            break
    torch.cuda.synchronize()
    out: dict = {}
    for c in chunks:
        o = out.setdefault(c.rid, {"tokens": [], "finish": None})
        o["tokens"] += c.token_ids
        if c.finished:
            assert o["finish"] is None, f"{c.rid}: two finished chunks"
            o["finish"] = c.finish_reason
    return out, sched


def requests(runner: ModelRunner, bs: int, stops: dict | None = None) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(500 + bs)
    vocab = runner.model_config.vocab_size
    reqs = []
    for i in range(bs):
        n = int(torch.randint(4, 60, (1,), generator=gen))
        prompt = torch.randint(3, vocab, (n,), generator=gen).tolist()
        max_new = STEPS if bs < 17 else 40 + (i * 3) % 25
        stop = [] if stops is None else [stops[f"r{i}"]]
        reqs.append(
            GenerateRequest(
                f"r{i}",
                prompt,
                SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True, stop_token_ids=stop),
            )
        )
    return reqs


def assert_free(sched: Scheduler) -> None:
    st = sched.get_stats()
    assert st["free_slots"] == st["total_slots"], st
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
    assert not sched.running and not sched.reqs
    assert sched.overlap is None or not sched.overlap.has_pending()


@pytest.mark.parametrize("bs", [1, 3, 17])
def test_overlapped_scheduler_decodes_the_same_greedy_tokens_and_frees_every_slot(runner, bs):
    reqs = requests(runner, bs)
    sync, s_sched = serve(runner, reqs, overlap=False)
    over, o_sched = serve(runner, reqs, overlap=True)
    for r in reqs:
        assert over[r.rid]["tokens"] == sync[r.rid]["tokens"], r.rid
        assert len(sync[r.rid]["tokens"]) == r.sampling_params.max_new_tokens
        assert (
            over[r.rid]["finish"]
            == sync[r.rid]["finish"]
            == {"type": "length", "length": r.sampling_params.max_new_tokens}
        )
    assert o_sched.overlap.launched >= STEPS // 2 - 2
    assert_free(s_sched)
    assert_free(o_sched)

    # stop on a token of the middle of each output: each ends at that token's first occurrence in its own
    # output (the extra chained step of a stopped request is dropped) or runs to its length without it.
    # Not compared token for token with a synchronous run: there a stopped request leaves the batch at once,
    # here it is in the next (already launched) step too, so later steps run other batch sizes, and a random
    # fallback model's bf16 near-ties may flip (the run without stops above has identical batches and is exact)
    stops = {r.rid: sync[r.rid]["tokens"][len(sync[r.rid]["tokens"]) // 2] for r in reqs}
    stopped, st_sched = serve(runner, requests(runner, bs, stops), overlap=True)
    n_stopped = 0
    for r in reqs:
        toks, finish, stop = stopped[r.rid]["tokens"], stopped[r.rid]["finish"], stops[r.rid]
        if stop in toks:
            n_stopped += 1
            assert toks.index(stop) == len(toks) - 1 and finish == {"type": "stop", "matched": stop}, r.rid
        else:
            assert finish == {"type": "length", "length": r.sampling_params.max_new_tokens}, r.rid
    assert n_stopped >= (len(reqs) + 1) // 2
    assert_free(st_sched)


@pytest.mark.parametrize("bs", [1, 4])
def test_graph_decode_through_the_scheduler_equals_eager(runner, bs):
    """The launcher's packed decode inputs (one copy into the graph's buffers) and the chained step's input
    ids taken as they are give eager decoding's tokens; at captured sizes both run the same kernels."""
    reqs = requests(runner, bs)
    graphs = runner.cuda_graph_runner
    assert graphs is not None and bs in graphs.batch_sizes
    runner.cuda_graph_runner = None
    try:
        eager, e_sched = serve(runner, reqs, overlap=False)
    finally:
        runner.cuda_graph_runner = graphs
    replays = graphs.replays
    over, o_sched = serve(runner, reqs, overlap=True)
    assert graphs.replays - replays >= STEPS - 1
    for r in reqs:
        assert over[r.rid]["tokens"] == eager[r.rid]["tokens"], r.rid
    assert_free(e_sched)
    assert_free(o_sched)


def test_host_mirror_of_req_to_token_equals_the_device_table(runner):
    """Finishing requests' slots (and prefill's pages to send) are read from ``ReqToTokenPool``'s host mirror,
    with no device sync: after every step of an overlapped, radix-cached run each live row's mirror equals the
    device table, including a request whose prefix row was written from a cache match."""
    sa = dataclasses.replace(
        runner.server_args, disable_overlap_schedule=False, disable_radix_cache=False, sampling_backend="torch"
    )
    sched = Scheduler(sa, runner, None, lambda chunks: None)
    pool = sched.req_to_token_pool
    assert pool.host is not None and pool.host is not pool.req_to_token
    reqs = requests(runner, 3)
    checked = 0
    for phase in (reqs, [dataclasses.replace(reqs[0], rid="again")]):  # the second hits the first's cached pages
        for r in phase:
            sched.submit(dataclasses.replace(r))
        for _ in range(10 * STEPS):
            sched.step()
            torch.cuda.synchronize()
            for req in list(sched.reqs.values()):
                if req.req_pool_idx is None:
                    continue
                n = req.kv_allocated_len
                device = pool.req_to_token[req.req_pool_idx, :n].cpu().long()
                assert torch.equal(pool.read_host(req.req_pool_idx, 0, n), device), req.rid
                checked += 1
            if sched.idle():
                break
    assert checked > STEPS
    assert sched.get_stats()["cached_tokens"] > 0
    assert_free(sched)
