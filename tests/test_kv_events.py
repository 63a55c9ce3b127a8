"""KV events (docs/cache.md): the hash chain, the event log, a subscriber's mirror and its resync, the HTTP stream."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from kvship.engine.mem.hicache import HostTier
from kvship.engine.mem.hicache_events import KVEvent, KVEventLog, KVEventMirror, page_hashes
from kvship.engine.mem.pools import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from kvship.engine.mem.radix_cache import RadixCache


def test_page_hash_chain_names_a_page_by_its_whole_prefix():
    a = page_hashes([1, 2, 3, 4, 5], 2)
    assert len(a) == 2  # the partial last page has no name
    assert page_hashes([1, 2, 3, 4], 2) == a
    assert page_hashes([3, 4], 2, parent=a[0]) == a[1:]
    assert page_hashes([9, 2, 3, 4], 2)[1] != a[1]  # same tokens after a different prefix: another page


def test_log_returns_events_after_a_sequence_number_and_none_after_a_gap():
    log = KVEventLog(page_size=2, capacity=3)
    log.stored([1, 2], "gpu")
    log.stored([1], "host")
    log.removed([2])
    assert [e.seq for e in log.since(0)] == [1, 2, 3] and log.since(3) == []
    log.stored([5], "gpu")
    assert log.since(0) is None  # event 1 was dropped
    assert [e.seq for e in log.since(1)] == [2, 3, 4]
    snap = log.snapshot()
    assert snap["seq"] == 4 and dict(map(tuple, snap["pages"])) == {1: "host", 5: "gpu"}
    assert KVEvent.from_json(log.since(3)[0].to_json()) == log.since(3)[0]
    with pytest.raises(ValueError):
        KVEvent.from_json({"seq": 1, "kind": "stored", "hashes": [1], "tier": "disk"})


def _tiered_cache(events):
    kv = KVPool(40, 2, torch.float32, 1, 2, 1, "cpu")
    alloc = TokenToKVPoolAllocator(kv.num_slots, 2)
    rtt = ReqToTokenPool(size=4, max_context_len=64, device="cpu")
    return RadixCache(rtt, alloc, 2, HostTier(kv, 24), events), alloc


def _churn(cache, alloc, rng, steps):
    for _ in range(steps):
        tokens = rng.choice([[1, 1], [2, 2, 3, 3]]) + [rng.randrange(4, 8) for _ in range(rng.randrange(0, 10))]
        m = cache.match_prefix(tokens)
        if m.host_len and rng.random() < 0.6:
            m = cache.load_back(m, 100)
        cache.inc_lock_ref(m.last_node)
        n_new = len(tokens) // 2 * 2 - m.length
        if n_new > alloc.available_size():
            cache.evict(n_new - alloc.available_size())
        new = alloc.alloc(n_new) if n_new > 0 else torch.empty(0, dtype=torch.int64)
        if new is not None:
            value = torch.cat([m.indices, new])
            alloc.free(value[m.length : cache.insert(tokens, value)])
        cache.dec_lock_ref(m.last_node)


def test_a_mirror_fed_every_event_equals_the_cache_and_one_that_drops_a_message_resyncs():
    log = KVEventLog(page_size=2, capacity=64)
    cache, alloc = _tiered_cache(log)
    rng = random.Random(7)
    full, lossy = KVEventMirror(), KVEventMirror()
    lossy.reset(log.snapshot())
    dropped = False
    for _ in range(30):
        _churn(cache, alloc, rng, 10)
        batch = log.since(full.seq)
        assert batch is not None and full.apply(batch)
        got = log.since(lossy.seq)
        if not dropped and len(got) > 1:
            got, dropped = got[1:], True  # lose one message
        if got is None or not lossy.apply(got):
            lossy.reset(log.snapshot())
        assert full.pages == cache.cached_pages() == log.pages()
        assert lossy.pages == full.pages
    assert dropped and lossy.resyncs == 2  # the first sync, then the one after the loss
    assert set(full.pages.values()) == {"gpu", "host"}


def test_scheduler_events_name_the_pages_a_router_computes_from_the_prompt(tiny_llama_dir):
    from tests.test_hicache import _drain, _gen, _sched

    sched, _, _ = _sched(tiny_llama_dir, page_size=4, max_total_tokens=160, hicache_ratio=2.0, enable_kv_events=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 384, (60,), generator=g).tolist() for _ in range(5)]
    mirror = KVEventMirror()
    for i, p in enumerate(prompts):
        sched.submit(_gen(f"r{i}", p, 4))
        _drain(sched)
        assert mirror.apply(sched.kv_events.since(mirror.seq))
    assert mirror.pages == sched.cache.cached_pages()
    tiers = [[mirror.pages.get(h) for h in page_hashes(p, 4)] for p in prompts]
    assert tiers[-1][:14] == ["gpu"] * 14  # the latest prompt is on the device
    assert "host" in tiers[0]  # the first one was pushed to host memory


def test_worker_http_streams_events_and_snapshot_behind_the_worker_key(tiny_llama_dir):
    import httpx

    from kvship.engine.config import ServerArgs
    from kvship.engine.engine import Engine
    from kvship.engine.http_server import create_app

    sa = ServerArgs(model_path=tiny_llama_dir, max_total_tokens=512, api_key="k" * 24, enable_kv_events=True)
    engine = Engine(sa)
    try:

        async def main():
            app = create_app(engine, sa)
            auth = {"Authorization": "Bearer " + "k" * 24}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                assert (await c.get("/kv_events/snapshot")).status_code == 401
                body = {"input_ids": list(range(5, 45)), "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
                assert (await c.post("/generate", json=body, headers=auth)).status_code == 200
                snap = (await c.get("/kv_events/snapshot", headers=auth)).json()
                stream = await c.get("/kv_events", params={"after": 0, "idle_timeout_s": 0.5}, headers=auth)
                return snap, [json.loads(line) for line in stream.text.splitlines()]

        snap, lines = asyncio.run(main())
        mirror = KVEventMirror()
        assert mirror.apply([KVEvent.from_json(x) for x in lines])
        assert mirror.seq == snap["seq"] > 0
        assert mirror.pages == {int(h): t for h, t in snap["pages"]}
        assert mirror.pages.get(page_hashes(list(range(5, 45)), 1)[-1]) == "gpu"
    finally:
        engine.shutdown()
