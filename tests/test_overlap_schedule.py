"""Overlap scheduling (``kvship.engine.scheduler.overlap``) on CPU: the same tokens as the synchronous loop.

The overlapped loop is on by default only on CUDA; ``KVSHIP_FORCE_OVERLAP_SCHEDULE=1``
turns it on here, so its bookkeeping (future input ids gathered from the pending
step, the extra step of a finished request, fallbacks to the synchronous loop)
runs against ``FakeRunner``, which checks every request's KV layout on each
forward and whose next token is a pure function of the context.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from test_scheduler import EOS, VOCAB, FakeRunner, assert_all_free, greedy, make, prompt, reference, run

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


# ------------------------------------------------------------------ constrained requests, masks filled aside


class ScriptedGrammar:
    """A stand-in grammar matcher: token ``t`` is allowed when ``t % 4 != n % 4`` (``n``: tokens accepted),
    the ``refuse_at``-th token is refused anyway, the grammar ends on its ``end_at``-th token.

    It records any use by two threads at once (``clashes``) and the threads its fills ran on; a fill on
    the mask filler's thread waits for ``gate`` when one is given.
    """

    def __init__(self, refuse_at=None, end_at=None, gate=None, fill_s=0.0):
        self.refuse_at, self.end_at, self.gate, self.fill_s = refuse_at, end_at, gate, fill_s
        self.n = 0
        self.done = False
        self.accepts = 0
        self.clashes = 0
        self.fill_threads: set[str] = set()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _exclusive(self):
        if not self._lock.acquire(blocking=False):
            self.clashes += 1
            raise AssertionError("two threads use one matcher")
        try:
            yield
        finally:
            self._lock.release()

    def accept(self, token):
        with self._exclusive():
            self.accepts += 1
            if self.done or self.n + 1 == self.refuse_at:
                return False
            self.n += 1
            self.done = self.n == self.end_at
            return True

    @property
    def terminated(self):
        with self._exclusive():
            return self.done

    def fill(self, bitmask, row):
        with self._exclusive():
            name = threading.current_thread().name
            self.fill_threads.add(name.split("_")[0])
            if self.gate is not None and name.startswith("kvship-mask"):
                assert self.gate.wait(10), "gate never opened"
            time.sleep(self.fill_s)
            allowed = torch.tensor([t % 4 != self.n % 4 for t in range(VOCAB)])
            bitmask[row].copy_(pack_bits(allowed, bitmask.shape[1]))


def pack_bits(allowed, words):
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[: len(allowed)] = allowed.long()
    w = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


def scripted(sched, **shared):
    """Requests of ``sched`` whose ``regex`` is ``"refuse_at=3,end_at=9"`` get a ``ScriptedGrammar``
    (returned by rid once made: ``grammars[rid]``)."""
    grammars = {}

    def compile(key):
        fut = Future()
        fut.set_result(key[1])
        return fut

    def matcher(text):
        kw = {k: int(v) for k, v in (p.split("=") for p in text.split(",") if p)}
        return ScriptedGrammar(**kw, **shared)

    sched.grammar.compile = compile
    sched.grammar.matcher = matcher
    real_poll = sched.grammar_queue.poll

    def poll():
        ready = real_poll()
        for req, _, _ in ready:
            grammars[req.rid] = req.grammar
        return ready

    sched.grammar_queue.poll = poll
    return grammars


def scripted_mix():
    return [
        GenerateRequest("end", prompt(5, 1), greedy(30, regex="end_at=11")),
        GenerateRequest("refuse", prompt(7, 2), greedy(30, regex="refuse_at=6")),
        GenerateRequest("free", prompt(4, 3), greedy(14, regex="", ignore_eos=True)),
        GenerateRequest("plain", prompt(6, 4), greedy(25)),
        GenerateRequest("stop", prompt(8, 5), greedy(30, regex="", stop_token_ids=[2, 3])),
    ]


def test_constrained_and_plain_requests_chained_with_masks_filled_aside_equal_the_synchronous_loop(overlap_on):
    def build(sched):
        build.grammars[sched.overlap is not None] = scripted(sched, fill_s=0.002)
        staggered(sched, scripted_mix(), every=2)

    build.runner_kw = dict(total_tokens=512)
    build.grammars = {}
    res = both(build)
    (_, out_s), (sched, out_o) = res["sync"], res["overlap"]
    for rid in ("end", "refuse", "free", "plain", "stop"):
        assert out_o.tokens(rid) == out_s.tokens(rid), rid
        assert out_o.final(rid).finish_reason == out_s.final(rid).finish_reason, rid
    assert out_o.tokens("plain") == reference(prompt(6, 4), 25)  # the masks leave plain rows alone
    assert out_o.final("end").finish_reason["type"] == "stop" and len(out_o.tokens("end")) == 11
    refused = out_o.final("refuse").finish_reason
    assert refused["type"] == "abort" and "grammar" in refused["message"] and len(out_o.tokens("refuse")) == 6
    assert len(out_o.tokens("free")) == 14 and out_o.tokens("free") != reference(prompt(4, 3), 14)
    grammars = build.grammars[True]
    assert sched.launcher.masks.started > 5 and sched.overlap.launched > 5
    assert any("kvship-mask" in g.fill_threads for g in grammars.values())  # filled on the filler's thread
    assert sum(g.clashes for g in grammars.values()) == 0
    assert_all_free(sched)


def test_abort_of_a_constrained_request_while_its_mask_fills_frees_its_kv(overlap_on):
    sched, runner, out = make(FakeRunner(total_tokens=256))
    gate = threading.Event()
    grammars = scripted(sched, gate=gate)
    sched.submit(GenerateRequest("a", prompt(5, 1), greedy(40, regex="")))
    sched.submit(GenerateRequest("b", prompt(6, 2), greedy(12, regex="")))
    sched.submit(GenerateRequest("c", prompt(7, 3), greedy(12)))
    real_process = sched.process
    seen = {}

    def process(p):
        real_process(p)  # step N, while N+1's masks fill
        chained = sched.overlap.pending
        if not seen and chained is not None and chained.sampling is not None:
            a = sched.reqs["a"]
            assert chained.sampling.masks.in_flight and a in chained.batch.reqs
            sched.abort_request("a", "aborted")  # on the scheduler thread, as ``recv`` does
            seen.update(pool_idx=a.req_pool_idx, accepts=grammars["a"].accepts)
            gate.set()  # only now may the fill of a's row finish

    sched.process = process
    run(sched)
    assert seen["pool_idx"] is None  # a's KV (its in-flight step's slot included) was released at once
    assert out.final("a").finish_reason == {"type": "abort", "message": "aborted"}
    assert grammars["a"].accepts == seen["accepts"]  # its matcher was not touched after the abort
    ref = make(FakeRunner(total_tokens=256), disable_overlap_schedule=True)
    scripted(ref[0])
    for rid, n, i in (("b", 6, 2), ("c", 7, 3)):
        ref[0].submit(GenerateRequest(rid, prompt(n, i), greedy(12, regex="") if rid == "b" else greedy(12)))
    run(ref[0])
    assert out.tokens("b") == ref[2].tokens("b") and out.tokens("c") == ref[2].tokens("c") == reference(
        prompt(7, 3), 12
    )
    assert sum(g.clashes for g in grammars.values()) == 0
    assert_all_free(sched)


def test_a_failure_while_masks_fill_fails_both_steps_after_the_fill_ends(overlap_on):
    sched, runner, out = make(FakeRunner(total_tokens=256))
    grammars = scripted(sched, fill_s=0.05)
    sched.submit(GenerateRequest("a", prompt(5, 1), greedy(30, regex="")))
    real_process = sched.process
    failed = []

    def process(p):
        chained = sched.overlap.pending
        if not failed and chained is not None and chained.sampling is not None:
            failed.append(chained.sampling.masks)
            raise RuntimeError("injected processing failure")
        real_process(p)

    sched.process = process
    run(sched)
    assert out.final("a").finish_reason["type"] == "abort"
    assert "injected processing failure" in out.final("a").finish_reason["message"]
    assert not failed[0].in_flight  # abandoned: waited for before the requests were failed
    assert grammars["a"].clashes == 0
    sched.submit(GenerateRequest("b", prompt(6, 2), greedy(8)))
    run(sched)
    assert out.tokens("b") == reference(prompt(6, 2), 8)
    assert_all_free(sched)
