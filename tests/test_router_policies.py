"""Router building blocks without HTTP: policies, the approximate radix tree, circuit breaker, rate limiter."""

from __future__ import annotations

import asyncio
import collections
import json
import random

import pytest

from kvship.common import fastjson
from kvship.router.circuit import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvship.router.config import RouterConfig
from kvship.router.core import Router, SessionTable
from kvship.router.policies import POLICIES, CacheAwarePolicy, create_policy
from kvship.router.radix_tree import ApproxRadixTree, common_prefix_len
from kvship.router.ratelimit import RateLimited, TokenBucket
from kvship.router.wire import PDBootstrap, RequestError, RoutingRequest, WorkerInfo
from kvship.router.worker import Worker


def make_workers(n: int, model: str = "m") -> list[Worker]:
    out = []
    for i in range(n):
        w = Worker(url=f"http://w{i}:30000", role="unified", breaker=CircuitBreaker(5, 30))
        w.info = WorkerInfo(models=(model,))
        w.healthy = True
        out.append(w)
    return out


def req(text: str, session: str | None = None) -> RoutingRequest:
    return RoutingRequest(route="/generate", body={}, raw=b"", text=text, model=None, stream=False, session_id=session)


# ---------------------------------------------------------------- radix tree


def test_common_prefix_len_matches_a_character_loop():
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        b = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        start = rng.randint(0, len(b))
        expected = 0
        while expected < min(len(a), len(b) - start) and a[expected] == b[start + expected]:
            expected += 1
        assert common_prefix_len(a, b, start) == expected


def test_radix_tree_matches_longest_inserted_prefix():
    t = ApproxRadixTree(max_size=10_000)
    t.insert("system: you are a pirate\nuser: hi")
    t.insert("system: you are a pirate\nuser: what is rum?")
    t.insert("system: you are a doctor\nuser: hi")
    assert t.match("system: you are a pirate\nuser: bye") == len("system: you are a pirate\nuser: ")
    assert t.match("system: you are a doctor\nuser: hi") == len("system: you are a doctor\nuser: hi")
    assert t.match("system: you are a dentist") == len("system: you are a d")
    assert t.match("zzz") == 0
    assert t.match("") == 0
    # a text that ends inside an edge splits it without losing the rest
    t.insert("system: you")
    assert t.match("system: you are a pirate\nuser: hi") == len("system: you are a pirate\nuser: hi")
    # shared prefixes are stored once
    assert t.size == len("system: you are a pirate\nuser: hi") + len("what is rum?") + len("doctor\nuser: hi")


def test_radix_tree_evicts_least_recently_used_text_by_size():
    t = ApproxRadixTree(max_size=100, evict_to=0.9)
    t.insert("A" * 40)
    t.insert("B" * 40)
    t.insert("A" * 40)  # refresh A: B is now least recently used
    t.insert("C" * 40)  # 120 chars > 100: evict down to <= 90
    assert t.size <= 90
    assert t.match("A" * 40) == 40
    assert t.match("C" * 40) == 40
    assert t.match("B" * 40) == 0


def test_radix_tree_size_stays_bounded_under_many_inserts():
    t = ApproxRadixTree(max_size=5_000)
    rng = random.Random(1)
    for i in range(2_000):
        t.insert(f"tenant{rng.randint(0, 20)} " + "x" * rng.randint(0, 200) + str(i))
        assert t.size <= 5_000


# ---------------------------------------------------------------- policies


def test_every_policy_in_the_cli_choices_is_registered():
    from kvship.router.config import POLICY_NAMES
    from kvship.router.policies import _LAZY_MODULES

    assert set(POLICY_NAMES) == set(POLICIES) | set(_LAZY_MODULES)


def test_round_robin_visits_workers_in_turn():
    ws = make_workers(3)
    p = create_policy("round_robin", RouterConfig())
    picks = [p.select(ws, req("x")).url for _ in range(9)]
    assert picks == [w.url for w in ws] * 3


def test_random_spreads_requests_over_all_workers():
    ws = make_workers(4)
    p = create_policy("random", RouterConfig())
    counts = collections.Counter(p.select(ws, req("x")).url for _ in range(4000))
    assert set(counts) == {w.url for w in ws}
    assert all(800 < c < 1200 for c in counts.values()), counts


def test_shortest_queue_picks_the_least_loaded_worker():
    ws = make_workers(3)
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight = 5, 1, 3
    p = create_policy("shortest_queue", RouterConfig())
    assert all(p.select(ws, req("x")) is ws[1] for _ in range(20))
    ws[2].in_flight = 0
    assert p.select(ws, req("x")) is ws[2]


def test_power_of_two_never_picks_the_most_loaded_of_three():
    ws = make_workers(3)
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight = 0, 10, 20
    p = create_policy("power_of_two", RouterConfig())
    counts = collections.Counter(p.select(ws, req("x")).url for _ in range(600))
    assert counts[ws[2].url] == 0  # it loses every pairing
    assert counts[ws[0].url] > counts[ws[1].url] > 0


def simulate_multi_tenant(
    policy: CacheAwarePolicy, n_workers: int, n_tenants: int, n_requests: int, concurrency: int, seed: int = 0
):
    """Interleaved tenants with long shared system prompts; ``concurrency`` requests in flight."""
    rng = random.Random(seed)
    ws = make_workers(n_workers)
    prompts = [f"system: tenant {t} " + "".join(rng.choice("abcdefgh ") for _ in range(2000)) for t in range(n_tenants)]
    placements: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    in_flight: collections.deque = collections.deque()
    load = collections.Counter()
    for i in range(n_requests):
        if len(in_flight) >= concurrency:
            done = in_flight.popleft()
            done.in_flight -= 1
        tenant = rng.randrange(n_tenants)
        text = prompts[tenant] + f"\nuser: question {i} " + "q" * rng.randint(10, 300)
        w = policy.select(ws, req(text))
        w.in_flight += 1
        in_flight.append(w)
        placements[tenant][w.url] += 1
        load[w.url] += 1
    return placements, load


def test_cache_aware_keeps_tenants_on_one_worker_without_overloading_any():
    policy = create_policy("cache_aware", RouterConfig())
    placements, load = simulate_multi_tenant(policy, n_workers=4, n_tenants=8, n_requests=800, concurrency=8)
    for tenant, counter in placements.items():
        share = counter.most_common(1)[0][1] / sum(counter.values())
        assert share >= 0.9, (tenant, counter)
    mean = sum(load.values()) / 4
    assert max(load.values()) <= 2 * mean, load
    assert len(load) == 4


def test_cache_aware_balances_when_load_is_skewed():
    cfg = RouterConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    policy = create_policy("cache_aware", cfg)
    ws = make_workers(2)
    text = "shared prompt " * 50
    first = policy.select(ws, req(text))
    other = ws[1] if first is ws[0] else ws[0]
    first.in_flight = 4  # 4 - 0 <= 4: balanced enough, the prefix wins
    assert policy.select(ws, req(text)) is first
    first.in_flight = 10  # 10 - 0 > 4 and 10 > 1.5 * 0: least loaded wins
    assert policy.select(ws, req(text)) is other
    first.in_flight, other.in_flight = 10, 8  # 10 - 8 <= 4: balanced again
    assert policy.select(ws, req(text + "more")) is other  # both hold the prefix now: less loaded wins


def test_cache_aware_sends_unmatched_text_to_least_loaded_worker():
    policy = create_policy("cache_aware", RouterConfig(cache_threshold=0.5))
    ws = make_workers(3)
    policy.select(ws, req("A" * 100))
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight = 2, 1, 2
    assert policy.select(ws, req("Z" * 100)) is ws[1]


def test_cache_aware_forgets_a_removed_worker():
    policy = create_policy("cache_aware", RouterConfig())
    ws = make_workers(2)
    chosen = policy.select(ws, req("hello world"))
    assert chosen.url in policy.trees
    policy.on_worker_removed(chosen)
    assert chosen.url not in policy.trees


def test_session_sticks_to_its_worker_and_moves_when_it_is_unavailable(caplog):
    router = Router(RouterConfig(policy="round_robin"))
    ws = make_workers(3)
    for w in ws:
        router.registry._workers[w.url] = w
    first = router.choose(req("a", session="s1"), set()).worker
    assert all(router.choose(req("b", session="s1"), set()).worker is first for _ in range(10))
    first.healthy = False
    with caplog.at_level("INFO", logger="kvship.router.core"):
        moved = router.choose(req("c", session="s1"), set()).worker
    assert moved is not first
    assert "session moved" in caplog.text
    assert router.choose(req("d", session="s1"), set()).worker is moved


def test_session_table_drops_least_recently_used_sessions():
    t = SessionTable(capacity=2)
    t.set("a", "u1")
    t.set("b", "u2")
    t.get("a")
    t.set("c", "u3")
    assert t.get("b") is None and t.get("a") == "u1" and t.get("c") == "u3"


# ---------------------------------------------------------------- circuit breaker


def test_circuit_opens_after_consecutive_failures_then_half_opens_after_cooldown():
    now = [0.0]
    b = CircuitBreaker(failure_threshold=3, cooldown=10, clock=lambda: now[0])
    for _ in range(2):
        b.on_attempt()
        b.record_failure()
    assert b.state == CLOSED and b.can_attempt()
    b.on_attempt()
    b.record_success()  # a success resets the count
    for _ in range(3):
        b.on_attempt()
        b.record_failure()
    assert b.state == OPEN and not b.can_attempt()
    now[0] = 9.9
    assert not b.can_attempt()
    now[0] = 10.0
    assert b.can_attempt()
    b.on_attempt()
    assert b.state == HALF_OPEN and not b.can_attempt()  # one trial at a time
    b.record_failure()
    assert b.state == OPEN and not b.can_attempt()  # cool-down restarts
    now[0] = 20.0
    b.on_attempt()
    b.record_success()
    assert b.state == CLOSED and b.can_attempt()


def test_circuit_threshold_zero_never_opens():
    b = CircuitBreaker(failure_threshold=0, cooldown=10)
    for _ in range(100):
        b.on_attempt()
        b.record_failure()
    assert b.state == CLOSED


# ---------------------------------------------------------------- rate limiter


async def test_token_bucket_queues_then_refuses_when_queue_is_full():
    bucket = TokenBucket(rate=20, burst=2, queue_size=2, queue_timeout=5)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await bucket.acquire()
    await bucket.acquire()  # burst of 2 at once
    assert loop.time() - t0 < 0.04
    waiters = [asyncio.create_task(bucket.acquire()) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(RateLimited) as e:
        await bucket.acquire()  # queue (2) is full
    assert e.value.retry_after > 0 and e.value.retry_after_header == "1"
    await asyncio.gather(*waiters)
    assert loop.time() - t0 >= 0.09  # two tokens at 20/s took ~100 ms


async def test_token_bucket_refuses_a_wait_longer_than_the_queue_timeout():
    bucket = TokenBucket(rate=1, burst=1, queue_size=100, queue_timeout=0.5)
    await bucket.acquire()
    with pytest.raises(RateLimited):
        await bucket.acquire()  # next token in 1 s > 0.5 s


async def test_token_bucket_gives_back_the_reservation_of_a_cancelled_waiter():
    bucket = TokenBucket(rate=10, burst=1, queue_size=1, queue_timeout=5)
    await bucket.acquire()
    w = asyncio.create_task(bucket.acquire())
    await asyncio.sleep(0.01)
    w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w
    assert bucket.waiting == 0
    await asyncio.sleep(0.1)
    await asyncio.wait_for(bucket.acquire(), 0.05)  # the cancelled reservation was returned


# ---------------------------------------------------------------- request parsing


@pytest.mark.parametrize(
    "route,body,msg",
    [
        ("/v1/chat/completions", b"{not json", "not valid JSON"),
        ("/v1/chat/completions", b"[" * 100_000, "too deeply"),
        ("/generate", b'{"text": ' + b"[" * 3000 + b"]" * 3000 + b"}", "too deeply"),
        ("/v1/chat/completions", b"[1, 2]", "JSON object"),
        ("/v1/chat/completions", b'{"model": "m"}', "messages"),
        ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user"}], "stream": "yes"}', "stream"),
        ("/v1/completions", b'{"model": "m"}', "prompt"),
        ("/v1/completions", b'{"model": "m", "prompt": {"a": 1}}', "prompt"),
        ("/v1/completions", b'{"model": 5, "prompt": "x"}', "model"),
        ("/generate", b'{"sampling_params": {}}', "text"),
    ],
)
def test_malformed_requests_are_refused_with_400(route, body, msg):
    with pytest.raises(RequestError) as e:
        RoutingRequest.parse(route, body)
    assert e.value.status == 400 and msg in e.value.message


def test_routing_text_covers_chat_completion_and_native_forms():
    chat = RoutingRequest.parse(
        "/v1/chat/completions",
        b'{"model": "m", "messages": [{"role": "system", '
        b'"content": "be brief"}, {"role": "user", "content": [{"type": "text", '
        b'"text": "hi"}]}], "session_id": "abc"}',
    )
    assert chat.text == "system: be brief\nuser: hi\n" and chat.session_id == "abc"
    comp = RoutingRequest.parse("/v1/completions", b'{"model": "m", "prompt": ["a", "b"]}')
    assert comp.text == "a\nb" and comp.batch_size == 2
    gen = RoutingRequest.parse("/generate", b'{"input_ids": [1, 2, 3], "stream": true}', session_header="h")
    assert gen.text == "\x01\x02\x03" and gen.stream and gen.session_id == "h"  # one character per id
    # a shared id prefix is a shared text prefix (what the cache-aware tree matches on); a batch keys each item
    a = RoutingRequest.parse("/generate", b'{"input_ids": [70000, 5, 9]}').text
    b = RoutingRequest.parse("/generate", b'{"input_ids": [70000, 5, 8, 1]}').text
    assert a[:2] == b[:2] == "\U00011170\x05" and a[2] != b[2]
    batch = RoutingRequest.parse("/generate", b'{"input_ids": [[1, 2], [3]]}')
    assert batch.text == "\x01\x02\n\x03" and batch.batch_size == 2
    # ids no character holds keep the decimal key (the worker answers 400 for them); bools are not ids
    assert RoutingRequest.parse("/generate", b'{"input_ids": [-1, 2]}').text == "-1 2"
    assert RoutingRequest.parse("/generate", b'{"input_ids": [99999999999, 2]}').text == "99999999999 2"
    assert RoutingRequest.parse("/generate", b'{"input_ids": [1114112, 2]}').text == "1114112 2"  # past U+10FFFF
    # ids in the surrogate range and at the top of Unicode are one character each, like every other id
    top = RoutingRequest.parse("/generate", b'{"input_ids": [55296, 57343, 1114111, 0]}').text
    assert top == "".join(map(chr, [55296, 57343, 1114111, 0]))
    with pytest.raises(RequestError):
        RoutingRequest.parse("/generate", b'{"input_ids": [1, true]}')


@pytest.mark.parametrize(
    "raw",
    [
        rb'{"input_ids": [1, 2, 3], "x": 1.5e-7, "s": "caf\u00e9 \n", "n": null}',
        b'{"x": NaN, "y": -Infinity}',  # orjson refuses these; json.loads takes them
        b'{"big": 123456789012345678901234567890}',  # past 64 bits: orjson would make it a float
        b"[18446744073709551615, 18446744073709551616, -9223372036854775808, -9223372036854775809]",
        '{"text": "caf\u00e9", "ids": [-9223372036854775809]}',  # str input
        rb'{"s": "\ud800"}',  # a lone surrogate escape
        '{"utf16": "é"}'.encode("utf-16"),  # json.loads detects UTF-16/32
        b'  {"ws": [ ] }\n',
    ],
)
def test_fastjson_loads_is_json_loads(raw):
    want = json.loads(raw)
    got = fastjson.loads(raw)
    assert repr(got) == repr(want)  # repr: NaN != NaN


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"a": 1', b"\xff\xfe{", b'{"a": 1} x'])
def test_fastjson_refuses_what_json_loads_refuses_with_its_error(raw):
    with pytest.raises(ValueError) as want:
        json.loads(raw)
    with pytest.raises(ValueError) as got:
        fastjson.loads(raw)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


def test_bootstrap_fields_are_spliced_into_the_clients_body_or_written_out_with_it():
    boot = PDBootstrap(host="10.0.0.7", port=8998, room=2**62 + 5)
    fields = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 2**62 + 5}
    cases = [
        b'{"input_ids": [1, 2, 3], "stream": true}',
        b'  {"text": "caf\xc3\xa9 \\u00e9 }", "sampling_params": {"max_new_tokens": 4}}\n\r\t ',
        b"{}",
        b"{ }",
    ]
    for raw in cases:
        body = json.loads(raw)
        out = boot.inject(body, raw)
        assert json.loads(out) == {**body, **fields}, raw
        assert out.startswith(raw.rstrip()[:-1]), raw  # spliced, not written out again
    # written out from the body: no raw, a BOM, UTF-16, or the client's own bootstrap fields (ours win)
    for raw in [b'\xef\xbb\xbf{"text": "x"}', '{"text": "x"}'.encode("utf-16-be"), '{"text": "x"}'.encode("utf-16")]:
        body = json.loads(raw)
        out = boot.inject(body, raw)
        assert json.loads(out) == {**body, **fields} and out.startswith(b'{"text"'), raw
    own = b'{"text": "x", "bootstrap_room": 7}'
    out = boot.inject(json.loads(own), own)
    assert json.loads(out) == {"text": "x", **fields} and out.count(b"bootstrap_room") == 1
    assert json.loads(boot.inject({"text": "x"})) == {"text": "x", **fields}
