"""``--enable-mixed-chunk``: running requests decode one token inside each extend step (CPU, the scheduler double).

``FakeRunner`` (tests/test_scheduler.py) checks every request's KV layout on each forward and computes the
next token as a pure function of the context, so a decode row riding in an extend must give exactly the
tokens its own decode steps give.  Both loops: synchronous and overlapped (``KVSHIP_FORCE_OVERLAP_SCHEDULE``).
"""

from __future__ import annotations

import pytest
from test_scheduler import FakeRunner, assert_all_free, greedy, make, prompt, reference, run

from kvship.engine.config import ServerArgs
from kvship.engine.io_struct import GenerateRequest
from kvship.engine.scheduler.overlap import FORCE_ENV


@pytest.mark.parametrize("loop", ["sync", "overlap"])
@pytest.mark.parametrize("ps", [1, 4])
def test_running_requests_decode_inside_the_extend_steps_of_long_prompts(monkeypatch, loop, ps):
    """While "a" and "b" decode, three 24-token prompts arrive (9 extend steps of 8 tokens).  Mixed: every one
    of those extends also carries a and b's next token, so no decode step runs until the prompts are in,
    and every output equals the reference."""
    monkeypatch.setenv(FORCE_ENV, "1")
    sched, runner, out = make(
        FakeRunner(total_tokens=1024, page_size=ps),
        page_size=ps,
        chunked_prefill_size=8,
        max_prefill_tokens=8,
        enable_mixed_chunk=True,
        disable_overlap_schedule=loop == "sync",
    )
    assert (sched.overlap is not None) == (loop == "overlap")
    sched.submit(GenerateRequest("a", prompt(5, 1), greedy(40)))
    sched.submit(GenerateRequest("b", prompt(9, 2), greedy(40)))
    for _ in range(4):
        sched.step()
    prompts = {f"p{i}": prompt(24, 10 + i) for i in range(3)}
    for rid, p in prompts.items():
        sched.submit(GenerateRequest(rid, p, greedy(4)))
    before = {rid: len(out.tokens(rid)) for rid in ("a", "b")}
    start = len(runner.batch_sizes)
    for _ in range(9):  # the prompts' 9 chunks: a and b gain a token in each
        sched.step()
    steps = runner.batch_sizes[start:]
    assert [m for m, _ in steps].count("EXTEND") >= 8, steps
    assert "DECODE" not in [m for m, _ in steps[: [m for m, _ in steps].index("EXTEND") + 8]], steps
    gained = {rid: len(out.tokens(rid)) - before[rid] for rid in ("a", "b")}
    assert min(gained.values()) >= 8, (gained, steps)
    assert sched.counters["mixed_decode_rows"] >= 16
    run(sched)
    assert out.tokens("a") == reference(prompt(5, 1), 40)
    assert out.tokens("b") == reference(prompt(9, 2), 40)
    for rid, p in prompts.items():
        assert out.tokens(rid) == reference(p, 4), rid
    assert_all_free(sched)


def test_requests_with_host_state_sampling_decode_in_their_own_steps():
    """A request with a repetition penalty (its sampler reads its tokens on the host) is not mixed in: it
    decodes in decode steps while the plain one rides in the extends; both equal the reference."""
    sched, runner, out = make(
        FakeRunner(total_tokens=1024), chunked_prefill_size=8, max_prefill_tokens=8, enable_mixed_chunk=True
    )
    sched.submit(GenerateRequest("plain", prompt(5, 1), greedy(30)))
    sched.submit(GenerateRequest("pen", prompt(6, 3), greedy(30, repetition_penalty=1.0001)))
    for _ in range(3):
        sched.step()
    sched.submit(GenerateRequest("long", prompt(40, 7), greedy(3)))
    run(sched)
    assert out.tokens("plain") == reference(prompt(5, 1), 30)
    assert out.tokens("pen") == reference(prompt(6, 3), 30)  # the double's logits: a tiny penalty keeps argmax
    assert out.tokens("long") == reference(prompt(40, 7), 3)
    assert sched.counters["mixed_decode_rows"] >= 4  # "plain" rode in the 5 extends of "long"
    assert "DECODE" in [m for m, _ in runner.batch_sizes]
    assert_all_free(sched)


def test_mixing_is_skipped_when_the_decode_rows_would_not_fit(monkeypatch):
    """When the pool (after eviction) has no room for the running rows beside the prompt's chunk, the extend
    runs alone and the running request decodes in decode steps (which can retract; an extend cannot); the
    outputs still match."""
    sched, runner, out = make(
        FakeRunner(total_tokens=1024), chunked_prefill_size=8, max_prefill_tokens=8, enable_mixed_chunk=True
    )
    sched.submit(GenerateRequest("a", prompt(5, 1), greedy(20)))
    for _ in range(3):
        sched.step()
    fits = sched.kv.shortfall_after_evict
    monkeypatch.setattr(
        sched.kv, "shortfall_after_evict", lambda need: 1 if need > 8 + 1 else fits(need)
    )  # chunk + a page
    sched.submit(GenerateRequest("long", prompt(40, 7), greedy(3)))
    start = len(runner.batch_sizes)
    run(sched)
    assert sched.counters["mixed_decode_rows"] == 0
    modes = [m for m, _ in runner.batch_sizes[start:]]
    assert modes[:5] == ["EXTEND"] * 5 and "DECODE" in modes  # the prompt first, "a" waited (no room to ride)
    assert out.tokens("a") == reference(prompt(5, 1), 20)
    assert out.tokens("long") == reference(prompt(40, 7), 3)
    assert_all_free(sched)


@pytest.mark.parametrize(
    "extra,named",
    [
        (dict(mode="prefill"), "--mode prefill"),
        (dict(speculative_algorithm="ngram"), "--speculative-algorithm"),
        (dict(pp_size=2), "--pp-size 2"),
    ],
)
def test_mixed_chunk_is_refused_where_decode_rows_cannot_ride(extra, named):
    with pytest.raises(ValueError, match="--enable-mixed-chunk works on a unified worker") as e:
        ServerArgs(device="cpu", enable_mixed_chunk=True, **extra).validate()
    assert named in str(e.value)
