"""``--hicache-write-policy write_through`` (docs/cache.md, "Tiers"): pages are copied to the host tier when they
are cached, evicting them from the device copies nothing; the radix cache on CPU pools, its KV events, the
router's index of a page on two tiers, then the scheduler end to end (tiny random llama, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from kvship.engine.mem.hicache import HostTier
from kvship.engine.mem.hicache_events import KVEvent, KVEventLog, KVEventMirror, page_hashes
from kvship.engine.mem.pools import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from kvship.engine.mem.radix_cache import RadixCache
from tests.test_hicache import _drain, _gen, _sched, cached, read_tokens, settle, write_kv


def make_wt(ps=2, pages=16, host_pages=32, events=None, policy="write_through"):
    kv = KVPool(pages * ps, ps, torch.float32, 1, 2, 2, "cpu")
    alloc = TokenToKVPoolAllocator(kv.num_slots, ps)
    rtt = ReqToTokenPool(size=8, max_context_len=pages * ps, device="cpu")
    host = HostTier(kv, host_pages * ps, policy)
    return RadixCache(rtt, alloc, ps, host, events), alloc, kv, host


def scribble(kv: KVPool) -> None:
    for layer in range(kv.num_layers):
        kv.k_buffer[layer].fill_(-1)
        kv.v_buffer[layer].fill_(-1)


def check_tiers(cache: RadixCache, alloc, host) -> None:
    """Counters equal the tree; every slot is free xor in one node of its tier; gpu nodes form a rooted subtree,
    host-only nodes hang below it; without write-through no node is on both tiers."""
    gpu_slots, host_slots, evictable, protected = [], [], 0, 0
    stack = [(cache.root, True)]
    while stack:
        node, parent_on_gpu = stack.pop()
        if node is not cache.root:
            assert node.value is not None or node.host_value is not None, "a node on no tier"
            if node.host_value is not None:
                assert node.host_value.numel() == len(node.key)
                host_slots += node.host_value.tolist()
            if node.value is not None:
                assert parent_on_gpu, "a gpu node below a host node"
                assert node.value.numel() == len(node.key)
                gpu_slots += node.value.tolist()
                if node.lock_ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
            else:
                assert node.lock_ref == 0, "a host node is locked"
        for c in node.children.values():
            assert c.parent is node
            stack.append((c, node is cache.root or node.value is not None))
    assert len(set(gpu_slots)) == len(gpu_slots) and len(set(host_slots)) == len(host_slots)
    assert cache.evictable_size() == evictable and cache.protected_size() == protected
    assert cache.host_size() == len(host_slots) == cache.tier_stats()["host_cached_slots"]
    assert alloc.available_size() + len(gpu_slots) == alloc.total_slots
    assert host.available_size() + len(host_slots) == host.total_slots


# --- the radix cache on CPU pools ----------------------------------------------------------------------------------


def test_cached_pages_are_copied_at_once_and_evicting_them_copies_nothing():
    cache, alloc, kv, host = make_wt()
    tokens = list(range(10, 18))
    cached(cache, alloc, kv, tokens)
    assert host.pages_written == 4 and cache.host_size() == 8  # the copy is made when the pages are cached
    assert cache.match_prefix(tokens).last_node.backed_up
    written = host.bytes_written
    assert cache.evict(8) == 8
    assert host.bytes_written == written and host.pages_written == 4  # a backed-up leaf leaves without a copy
    assert alloc.available_size() == alloc.total_slots and cache.host_size() == 8
    m = cache.match_prefix(tokens + [1, 2])
    assert m.length == 0 and m.host_len == 8
    scribble(kv)  # only the host copy holds the pages now
    m2 = cache.load_back(m, max_tokens=100)
    settle(cache)
    assert m2.length == 8 and read_tokens(kv, m2.indices) == tokens
    assert kv.v_buffer[1][m2.indices, 0, 1].long().tolist() == [-(t + 1000) for t in tokens]
    assert m2.last_node.backed_up and cache.host_size() == 8  # the load-back kept the host copy
    check_tiers(cache, alloc, host)
    assert cache.evict(8) == 8 and host.pages_written == 4  # so the next eviction is free too
    check_tiers(cache, alloc, host)
    st = cache.tier_stats()
    assert st["host_write_policy"] == "write_through" and st["host_hit_tokens"] == 8


def test_an_insert_over_host_pages_keeps_the_host_copy_and_splits_keep_both_tiers():
    cache, alloc, kv, host = make_wt()
    tokens = [1, 2, 3, 4, 5, 6]
    cached(cache, alloc, kv, tokens)
    cache.evict(6)
    slots = alloc.alloc_extend([0], [8], [-1])
    write_kv(kv, slots, tokens + [7, 8])
    assert cache.insert(tokens + [7, 8], slots) == 0  # the request computed all 8 again: the cache takes them
    assert host.pages_written == 4  # only the new page [7, 8] was copied
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])  # splits the backed-up node after 4 tokens
    assert m.length == 4 and m.last_node.backed_up and m.last_node.key == [1, 2, 3, 4]
    assert m.last_node.children[(5, 6)].backed_up
    check_tiers(cache, alloc, host)
    scribble(kv)
    cache.evict(alloc.total_slots)
    m = cache.load_back(cache.match_prefix(tokens + [7, 8]), max_tokens=4)  # part of the split node's host pages
    settle(cache)
    assert m.length == 4 and read_tokens(kv, m.indices) == [1, 2, 3, 4] and m.host_len == 4
    check_tiers(cache, alloc, host)


def test_a_full_host_pool_drops_host_leaves_first_then_skips_the_copy_which_eviction_makes_later():
    cache, alloc, kv, host = make_wt(ps=2, pages=16, host_pages=4)
    a, b, c = [1, 1, 2, 2, 3, 3, 4, 4], [5, 5, 6, 6, 7, 7], [8, 8, 9, 9]
    cached(cache, alloc, kv, a)
    assert host.available_size() == 0
    cache.evict(8)  # a is host-only now
    cached(cache, alloc, kv, b)  # its copy needs 6 host slots: a (a host leaf) is dropped for it
    assert cache.match_prefix(a).length == 0 and cache.match_prefix(a).host_len == 0
    assert cache.match_prefix(b).last_node.backed_up and host.pages_written == 7
    cached(cache, alloc, kv, c)  # 2 host slots free and no host leaf: the copy is skipped, c is device-only
    node_c = cache.match_prefix(c).last_node
    assert not node_c.backed_up and node_c.host_value is None and host.pages_written == 7
    check_tiers(cache, alloc, host)
    cache.match_prefix(b)  # c is the least recently used device leaf
    assert cache.evict(4) == 4  # c is written back at eviction (write-back's rule): b's host copy makes room
    assert host.pages_written == 9 and cache.match_prefix(c).host_len == 4
    m = cache.match_prefix(b)
    assert m.length == 6 and not m.last_node.backed_up  # b stays on the device, without its host copy
    check_tiers(cache, alloc, host)


def test_the_host_lru_may_drop_the_host_copy_of_a_page_still_on_the_device():
    cache, alloc, kv, host = make_wt()
    tokens = list(range(20, 28))
    cached(cache, alloc, kv, tokens)
    assert cache.evict_host(2) == 8
    m = cache.match_prefix(tokens)
    assert m.length == 8 and m.host_len == 0 and not m.last_node.backed_up  # still a device node
    assert cache.host_size() == 0 and host.available_size() == host.total_slots
    check_tiers(cache, alloc, host)
    assert cache.evict(8) == 8 and host.pages_written == 8  # no host copy left: eviction writes it back
    m = cache.load_back(cache.match_prefix(tokens + [0]), max_tokens=100)
    settle(cache)
    assert read_tokens(kv, m.indices) == tokens
    check_tiers(cache, alloc, host)


def _events_agree(log: KVEventLog, mirror: KVEventMirror, cache: RadixCache) -> None:
    assert mirror.apply(log.since(mirror.seq))
    pairs = {(h, t) for h, t in log.snapshot()["pages"]}
    assert pairs == log.page_tiers() == mirror.tiers() == cache.cached_page_tiers()
    assert mirror.pages == log.pages() == cache.cached_pages()


def test_kv_events_report_a_backed_up_page_on_both_tiers_and_a_device_eviction_as_removed_gpu_only():
    log = KVEventLog(page_size=2)
    cache, alloc, kv, host = make_wt(events=log)
    mirror = KVEventMirror()
    tokens = [1, 2, 3, 4]
    names = page_hashes(tokens, 2)
    cached(cache, alloc, kv, tokens)
    got = log.since(0)
    assert [(e.kind, e.tier) for e in got] == [("stored", "gpu"), ("stored", "host")]
    assert all(e.hashes == tuple(names) for e in got)
    _events_agree(log, mirror, cache)
    assert mirror.tiers() == {(h, t) for h in names for t in ("gpu", "host")} and mirror.pages[names[0]] == "gpu"
    cache.evict(4)
    assert [(e.kind, e.tier) for e in log.since(2)] == [("removed", "gpu")]
    _events_agree(log, mirror, cache)
    assert mirror.pages == {h: "host" for h in names}
    cache.load_back(cache.match_prefix(tokens + [0]), max_tokens=100)
    settle(cache)
    assert [(e.kind, e.tier) for e in log.since(3)] == [("stored", "gpu")]
    _events_agree(log, mirror, cache)
    cache.evict_host(4)  # the host copy goes, the device copy stays
    assert [(e.kind, e.tier) for e in log.since(4)] == [("removed", "host")]
    _events_agree(log, mirror, cache)
    assert mirror.tiers() == {(h, "gpu") for h in names}
    cache.evict(4)  # no host copy: written back, a move
    assert [(e.kind, e.tier) for e in log.since(5)] == [("removed", "gpu"), ("stored", "host")]
    cache.evict_host(4)
    assert [(e.kind, e.tier) for e in log.since(7)] == [("removed", None)]  # gone from the cache
    _events_agree(log, mirror, cache)
    assert mirror.tiers() == set()


def test_write_back_events_move_a_page_by_a_removal_then_a_store_and_a_load_back_keeps_the_host_copy():
    log = KVEventLog(page_size=2)
    cache, alloc, kv, host = make_wt(events=log, policy="write_back")
    mirror = KVEventMirror()
    cached(cache, alloc, kv, [1, 2, 3, 4])
    assert host.pages_written == 0 and cache.host_size() == 0  # nothing is copied until eviction
    cache.evict(4)
    assert host.pages_written == 2
    cache.load_back(cache.match_prefix([1, 2, 3, 4, 0]), max_tokens=100)
    settle(cache)
    kinds = [(e.kind, e.tier) for e in log.since(0)]
    assert kinds == [("stored", "gpu"), ("removed", "gpu"), ("stored", "host"), ("stored", "gpu")]  # on both now
    _events_agree(log, mirror, cache)
    check_tiers(cache, alloc, host)
    cache.evict(4)  # backed up: the device copy goes, nothing is written
    assert [(e.kind, e.tier) for e in log.since(4)] == [("removed", "gpu")] and host.pages_written == 2
    _events_agree(log, mirror, cache)


def test_random_operations_keep_both_tiers_consistent_the_events_exact_and_end_full():
    rng = random.Random(5)
    log = KVEventLog(page_size=2, capacity=100000)
    cache, alloc, kv, host = make_wt(ps=2, pages=24, host_pages=14, events=log)
    mirror = KVEventMirror()
    for _ in range(400):
        base = rng.choice([[1, 1], [2, 2], [3, 3, 4, 4]])
        tokens = base + [rng.randrange(5, 9) for _ in range(rng.randrange(0, 12))]
        m = cache.match_prefix(tokens)
        if m.host_len and rng.random() < 0.7:
            m = cache.load_back(m, rng.choice([2, 4, 100]))
            if rng.random() < 0.5:  # else the next copy to host completes it first
                settle(cache)
        settle(cache)
        assert read_tokens(kv, m.indices) == tokens[: m.length]  # every tier kept each page's own K/V
        cache.inc_lock_ref(m.last_node)
        n_new = len(tokens) // 2 * 2 - m.length
        if n_new > alloc.available_size():
            cache.evict(n_new - alloc.available_size())
        new = alloc.alloc(n_new) if n_new > 0 else torch.empty(0, dtype=torch.int64)
        if new is not None:
            write_kv(kv, new, tokens[m.length : m.length + n_new])
            value = torch.cat([m.indices, new])
            already = cache.insert(tokens, value)
            alloc.free(value[m.length : already])
        if rng.random() < 0.1:
            cache.evict_host(rng.choice([2, 6]))
        cache.dec_lock_ref(m.last_node)
        check_tiers(cache, alloc, host)
        _events_agree(log, mirror, cache)
    assert cache.host_hits > 0 and host.pages_written > 0
    cache.evict(alloc.total_slots)
    cache.evict_host(host.total_slots)
    assert alloc.available_size() == alloc.total_slots and host.available_size() == host.total_slots
    assert not cache.root.children
    _events_agree(log, mirror, cache)
    assert mirror.tiers() == set()


def test_router_index_counts_a_page_on_both_tiers_as_gpu_until_it_leaves_the_gpu():
    from kvship.router.kv_events import PrefixIndex

    index = PrefixIndex(max_pages=8)
    index.reset("a", {"seq": 1, "page_size": 2, "pages": [[1, "gpu"], [1, "host"], [2, "host"]]})
    assert index.pages("a") == {1: "gpu", 2: "host"} and index.prefix("a", [1, 2]) == (1, 1)
    ev = KVEvent.from_json({"seq": 2, "kind": "removed", "hashes": [1], "tier": "gpu"})
    assert ev.tier == "gpu" and KVEvent.from_json(ev.to_json()) == ev
    assert index.apply("a", [ev])
    assert index.pages("a") == {1: "host", 2: "host"} and index.prefix("a", [1, 2]) == (0, 2)
    assert index.apply("a", [KVEvent(3, "stored", (2,), "gpu"), KVEvent(4, "removed", (1,), "host")])
    assert index.pages("a") == {2: "gpu"} and index.held("a") == 1 and len(index) == 1
    assert index.apply("a", [KVEvent(5, "stored", (2,), "host"), KVEvent(6, "removed", (2,))])  # every tier
    assert index.pages("a") == {} and len(index) == 0
    with pytest.raises(ValueError):
        KVEvent.from_json({"seq": 1, "kind": "removed", "hashes": [1], "tier": "disk"})


def test_the_write_policy_flag_needs_a_host_tier():
    from kvship.engine.config import ServerArgs

    with pytest.raises(ValueError, match="write_through needs the host KV tier"):
        ServerArgs(hicache_write_policy="write_through").validate()
    with pytest.raises(ValueError, match="must be write_back or write_through"):
        ServerArgs(hicache_write_policy="write_around", hicache_ratio=1.0).validate()
    ServerArgs(hicache_write_policy="write_through", hicache_ratio=1.0).validate()
    ServerArgs().validate()  # write_back, the default, without a host tier: nothing to write
    kv = KVPool(16, 4, torch.float32, 1, 2, 1, "cpu")
    with pytest.raises(ValueError, match="write policy"):
        HostTier(kv, 16, "write_around")


# --- the scheduler end to end (tiny random llama, CPU) -----------------------------------------------------------


def test_write_through_prefix_evicted_and_loaded_back_gives_the_cold_tokens_and_counts_as_cached(tiny_llama_dir):
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(3, 384, (n,), generator=g).tolist()  # noqa: E731
    first = rand(100)
    sched, _, out = _sched(
        tiny_llama_dir, page_size=4, max_total_tokens=256, hicache_ratio=4.0, hicache_write_policy="write_through"
    )
    host = sched.cache.host
    sched.submit(_gen("t1", first, 8))
    _drain(sched)
    m = sched.cache.match_prefix(first)
    assert m.length == 100 and m.last_node.backed_up  # copied to host when cached, before any eviction
    for i in range(4):  # other sessions push the first one's pages out of the device pool
        sched.submit(_gen(f"other{i}", rand(120), 8))
        _drain(sched)
    turn2 = first + out.tokens("t1") + rand(10)
    m = sched.cache.match_prefix(turn2[:-1])
    assert m.host_len >= 96, "the first turn's pages should be on the host tier by now"
    written = host.pages_written
    sched.submit(_gen("t2", turn2, 12))
    _drain(sched)
    fin = out.finished("t2")[0]
    assert fin.cached_tokens >= 100 // 4 * 4
    st = sched.get_stats()
    assert st["host_hit_tokens"] >= 96 and st["host_bytes_loaded"] > 0 and st["host_write_policy"] == "write_through"
    # t2 copied only the pages it added (the loaded ones kept their host copy): at most its new tokens' pages
    assert host.pages_written - written <= (len(turn2) + 12 - fin.cached_tokens) // 4 + 1

    cold, _, cold_out = _sched(tiny_llama_dir, page_size=4, max_total_tokens=256, disable_radix_cache=True)
    cold.submit(_gen("t2", turn2, 12))
    _drain(cold)
    assert cold_out.finished("t2")[0].cached_tokens == 0
    assert out.tokens("t2") == cold_out.tokens("t2")


def test_write_through_many_sessions_over_tiny_pools_leak_nothing_and_events_equal_the_tree(tiny_llama_dir):
    g = torch.Generator().manual_seed(12)
    sched, _, out = _sched(
        tiny_llama_dir,
        page_size=4,
        max_total_tokens=160,
        hicache_ratio=0.5,  # 80 host slots: full most of the time, write-through copies get skipped
        hicache_write_policy="write_through",
        chunked_prefill_size=32,
        enable_kv_events=True,
    )
    history = {s: torch.randint(3, 384, (24 + 4 * s,), generator=g).tolist() for s in range(8)}
    mirror = KVEventMirror()
    for turn in range(3):
        for s in range(8):  # every session's next turn, all queued at once
            sched.submit(_gen(f"s{s}t{turn}", history[s], 6))
        _drain(sched)
        for s in range(8):
            assert len(out.finished(f"s{s}t{turn}")) == 1
            history[s] = history[s] + out.tokens(f"s{s}t{turn}") + torch.randint(3, 384, (5,), generator=g).tolist()
        assert mirror.apply(sched.kv_events.since(mirror.seq))
    cache = sched.cache
    snap = {(int(h), t) for h, t in sched.kv_events.snapshot()["pages"]}
    assert snap == mirror.tiers() == cache.cached_page_tiers()
    assert {h for h, t in snap if t == "gpu"} & {h for h, t in snap if t == "host"}, "no page on both tiers"
    st = sched.get_stats()
    assert st["host_hit_tokens"] > 0 and st["host_bytes_written"] > 0
    assert st["running"] == 0 and st["waiting"] == 0 and st["num_aborted"] == 0
    assert st["free_slots"] == st["total_slots"]  # every device slot is free or evictable
    assert cache.protected_size() == 0
    check_tiers(cache, sched.allocator, cache.host)
    cache.evict(st["total_slots"])
    cache.evict_host(st["host_total_slots"])
    assert sched.allocator.available_size() == sched.allocator.total_slots
    assert cache.host.available_size() == cache.host.total_slots
    assert mirror.apply(sched.kv_events.since(mirror.seq)) and mirror.tiers() == set()
