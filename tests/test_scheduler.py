"""Scheduler unit tests with a deterministic test-double runner (CPU, no model).

``FakeRunner`` stands in for ``ModelRunner``: it writes each new token's id
(as K) and position (as V) into a real ``KVPool`` at ``out_cache_loc``, then
reads every request's whole context back through ``req_to_token`` and checks
that positions are contiguous -- so a wrong slot mapping, a bad prefix reuse
or a stale retraction shows up as a wrong token or a failed step.  The next
token is a fixed function of the context (``next_token``), so every output has
a pure-Python reference.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import pytest
import torch

from kvship.engine.config import ServerArgs
from kvship.engine.forward_batch import ForwardBatch, LogitsOutput
from kvship.engine.io_struct import GenerateRequest, SamplingParams
from kvship.engine.mem.pools import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from kvship.engine.schedule_batch import Req
from kvship.engine.scheduler import Scheduler, SchedulerClosedError
from kvship.engine.scheduler.policy import SchedulerTuning

VOCAB = 64
EOS = 1


def next_token(ctx: list[int]) -> int:
    """The double's 'model': a deterministic function of the whole context (never EOS)."""
    h = 0
    for i, t in enumerate(ctx):
        h = (h * 31 + t * (i + 7)) % 1_000_003
    return 2 + h % (VOCAB - 2)


def reference(prompt: list[int], n: int, fn: Callable[[list[int]], int] = next_token) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(fn(ctx))
    return ctx[len(prompt) :]


@dataclasses.dataclass
class FakeModelConfig:
    vocab_size: int = VOCAB
    eos_token_ids: frozenset = frozenset({EOS})


class FakeRunner:
    """Test double with ModelRunner's public attributes and forward contract."""

    def __init__(
        self,
        total_tokens=256,
        page_size=1,
        context_len=512,
        max_reqs=16,
        fn: Callable[[list[int]], int] = next_token,
        logit_scale: float = 30.0,
    ):
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.model_config = FakeModelConfig()
        self.page_size = page_size
        self.context_len = context_len
        self.req_to_token_pool = ReqToTokenPool(max_reqs, context_len + page_size, "cpu")
        self.kv_pool = KVPool(total_tokens, page_size, torch.float32, 1, 2, 1, "cpu")
        self.allocator = TokenToKVPoolAllocator(self.kv_pool.num_slots, page_size)
        self.attn_backend = None
        self.max_total_tokens = self.allocator.total_slots
        self.fn = fn
        self.logit_scale = logit_scale
        self.calls = 0
        self.fail_on_calls: set[int] = set()
        self.batch_sizes: list[tuple[str, int]] = []

    def context(self, pool_idx: int, length: int) -> list[int]:
        slots = self.req_to_token_pool.req_to_token[pool_idx, :length].long()
        kv = self.kv_pool.k_buffer[0][slots, 0, :]
        tokens, positions = kv[:, 0].long().tolist(), kv[:, 1].long().tolist()
        if positions != list(range(length)):
            raise AssertionError(f"KV layout broken: positions {positions}")
        return tokens

    def forward(self, fb: ForwardBatch) -> LogitsOutput:
        self.calls += 1
        self.batch_sizes.append((fb.forward_mode.name, fb.batch_size))
        if self.calls in self.fail_on_calls:
            raise RuntimeError("injected model failure")
        assert fb.input_ids.shape == fb.positions.shape == fb.out_cache_loc.shape
        kv = torch.stack([fb.input_ids.float(), fb.positions.float()], dim=1)[:, None, :]
        self.kv_pool.set_kv_buffer(0, fb.out_cache_loc, kv, kv)
        idx = fb.logits_indices if fb.logits_indices is not None else fb.default_logits_indices()
        if fb.forward_mode.is_extend():
            starts = fb.extend_start_loc.tolist()
            rows = []
            for i in idx.tolist():
                b = max(j for j, s in enumerate(starts) if s <= i)
                rows.append((b, int(fb.positions[i]) + 1))
        else:
            rows = [(b, fb.seq_lens_cpu[b]) for b in idx.tolist()]
        logits = torch.zeros((len(rows), VOCAB))
        for r, (b, length) in enumerate(rows):
            ctx = self.context(int(fb.req_pool_indices[b]), length)
            logits[r, self.fn(ctx)] = self.logit_scale
        return LogitsOutput(next_token_logits=logits)


class Collector:
    def __init__(self):
        self.chunks = []
        self.lock = threading.Lock()

    def __call__(self, chunks):
        with self.lock:
            self.chunks.extend(chunks)

    def tokens(self, rid):
        return [t for c in self.chunks if c.rid == rid for t in c.token_ids]

    def final(self, rid):
        fin = [c for c in self.chunks if c.rid == rid and c.finished]
        assert len(fin) == 1, f"{rid}: {len(fin)} finished chunks"
        return fin[0]


class DummyTokenizer:
    """Token t decodes to one letter, so stop strings are easy to place."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def make(runner=None, tuning=None, tokenizer=None, **args):
    runner = runner or FakeRunner()
    sa = ServerArgs(device="cpu", sampling_backend="torch", **args)
    out = Collector()
    return Scheduler(sa, runner, tokenizer or DummyTokenizer(), out, tuning=tuning), runner, out


def greedy(max_new, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw)


def run(sched, max_steps=5000):
    for _ in range(max_steps):
        sched.step()
        if sched.idle():
            return
    raise AssertionError("scheduler did not drain")


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


def assert_all_free(sched):
    st = sched.get_stats()
    assert st["free_slots"] == st["total_slots"], st
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
    assert sched.cache.protected_size() == 0
    assert not sched.reqs and not sched.running and not sched.waiting and sched.chunked_req is None


@pytest.mark.parametrize("ps", [1, 4])
def test_concurrent_requests_match_the_reference_with_chunked_prefill(ps):
    sched, runner, out = make(
        FakeRunner(total_tokens=1024, page_size=ps), page_size=ps, chunked_prefill_size=8, max_prefill_tokens=16
    )
    prompts = {f"r{i}": prompt(n, i) for i, n in enumerate([3, 30, 7, 19, 1, 12])}
    for rid, p in prompts.items():
        sched.submit(GenerateRequest(rid, p, greedy(12)))
    run(sched)
    for rid, p in prompts.items():
        assert out.tokens(rid) == reference(p, 12), rid
        assert out.final(rid).finish_reason == {"type": "length", "length": 12}
    # the 30-token prompt took several extend steps of <= 8 tokens
    assert sched.get_stats()["extend_steps"] >= 30 // 8
    assert_all_free(sched)


def test_new_requests_join_while_others_decode():
    sched, runner, out = make()
    sched.submit(GenerateRequest("a", prompt(5, 1), greedy(20)))
    for _ in range(5):
        sched.step()
    assert len(sched.running) == 1 and len(out.tokens("a")) == 5
    sched.submit(GenerateRequest("b", prompt(9, 2), greedy(10)))
    sched.step()  # b's prefill
    sched.step()  # one decode step for both
    assert runner.batch_sizes[-1] == ("DECODE", 2)
    run(sched)
    assert out.tokens("a") == reference(prompt(5, 1), 20)
    assert out.tokens("b") == reference(prompt(9, 2), 10)
    assert_all_free(sched)


@pytest.mark.parametrize("interleave", [0, 1, 2])
def test_decode_interleave_bounds_the_extend_steps_a_running_request_waits(interleave):
    """``--decode-interleave N``: while "a" decodes, long prompts arriving (chunked into 8-token extends) run at
    most N extend steps in a row before a decode step; 0 keeps extends first (decode waits for them all).
    Every output equals the reference either way and every slot comes back."""
    sched, runner, out = make(
        FakeRunner(total_tokens=1024), chunked_prefill_size=8, max_prefill_tokens=8, decode_interleave=interleave
    )
    sched.submit(GenerateRequest("a", prompt(5, 1), greedy(40)))
    for _ in range(3):
        sched.step()
    prompts = {f"p{i}": prompt(24, 10 + i) for i in range(3)}  # 9 extend steps of 8 tokens
    for rid, p in prompts.items():
        sched.submit(GenerateRequest(rid, p, greedy(4)))
    start = len(runner.batch_sizes)
    run(sched)
    modes = [m for m, _ in runner.batch_sizes[start:]]
    streaks, n = [], 0
    for m in modes[: modes.index("DECODE", modes.index("EXTEND")) if interleave == 0 else len(modes)] + ["DECODE"]:
        if m == "EXTEND":
            n += 1
        elif n:
            streaks.append(n)
            n = 0
    if interleave == 0:
        assert streaks == [9], modes  # every chunk of every waiting prompt before a's next token
    else:
        assert max(streaks) == interleave and sum(streaks) == 9, modes
    assert out.tokens("a") == reference(prompt(5, 1), 40)
    for rid, p in prompts.items():
        assert out.tokens(rid) == reference(p, 4), rid
    assert_all_free(sched)


def test_decode_interleave_must_not_be_negative():
    with pytest.raises(ValueError, match="--decode-interleave must be >= 0"):
        ServerArgs(device="cpu", decode_interleave=-1).validate()


def test_one_chunk_per_request_per_step_and_exactly_one_finished_chunk():
    sched, _, out = make()
    sched.submit(GenerateRequest("a", prompt(4, 3), greedy(6)))
    run(sched)
    chunks = [c for c in out.chunks if c.rid == "a"]
    assert [len(c.token_ids) for c in chunks] == [1] * 6
    assert [c.finished for c in chunks] == [False] * 5 + [True]
    assert chunks[-1].completion_tokens == 6 and chunks[-1].prompt_tokens == 4


@pytest.mark.parametrize("ps", [1, 4])
def test_prefix_cache_reuses_kv_across_requests(ps):
    sched, runner, out = make(FakeRunner(page_size=ps), page_size=ps)
    shared = prompt(40, 7)
    sched.submit(GenerateRequest("cold", shared + [5, 6], greedy(8)))
    run(sched)
    sched.submit(GenerateRequest("warm", shared + [9, 9, 9], greedy(8)))
    run(sched)
    warm = out.final("warm")
    assert warm.cached_tokens == 40 // ps * ps
    assert out.tokens("warm") == reference(shared + [9, 9, 9], 8)
    assert out.final("cold").cached_tokens == 0
    assert sched.get_stats()["cache_hit_rate"] > 0
    assert_all_free(sched)


def test_identical_prompt_still_computes_its_last_token():
    sched, _, out = make()
    p = prompt(20, 8)
    for rid in ("x", "y"):
        sched.submit(GenerateRequest(rid, p, greedy(4)))
        run(sched)
    assert out.tokens("x") == out.tokens("y") == reference(p, 4)
    assert out.final("y").cached_tokens == 19


def test_disabled_radix_cache_never_reports_cached_tokens():
    sched, _, out = make(disable_radix_cache=True)
    p = prompt(20, 8)
    for rid in ("x", "y"):
        sched.submit(GenerateRequest(rid, p, greedy(4)))
        run(sched)
    assert out.final("y").cached_tokens == 0
    assert out.tokens("y") == reference(p, 4)
    assert_all_free(sched)


@pytest.mark.parametrize("ps", [1, 4])
def test_retract_under_kv_pressure_requeues_and_outputs_still_match(ps):
    runner = FakeRunner(total_tokens=64, page_size=ps)
    tuning = SchedulerTuning(init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    sched, _, out = make(runner, tuning=tuning, page_size=ps)
    prompts = {f"r{i}": prompt(10, 20 + i) for i in range(5)}
    for rid, p in prompts.items():
        sched.submit(GenerateRequest(rid, p, greedy(20)))
    run(sched)
    assert sched.get_stats()["num_retracted"] > 0
    for rid, p in prompts.items():
        assert out.tokens(rid) == reference(p, 20), rid
        assert out.final(rid).finish_reason["type"] == "length"
    assert_all_free(sched)


def test_max_running_requests_caps_the_batch_and_max_prefill_tokens_splits_admission():
    sched, runner, out = make(max_running_requests=2, max_prefill_tokens=8, chunked_prefill_size=-1)
    for i in range(5):
        sched.submit(GenerateRequest(f"r{i}", prompt(6, 30 + i), greedy(5)))
    run(sched)
    assert max(bs for _, bs in runner.batch_sizes) <= 2
    # two 6-token prompts do not fit one 8-token prefill budget
    assert all(bs == 1 for mode, bs in runner.batch_sizes if mode == "EXTEND")
    for i in range(5):
        assert out.tokens(f"r{i}") == reference(prompt(6, 30 + i), 5)
    assert_all_free(sched)


def test_abort_while_waiting():
    sched, _, out = make(max_running_requests=1)
    sched.submit(GenerateRequest("run", prompt(4, 1), greedy(50)))
    sched.submit(GenerateRequest("wait", prompt(4, 2), greedy(50)))
    sched.step()
    assert [r.rid for r in sched.waiting] == ["wait"]
    sched.abort("wait")
    sched.step()
    fin = out.final("wait")
    assert fin.finish_reason["type"] == "abort" and out.tokens("wait") == []
    sched.abort("run")
    run(sched)
    assert out.final("run").finish_reason["type"] == "abort"
    assert_all_free(sched)


@pytest.mark.parametrize("ps", [1, 4])
def test_abort_mid_chunked_prefill_frees_everything(ps):
    sched, _, out = make(FakeRunner(page_size=ps), page_size=ps, chunked_prefill_size=8)
    sched.submit(GenerateRequest("long", prompt(50, 3), greedy(5)))
    sched.step()
    sched.step()
    assert sched.chunked_req is not None and sched.chunked_req.kv_committed_len == 16
    sched.abort("long")
    sched.step()
    assert out.final("long").finish_reason["type"] == "abort"
    run(sched)
    assert_all_free(sched)


def test_abort_while_running_and_unknown_rids_are_ignored():
    sched, _, out = make()
    sched.submit(GenerateRequest("a", prompt(6, 4), greedy(100)))
    for _ in range(4):
        sched.step()
    sched.abort("a")
    sched.abort("nope")
    sched.step()
    fin = out.final("a")
    assert fin.finish_reason["type"] == "abort"
    assert out.tokens("a") == reference(prompt(6, 4), 4)
    sched.abort("a")  # already finished: ignored
    run(sched)
    assert len([c for c in out.chunks if c.rid == "a" and c.finished]) == 1
    assert_all_free(sched)


def test_stop_string_ends_generation_where_it_first_appears():
    p = prompt(8, 11)
    ref = reference(p, 30)
    text = DummyTokenizer().decode(ref)
    stop = text[10:13]
    first = text.index(stop)
    sched, _, out = make()
    sched.submit(GenerateRequest("s", p, greedy(30, stop=["zzzzzz", stop])))
    run(sched)
    toks = out.tokens("s")
    assert toks == ref[: first + 3]
    assert out.final("s").finish_reason == {"type": "stop", "matched": stop}
    assert_all_free(sched)


def test_stop_token_ids_eos_and_ignore_eos():
    def fn(ctx):  # EOS after 6 generated tokens of a 5-token prompt
        return EOS if len(ctx) == 11 else next_token(ctx)

    p = prompt(5, 12)
    ref = reference(p, 10, fn)
    sched, _, out = make(FakeRunner(fn=fn))
    sched.submit(GenerateRequest("eos", p, greedy(10)))
    sched.submit(GenerateRequest("ign", p, greedy(10, ignore_eos=True)))
    sched.submit(GenerateRequest("stoptok", p, greedy(10, stop_token_ids=[ref[2]])))
    run(sched)
    assert out.tokens("eos") == ref[:7]
    assert out.final("eos").finish_reason == {"type": "stop", "matched": EOS}
    assert out.tokens("ign") == ref
    assert out.final("ign").finish_reason == {"type": "length", "length": 10}
    assert out.tokens("stoptok") == ref[:3]
    assert out.final("stoptok").finish_reason == {"type": "stop", "matched": ref[2]}
    assert_all_free(sched)


def test_max_new_tokens_and_context_limit_finish_with_length():
    sched, _, out = make(FakeRunner(context_len=20))
    sched.submit(GenerateRequest("len", prompt(5, 1), greedy(3)))
    sched.submit(GenerateRequest("ctx", prompt(15, 2), greedy(100)))
    sched.submit(GenerateRequest("zero", prompt(5, 3), greedy(0)))
    run(sched)
    assert out.final("len").finish_reason == {"type": "length", "length": 3}
    assert out.final("ctx").finish_reason == {"type": "length", "length": 5}
    assert out.tokens("ctx") == reference(prompt(15, 2), 5)
    assert out.final("zero").finish_reason == {"type": "length", "length": 0}
    assert_all_free(sched)


def test_bad_requests_finish_with_an_abort_message_and_serving_continues():
    sched, _, out = make(FakeRunner(context_len=20, total_tokens=64))
    sched.submit(GenerateRequest("long", prompt(20, 1), greedy(3)))
    sched.submit(GenerateRequest("empty", [], greedy(3)))
    sched.submit(GenerateRequest("badtok", [1, 2, VOCAB], greedy(3)))
    sched.submit(GenerateRequest("negtok", [-1, 2, 3], greedy(3)))
    sched.submit(GenerateRequest("strtok", [1, "2", 3], greedy(3)))  # in-process callers skip the HTTP checks
    sched.submit(GenerateRequest("badtemp", [3, 4], SamplingParams(temperature=-1.0)))
    sched.submit(GenerateRequest("ok", prompt(5, 2), greedy(3)))
    sched.submit(GenerateRequest("ok", prompt(5, 2), greedy(3)))  # duplicate rid while "ok" is open
    run(sched)
    for rid, words in [
        ("long", "context length"),
        ("empty", "empty"),
        ("badtok", "token ids"),
        ("negtok", "token ids"),
        ("strtok", "token ids"),
        ("badtemp", "temperature"),
    ]:
        fin = out.final(rid)
        assert fin.finish_reason["type"] == "abort" and words in fin.finish_reason["message"], fin
    okf = [c for c in out.chunks if c.rid == "ok" and c.finished]
    assert sorted(c.finish_reason["type"] for c in okf) == ["abort", "length"]
    assert "duplicate" in [c for c in okf if c.finish_reason["type"] == "abort"][0].finish_reason["message"]
    assert_all_free(sched)


def test_prompt_larger_than_the_kv_pool_is_rejected():
    sched, _, out = make(FakeRunner(total_tokens=32, context_len=512))
    sched.submit(GenerateRequest("huge", prompt(40, 1), greedy(3)))
    run(sched)
    assert "KV cache" in out.final("huge").finish_reason["message"]


def test_failed_forward_fails_only_that_batch_and_keeps_serving():
    sched, runner, out = make()
    runner.fail_on_calls = {3}
    sched.submit(GenerateRequest("a", prompt(5, 1), greedy(5)))
    sched.submit(GenerateRequest("b", prompt(5, 2), greedy(5)))
    run(sched)
    for rid in ("a", "b"):
        fin = out.final(rid)
        assert fin.finish_reason["type"] == "abort" and "injected model failure" in fin.finish_reason["message"]
    sched.submit(GenerateRequest("c", prompt(5, 3), greedy(5)))
    run(sched)
    assert out.tokens("c") == reference(prompt(5, 3), 5)
    assert_all_free(sched)


def test_output_sink_errors_do_not_stop_the_scheduler():
    calls = []

    def sink(chunks):
        calls.append(chunks)
        raise RuntimeError("consumer broke")

    sched = Scheduler(ServerArgs(device="cpu"), FakeRunner(), DummyTokenizer(), sink)
    sched.submit(GenerateRequest("a", prompt(5, 1), greedy(3)))
    run(sched)
    assert sum(len(c) for c in calls) == 3
    assert_all_free(sched)


def test_lpm_admits_the_request_with_the_longest_cached_prefix_first():
    shared = prompt(30, 5)
    order = {}
    for policy in ("lpm", "fcfs"):
        sched, runner, out = make(max_running_requests=1, schedule_policy=policy)
        sched.submit(GenerateRequest("warmup", shared + [2], greedy(1)))
        run(sched)
        sched.submit(GenerateRequest("blocker", prompt(3, 9), greedy(3)))
        sched.step()
        sched.submit(GenerateRequest("cold", prompt(10, 6), greedy(2)))
        sched.submit(GenerateRequest("warm", shared + [3], greedy(2)))
        run(sched)
        done = [c.rid for c in out.chunks if c.finished]
        order[policy] = done[2:]
        assert out.tokens("warm") == reference(shared + [3], 2)
        assert_all_free(sched)
    assert order["lpm"] == ["warm", "cold"]
    assert order["fcfs"] == ["cold", "warm"]


def test_logprobs_are_returned_per_token():
    sched, _, out = make()
    sched.submit(GenerateRequest("lp", prompt(5, 1), greedy(4), return_logprob=True, top_logprobs_num=3))
    run(sched)
    chunks = [c for c in out.chunks if c.rid == "lp"]
    lps = [x for c in chunks for x in c.logprobs]
    tops = [x for c in chunks for x in c.top_logprobs]
    assert len(lps) == 4 and len(tops) == 4
    assert all(lp > -1e-3 for lp in lps)  # the double's logits are peaked: chosen logprob ~ 0
    assert all(len(t) == 3 and t[0][0] == tok for t, tok in zip(tops, out.tokens("lp")))


def test_same_seed_gives_the_same_sampled_output():
    def outputs(seed, others):
        sched, _, out = make(FakeRunner(logit_scale=1.0))
        for i in range(others):
            sched.submit(GenerateRequest(f"o{i}", prompt(4, 50 + i), SamplingParams(temperature=1.0, max_new_tokens=8)))
        sched.submit(GenerateRequest("s", prompt(6, 1), SamplingParams(temperature=1.0, seed=seed, max_new_tokens=16)))
        run(sched)
        return out.tokens("s")

    assert outputs(42, 0) == outputs(42, 3)
    assert outputs(42, 0) != outputs(43, 0)


def test_prefilled_request_joins_the_running_batch_with_its_first_token():
    p = prompt(12, 4)
    ref = reference(p, 8)
    src = FakeRunner()
    # compute the prompt's KV on one runner
    sched_a, _, _ = make(src)
    sched_a.submit(GenerateRequest("x", p, greedy(1)))
    run(sched_a)
    match = sched_a.cache.match_prefix(p)
    assert match.length == 12
    # decode side: reserve slots, copy the KV in, then admit with the first token
    sched_b, dst, out = make(FakeRunner())
    req = Req("x", p, greedy(8), eos_token_ids={EOS})
    slots = sched_b.alloc_prefilled_kv(req)
    assert slots is not None and slots.numel() == 12
    dst.kv_pool.k_buffer[0][slots] = src.kv_pool.k_buffer[0][match.indices]
    sched_b.admit_prefilled(req, ref[0])
    run(sched_b)
    assert out.tokens("x") == ref
    assert_all_free(sched_b)


def test_run_forever_serves_from_another_thread_and_aborts_open_requests_on_stop():
    sched, _, out = make()
    stop = threading.Event()
    t = sched.start(stop)
    assert sched.is_alive()
    sched.submit(GenerateRequest("a", prompt(5, 1), greedy(5)))
    sched.submit(GenerateRequest("long", prompt(5, 2), greedy(10_000)))
    deadline = time.time() + 20
    while time.time() < deadline and not any(c.rid == "a" and c.finished for c in out.chunks):
        time.sleep(0.01)
    assert out.tokens("a") == reference(prompt(5, 1), 5)
    assert sched.get_stats()["running"] == 1
    stop.set()
    t.join(10)
    assert not sched.is_alive()
    assert out.final("long").finish_reason["type"] == "abort"
    with pytest.raises(SchedulerClosedError):
        sched.submit(GenerateRequest("late", prompt(3, 3), greedy(1)))
    assert_all_free(sched)


def test_many_requests_with_aborts_and_stop_strings_leave_every_slot_free():
    runner = FakeRunner(total_tokens=160, page_size=4)
    tuning = SchedulerTuning(init_new_token_ratio=0.2, min_new_token_ratio=0.05)
    sched, _, out = make(runner, tuning=tuning, page_size=4, chunked_prefill_size=16, max_running_requests=8)
    g = torch.Generator().manual_seed(0)
    shared = prompt(20, 99)
    rids = []
    for i in range(200):
        n = int(torch.randint(1, 40, (1,), generator=g))
        p = (shared[: int(torch.randint(0, 20, (1,), generator=g))] + prompt(n, i))[:60]
        stop = ["ab"] if i % 5 == 0 else []
        sched.submit(GenerateRequest(f"q{i}", p, greedy(int(torch.randint(1, 30, (1,), generator=g)), stop=stop)))
        rids.append(f"q{i}")
        if i % 7 == 3:
            sched.abort(f"q{i - 2}")
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):
            sched.step()
    run(sched)
    for rid in rids:
        out.final(rid)
    assert_all_free(sched)
    st = sched.get_stats()
    assert st["num_aborted"] > 0 and st["cache_hit_rate"] > 0
