"""``--policy kv_events`` (docs/cache.md, "Routing on KV events"): the router's global prefix index, fed by real
workers' KV events, and the routing it drives."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time

import aiohttp
import httpx
import pytest
import server_fixtures
from router_fixtures import running_router

from kvship.engine.mem.hicache_events import KVEvent, page_hashes
from kvship.router.circuit import CircuitBreaker
from kvship.router.config import RouterConfig
from kvship.router.kv_events import KVEventsPolicy, KVPrediction, PrefixIndex, WorkerFeed
from kvship.router.metrics import RouterMetrics
from kvship.router.policies import create_policy
from kvship.router.wire import RoutingRequest
from kvship.router.worker import Worker

KEY = "w" * 32
AUTH = {"Authorization": f"Bearer {KEY}"}
PAGE = 4


def _ev(seq, kind, hashes, tier=None):
    return KVEvent(seq, kind, tuple(hashes), tier)


def _gen_request(ids: list[int]) -> RoutingRequest:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    return RoutingRequest.parse("/generate", json.dumps(body).encode())


# -- the index and the policy, no workers -------------------------------------------------------------------------


def test_index_applies_events_in_order_refuses_a_gap_and_keeps_at_most_its_page_bound():
    index = PrefixIndex(max_pages=4)
    index.reset("a", {"seq": 2, "page_size": 2, "pages": [[1, "gpu"], [2, "host"]]})
    assert index.apply("a", [_ev(1, "stored", [9], "gpu"), _ev(3, "stored", [3], "gpu")])  # a replay is skipped
    assert index.pages("a") == {1: "gpu", 2: "host", 3: "gpu"}
    assert not index.apply("a", [_ev(5, "removed", [1])])  # event 4 never came
    assert not index.synced("a") and index.pages("a")[1] == "gpu"  # nothing applied; resync needed
    index.reset("a", {"seq": 5, "page_size": 2, "pages": [[2, "gpu"]]})
    assert index.synced("a") and index.pages("a") == {2: "gpu"} and index.state["a"].resyncs == 2
    index.reset("b", {"seq": 1, "page_size": 2, "pages": [[2, "gpu"], [7, "gpu"], [8, "gpu"]]})
    assert index.prefix("a", [2, 7]) == (1, 0)  # page 2 is now the most recently used
    assert index.apply("b", [_ev(2, "stored", [10, 11], "host")])
    assert len(index) == 4 and index.evicted_pages == 1
    assert 7 not in index.pages("b") and 2 in index.pages("a")  # the least recently used page went
    index.forget("b")
    assert index.pages("b") == {} and len(index) == 1


def test_policy_routes_to_the_longest_cached_prefix_weighted_by_tier_and_load():
    # pages on their way off: the same prompt is routed again and again here, each time as the index says
    cfg = RouterConfig(kv_events_host_weight=0.5, kv_events_load_tokens=8, kv_events_pending=False)
    policy = create_policy("kv_events", cfg)
    assert isinstance(policy, KVEventsPolicy)
    a, b, c = (Worker(url=f"http://w{i}", role="unified", breaker=CircuitBreaker(5, 30)) for i in range(3))
    ids = list(range(100, 132))  # 8 pages of 4
    h = page_hashes(ids, PAGE)
    policy.index.reset(a.url, {"seq": 0, "page_size": PAGE, "pages": [[x, "gpu"] for x in h[:3]]})
    policy.index.reset(b.url, {"seq": 0, "page_size": PAGE, "pages": [[x, "host"] for x in h[:5]]})
    policy.index.reset(c.url, {"seq": 0, "page_size": PAGE, "pages": [[x, "gpu"] for x in h[1:8]]})  # no page 0
    req = _gen_request(ids)
    assert policy.select([a, b, c], req) is a  # 12 gpu tokens beat 20 host tokens worth 10; c holds no prefix
    b.in_flight = 0
    policy.index.reset(b.url, {"seq": 0, "page_size": PAGE, "pages": [[x, "host"] for x in h[:8]]})
    assert policy.select([a, b, c], req) is b  # 32 host tokens worth 16
    b.in_flight = 1  # costs 8 tokens: 16 - 8 < 12
    assert policy.select([a, b, c], req) is a
    # a worker whose stream is behind is judged by the approximate tree of what was sent to it
    policy.index.mark_unsynced(a.url)
    policy.index.mark_unsynced(b.url)
    assert policy.select([a, b], req) is a  # the tree remembers the earlier choices of a
    # a text prompt: the router cannot tokenize it, so cache_aware's rule on the tree decides
    text = RoutingRequest.parse("/generate", json.dumps({"text": "hello " * 20}).encode())
    first = policy.select([a, b, c], text)
    assert policy.select([a, b, c], text) is first


def test_policy_keeps_the_longest_cached_prefix_under_load_until_the_balance_thresholds_pass():
    a, b, c = (Worker(url=f"http://w{i}", role="unified", breaker=CircuitBreaker(5, 30)) for i in range(3))
    ids = list(range(200, 232))
    h = page_hashes(ids, PAGE)
    req = _gen_request(ids)

    def policy_for(cfg: RouterConfig) -> KVEventsPolicy:
        p = create_policy("kv_events", cfg)
        assert isinstance(p, KVEventsPolicy)
        p.index.reset(a.url, {"seq": 0, "page_size": PAGE, "pages": [[x, "gpu"] for x in h[:2]]})
        p.index.reset(b.url, {"seq": 0, "page_size": PAGE, "pages": [[x, "gpu"] for x in range(7)]})  # others
        p.index.reset(c.url, {"seq": 0, "page_size": PAGE, "pages": [[x, "gpu"] for x in range(10, 13)]})
        return p

    a.in_flight, b.in_flight, c.in_flight = 3, 0, 0
    policy = policy_for(RouterConfig())  # default: load does not offset cached tokens
    assert policy.select([a, b, c], req) is a  # 8 cached tokens on a busy worker beat an idle one
    prediction = policy.take_prediction(req)
    assert prediction is not None and (prediction.worker, prediction.tokens, prediction.source) == (a.url, 8, "index")
    assert policy.take_prediction(req) is None  # handed over once
    # no worker holds the prompt: the least loaded, then the fewest pages held (c: 3 against b's 7)
    assert policy.select([a, b, c], _gen_request(list(range(300, 332)))) is c
    policy = policy_for(RouterConfig(balance_abs_threshold=2, balance_rel_threshold=1.5))
    assert policy.select([a, b, c], req) is c  # 3 - 0 > 2: imbalanced, the least loaded (fewest pages) wins
    a.in_flight = 0


def test_index_counts_pages_a_worker_lost_from_every_tier_not_demotions():
    index = PrefixIndex(max_pages=100)
    index.reset("a", {"seq": 0, "page_size": PAGE, "pages": [[1, "gpu"], [2, "gpu"], [3, "host"]]})
    index.apply("a", [_ev(1, "stored", [1, 2], "host")])  # write-through copies: 1 and 2 on both tiers
    index.apply("a", [_ev(2, "removed", [1, 2], "gpu")])  # GPU evictions that leave the host copies: no loss
    assert index.lost.get("a", 0) == 0 and index.pages("a") == {1: "host", 2: "host", 3: "host"}
    index.apply("a", [_ev(3, "removed", [1, 3], "host"), _ev(4, "removed", [99])])  # 99: never held
    assert index.lost["a"] == 2 and index.pages("a") == {2: "host"}
    index.forget("a")
    assert "a" not in index.lost


def test_a_returning_prompt_every_worker_lost_goes_to_the_worker_losing_the_most_pages():
    a, b, c = (Worker(url=f"http://w{i}", role="unified", breaker=CircuitBreaker(5, 30)) for i in range(3))
    conv = list(range(100, 140))  # a conversation's first turn (10 pages)
    later = conv + list(range(140, 148))  # its next turn

    def run(contain: bool) -> tuple[Worker, Worker, KVEventsPolicy, RouterMetrics]:
        metrics = RouterMetrics()
        # pages on their way off: every prompt here is new or lost, which is what containment is about
        p = create_policy("kv_events", RouterConfig(kv_events_contain_thrash=contain, kv_events_pending=False), metrics)
        assert isinstance(p, KVEventsPolicy)
        for w in (a, b, c):
            p.index.reset(w.url, {"seq": 0, "page_size": PAGE, "pages": []})
        first = p.select([a, b, c], _gen_request(conv))  # held nowhere: the tie rule picks
        h = page_hashes(conv, PAGE)
        p.index.apply(first.url, [_ev(1, "stored", h, "gpu")])
        # the worker that got it loses it; another worker, c or b, loses more pages of other prompts
        p.index.apply(first.url, [_ev(2, "removed", h)])
        other = b if first is c else c
        p.fallback.tree(other).insert("x" * 10)  # it was sent a little: the tie rule would not pick it
        p.index.apply(other.url, [_ev(1, "stored", range(500, 530), "gpu"), _ev(2, "removed", range(500, 530))])
        return first, other, p, metrics

    first, other, policy, metrics = run(contain=True)
    assert set(policy.recent_losses.values()) == {0.0}  # the losses count from the next routing
    assert policy.select([a, b, c], _gen_request(later)) is other  # lost everywhere: to the thrashing pool
    assert metrics.kv_lost_prompts.labels("contained")._value.get() == 1
    # mostly lost (the worker kept its first 3 pages: 12 of 48 tokens, at most --cache-threshold): contained too
    h = page_hashes(conv, PAGE)
    policy.index.apply(first.url, [_ev(3, "stored", h[:3], "gpu")])
    assert policy.select([a, b, c], _gen_request(later)) is other
    assert metrics.kv_lost_prompts.labels("contained")._value.get() == 2
    # held again (40 of 48 tokens): the cached prefix wins, nothing is counted as lost
    policy.index.apply(first.url, [_ev(4, "stored", h[3:], "gpu")])
    assert policy.select([a, b, c], _gen_request(later)) is first
    assert metrics.kv_lost_prompts.labels("contained")._value.get() == 2
    policy.index.apply(first.url, [_ev(5, "removed", h)])
    # a new prompt (nothing the tree of what was sent matches) keeps the tie rule: the worker sent the fewest
    # tokens (the third one: nothing yet), not the thrashing pool
    (third,) = [w for w in (a, b, c) if w not in (first, other)]
    assert policy.select([a, b, c], _gen_request(list(range(700, 740)))) is third
    # the losses fade: LOSS_WINDOW routings later without new losses they are a small share of what they were
    before = policy.recent_losses[other.url]
    for i in range(64):
        policy.select([a, b, c], _gen_request(list(range(1000 + 40 * i, 1040 + 40 * i))))
    assert policy.recent_losses[other.url] < 0.4 * before

    first, other, policy, metrics = run(contain=False)
    # without containment the tie rule decides: the least KV demand (the tree of what was sent: the third
    # worker, sent nothing), not the thrashing ``other``
    (third,) = [w for w in (a, b, c) if w not in (first, other)]
    assert policy.select([a, b, c], _gen_request(later)) is third
    assert metrics.kv_lost_prompts.labels("spread")._value.get() == 1
    assert metrics.kv_lost_prompts.labels("contained")._value.get() == 0


def test_pages_on_their_way_count_as_the_workers_until_its_events_or_the_reply_or_time_say_otherwise(monkeypatch):
    a, b, c = (Worker(url=f"http://w{i}", role="unified", breaker=CircuitBreaker(5, 30)) for i in range(3))
    system = list(range(100, 132))  # a tenant's system prompt: 8 pages
    s1, s2, s3 = (system + list(range(200 + 10 * i, 208 + 10 * i)) for i in range(3))  # three sessions of it

    def policy(pending: bool) -> KVEventsPolicy:
        p = create_policy("kv_events", RouterConfig(kv_events_pending=pending), RouterMetrics())
        assert isinstance(p, KVEventsPolicy)
        for w in (a, b, c):
            p.index.reset(w.url, {"seq": 0, "page_size": PAGE, "pages": []})
        return p

    # the sessions arrive together, before any event: without pages on their way the index knows nothing, so the
    # tie rule spreads them; with them, the second and third follow the first, predicted to hit the system prompt
    off = policy(False)
    assert len({off.select([a, b, c], _gen_request(s)).url for s in (s1, s2, s3)}) == 3
    p = policy(True)
    first = p.select([a, b, c], _gen_request(s1))
    req2 = _gen_request(s2)
    assert p.select([a, b, c], req2) is first
    pred = p.take_prediction(req2)
    assert pred is not None and pred.tokens == 32 and pred.source == "index"
    assert p.select([a, b, c], _gen_request(s3)) is first
    h1, h2 = page_hashes(s1, PAGE), page_hashes(s2, PAGE)
    assert set(p.index.pending[first.url]) == set(h1) | set(h2) | set(page_hashes(s3, PAGE))
    # the worker's events replace the expectation: stored pages leave it (the index holds them now), and so does
    # a page reported removed
    p.index.apply(first.url, [_ev(1, "stored", h1, "gpu"), _ev(2, "removed", h2[8:9])])
    waiting = p.index.pending[first.url]
    assert not set(h1) & set(waiting) and h2[8] not in waiting and h2[9] in waiting
    assert p.index.prefix(first.url, h2) == (8, 0)  # the run stops at the page reported removed
    # the reply of session 2 ended: its pages count for PENDING_AFTER_REPLY_S more, then not at all
    pred.finish(None, first.url)
    now = time.monotonic()
    assert p.index.prefix(first.url, h2[:8] + h2[9:], now) == (9, 0)
    assert p.index.prefix(first.url, h2[:8] + h2[9:], now + 1.5) == (8, 0) and h2[9] not in waiting
    # without events or a reply they count PENDING_S at most
    h3 = page_hashes(s3, PAGE)
    assert p.index.prefix(first.url, h3, now) == (10, 0)
    assert p.index.prefix(first.url, h3, now + 11) == (8, 0)
    # at most MAX_PENDING_PAGES per worker, the oldest dropped; a worker that leaves takes its expectations along
    monkeypatch.setattr("kvship.router.kv_events.MAX_PENDING_PAGES", 4)
    p.index.expect(b.url, [1, 2, 3, 4, 5, 6])
    assert list(p.index.pending[b.url]) == [3, 4, 5, 6]
    p.index.forget(b.url)
    assert b.url not in p.index.pending


def test_prediction_reads_the_workers_cached_tokens_from_a_split_stream_and_counts_the_outcome():
    metrics = RouterMetrics()
    events = [
        {"text": "a", "meta_info": {"prompt_tokens": 40, "cached_tokens": 16}},
        {"text": "ab", "meta_info": {"prompt_tokens": 40, "cached_tokens": 32}},
    ]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    p = KVPrediction("http://w0", 32, "index")
    for i in range(0, len(stream), 7):  # lines split across chunks
        p.feed(stream[i : i + 7])
    assert p.actual == 32
    p.finish(metrics, "http://w0")
    q = KVPrediction("http://w0", 48, "tree")
    q.feed_body(json.dumps({"usage": {"prompt_tokens": 60, "prompt_tokens_details": {"cached_tokens": 20}}}).encode())
    q.finish(metrics, "http://w0")
    r = KVPrediction("http://w0", 0, "index")
    r.feed_body(json.dumps({"meta_info": {"cached_tokens": 8}}).encode())
    r.finish(metrics, "http://w1")  # the reply came from another worker (a resumed stream): not counted
    value = metrics.registry.get_sample_value
    assert value("kvship_router_kv_predictions_total", {"source": "index", "outcome": "exact"}) == 1
    assert value("kvship_router_kv_predictions_total", {"source": "tree", "outcome": "over"}) == 1
    assert value("kvship_router_kv_predictions_total", {"source": "index", "outcome": "under"}) is None
    assert value("kvship_router_kv_prediction_error_tokens_sum", {"source": "tree"}) == 28
    assert value("kvship_router_kv_actual_cached_tokens_sum", {"source": "index"}) == 32


# -- real workers ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    args = [
        "--model-path",
        tiny_llama_dir,
        "--served-model-name",
        "tiny",
        "--page-size",
        str(PAGE),
        "--max-total-tokens",
        "320",
        "--max-running-requests",
        "4",
        "--hicache-ratio",
        "1",
        "--enable-kv-events",
        "--api-key",
        KEY,
    ]
    with contextlib.ExitStack() as stack:
        yield server_fixtures.enter_together(stack, [server_fixtures.start_server(args) for _ in range(2)])


def _body(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


async def _snapshot(c: httpx.AsyncClient, url: str) -> dict:
    r = await c.get(url + "/kv_events/snapshot", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


async def _until(predicate, timeout: float = 20.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.1)
    return await predicate()


@pytest.mark.timeout(300)
async def test_requests_sharing_a_long_prefix_land_on_the_worker_that_caches_it(workers):
    cfg = RouterConfig(worker_urls=[w.url for w in workers], policy="kv_events", worker_api_key=KEY, debug_headers=True)
    async with running_router(cfg) as (url, app), httpx.AsyncClient(timeout=120) as c:
        index = app.state.router.policies["unified"].index

        async def synced():
            return all(index.synced(w.url) for w in workers)

        assert await _until(synced)
        rng = random.Random(5)
        for holder in (workers[1], workers[0], workers[1]):
            prefix = [rng.randrange(3, 380) for _ in range(96)]
            # warmed on the worker directly: the router's own tree knows nothing of it, only the events do
            assert (
                await c.post(holder.url + "/generate", json=_body(prefix + [7, 8]), headers=AUTH)
            ).status_code == 200
            last = page_hashes(prefix, PAGE)[-1]

            async def indexed(last=last, holder=holder):
                return index.pages(holder.url).get(last) == "gpu"

            assert await _until(indexed)
            r = await c.post(url + "/generate", json=_body(prefix + [9, 10, 11]))
            assert r.status_code == 200, r.text
            assert r.headers["x-kvship-worker"] == holder.url
            assert r.json()["meta_info"]["cached_tokens"] >= len(prefix)
        metrics = (await c.get(url + "/metrics", headers=AUTH)).text
        assert 'kvship_router_kv_predicted_cached_tokens_count{source="index"} 3.0' in metrics
        # the worker's reply reported exactly the prefix the index predicted, each time
        assert 'kvship_router_kv_predictions_total{outcome="exact",source="index"} 3.0' in metrics


@pytest.mark.timeout(300)
async def test_router_index_equals_every_workers_cache_after_a_run_with_evictions(workers):
    cfg = RouterConfig(worker_urls=[w.url for w in workers], policy="kv_events", worker_api_key=KEY)
    async with running_router(cfg) as (url, app), httpx.AsyncClient(timeout=120) as c:
        index = app.state.router.policies["unified"].index
        rng = random.Random(11)
        tenants = [[rng.randrange(3, 380) for _ in range(48)] for _ in range(6)]
        sem = asyncio.Semaphore(4)

        async def one(i: int) -> None:
            ids = tenants[i % len(tenants)] + [rng.randrange(3, 380) for _ in range(rng.randrange(8, 40))]
            async with sem:
                r = await c.post(url + "/generate", json=_body(ids))
                assert r.status_code == 200, r.text

        await asyncio.gather(*(one(i) for i in range(36)))  # ~3000 prompt tokens over two 320-token pools
        snaps = {}

        async def agree():
            for w in workers:
                snaps[w.url] = await _snapshot(c, w.url)
            return all(
                index.synced(w.url)
                and index.state[w.url].seq == snaps[w.url]["seq"]
                and index.pages(w.url) == {int(h): t for h, t in snaps[w.url]["pages"]}
                for w in workers
            )

        if not await _until(agree, timeout=40.0):  # a loaded CI box: say what differs, for the next reader
            report = []
            for w in workers:
                mine, theirs = index.pages(w.url), {int(h): t for h, t in snaps[w.url]["pages"]}
                diff = {
                    h: (mine.get(h), theirs.get(h)) for h in set(mine) | set(theirs) if mine.get(h) != theirs.get(h)
                }
                report.append(
                    f"{w.url}: synced={index.synced(w.url)} index seq={index.state[w.url].seq} "
                    f"snapshot seq={snaps[w.url]['seq']} resyncs={index.state[w.url].resyncs} "
                    f"pages {len(mine)} vs {len(theirs)}, {len(diff)} differ: {list(diff.items())[:8]}"
                )
            pytest.fail("the router's index never matched the workers' snapshots:\n" + "\n".join(report))
        for w in workers:
            tiers = list(index.pages(w.url).values())
            assert "host" in tiers  # the device pool overflowed: pages were evicted to host memory
            assert tiers.count("gpu") <= 320 // PAGE


@pytest.mark.timeout(300)
async def test_a_feed_that_drops_a_message_resyncs_from_the_snapshot(workers):
    w = workers[0]
    index = PrefixIndex(1_000_000)
    async with aiohttp.ClientSession() as session, httpx.AsyncClient(timeout=120) as c:
        feed = WorkerFeed(w.url, index, lambda: session, AUTH, idle_s=0.5)
        await feed.resync()
        start = index.state[w.url].seq
        rng = random.Random(3)
        for _ in range(3):
            ids = [rng.randrange(3, 380) for _ in range(60)]
            assert (await c.post(w.url + "/generate", json=_body(ids), headers=AUTH)).status_code == 200
        r = await c.get(w.url + "/kv_events", params={"after": start, "idle_timeout_s": 0.5}, headers=AUTH)
        lines = [line for line in r.text.splitlines() if line.strip()]
        assert len(lines) >= 2
        assert not feed.feed_line(lines[1].encode())  # the first line was lost on the way
        assert not index.synced(w.url)
        assert not feed.feed_line(b'{"gap": true, "seq": 99}')  # a gap line keeps it unsynced too
        await feed.resync()
        await feed.follow()  # nothing new: ends after the idle timeout
        snap = await _snapshot(c, w.url)
        assert index.synced(w.url) and index.state[w.url].resyncs == 2
        assert index.state[w.url].seq == snap["seq"]
        assert index.pages(w.url) == {int(h): t for h, t in snap["pages"]}
