"""Speculative decoding over pipeline stages (CPU, gloo, real rank processes): ngram at ``--pp-size 2``.

One group of rank processes (``--pp-size 2``: 2; ``--pp-size 2 --tp-size 2``: 4) builds, on every rank, its
stage of a tiny two-layer Llama and the unified scheduler with the pipeline scheduler I/O, exactly as
``kvship serve --pp-size 2`` does: first without speculation (the plain PP path), then with
``--speculative-algorithm ngram``.  The leader submits greedy requests whose prompts repeat a pattern (prompt
lookup finds drafts), one greedy request with logprobs, a sampled one, a seeded one (it decodes plainly inside
the round) and one aborted mid-stream; every rank steps until the leader stops it and reports its tokens,
logprobs, counters and KV pool.  Greedy tokens must equal the plain PP=2 path and the single process; every
stage must emit the same tokens and logprobs (acceptances are the last stage's) and leave its KV pool full.
"""

from __future__ import annotations

import pytest
from pd_fixtures import Collector, _server_args, run_until_idle, unified_greedy
from server_fixtures import rank_body, run_ranks
from test_spec_decode import _prompts  # prompts that repeat a pattern: prompt lookup finds drafts

from kvship.engine.config import ServerArgs

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 20
RANK_TIMEOUT_S = 240
PROMPTS = _prompts(3, seed=41)
EXTRA = _prompts(4, seed=42)  # the logprob, sampled, seeded and aborted requests
BASE = dict(attention_backend="torch_native", max_total_tokens=2048, max_running_requests=16)
RIDS = [f"g{i}" for i in range(len(PROMPTS))] + ["lp", "hot", "seeded", "gone"]


def _submit(sched) -> None:
    from kvship.engine.io_struct import GenerateRequest, SamplingParams

    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    for i, p in enumerate(PROMPTS):
        sched.submit(GenerateRequest(f"g{i}", list(p), greedy))
    sched.submit(GenerateRequest("lp", EXTRA[0], greedy, return_logprob=True, top_logprobs_num=2))
    sched.submit(GenerateRequest("hot", EXTRA[1], SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9)))
    sched.submit(GenerateRequest("seeded", EXTRA[2], SamplingParams(max_new_tokens=8, temperature=0.7, seed=5)))
    sched.submit(GenerateRequest("gone", EXTRA[3], SamplingParams(max_new_tokens=300, temperature=0.0)))


def _run(groups, sa: ServerArgs) -> dict:
    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.scheduler.io import scheduler_io

    runner = ModelRunner(sa, groups=groups)
    stopped: list = []
    io = scheduler_io(groups.tp, lambda: stopped.append(True), link=runner.pipeline)
    sink = Collector()
    sched = scheduler_for_mode("unified")(sa, runner, None, sink, io=io)
    if groups.topology.rank != 0:  # another random stream than the leader's: acceptances must be the last stage's
        sched.launcher.sampler.generator.manual_seed(1000 + groups.topology.rank)
    if groups.is_leader:
        _submit(sched)
        for _ in range(6):
            sched.step()
        sched.abort("gone")
        run_until_idle(sched)
        sched.inbox.close("test done")
    else:
        while not stopped:
            sched.step(block_s=0.01)
    st = sched.get_stats()
    lp_chunks = [c for c in sink.chunks if c.rid == "lp"]
    return {
        "tokens": {rid: sink.tokens(rid) for rid in RIDS},
        "logprobs": [round(x, 4) for c in lp_chunks for x in (c.logprobs or [])],
        "top_ids": [[t for t, _ in top] for c in lp_chunks for top in (c.top_logprobs or [])],
        "gone": [c.finish_reason["type"] for c in sink.finished("gone")],
        "free": (st["free_slots"], st["total_slots"]),
        "open": len(sched.reqs),
        "spec": {k: st.get(k) for k in ("spec_rounds", "spec_draft_tokens", "spec_accept_length")},
        "stage": runner.pipeline.stage,
    }


def _rank_main(rank: int, init_method: str, tp: int, model: str, out) -> None:
    def body(groups) -> dict:
        return {
            name: _run(groups, _server_args(model, tp_size=tp, pp_size=2, **BASE, **kw))
            for name, kw in (("plain", {}), ("ngram", {"speculative_algorithm": "ngram"}))
        }

    rank_body(rank, init_method, _server_args("", tp_size=tp, pp_size=2), body, out)


@pytest.fixture(scope="module")
def pp2(tiny_llama_dir) -> list[dict]:
    """Per rank of a --pp-size 2 worker: {"plain" | "ngram": results}."""
    return run_ranks(_rank_main, 2, (1, tiny_llama_dir), RANK_TIMEOUT_S)


def _single(model: str) -> dict[str, list[int]]:
    toks = unified_greedy(model, PROMPTS + EXTRA[:1], MAX_NEW, attention_backend="torch_native")
    return {**{f"g{i}": t for i, t in enumerate(toks[:-1])}, "lp": toks[-1]}


def _check(ranks: list[dict], want: dict[str, list[int]]) -> None:
    last = ranks[-1]["ngram"]
    for rank, res in enumerate(ranks):
        spec, plain = res["ngram"], res["plain"]
        for rid, toks in want.items():
            assert spec["tokens"][rid] == toks, (rank, rid)
            assert plain["tokens"][rid] == toks, (rank, rid, "plain PP")
        # every stage emitted the last stage's tokens and logprobs, sampled and seeded requests included
        assert spec["tokens"] == last["tokens"], rank
        assert spec["logprobs"] == last["logprobs"] and len(spec["logprobs"]) == MAX_NEW, rank
        assert spec["top_ids"] == last["top_ids"] and all(len(t) == 2 for t in spec["top_ids"]), rank
        assert len(spec["tokens"]["hot"]) == 16 and len(spec["tokens"]["seeded"]) == 8, rank
        assert spec["gone"] == ["abort"] and 0 < len(spec["tokens"]["gone"]) < 300, rank
        assert spec["spec"] == last["spec"], rank  # the same rounds on every stage
        assert spec["spec"]["spec_rounds"] > 0 and spec["spec"]["spec_accept_length"] > 1.0, (rank, spec["spec"])
        for name in ("plain", "ngram"):  # every stage's KV pool is back to full
            assert res[name]["free"][0] == res[name]["free"][1] and res[name]["open"] == 0, (rank, name)


def test_ngram_at_pp2_gives_the_plain_pp2_and_single_process_greedy_tokens_on_every_stage(pp2, tiny_llama_dir):
    assert [r["ngram"]["stage"] for r in pp2] == [0, 1]
    _check(pp2, _single(tiny_llama_dir))
    # the greedy logprobs equal the plain PP path's (verify logits of the accepted path = decode logits)
    assert pp2[0]["ngram"]["logprobs"] == pytest.approx(pp2[0]["plain"]["logprobs"], abs=2e-3)


def test_ngram_at_pp2_tp2_gives_the_single_process_greedy_tokens_on_every_rank(tiny_llama_dir):
    ranks = run_ranks(_rank_main, 4, (2, tiny_llama_dir), RANK_TIMEOUT_S)
    assert [r["ngram"]["stage"] for r in ranks] == [0, 0, 1, 1]
    _check(ranks, _single(tiny_llama_dir))


@pytest.mark.parametrize("algo", ["draft", "eagle", "eagle3"])
def test_other_algorithms_over_pipeline_stages_are_one_clear_line(algo):
    sa = ServerArgs(pp_size=2, speculative_algorithm=algo, speculative_draft_model_path="/models/x")
    with pytest.raises(
        ValueError, match=f"runs --speculative-algorithm ngram only .*got --speculative-algorithm {algo}"
    ):
        sa.validate()
    ServerArgs(pp_size=2, speculative_algorithm="ngram").validate()
