"""The host-memory KV tier (docs/cache.md): the radix cache's tiers on CPU pools, then the scheduler end to end."""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvship.engine.mem.hicache import HostTier, host_pool_slots
from kvship.engine.mem.pools import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from kvship.engine.mem.radix_cache import RadixCache, create_prefix_cache


def make_tiered(ps=1, pages=16, host_pages=32, layers=2):
    kv = KVPool(pages * ps, ps, torch.float32, 1, 2, layers, "cpu")
    alloc = TokenToKVPoolAllocator(kv.num_slots, ps)
    rtt = ReqToTokenPool(size=8, max_context_len=pages * ps, device="cpu")
    host = HostTier(kv, host_pages * ps)
    return RadixCache(rtt, alloc, ps, host), alloc, kv, host


def write_kv(kv: KVPool, slots: torch.Tensor, tokens: list[int]) -> None:
    """K/V rows that say which token (and layer) they belong to."""
    for layer in range(kv.num_layers):
        t = torch.tensor(tokens, dtype=torch.float32)
        k = torch.stack([t, t + 1000 * layer], dim=-1)[:, None, :]
        kv.set_kv_buffer(layer, slots, k, -k)


def read_tokens(kv: KVPool, slots: torch.Tensor) -> list[int]:
    return kv.k_buffer[0][slots, 0, 0].long().tolist()


def cached(cache, alloc, kv, tokens):
    slots = alloc.alloc_extend([0], [len(tokens)], [-1])
    write_kv(kv, slots, tokens)
    assert cache.insert(tokens, slots) == 0
    return slots


def settle(cache: RadixCache) -> None:
    """Run the queued load-backs to the end (what the launcher does around the forward that reads them)."""
    loads = cache.take_loads()
    if loads is not None:
        loads.finish()
    cache.poll_loads()  # the loaded pages' lock goes once the copies are seen done


def check_consistent(cache: RadixCache, alloc, host) -> None:
    """Counters equal the tree; every slot is free xor in exactly one node; gpu nodes form a rooted subtree."""
    gpu_slots, host_slots, evictable, protected = [], [], 0, 0
    stack = [(cache.root, True)]
    while stack:
        node, parent_on_gpu = stack.pop()
        if node is not cache.root:
            assert node.value is not None or node.host_value is not None, "a node on no tier"
            if node.value is not None:
                assert parent_on_gpu, "a gpu node below a host node"
                gpu_slots += node.value.tolist()
                if node.lock_ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
            else:
                assert node.lock_ref == 0, "a host node is locked"
            if node.host_value is not None:  # a host node, or a backed-up one (loaded back: on both tiers)
                host_slots += node.host_value.tolist()
        for c in node.children.values():
            assert c.parent is node
            stack.append((c, node is cache.root or node.value is not None))
    assert len(set(gpu_slots)) == len(gpu_slots) and len(set(host_slots)) == len(host_slots)
    assert cache.evictable_size() == evictable and cache.protected_size() == protected
    assert cache.host_size() == len(host_slots)
    assert alloc.available_size() + len(gpu_slots) == alloc.total_slots
    assert host.available_size() + len(host_slots) == host.total_slots


def test_evicted_prefix_moves_to_host_and_loads_back_with_the_same_kv():
    cache, alloc, kv, host = make_tiered(ps=2)
    tokens = list(range(10, 18))
    cached(cache, alloc, kv, tokens)
    assert cache.evict(8) == 8
    assert alloc.available_size() == alloc.total_slots and cache.host_size() == 8
    m = cache.match_prefix(tokens + [1, 2])
    assert m.length == 0 and m.host_len == 8
    # scribble over the whole device pool: the load-back must restore the rows from host memory
    for layer in range(kv.num_layers):
        kv.k_buffer[layer].fill_(-1)
        kv.v_buffer[layer].fill_(-1)
    m2 = cache.load_back(m, max_tokens=100)
    # the loaded pages keep their host copy: the node is backed up
    assert m2.length == 8 and m2.host_len == 0 and cache.host_size() == 8
    assert read_tokens(kv, m2.indices) == [-1] * 8  # queued, not copied: the forward starts it
    loads = cache.take_loads()
    assert loads is not None and cache.take_loads() is None
    loads.wait(0)  # layer 0 is in place once its wait returns
    assert read_tokens(kv, m2.indices) == tokens
    loads.finish()
    cache.poll_loads()
    assert kv.k_buffer[1][m2.indices, 0, 1].long().tolist() == [t + 1000 for t in tokens]
    assert kv.v_buffer[1][m2.indices, 0, 1].long().tolist() == [-(t + 1000) for t in tokens]
    assert cache.match_prefix(tokens).indices.tolist() == m2.indices.tolist()
    assert cache.tier_stats()["host_hit_tokens"] == 8
    check_consistent(cache, alloc, host)
    written = host.bytes_written
    assert cache.evict(8) == 8 and host.bytes_written == written  # evicting it again copies nothing
    assert cache.match_prefix(tokens + [1, 2]).host_len == 8 and cache.host_size() == 8
    check_consistent(cache, alloc, host)


def test_partial_host_match_splits_the_host_node_and_load_back_respects_max_tokens():
    cache, alloc, kv, host = make_tiered(ps=2)
    cached(cache, alloc, kv, [1, 2, 3, 4])
    slots = alloc.alloc_extend([0], [8], [-1])
    write_kv(kv, slots, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], slots) == 4
    alloc.free(slots[:4])
    cache.match_prefix([1, 2, 3, 4])  # [1..4] used more recently: [5..8] goes to host first
    assert cache.evict(2) == 4
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 9, 9])
    assert m.length == 4 and m.host_len == 2
    assert cache.load_back(m, max_tokens=0).length == 4  # no room: the match is unchanged
    m2 = cache.load_back(m, max_tokens=2)
    settle(cache)
    assert m2.length == 6 and read_tokens(kv, m2.indices) == [1, 2, 3, 4, 5, 6]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).host_len == 2  # [7, 8] stayed on host
    check_consistent(cache, alloc, host)


def test_settle_loads_waits_for_a_load_ahead_and_unlocks_its_pages():
    """A decode short of KV first settles the started load-aheads (``settle_loads``, engine/scheduler/decode.py):
    their locked pages become evictable, so a lone running request is not aborted for pages a copy holds."""
    cache, alloc, kv, host = make_tiered(ps=2, pages=8, host_pages=8)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    cached(cache, alloc, kv, a)
    cache.evict(8)
    assert not cache.settle_loads()  # nothing in flight
    assert cache.load_ahead(cache.match_prefix(a + [0]), max_tokens=100)
    assert cache.loads_in_flight() and cache.protected_size() == 8 and cache.evictable_size() == 0
    assert cache.settle_loads()
    assert not cache.loads_in_flight() and cache.protected_size() == 0 and cache.evictable_size() == 8
    assert not cache.settle_loads()
    check_consistent(cache, alloc, host)


def test_pages_a_load_back_writes_are_not_evicted_until_its_copies_are_done():
    """A load-back locks the device pages it fills from the moment it is queued: an eviction in between (a
    request that did not fit after its load-back was queued) cannot hand them to another request while the
    copy is still to write them.  Once seen done they unlock, and, backed up, leave the device without a copy."""
    cache, alloc, kv, host = make_tiered(ps=2, pages=8, host_pages=8)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 8, 8, 7, 7]
    cached(cache, alloc, kv, a)
    cache.evict(8)
    for layer in range(kv.num_layers):  # the device rows a left behind are gone
        kv.k_buffer[layer].fill_(-1)
        kv.v_buffer[layer].fill_(-1)
    m = cache.load_back(cache.match_prefix(a + [0]), max_tokens=100)
    assert m.length == 8 and cache.loads_in_flight() and cache.protected_size() == 8
    cached(cache, alloc, kv, b)
    assert cache.evict(16) == 6  # b only: a's pages wait for their copy
    assert cache.protected_size() == 8 and cache.loads_in_flight()
    settle(cache)  # (b's write-back, short of host pages, may have run the load itself: the lock goes all the same)
    assert not cache.loads_in_flight() and cache.protected_size() == 0
    assert read_tokens(kv, m.indices) == a
    check_consistent(cache, alloc, host)
    written = host.bytes_written
    assert cache.evict(8) == 8 and host.bytes_written == written  # backed up: no copy
    assert cache.match_prefix(a + [0]).host_len == 8
    check_consistent(cache, alloc, host)


def test_load_back_with_room_for_part_of_a_host_node_loads_its_leading_pages():
    cache, alloc, kv, host = make_tiered(ps=2)
    tokens = list(range(20, 30))
    cached(cache, alloc, kv, tokens)
    cache.evict(10)  # one host node of 10 tokens
    m = cache.match_prefix(tokens + [0])
    assert m.host_len == 10 and len(m.host_nodes) == 1
    m2 = cache.load_back(m, max_tokens=7)  # room for 3 whole pages of it
    settle(cache)
    assert m2.length == 6 and m2.host_len == 4 and read_tokens(kv, m2.indices) == tokens[:6]
    assert [node.key for node in m2.host_nodes] == [tokens[6:]]
    m3 = cache.load_back(m2, max_tokens=100)
    settle(cache)
    assert m3.length == 10 and read_tokens(kv, m3.indices) == tokens
    check_consistent(cache, alloc, host)


def test_a_failed_load_back_copy_fails_the_forward_that_waits_for_it():
    _, _, kv, host = make_tiered(ps=2, pages=4)
    host.load_back(torch.tensor([2, 3]), torch.tensor([kv.num_slots + 64, kv.num_slots + 65]))  # no such rows
    loads = host.start_loads()
    with pytest.raises(RuntimeError, match="host KV load-back failed"):
        loads.wait(0)
    with pytest.raises(RuntimeError, match="host KV load-back failed"):
        loads.finish()


def test_full_host_pool_evicts_its_least_recently_used_pages_first():
    cache, alloc, kv, host = make_tiered(ps=1, pages=16, host_pages=6)
    cached(cache, alloc, kv, [1, 1, 1])
    cached(cache, alloc, kv, [2, 2, 2])
    cached(cache, alloc, kv, [3, 3, 3])
    cache.match_prefix([1, 1, 1])
    cache.match_prefix([3, 3, 3])
    cache.evict(9)  # [2] moves first (least recent), then [1], then [3] pushes [2] out of the host pool
    assert cache.match_prefix([2, 2, 2]).host_len == 0
    assert cache.match_prefix([1, 1, 1]).host_len == 3
    assert cache.match_prefix([3, 3, 3]).host_len == 3
    check_consistent(cache, alloc, host)


def test_insert_over_host_pages_keeps_the_new_device_copy_and_frees_the_host_one():
    cache, alloc, kv, host = make_tiered(ps=2)
    tokens = [1, 2, 3, 4, 5, 6]
    cached(cache, alloc, kv, tokens)
    cache.evict(6)
    slots = alloc.alloc_extend([0], [8], [-1])
    write_kv(kv, slots, tokens + [7, 8])
    # the request computed all 8 again: the cache takes every slot (0 were cached on the device)
    assert cache.insert(tokens + [7, 8], slots) == 0
    assert cache.host_size() == 0
    assert cache.match_prefix(tokens + [7, 8]).indices.tolist() == slots.tolist()
    check_consistent(cache, alloc, host)


def test_random_operations_keep_both_pools_consistent_and_end_full():
    rng = random.Random(3)
    cache, alloc, kv, host = make_tiered(ps=2, pages=24, host_pages=20)
    for _ in range(400):
        base = rng.choice([[1, 1], [2, 2], [3, 3, 4, 4]])
        tokens = base + [rng.randrange(5, 9) for _ in range(rng.randrange(0, 12))]
        m = cache.match_prefix(tokens)
        if m.host_len and rng.random() < 0.7:
            m = cache.load_back(m, rng.choice([2, 4, 100]))
            if rng.random() < 0.5:  # else the next write-back (an eviction) completes it first
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
        cache.dec_lock_ref(m.last_node)
        check_consistent(cache, alloc, host)
    assert cache.host_hits > 0 and host.bytes_written > 0
    cache.evict(alloc.total_slots)
    cache.evict_host(host.total_slots)
    assert alloc.available_size() == alloc.total_slots and host.available_size() == host.total_slots
    assert not cache.root.children


def test_host_pool_size_from_flags():
    kv = KVPool(64, 4, torch.float16, 2, 8, 3, "cpu")  # 2*3*2*8*2 = 192 bytes a token
    assert host_pool_slots(kv) == 0
    assert host_pool_slots(kv, ratio=2.5) == 160
    assert host_pool_slots(kv, size_gb=192 * 100 / 2**30) == 100 // 4 * 4
    with pytest.raises(ValueError, match="at least one page"):
        host_pool_slots(kv, size_gb=1e-9)
    with pytest.raises(ValueError, match="not both"):
        host_pool_slots(kv, size_gb=1, ratio=1)
    rtt = ReqToTokenPool(size=2, max_context_len=8, device="cpu")
    with pytest.raises(ValueError, match="need the radix cache"):
        create_prefix_cache(True, rtt, TokenToKVPoolAllocator(64, 4), 4, HostTier(kv, 16))


# --- the scheduler end to end (tiny random llama, CPU) -----------------------------------------------------------


def _sched(model_dir, **kw):
    from tests.test_scheduler_e2e import make

    return make(model_dir, **kw)


def _drain(sched):
    from tests.test_scheduler_e2e import drain

    drain(sched)


def _greedy(n):
    from kvship.engine.io_struct import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=n)


def _gen(rid, ids, n):
    from kvship.engine.io_struct import GenerateRequest

    return GenerateRequest(rid, ids, _greedy(n))


def test_prefix_evicted_to_host_and_loaded_back_gives_the_cold_tokens_and_counts_as_cached(tiny_llama_dir):
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(3, 384, (n,), generator=g).tolist()  # noqa: E731
    first = rand(100)
    sched, _, out = _sched(tiny_llama_dir, page_size=4, max_total_tokens=256, hicache_ratio=4.0)
    sched.submit(_gen("t1", first, 8))
    _drain(sched)
    for i in range(4):  # other sessions push the first one's pages out of the device pool
        sched.submit(_gen(f"other{i}", rand(120), 8))
        _drain(sched)
    turn2 = first + out.tokens("t1") + rand(10)
    m = sched.cache.match_prefix(turn2[:-1])
    assert m.host_len >= 96, "the first turn's pages should be on the host tier by now"
    sched.submit(_gen("t2", turn2, 12))
    _drain(sched)
    fin = out.finished("t2")[0]
    assert fin.cached_tokens >= 100 // 4 * 4
    st = sched.get_stats()
    assert st["host_hit_tokens"] >= 96 and st["host_bytes_loaded"] > 0

    cold, _, cold_out = _sched(tiny_llama_dir, page_size=4, max_total_tokens=256, disable_radix_cache=True)
    cold.submit(_gen("t2", turn2, 12))
    _drain(cold)
    assert cold_out.finished("t2")[0].cached_tokens == 0
    assert out.tokens("t2") == cold_out.tokens("t2")


@pytest.mark.parametrize("ahead", ["0", "1"])
def test_many_sessions_over_a_tiny_pool_leak_nothing_on_either_tier(tiny_llama_dir, monkeypatch, ahead):
    monkeypatch.setenv("KVSHIP_HICACHE_LOAD_AHEAD", ahead)  # 1: most returning turns load ahead
    g = torch.Generator().manual_seed(12)
    sched, _, out = _sched(
        tiny_llama_dir, page_size=4, max_total_tokens=160, hicache_ratio=1.5, chunked_prefill_size=32
    )
    history = {s: torch.randint(3, 384, (24 + 4 * s,), generator=g).tolist() for s in range(8)}
    for turn in range(3):
        for s in range(8):  # every session's next turn, all queued at once
            sched.submit(_gen(f"s{s}t{turn}", history[s], 6))
        _drain(sched)
        for s in range(8):
            assert len(out.finished(f"s{s}t{turn}")) == 1
            history[s] = history[s] + out.tokens(f"s{s}t{turn}") + torch.randint(3, 384, (5,), generator=g).tolist()
    st = sched.get_stats()
    assert st["host_hit_tokens"] > 0 and st["host_bytes_written"] > 0
    assert (st["host_load_ahead_tokens"] > 0) == (ahead == "1")
    assert st["running"] == 0 and st["waiting"] == 0 and st["num_aborted"] == 0
    assert st["free_slots"] == st["total_slots"]  # every device slot is free or evictable
    cache = sched.cache
    assert cache.protected_size() == 0
    check_consistent(cache, sched.allocator, cache.host)
    cache.evict(st["total_slots"])
    cache.evict_host(st["host_total_slots"])
    assert sched.allocator.available_size() == sched.allocator.total_slots
    assert cache.host.available_size() == cache.host.total_slots


def test_mixed_chunks_over_load_backs_give_the_unmixed_tokens_and_leak_nothing(tiny_llama_dir):
    """``--enable-mixed-chunk`` with the host tier: returning turns load their prefixes back while other
    sessions decode inside those extend steps; every output equals the same schedule's without mixing, the
    running requests really rode in extends, and both tiers end full."""
    outs = {}
    for mixed in (False, True):
        g = torch.Generator().manual_seed(13)
        sched, _, out = _sched(
            tiny_llama_dir,
            page_size=4,
            max_total_tokens=192,
            hicache_ratio=2.0,
            chunked_prefill_size=16,
            enable_mixed_chunk=mixed,
        )
        history = {s: torch.randint(3, 384, (20 + 6 * s,), generator=g).tolist() for s in range(6)}
        for turn in range(3):
            for s in range(6):  # staggered: later sessions' prompts arrive while earlier ones decode
                sched.submit(_gen(f"s{s}t{turn}", history[s], 10))
                for _ in range(2):
                    sched.step()
            _drain(sched)
            for s in range(6):
                history[s] = history[s] + out.tokens(f"s{s}t{turn}") + torch.randint(3, 384, (6,), generator=g).tolist()
        st = sched.get_stats()
        assert st["host_hit_tokens"] > 0 and st["num_aborted"] == 0
        assert st["free_slots"] == st["total_slots"] and sched.cache.protected_size() == 0
        check_consistent(sched.cache, sched.allocator, sched.cache.host)
        if mixed:
            assert sched.counters["mixed_decode_rows"] > 0
        outs[mixed] = {f"s{s}t{t}": out.tokens(f"s{s}t{t}") for s in range(6) for t in range(3)}
    assert outs[True] == outs[False]


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("aligned", [True, False])
def test_write_back_and_load_back_copy_every_layer_row_by_pages_or_by_slots(ps, aligned):
    """The tier's copies move whole pages as single rows when the slots are whole pages (what the allocators
    hand out) and slot by slot otherwise; either way every layer's K and V rows arrive unchanged."""
    kv = KVPool(32 * ps, ps, torch.float32, 1, 2, 3, "cpu")
    host = HostTier(kv, 16 * ps)
    gen = torch.Generator().manual_seed(ps)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    if aligned:
        src = (torch.tensor([5, 2, 9])[:, None] * ps + torch.arange(ps)).flatten()
        dst = (torch.tensor([11, 3, 20])[:, None] * ps + torch.arange(ps)).flatten()
    else:  # slots that are not whole pages (the copies must still be right)
        src = torch.tensor([7, 3, 12, 13, 1, 30, 2, 9])[: 2 * ps] + ps
        dst = torch.tensor([17, 6, 25, 29, 40, 41, 50, 60])[: 2 * ps] + ps
    want = [(k[src].clone(), v[src].clone()) for k, v in zip(kv.k_buffer, kv.v_buffer)]
    host_slots = host.write_back(src)
    assert host_slots is not None and host_slots.numel() == src.numel()
    host.sync_writes()  # the copy thread scatters the rows into the host pool
    for layer, (k, v) in enumerate(want):
        assert torch.equal(host.pool.k_buffer[layer][host_slots], k)
        assert torch.equal(host.pool.v_buffer[layer][host_slots], v)
    before = [(k.clone(), v.clone()) for k, v in zip(kv.k_buffer, kv.v_buffer)]
    host.load_back(host_slots, dst)
    host.start_loads().finish()
    for layer, (k, v) in enumerate(want):
        assert torch.equal(kv.k_buffer[layer][dst], k) and torch.equal(kv.v_buffer[layer][dst], v)
        untouched = torch.ones(kv.k_buffer[layer].shape[0], dtype=torch.bool)
        untouched[dst] = False
        assert torch.equal(kv.k_buffer[layer][untouched], before[layer][0][untouched])


def test_a_write_back_does_not_wait_and_a_load_back_queued_after_it_reads_its_rows():
    """The copy thread scatters a write-back's rows into the host pool in order with the load-backs it runs:
    host slots written back and loaded straight back (no wait in between) bring back the written rows."""
    ps = 2
    kv = KVPool(16 * ps, ps, torch.float32, 1, 2, 2, "cpu")
    host = HostTier(kv, 8 * ps)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(7)))
    src = (torch.tensor([3, 1])[:, None] * ps + torch.arange(ps)).flatten()
    dst = (torch.tensor([9, 12])[:, None] * ps + torch.arange(ps)).flatten()
    want = [k[src].clone() for k in kv.k_buffer]
    slots = host.write_back(src)
    for k in kv.k_buffer:  # the device rows change right after: the write-back took them already
        k[src] = -5.0
    host.load_back(slots, dst)
    host.start_loads().finish()
    assert all(torch.equal(k[dst], w) for k, w in zip(kv.k_buffer, want))
    host.free(slots)
    host.drain()
    assert host.available_size() == host.total_slots


def test_a_failed_write_back_copy_fails_every_later_wait():
    """A write-back whose scatter fails on the copy thread (here: host slots that do not exist) leaves the
    host pool wrong: the next write-back, ``sync_writes`` and the load-backs after it all raise."""
    from kvship.engine.mem.hicache import HostWrite

    _, _, kv, host = make_tiered(ps=2, pages=4)
    bad = HostWrite(torch.zeros((4, 2, 1, 2)), torch.tensor([10**6]), True, None)
    host._writes.append(bad)
    host._copier.submit(bad)
    with pytest.raises(RuntimeError, match="host KV write-back failed"):
        host.sync_writes()
    host.load_back(torch.tensor([2, 3]), torch.tensor([2, 3]))
    with pytest.raises(RuntimeError, match="host KV load-back failed"):
        host.start_loads().finish()


# --- load-ahead (KVSHIP_HICACHE_LOAD_AHEAD; docs/cache.md, "Load-ahead") ---------------------------------------


def _returning_turn(model_dir, seed):
    """A worker with a host tier whose first session comes back after four others pushed its pages to host:
    (scheduler, output, the session's next prompt)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, 384, (n,), generator=g).tolist()  # noqa: E731
    first = rand(100)
    sched, _, out = _sched(model_dir, page_size=4, max_total_tokens=256, hicache_ratio=4.0)
    sched.submit(_gen("t1", first, 8))
    _drain(sched)
    for i in range(4):
        sched.submit(_gen(f"other{i}", rand(120), 8))
        _drain(sched)
    turn2 = first + out.tokens("t1") + rand(2)
    assert sched.cache.match_prefix(turn2[:-1]).host_len >= 96
    return sched, out, turn2


@pytest.mark.parametrize("ratio", ["0", "8"])
def test_a_prefix_loaded_ahead_gives_the_cold_tokens_and_only_then_joins_an_extend(tiny_llama_dir, monkeypatch, ratio):
    """With the knob on, the returning turn (100 host tokens, 3 to compute) is not admitted until its pages are on
    the device: the step that starts the copies admits nothing, and the request's extend computes only what was
    not cached.  Off, the load-back rides in the extend that admits it.  Both give the cold tokens."""
    monkeypatch.setenv("KVSHIP_HICACHE_LOAD_AHEAD", ratio)
    sched, out, turn2 = _returning_turn(tiny_llama_dir, 11)
    sched.submit(_gen("t2", turn2, 12))
    sched.step()  # takes the request in; off: admits it with its load-back, on: only starts the copies
    st = sched.get_stats()
    if ratio == "0":
        assert st["host_load_ahead_tokens"] == 0 and st["waiting"] == 0
    else:
        assert st["host_load_ahead_tokens"] >= 96 and st["waiting"] == 1 and st["running"] == 0
    _drain(sched)
    assert out.finished("t2")[0].cached_tokens >= 100 // 4 * 4
    st = sched.get_stats()
    assert st["host_loads_in_flight"] == 0 and sched.cache.protected_size() == 0
    assert st["free_slots"] == st["total_slots"]

    cold, _, cold_out = _sched(tiny_llama_dir, page_size=4, max_total_tokens=256, disable_radix_cache=True)
    cold.submit(_gen("t2", turn2, 12))
    _drain(cold)
    assert out.tokens("t2") == cold_out.tokens("t2")


def test_a_request_aborted_while_its_prefix_loads_ahead_leaks_nothing(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("KVSHIP_HICACHE_LOAD_AHEAD", "1")
    sched, out, turn2 = _returning_turn(tiny_llama_dir, 14)
    sched.submit(_gen("t2", turn2, 12))
    sched.submit(_gen("t2b", turn2[:-1] + [5], 4))  # shares the loading prefix: waits for the same copies
    sched.step()
    assert sched.get_stats()["host_load_ahead_tokens"] >= 96 and sched.cache.protected_size() > 0
    sched.abort("t2")
    _drain(sched)
    assert out.finished("t2")[0].finish_reason.is_abort
    assert len(out.tokens("t2b")) == 4
    sched.step()  # (idle: the poll at the next schedule unlocks any path still listed)
    st = sched.get_stats()
    assert st["host_loads_in_flight"] == 0 and sched.cache.protected_size() == 0
    assert st["free_slots"] == st["total_slots"] and st["running"] == 0 and st["waiting"] == 0
    check_consistent(sched.cache, sched.allocator, sched.cache.host)


def test_a_multi_rank_tier_counts_a_load_done_only_once_finished_never_by_its_own_timing():
    """The ranks of a TP / PP worker schedule in lockstep, so a load-back's pages unlock (and the host pages it
    read return) at the ``finish`` every rank runs at the same point, not when one rank's copies happen to end."""
    for lockstep in (False, True):
        kv = KVPool(16, 2, torch.float32, 1, 2, 2, "cpu")
        host = HostTier(kv, 8, lockstep=lockstep)
        alloc = TokenToKVPoolAllocator(16, 2)
        cache = RadixCache(ReqToTokenPool(size=2, max_context_len=8, device="cpu"), alloc, 2, host)
        cached(cache, alloc, kv, [1, 2, 3, 4])
        cache.evict(4)
        cache.load_back(cache.match_prefix([1, 2, 3, 4, 0]), max_tokens=100)
        loads = cache.take_loads()
        while not loads.done():  # the copy thread wrote every layer
            time.sleep(0.001)
        cache.poll_loads()
        assert cache.loads_in_flight() == lockstep and cache.protected_size() == (4 if lockstep else 0)
        loads.finish()
        cache.poll_loads()
        assert not cache.loads_in_flight() and cache.protected_size() == 0
        check_consistent(cache, alloc, host)


def check_host_io_round_trip(tiny_llama_dir, io: str, device: str) -> None:
    """A scheduler whose host tier copies with ``io`` (``--hicache-io-backend``): a session's pages pushed to the
    host tier by others come back for its next turn, which gives a cold request's greedy tokens and counts the
    host hit; then both pools go back to full (tests/test_hicache_kernel_io.py, tests/test_hicache_dma_io.py)."""
    g = torch.Generator().manual_seed(21)
    rand = lambda n: torch.randint(3, 384, (n,), generator=g).tolist()  # noqa: E731
    kw = dict(device=device, page_size=4, max_total_tokens=192)
    sched, _, out = _sched(tiny_llama_dir, hicache_ratio=3.0, hicache_io_backend=io, **kw)
    assert sched.cache.host.io_backend == io
    first = rand(90)
    sched.submit(_gen("t1", first, 6))
    _drain(sched)
    for i in range(3):  # other sessions push the first one's pages to the host tier
        sched.submit(_gen(f"other{i}", rand(110), 6))
        _drain(sched)
    turn2 = first + out.tokens("t1") + rand(8)
    assert sched.cache.match_prefix(turn2[:-1]).host_len >= 80
    sched.submit(_gen("t2", turn2, 10))
    _drain(sched)
    assert out.finished("t2")[0].cached_tokens >= 88
    st = sched.get_stats()
    assert st["host_hit_tokens"] >= 80 and st["host_bytes_loaded"] > 0 and st["host_bytes_written"] > 0

    cold, _, cold_out = _sched(tiny_llama_dir, disable_radix_cache=True, **kw)
    cold.submit(_gen("t2", turn2, 10))
    _drain(cold)
    assert out.tokens("t2") == cold_out.tokens("t2")

    cache = sched.cache
    check_consistent(cache, sched.allocator, cache.host)
    cache.evict(st["total_slots"])
    cache.evict_host(st["host_total_slots"])
    assert sched.allocator.available_size() == sched.allocator.total_slots
    assert cache.host.available_size() == cache.host.total_slots
