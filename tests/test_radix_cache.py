"""RadixCache: match/insert/split, page alignment, locks, LRU eviction, request hand-off."""

import pytest
import torch

from kvship.engine.io_struct import SamplingParams
from kvship.engine.mem.pools import ReqToTokenPool, TokenToKVPoolAllocator
from kvship.engine.mem.radix_cache import NoPrefixCache, RadixCache, create_prefix_cache
from kvship.engine.schedule_batch import Req


def make_cache(ps=1, pages=64, disable=False):
    alloc = TokenToKVPoolAllocator(num_slots=pages * ps, page_size=ps)
    pool = ReqToTokenPool(size=8, max_context_len=pages * ps, device="cpu")
    return create_prefix_cache(disable, pool, alloc, ps), alloc, pool


def cached(cache, alloc, tokens):
    """Allocate slots for ``tokens`` and hand them to the cache; returns the slots."""
    slots = alloc.alloc_extend([0], [len(tokens)], [-1])
    already = cache.insert(tokens, slots)
    assert already == 0
    return slots


def test_match_on_empty_cache_returns_nothing():
    cache, _, _ = make_cache()
    m = cache.match_prefix([1, 2, 3])
    assert m.length == 0 and m.last_node is cache.root


def test_insert_then_match_returns_the_inserted_slots_for_the_common_prefix():
    cache, alloc, _ = make_cache()
    slots = cached(cache, alloc, [1, 2, 3, 4, 5])
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == slots.tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).indices.tolist() == slots.tolist()
    assert cache.match_prefix([1, 2, 9]).indices.tolist() == slots[:2].tolist()
    assert cache.match_prefix([9, 1, 2]).length == 0
    assert cache.evictable_size() == 5 and cache.protected_size() == 0


def test_partial_match_splits_the_node_and_branches_share_the_prefix():
    cache, alloc, _ = make_cache()
    a = cached(cache, alloc, [1, 2, 3, 4])
    b = alloc.alloc(5)
    already = cache.insert([1, 2, 7, 8, 9], b)
    assert already == 2  # the caller still owns b[:2], a duplicate of a[:2]
    alloc.free(b[:2])
    assert cache.match_prefix([1, 2, 7, 8, 9]).indices.tolist() == a[:2].tolist() + b[2:].tolist()
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == a.tolist()
    root_children = list(cache.root.children.values())
    assert len(root_children) == 1 and root_children[0].key == [1, 2]
    assert len(root_children[0].children) == 2
    assert cache.evictable_size() == 7


def test_page_aligned_keys_match_and_insert_whole_pages_only():
    ps = 4
    cache, alloc, _ = make_cache(ps=ps)
    tokens = list(range(100, 110))  # 10 tokens: 2 whole pages + 2
    slots = alloc.alloc_extend([0], [10], [-1])
    assert cache.insert(tokens, slots) == 0
    assert cache.evictable_size() == 8  # the partial page is not cached
    alloc.free(slots[8:])
    assert cache.match_prefix(tokens).length == 8
    assert cache.match_prefix(tokens[:7]).length == 4
    # a difference inside the second page loses the whole second page
    assert cache.match_prefix(tokens[:5] + [0, 0, 0]).length == 4
    assert cache.match_prefix([0] + tokens[1:]).length == 0
    # every node holds whole pages
    stack = [cache.root]
    while stack:
        n = stack.pop()
        assert len(n.key) % ps == 0
        stack.extend(n.children.values())


def test_locked_nodes_are_never_evicted():
    cache, alloc, _ = make_cache()
    cached(cache, alloc, [1, 2, 3, 4])
    cached(cache, alloc, [5, 6, 7])
    m = cache.match_prefix([1, 2, 3])  # splits [1,2,3 | 4]
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 4
    freed = cache.evict(100)
    assert freed == 4  # [5,6,7] and [4]; the locked [1,2,3] stays
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == m.indices.tolist()
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
    assert cache.evict(100) == 3 and cache.total_size() == 0
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(m.last_node)


def test_eviction_takes_least_recently_used_leaves_first():
    cache, alloc, _ = make_cache()
    a = cached(cache, alloc, [1, 1, 1])
    cached(cache, alloc, [2, 2, 2])
    c = cached(cache, alloc, [3, 3, 3])
    cache.match_prefix([1, 1, 1])  # touch A: B is now the least recently used
    assert cache.evict(1) == 3
    assert cache.match_prefix([2, 2, 2]).length == 0
    assert cache.match_prefix([1, 1, 1]).indices.tolist() == a.tolist()
    cache.match_prefix([1, 1, 1])
    assert cache.evict(1) == 3
    assert cache.match_prefix([3, 3, 3]).length == 0
    assert c is not None


def test_evict_frees_slots_back_to_the_allocator_and_walks_up_emptied_parents():
    cache, alloc, _ = make_cache(ps=2, pages=16)
    total = alloc.available_size()
    cached(cache, alloc, [1, 2, 3, 4])
    b = alloc.alloc_extend([0], [6], [-1])
    assert cache.insert([1, 2, 3, 4, 5, 6], b) == 4
    alloc.free(b[:4])
    assert alloc.available_size() == total - 6
    assert cache.evict(6) == 6
    assert alloc.available_size() == total
    assert cache.total_size() == 0 and not cache.root.children


def _req_with_kv(cache, alloc, pool, tokens, prefix=None):
    req = Req("r", tokens, SamplingParams())
    req.req_pool_idx = pool.alloc()
    if prefix is not None:
        req.prefix_indices = prefix.indices
        req.last_node = prefix.last_node
        req.cache_protected_len = prefix.length
        cache.inc_lock_ref(prefix.last_node)
        pool.write(req.req_pool_idx, 0, prefix.indices)
    p = req.cache_protected_len
    last = int(prefix.indices[-1]) if prefix is not None and prefix.length else -1
    new = alloc.alloc_extend([p], [len(tokens)], [last])
    pool.write(req.req_pool_idx, p, new)
    req.kv_committed_len = req.kv_allocated_len = len(tokens)
    req.last_loc = int(new[-1])
    return req


@pytest.mark.parametrize("ps", [1, 4])
def test_finished_request_hands_its_kv_to_the_cache_and_the_next_one_reuses_it(ps):
    cache, alloc, pool = make_cache(ps=ps)
    total = alloc.available_size()
    tokens = list(range(1, 12))  # 11 tokens
    r1 = _req_with_kv(cache, alloc, pool, tokens)
    slots1 = pool.read(r1.req_pool_idx, 0, 11).tolist()
    cache.cache_finished_req(r1)
    aligned = 11 // ps * ps
    assert r1.req_pool_idx is None and pool.available_size() == 8
    assert cache.evictable_size() == aligned
    assert alloc.available_size() + cache.evictable_size() == total

    m = cache.match_prefix(tokens + [99])
    assert m.indices.tolist() == slots1[:aligned]
    r2 = _req_with_kv(cache, alloc, pool, tokens + [99, 98], prefix=m)
    assert cache.protected_size() == aligned
    cache.cache_finished_req(r2)
    assert cache.protected_size() == 0
    assert alloc.available_size() + cache.evictable_size() == total
    cache.evict(total)
    assert alloc.available_size() == total


def test_duplicate_kv_computed_twice_is_freed_when_the_second_copy_finishes():
    cache, alloc, pool = make_cache()
    total = alloc.available_size()
    tokens = [5, 6, 7, 8]
    r1 = _req_with_kv(cache, alloc, pool, tokens)
    r2 = _req_with_kv(cache, alloc, pool, tokens)  # computed concurrently, no sharing
    cache.cache_finished_req(r1)
    cache.cache_finished_req(r2)
    assert cache.evictable_size() == 4
    assert alloc.available_size() == total - 4


def test_unfinished_request_shares_its_chunk_and_keeps_running_on_cached_slots():
    cache, alloc, pool = make_cache(ps=2)
    total = alloc.available_size()
    tokens = list(range(1, 8))  # 7 tokens computed so far
    r = _req_with_kv(cache, alloc, pool, tokens)
    cache.cache_unfinished_req(r)
    assert r.cache_protected_len == 6 and cache.protected_size() == 6
    assert cache.match_prefix(tokens).indices.tolist() == pool.read(r.req_pool_idx, 0, 6).tolist()
    cache.cache_finished_req(r)
    assert cache.protected_size() == 0
    assert alloc.available_size() + cache.evictable_size() == total


def test_release_req_frees_owned_slots_without_caching():
    cache, alloc, pool = make_cache()
    total = alloc.available_size()
    r = _req_with_kv(cache, alloc, pool, [1, 2, 3])
    cache.release_req(r)
    assert cache.total_size() == 0 and alloc.available_size() == total


def test_disabled_cache_never_matches_and_frees_everything():
    cache, alloc, pool = make_cache(disable=True)
    assert isinstance(cache, NoPrefixCache)
    total = alloc.available_size()
    r = _req_with_kv(cache, alloc, pool, [1, 2, 3, 4])
    cache.cache_finished_req(r)
    assert cache.match_prefix([1, 2, 3, 4]).length == 0
    assert alloc.available_size() == total and pool.available_size() == 8
    assert isinstance(make_cache()[0], RadixCache)


def test_req_to_token_host_mirror_serves_host_written_rows_and_defers_device_written_ones():
    """On a non-CPU device the pool mirrors host-written slots and ``read_host`` answers from the mirror (the
    "meta" device holds no data: a device read raises); a row written from device values reads the device
    until it is freed; ``write_points`` (a decode step's slots) updates the mirror."""
    pool = ReqToTokenPool(size=4, max_context_len=16, device="meta")
    assert pool.host is not None and pool.host is not pool.req_to_token
    row = pool.alloc()
    pool.write(row, 0, torch.tensor([5, 6, 7], dtype=torch.int64))
    assert pool.read_host(row, 0, 3).tolist() == [5, 6, 7]
    assert pool.read_host(row, 0, 3).dtype == torch.int64
    rows, cols, slots = torch.tensor([row]), torch.tensor([3]), torch.tensor([8])
    pool.write_points(rows, cols, slots, (rows.to("meta"), cols.to("meta"), slots.to("meta")))
    assert pool.read_host(row, 0, 4).tolist() == [5, 6, 7, 8]
    pool.write(row, 4, torch.tensor([9], device="meta"))  # slots decided on the device: the mirror is stale
    with pytest.raises(NotImplementedError):  # so the read goes to the device (meta: no data to copy)
        pool.read_host(row, 0, 5)
    pool.free(row)
    again = pool.alloc()
    assert again == row
    pool.write(again, 0, torch.tensor([1, 2], dtype=torch.int64))
    assert pool.read_host(again, 0, 2).tolist() == [1, 2]
    cpu = ReqToTokenPool(size=2, max_context_len=8, device="cpu")  # on the CPU the table is its own mirror
    assert cpu.host is cpu.req_to_token
    no_mirror = ReqToTokenPool(size=2, max_context_len=8, device="meta", host_mirror=False)
    no_mirror.write(0, 0, torch.tensor([3]))
    with pytest.raises(NotImplementedError):
        no_mirror.read_host(0, 0, 1)
