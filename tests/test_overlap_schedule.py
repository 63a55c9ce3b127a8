"""Overlap scheduling (``kvship.engine.scheduler.overlap``) on CPU: the same tokens as the synchronous loop.

The overlapped loop is on by default only on CUDA; ``KVSHIP_FORCE_OVERLAP_SCHEDULE=1``
turns it on here, so its bookkeeping (future input ids gathered from the pending
step, the extra step of a finished request, fallbacks to the synchronous loop)
runs against ``FakeRunner``, which checks every request's KV layout on each
forward and whose next token is a pure function of the context.
"""

from __future__ import annotations

import pytest
from test_scheduler import EOS, FakeRunner, assert_all_free, greedy, make, prompt, reference, run

from kvship.engine.io_struct import GenerateRequest, SamplingParams
from kvship.engine.scheduler.overlap import FORCE_ENV
from kvship.engine.scheduler.policy import SchedulerTuning


@pytest.fixture
def overlap_on(monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "1")


def both(build, **args):
    """Run ``build(sched)`` (which submits and steps) with overlap off and on; returns both (sched, out)."""
    res = {}
    for mode in ("sync", "overlap"):
        sa = dict(args)
        if mode == "sync":
            sa["disable_overlap_schedule"] = True
        sched, runner, out = make(FakeRunner(**build.runner_kw), **sa)
        assert (sched.overlap is not None) == (mode == "overlap")
        build(sched)
        res[mode] = (sched, out)
    return res


def staggered(sched, reqs, every=3):
    """Submit ``reqs`` one every ``every`` steps (so they join a running decode), then drain."""
    for i, r in enumerate(reqs):
        sched.submit(r)
        for _ in range(every if i < len(reqs) - 1 else 0):
            sched.step()
    run(sched)


@pytest.mark.parametrize("ps", [1, 4])
def test_overlapped_decode_equals_the_synchronous_loop_and_frees_every_slot(overlap_on, ps):
    lens = [3, 30, 7, 19, 1, 12, 5, 9]
    news = [12, 5, 20, 1, 9, 16, 2, 7]

    def build(sched):
        staggered(
            sched, [GenerateRequest(f"r{i}", prompt(n, i), greedy(m)) for i, (n, m) in enumerate(zip(lens, news))]
        )

    build.runner_kw = dict(total_tokens=1024, page_size=ps)
    res = both(build, page_size=ps, chunked_prefill_size=8, max_prefill_tokens=16)
    (_, out_s), (sched, out_o) = res["sync"], res["overlap"]
    for i, (n, m) in enumerate(zip(lens, news)):
        assert out_o.tokens(f"r{i}") == out_s.tokens(f"r{i}") == reference(prompt(n, i), m)
        assert out_o.final(f"r{i}").finish_reason == {"type": "length", "length": m}
    assert sched.overlap.launched > 10  # decode steps really were chained
    assert_all_free(sched)
    assert_all_free(res["sync"][0])


def test_requests_stopping_on_tokens_and_strings_release_their_extra_step(overlap_on):
    p = prompt(6, 11)
    ref = reference(p, 30)
    text = "".join(chr(ord("a") + t % 26) for t in ref)

    def build(sched):
        sched.submit(GenerateRequest("tok", p, greedy(30, stop_token_ids=[ref[4]])))
        sched.submit(GenerateRequest("str", p, greedy(30, stop=[text[8:10]])))
        sched.submit(GenerateRequest("len", prompt(4, 3), greedy(25)))
        run(sched)

    build.runner_kw = dict(total_tokens=256)
    res = both(build)
    (_, out_s), (sched, out_o) = res["sync"], res["overlap"]
    for rid in ("tok", "str", "len"):
        assert out_o.tokens(rid) == out_s.tokens(rid), rid
        assert out_o.final(rid).finish_reason == out_s.final(rid).finish_reason, rid
    assert out_o.tokens("tok") == ref[: ref.index(ref[4]) + 1]
    assert sched.overlap.launched > 0
    assert_all_free(sched)


def test_abort_of_a_request_with_a_step_in_flight_frees_its_slots(overlap_on):
    sched, runner, out = make(FakeRunner(total_tokens=256))
    sched.submit(GenerateRequest("a", prompt(5, 1), greedy(40)))
    sched.submit(GenerateRequest("b", prompt(7, 2), greedy(12)))
    for _ in range(6):
        sched.step()
    assert sched.overlap.has_pending()
    sched.abort("a")
    run(sched)
    assert out.final("a").finish_reason["type"] == "abort"
    assert reference(prompt(5, 1), 40)[: len(out.tokens("a"))] == out.tokens("a")
    assert out.tokens("b") == reference(prompt(7, 2), 12)
    assert_all_free(sched)


def test_kv_pressure_retracts_through_the_synchronous_path_with_equal_output(overlap_on):
    def build(sched):
        for i in range(6):
            sched.submit(GenerateRequest(f"r{i}", prompt(10, i), greedy(30)))
        run(sched)

    build.runner_kw = dict(total_tokens=96)
    tuning = SchedulerTuning(init_new_token_ratio=0.05, min_new_token_ratio=0.01)
    res = {}
    for mode in ("sync", "overlap"):
        sched, _, out = make(FakeRunner(total_tokens=96), tuning=tuning, disable_overlap_schedule=mode == "sync")
        build(sched)
        res[mode] = (sched, out)
    sched, out = res["overlap"]
    for i in range(6):
        assert out.tokens(f"r{i}") == reference(prompt(10, i), 30), i
    assert sched.get_stats()["num_retracted"] > 0 and sched.overlap.synced > 0
    assert_all_free(sched)


def test_seeded_penalised_and_logprob_requests_match_the_synchronous_loop(overlap_on):
    def build(sched):
        sched.submit(GenerateRequest("seed", prompt(5, 1), SamplingParams(temperature=0.8, max_new_tokens=10, seed=7)))
        sched.submit(
            GenerateRequest(
                "pen", prompt(6, 2), SamplingParams(temperature=0.0, max_new_tokens=10, repetition_penalty=1.3)
            )
        )
        sched.submit(GenerateRequest("lp", prompt(7, 3), greedy(10), return_logprob=True, top_logprobs_num=2))
        run(sched)
        sched.submit(GenerateRequest("lp2", prompt(8, 4), greedy(10), return_logprob=True, top_logprobs_num=3))
        sched.submit(GenerateRequest("hot", prompt(8, 5), SamplingParams(temperature=0.7, max_new_tokens=10, top_k=5)))
        run(sched)

    build.runner_kw = dict(total_tokens=256, logit_scale=3.0)
    res = both(build, seed=3)
    (_, out_s), (sched, out_o) = res["sync"], res["overlap"]
    for rid in ("seed", "pen", "lp", "lp2"):
        assert out_o.tokens(rid) == out_s.tokens(rid), rid
    for rid in ("lp", "lp2"):
        a = [c for c in out_o.chunks if c.rid == rid]
        b = [c for c in out_s.chunks if c.rid == rid]
        assert [x for c in a for x in c.logprobs] == pytest.approx([x for c in b for x in c.logprobs])
        assert [x for c in a for x in c.top_logprobs] == [x for c in b for x in c.top_logprobs]
    assert len(out_o.tokens("hot")) == 10
    assert sched.overlap.launched > 0  # the greedy second round was chained
    assert_all_free(sched)


def test_eos_ends_a_request_while_the_other_keeps_decoding(overlap_on):
    def fn(ctx):
        return EOS if len(ctx) == 9 else 2 + (sum(ctx) * 7 + len(ctx)) % 60

    sched, runner, out = make(FakeRunner(total_tokens=256, fn=fn))
    sched.submit(GenerateRequest("eos", prompt(4, 1), greedy(20)))
    sched.submit(GenerateRequest("long", prompt(2, 2), greedy(20, ignore_eos=True)))
    run(sched)
    assert out.tokens("eos") == reference(prompt(4, 1), 6, fn)
    assert out.final("eos").finish_reason == {"type": "stop", "matched": EOS}
    assert out.tokens("long") == reference(prompt(2, 2), 20, fn)
    assert_all_free(sched)


def test_failed_forward_with_overlap_fails_its_requests_and_serving_continues(overlap_on):
    sched, runner, out = make(FakeRunner(total_tokens=256))
    runner.fail_on_calls = {4}
    sched.submit(GenerateRequest("a", prompt(5, 1), greedy(10)))
    run(sched)
    assert out.final("a").finish_reason["type"] == "abort"
    assert "injected model failure" in out.final("a").finish_reason["message"]
    sched.submit(GenerateRequest("b", prompt(6, 2), greedy(8)))
    run(sched)
    assert out.tokens("b") == reference(prompt(6, 2), 8)
    assert_all_free(sched)


def test_overlap_is_off_on_cpu_unless_forced(monkeypatch):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    sched, _, _ = make()
    assert sched.overlap is None
