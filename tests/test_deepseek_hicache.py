"""The host KV tier and the shared file tier over the MLA latent pool (DeepSeek; docs/deepseek.md, "Host KV
tier"): the host pool holds one latent buffer per layer, a prefix evicted to host (or to the file store) and
loaded back gives a cold request's greedy tokens, with the hit counted as cached, and both tiers end full.
One tiny random V3 model (tests/deepseek_fixtures.py), CPU, float32."""

from __future__ import annotations

import pytest
import torch
from deepseek_fixtures import build_tiny_deepseek

from kvship.engine.mem.hicache import HostTier, bytes_per_token, layer_buffers
from kvship.engine.mem.hicache_events import page_hashes
from kvship.engine.mem.hicache_store import FilePageStore, StorageTier
from kvship.engine.mem.mla_pool import MLAKVPool

PAGE = 4


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory) -> str:
    return build_tiny_deepseek(str(tmp_path_factory.mktemp("ds_hicache")), "v3_yarn_grouped", seed=41)


def _make(model_dir, **kw):
    from tests.test_scheduler_e2e import make

    args = dict(page_size=PAGE, max_total_tokens=160, max_running_requests=4, chunked_prefill_size=64)
    args.update(kw)
    return make(model_dir, **args)


def _drain(sched):
    from tests.test_scheduler_e2e import drain

    drain(sched)


def _gen(rid, ids, n):
    from kvship.engine.io_struct import GenerateRequest, SamplingParams

    return GenerateRequest(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=n))


def _pool(num_layers=3, slots=32):
    return MLAKVPool(slots, PAGE, torch.float32, 6, 2, num_layers, "cpu")


def test_host_pool_of_a_latent_pool_holds_one_latent_buffer_per_layer_and_copies_rows_both_ways():
    dev = _pool()
    tier = HostTier(dev, 16)
    assert [len(b) for b in tier.pool.layers] == [1, 1, 1] and not hasattr(tier.pool, "k_buffer")
    assert tier.pool.kv_buffer[0].shape == (16 + PAGE, 1, 8)
    assert bytes_per_token(dev) == 3 * 8 * 4  # no factor 2: one latent row per layer
    src = torch.arange(4, 12)
    for layer in range(3):
        dev.set_latent(layer, src, torch.randn(8, 8))
    want = [dev.kv_buffer[layer][src].clone() for layer in range(3)]
    host = tier.write_back(src)
    assert host is not None and tier.bytes_written == 8 * bytes_per_token(dev)
    for layer in range(3):
        dev.kv_buffer[layer].zero_()
    dst = torch.arange(20, 28)
    tier.load_back(host, dst)
    loads = tier.start_loads()
    loads.wait(0)  # the first layer is usable before the others are waited for
    assert torch.equal(dev.kv_buffer[0][dst], want[0])
    loads.finish()
    assert all(torch.equal(dev.kv_buffer[layer][dst], want[layer]) for layer in range(3))
    assert [[b.shape for b in bufs] for bufs in layer_buffers(dev)] == [[(36, 1, 8)]] * 3


def test_file_tier_stores_latent_pages_and_reads_them_back(tmp_path):
    dev = _pool()
    tier = StorageTier(FilePageStore(str(tmp_path), 1 << 20), dev, "fp/tp1pp1r0")
    try:
        assert tier.page_bytes == 3 * PAGE * 8 * 4
        slots = torch.arange(4, 12)
        for layer in range(3):
            dev.set_latent(layer, slots, torch.randn(8, 8))
        want = [dev.kv_buffer[layer][slots].clone() for layer in range(3)]
        assert tier.save([11, 22], slots, dev) == 2
        tier.flush()
        other = _pool()
        reader = StorageTier(FilePageStore(str(tmp_path), 1 << 20), other, "fp/tp1pp1r0")
        try:
            assert reader.lookup([11, 22, 33]) == 2
            dst = torch.arange(16, 24)
            assert reader.load([11, 22], dst) == 2
            assert all(torch.equal(other.kv_buffer[layer][dst], want[layer]) for layer in range(3))
        finally:
            reader.close()
    finally:
        tier.close()


def _turns(ds_dir, **kw):
    """A first turn, then other sessions that push its pages out of a 160-slot device pool; returns the
    scheduler, its collector and the turn-2 prompt."""
    g = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(3, 384, (n,), generator=g).tolist()  # noqa: E731
    sched, _, out = _make(ds_dir, **kw)
    first = rand(60)
    sched.submit(_gen("t1", first, 6))
    _drain(sched)
    for i in range(3):
        sched.submit(_gen(f"other{i}", rand(70), 6))
        _drain(sched)
    return sched, out, first + out.tokens("t1") + rand(6)


@pytest.fixture(scope="module")
def cold(ds_dir):
    """Greedy tokens of the turn-2 prompt on a fresh scheduler without a prefix cache."""
    _, _, turn2 = _turns(ds_dir, disable_radix_cache=True)
    sched, _, out = _make(ds_dir, disable_radix_cache=True)
    sched.submit(_gen("t2", turn2, 8))
    _drain(sched)
    assert out.finished("t2")[0].cached_tokens == 0
    return turn2, out.tokens("t2")


def test_deepseek_prefix_loaded_back_from_host_gives_the_cold_tokens_and_both_pools_end_full(ds_dir, cold):
    turn2, cold_tokens = cold
    sched, out, prompt = _turns(ds_dir, hicache_ratio=3.0, enable_kv_events=True)
    assert prompt == turn2
    assert sched.cache.match_prefix(turn2[:-1]).host_len >= 56, "turn 1's pages should be on the host tier"
    # KV events name the latent pages as any others: turn 1's leading pages are reported on the host tier
    pages = dict(map(tuple, sched.kv_events.snapshot()["pages"]))
    assert [pages.get(h) for h in page_hashes(turn2, PAGE)[:14]] == ["host"] * 14
    before = sched.get_stats()["host_hit_tokens"]
    sched.submit(_gen("t2", turn2, 8))
    _drain(sched)
    fin = out.finished("t2")[0]
    st = sched.get_stats()
    assert fin.cached_tokens >= 56 and st["host_hit_tokens"] - before >= 56 and st["host_bytes_loaded"] > 0
    assert out.tokens("t2") == cold_tokens
    assert st["free_slots"] == st["total_slots"] and st["running"] == 0
    cache = sched.cache
    cache.evict(st["total_slots"])
    cache.evict_host(st["host_total_slots"])
    assert sched.allocator.available_size() == sched.allocator.total_slots
    assert cache.host.available_size() == cache.host.total_slots


def test_deepseek_prefix_from_the_file_store_gives_the_cold_tokens(ds_dir, cold, tmp_path):
    turn2, cold_tokens = cold
    a, _, _ = _turns(ds_dir, hicache_storage="file", hicache_storage_path=str(tmp_path))
    a.cache.storage.flush()
    assert a.get_stats()["storage_bytes_written"] > 0 and a.get_stats()["storage_errors"] == 0
    b, _, out = _make(ds_dir, hicache_storage="file", hicache_storage_path=str(tmp_path))
    b.submit(_gen("t2", turn2, 8))
    _drain(b)
    fin = out.finished("t2")[0]
    st = b.get_stats()
    assert fin.cached_tokens >= 56 and st["storage_hit_tokens"] == fin.cached_tokens
    assert out.tokens("t2") == cold_tokens
    assert st["free_slots"] == st["total_slots"]
    a.cache.storage.close()
    b.cache.storage.close()


def test_deepseek_write_through_prefix_loaded_back_gives_the_cold_tokens(ds_dir, cold):
    turn2, cold_tokens = cold
    sched, out, prompt = _turns(ds_dir, hicache_ratio=3.0, hicache_write_policy="write_through", enable_kv_events=True)
    assert prompt == turn2
    cache = sched.cache
    assert cache.match_prefix(turn2[:-1]).host_len >= 56, "turn 1's pages should be on the host tier"
    # every latent page was copied to host once, when cached (the pages still on the device are there too)
    tiers = cache.cached_page_tiers()
    assert {(int(h), t) for h, t in sched.kv_events.snapshot()["pages"]} == tiers
    on_gpu, on_host = {h for h, t in tiers if t == "gpu"}, {h for h, t in tiers if t == "host"}
    assert on_gpu and on_gpu <= on_host
    st = sched.get_stats()
    assert st["host_write_policy"] == "write_through" and cache.host.pages_written * PAGE == st["host_cached_slots"]
    sched.submit(_gen("t2", turn2, 8))
    _drain(sched)
    fin = out.finished("t2")[0]
    assert fin.cached_tokens >= 56 and sched.get_stats()["host_hit_tokens"] >= 56
    assert out.tokens("t2") == cold_tokens
    st = sched.get_stats()
    assert st["free_slots"] == st["total_slots"] and st["running"] == 0
    cache.evict(st["total_slots"])
    cache.evict_host(st["host_total_slots"])
    assert sched.allocator.available_size() == sched.allocator.total_slots
    assert cache.host.available_size() == cache.host.total_slots
