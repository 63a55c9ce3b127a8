"""The shared KV tier (docs/cache.md, "Shared tier"): the file store, the radix cache's writes on eviction and
loads past the tree, two workers sharing a directory, a failing store, and Mooncake Store with its real master."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

from kvship.engine.mem.hicache import HostTier
from kvship.engine.mem.hicache_store import (
    ByteBudget,
    FilePageStore,
    KVPageStore,
    StorageTier,
    StoreError,
)
from kvship.engine.mem.pools import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from kvship.engine.mem.radix_cache import RadixCache
from tests.test_hicache import cached, read_tokens


class RaisingStore(KVPageStore):
    """A store whose every call fails (an unreachable or broken backend)."""

    name = "raising"

    def __init__(self):
        self.calls = 0

    def exists(self, keys):
        self.calls += 1
        raise OSError("store unreachable")

    def get(self, key):
        self.calls += 1
        raise OSError("store unreachable")

    def put(self, key, value):
        self.calls += 1
        raise OSError("store unreachable")


def make_cache(
    store: KVPageStore, ps=2, pages=16, host_pages=0, namespace="fp/tp1pp1r0", bandwidth=0.0, prefetch_pages=0
):
    kv = KVPool(pages * ps, ps, torch.float32, 1, 2, 2, "cpu")
    alloc = TokenToKVPoolAllocator(kv.num_slots, ps)
    rtt = ReqToTokenPool(size=8, max_context_len=pages * ps, device="cpu")
    host = HostTier(kv, host_pages * ps) if host_pages else None
    page_bytes = 2 * 2 * ps * 1 * 2 * 4  # K and V, two layers, ps rows of one head x 2 dims, float32
    tier = StorageTier(store, kv, namespace, bandwidth=bandwidth, prefetch_bytes=prefetch_pages * page_bytes)
    assert tier.page_bytes == page_bytes
    return RadixCache(rtt, alloc, ps, host, None, tier), alloc, kv, tier


# --- the file store --------------------------------------------------------------------------------------------------


def test_file_store_round_trip_atomic_names_and_lru_cap_by_mtime(tmp_path):
    st = FilePageStore(str(tmp_path / "kv"), capacity_bytes=1000)
    st.put("ns/a", b"x" * 300)
    assert st.exists(["ns/a", "ns/b"]) == [True, False]
    assert st.get("ns/a") == b"x" * 300 and st.get("ns/b") is None
    assert not [n for n in os.listdir(tmp_path / "kv" / "ns") if n.endswith(".tmp")]
    st.put("ns/b", b"y" * 300)
    st.put("ns/c", b"z" * 300)
    now = time.time()
    for i, k in enumerate("bac"):  # b oldest, then a, then c
        os.utime(tmp_path / "kv" / "ns" / f"{k}.kv", (now - 100 + i, now - 100 + i))
    st.put("ns/d", b"w" * 300)  # 1200 bytes > 1000: the oldest go until <= 900 (90% of the cap)
    assert st.exists(["ns/a", "ns/b", "ns/c", "ns/d"]) == [True, False, True, True]
    assert st.total_bytes() == 900
    os.utime(tmp_path / "kv" / "ns" / "a.kv", (now - 200, now - 200))
    assert st.get("ns/a") == b"x" * 300  # a read makes it the most recent
    st.put("ns/e", b"v" * 300)
    assert st.exists(["ns/a", "ns/c", "ns/d", "ns/e"]) == [True, False, True, True]
    with pytest.raises(StoreError, match="needs --hicache-storage-path"):
        FilePageStore("", 100)


def test_byte_budget_caps_bytes_per_second():
    t = [0.0]
    b = ByteBudget(1000, min_burst=100, clock=lambda: t[0])
    assert b.take(600) and not b.take(600)  # one second of burst
    t[0] = 0.5
    assert b.take(900) and not b.take(1)  # 400 left + 0.5 s at 1000 B/s
    assert ByteBudget(0, 100).take(10**12)  # 0: no cap


# --- the radix cache with a store ------------------------------------------------------------------------------------


def test_evicted_pages_are_written_and_another_cache_loads_them_past_its_tree(tmp_path):
    root = str(tmp_path / "kv")
    a, a_alloc, a_kv, a_tier = make_cache(FilePageStore(root, 1 << 20))
    tokens = list(range(10, 22))  # 6 pages
    cached(a, a_alloc, a_kv, tokens)
    assert a.evict(12) == 12  # no host tier: the pages leave the cache, and go to the store
    a_tier.flush()
    assert a_tier.stats()["storage_bytes_written"] == 6 * a_tier.page_bytes

    b, b_alloc, b_kv, b_tier = make_cache(FilePageStore(root, 1 << 20))
    cached(b, b_alloc, b_kv, tokens[:4])  # b holds the first 2 pages itself
    m = b.match_prefix(tokens + [99, 98, 97])
    assert m.length == 4 and m.host_len == 0
    m2 = b.load_back(m, max_tokens=6)  # at most 3 pages from the store
    assert m2.length == 10 and read_tokens(b_kv, m2.indices) == tokens[:10]
    assert b_kv.v_buffer[1][m2.indices, 0, 1].long().tolist() == [-(t + 1000) for t in tokens[:10]]
    assert b.match_prefix(tokens).length == 10  # the loaded pages joined the tree on the device
    assert b_tier.stats()["storage_hit_tokens"] == 6
    m3 = b.load_back(b.match_prefix(tokens + [1]), max_tokens=100)
    assert m3.length == 12
    # every device slot is free or in the tree
    b.evict(b_alloc.total_slots)
    assert b_alloc.available_size() == b_alloc.total_slots


def test_host_tier_writes_to_the_store_when_its_pages_leave_it(tmp_path):
    a, a_alloc, a_kv, a_tier = make_cache(FilePageStore(str(tmp_path), 1 << 20), pages=16, host_pages=2)
    tokens = list(range(30, 38))  # 4 pages; the host tier holds 2
    cached(a, a_alloc, a_kv, tokens)
    a.evict(8)
    a.evict_host(a.host.total_slots)
    a_tier.flush()
    assert a_tier.stats()["storage_bytes_written"] == 4 * a_tier.page_bytes
    assert a.host.available_size() == a.host.total_slots and a_alloc.available_size() == a_alloc.total_slots
    m = a.load_back(a.match_prefix(tokens), max_tokens=100)
    assert m.length == 8 and read_tokens(a_kv, m.indices) == tokens


def test_damaged_missing_or_other_namespace_pages_are_misses(tmp_path):
    a, a_alloc, a_kv, a_tier = make_cache(FilePageStore(str(tmp_path), 1 << 20))
    tokens = list(range(50, 58))
    cached(a, a_alloc, a_kv, tokens)
    a.evict(8)
    a_tier.flush()
    other, _, _, _ = make_cache(FilePageStore(str(tmp_path), 1 << 20), namespace="otherfp/tp1pp1r0")
    assert other.load_back(other.match_prefix(tokens), 100).length == 0
    # damage the third page: the first two load, the rest is recomputed
    files = {}
    for d, _, names in os.walk(tmp_path):
        for n in names:
            files[n] = os.path.join(d, n)
    from kvship.engine.mem.hicache_events import page_hashes

    third = a_tier.key(page_hashes(tokens, 2)[2]).rsplit("/", 1)[1] + ".kv"
    with open(files[third], "r+b") as f:
        f.seek(40)
        f.write(b"\xff\xfe")
    b, _, b_kv, b_tier = make_cache(FilePageStore(str(tmp_path), 1 << 20))
    m = b.load_back(b.match_prefix(tokens), 100)
    assert m.length == 4 and read_tokens(b_kv, m.indices) == tokens[:4]


def test_a_failing_store_costs_only_the_pages(tmp_path):
    store = RaisingStore()
    a, a_alloc, a_kv, a_tier = make_cache(store)
    tokens = list(range(60, 68))
    cached(a, a_alloc, a_kv, tokens)
    a.evict(8)
    a_tier.flush()
    assert a_alloc.available_size() == a_alloc.total_slots
    m = a.load_back(a.match_prefix(tokens), 100)
    assert m.length == 0 and a_tier.stats()["storage_errors"] >= 2 and store.calls >= 2


def test_read_bandwidth_cap_stops_the_load_and_the_rest_is_recomputed(tmp_path):
    a, a_alloc, a_kv, a_tier = make_cache(FilePageStore(str(tmp_path), 1 << 20))
    tokens = list(range(70, 82))
    cached(a, a_alloc, a_kv, tokens)
    a.evict(12)
    a_tier.flush()
    page = a_tier.page_bytes
    b, _, b_kv, b_tier = make_cache(FilePageStore(str(tmp_path), 1 << 20), bandwidth=2.5 * page)  # bursts 2 pages
    m = b.load_back(b.match_prefix(tokens), 100)
    assert m.length == 4 and read_tokens(b_kv, m.indices) == tokens[:4]


# --- read-ahead of queued prompts ------------------------------------------------------------------------------------


class CountingStore(KVPageStore):
    """Another store's pages, counting the calls (what admission asked the backend for)."""

    name = "counting"

    def __init__(self, inner: KVPageStore):
        self.inner, self.gets, self.exists_calls = inner, 0, 0

    def exists(self, keys):
        self.exists_calls += 1
        return self.inner.exists(keys)

    def get(self, key):
        self.gets += 1
        return self.inner.get(key)

    def put(self, key, value):
        self.inner.put(key, value)


def _stored(tmp_path, tokens) -> str:
    """A store directory holding ``tokens``' pages (written by a cache that evicted them)."""
    root = str(tmp_path / "kv")
    a, a_alloc, a_kv, a_tier = make_cache(FilePageStore(root, 1 << 20))
    cached(a, a_alloc, a_kv, tokens)
    a.evict(len(tokens))
    a_tier.flush()
    assert a_tier.stats()["storage_bytes_written"] == len(tokens) // 2 * a_tier.page_bytes
    return root


def test_a_queued_prompts_pages_are_read_ahead_and_its_admission_asks_the_store_nothing(tmp_path):
    tokens = list(range(110, 126))  # 8 pages
    root = _stored(tmp_path, tokens)
    store = CountingStore(FilePageStore(root, 1 << 20))
    b, b_alloc, b_kv, b_tier = make_cache(store, prefetch_pages=16)
    cached(b, b_alloc, b_kv, tokens[:4])  # b holds the first 2 pages: only the other 6 are read ahead
    assert b.prefetch(tokens + [1])
    b_tier.flush_prefetch()
    assert b_tier.staged_pages() == 6 and store.gets == 6
    calls = (store.gets, store.exists_calls)
    m = b.load_back(b.match_prefix(tokens + [1]), max_tokens=100)
    assert (store.gets, store.exists_calls) == calls  # every page came from the staging area
    assert m.length == 16 and read_tokens(b_kv, m.indices) == tokens
    assert b_kv.v_buffer[1][m.indices, 0, 1].long().tolist() == [-(t + 1000) for t in tokens]
    st = b_tier.stats()
    assert st["storage_prefetched_pages"] == 6 and st["storage_prefetch_hit_pages"] == 6
    assert st["storage_staged_pages"] == 0 and st["storage_hit_tokens"] == 12  # loaded pages leave the staging
    assert not b.prefetch(tokens)  # everything is held now: nothing to read
    b.evict(b_alloc.total_slots)
    assert b_alloc.available_size() == b_alloc.total_slots
    b_tier.close()


def test_read_ahead_is_bounded_and_admission_reads_the_rest(tmp_path):
    tokens = list(range(130, 146))
    store = CountingStore(FilePageStore(_stored(tmp_path, tokens), 1 << 20))
    b, _, b_kv, b_tier = make_cache(store, prefetch_pages=3)
    assert b_tier.staged_cap == 3
    assert b.prefetch(tokens)
    b_tier.flush_prefetch()
    assert b_tier.staged_pages() == 3 and store.gets == 3
    m = b.load_back(b.match_prefix(tokens), max_tokens=100)
    assert m.length == 16 and read_tokens(b_kv, m.indices) == tokens
    assert store.gets == 3 + 5 and b_tier.stats()["storage_prefetch_hit_pages"] == 3
    # two prompts' read-aheads over the cap: the oldest staged pages go first
    other = list(range(150, 158))
    c, _, c_kv, c_tier = make_cache(FilePageStore(_stored(tmp_path / "2", tokens + other), 1 << 20), prefetch_pages=4)
    c.prefetch(tokens[:8])
    c.prefetch(tokens + other)  # its first 4 pages: tokens[:8] again (staged already) -> nothing new beyond the cap
    c.prefetch(other)
    c_tier.flush_prefetch()
    assert c_tier.staged_pages() == 4
    c_tier.close()
    b_tier.close()


def test_read_ahead_stops_at_a_damaged_page_and_a_failing_store_only_costs_it(tmp_path):
    from kvship.engine.mem.hicache_events import page_hashes

    tokens = list(range(170, 182))
    root = _stored(tmp_path, tokens)
    b, _, b_kv, b_tier = make_cache(FilePageStore(root, 1 << 20), prefetch_pages=16)
    third = b_tier.key(page_hashes(tokens, 2)[2]).rsplit("/", 1)[1] + ".kv"
    path = next(os.path.join(d, third) for d, _, names in os.walk(root) if third in names)
    with open(path, "r+b") as f:
        f.seek(40)
        f.write(b"\xff\xfe")
    b.prefetch(tokens)
    b_tier.flush_prefetch()
    assert b_tier.staged_pages() == 2  # the two before it
    m = b.load_back(b.match_prefix(tokens), 100)
    assert m.length == 4 and read_tokens(b_kv, m.indices) == tokens[:4]
    b_tier.close()
    raising = RaisingStore()
    c, _, _, c_tier = make_cache(raising, prefetch_pages=16)
    assert c.prefetch(tokens)
    c_tier.flush_prefetch()
    assert c_tier.staged_pages() == 0 and c_tier.stats()["storage_errors"] == 1
    assert c.load_back(c.match_prefix(tokens), 100).length == 0
    c_tier.close()


def test_without_a_staging_area_nothing_is_read_ahead(tmp_path):
    tokens = list(range(190, 198))
    store = CountingStore(FilePageStore(_stored(tmp_path, tokens), 1 << 20))
    b, _, _, b_tier = make_cache(store)
    assert b_tier._reader is None and not b.prefetch(tokens) and store.gets == 0
    assert b.load_back(b.match_prefix(tokens), 100).length == 8


# --- a backend that connects late (a Mooncake master down or not started yet) ----------------------------------------


def test_a_store_that_is_not_there_yet_is_a_miss_until_it_connects(tmp_path):
    import threading

    from kvship.engine.mem.hicache_store import ReconnectingStore

    tokens = list(range(200, 208))
    root = _stored(tmp_path, tokens)
    attempts, up = [], threading.Event()

    def connect():
        attempts.append(time.monotonic())
        if not up.is_set():
            raise StoreError("master not answering")
        return FilePageStore(root, 1 << 20)

    store = ReconnectingStore("late", connect, retry_s=0.05, max_retry_s=0.2)
    b, b_alloc, b_kv, b_tier = make_cache(store)
    assert not store.wait_connected(0.3) and len(attempts) >= 2  # retried, backing off
    # meanwhile: every page a miss, every write a counted failure, the cache whole
    assert b.load_back(b.match_prefix(tokens), 100).length == 0
    cached(b, b_alloc, b_kv, list(range(300, 304)))
    b.evict(4)
    b_tier.flush()
    st = b_tier.stats()
    assert st["storage_connected"] is False and st["storage_errors"] == 2 and st["storage_bytes_written"] == 0
    assert b_alloc.available_size() == b_alloc.total_slots
    up.set()
    assert store.wait_connected(5)
    m = b.load_back(b.match_prefix(tokens), 100)
    assert m.length == 8 and read_tokens(b_kv, m.indices) == tokens
    assert b_tier.stats()["storage_connected"] is True
    n = len(attempts)
    b_tier.close()
    time.sleep(0.3)
    assert len(attempts) == n  # no retries once connected (and closed)


def test_closing_a_store_that_never_connected_stops_its_retries():
    from kvship.engine.mem.hicache_store import ReconnectingStore

    attempts = []

    def connect():
        attempts.append(1)
        raise StoreError("master not answering")

    store = ReconnectingStore("never", connect, retry_s=0.02, max_retry_s=0.02)
    time.sleep(0.2)
    store.close()
    n = len(attempts)
    assert n >= 2
    time.sleep(0.2)
    assert len(attempts) == n and not store.connected
    with pytest.raises(StoreError, match="not connected yet"):
        store.put("k", b"v")


# --- two workers sharing a directory (tiny random llama, CPU) --------------------------------------------------------


def _gen(rid, ids, n):
    from kvship.engine.io_struct import GenerateRequest, SamplingParams

    return GenerateRequest(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=n))


def _sched(model_dir, **kw):
    from tests.test_scheduler_e2e import make

    return make(model_dir, **kw)


def _drain(sched):
    from tests.test_scheduler_e2e import drain

    drain(sched)


@pytest.fixture(scope="module")
def two_turns(tiny_llama_dir, tmp_path_factory):
    """Worker A serves a first turn, then other sessions push its pages out of A's pool (into the store).
    Returns (store dir, turn-2 prompt, the cold greedy tokens of turn 2)."""
    store = str(tmp_path_factory.mktemp("kvstore"))
    g = torch.Generator().manual_seed(21)
    rand = lambda n: torch.randint(3, 384, (n,), generator=g).tolist()  # noqa: E731
    a, _, out = _sched(
        tiny_llama_dir, page_size=4, max_total_tokens=256, hicache_storage="file", hicache_storage_path=store
    )
    first = rand(100)
    a.submit(_gen("t1", first, 8))
    _drain(a)
    for i in range(3):
        a.submit(_gen(f"o{i}", rand(120), 4))
        _drain(a)
    a.cache.storage.flush()
    st = a.get_stats()
    assert st["storage_bytes_written"] > 0 and st["storage_errors"] == 0
    turn2 = first + out.tokens("t1") + rand(10)
    cold, _, cold_out = _sched(tiny_llama_dir, page_size=4, max_total_tokens=256, disable_radix_cache=True)
    cold.submit(_gen("t2", turn2, 10))
    _drain(cold)
    return store, turn2, cold_out.tokens("t2")


def test_two_workers_share_a_file_store_one_writes_the_other_hits(tiny_llama_dir, two_turns):
    store, turn2, cold_tokens = two_turns
    b, _, out = _sched(
        tiny_llama_dir, page_size=4, max_total_tokens=256, hicache_storage="file", hicache_storage_path=store
    )
    b.submit(_gen("t2", turn2, 10))
    _drain(b)
    fin = out.finished("t2")[0]
    assert fin.cached_tokens >= 100 // 4 * 4  # B never saw turn 1: its prefix came from A through the store
    assert out.tokens("t2") == cold_tokens
    st = b.get_stats()
    assert st["storage_hit_tokens"] == fin.cached_tokens and st["free_slots"] == st["total_slots"]


def test_a_queued_turn_is_read_ahead_and_admitted_from_the_staging_area(tiny_llama_dir, two_turns):
    store, turn2, cold_tokens = two_turns
    b, _, out = _sched(
        tiny_llama_dir, page_size=4, max_total_tokens=256, hicache_storage="file", hicache_storage_path=store
    )
    b.submit(_gen("t2", turn2, 10))
    b.recv()  # queued (as behind a running step on a busy worker): its pages are read ahead while it waits
    assert [r.rid for r in b.waiting] == ["t2"]
    b.cache.storage.flush_prefetch()
    staged = b.cache.storage.stats()["storage_staged_pages"]
    assert staged >= 100 // 4
    _drain(b)
    fin = out.finished("t2")[0]
    assert out.tokens("t2") == cold_tokens
    st = b.get_stats()
    assert st["storage_prefetch_hit_pages"] == staged and st["storage_staged_pages"] == 0
    assert st["storage_hit_tokens"] == fin.cached_tokens == staged * 4
    assert st["free_slots"] == st["total_slots"]


def test_a_worker_whose_store_fails_recomputes_and_gives_the_same_tokens(tiny_llama_dir, two_turns):
    store, turn2, cold_tokens = two_turns
    b, _, out = _sched(
        tiny_llama_dir, page_size=4, max_total_tokens=256, hicache_storage="file", hicache_storage_path=store
    )
    b.cache.storage.store = RaisingStore()  # the backend breaks after start-up
    b.submit(_gen("t2", turn2, 10))
    _drain(b)
    assert out.finished("t2")[0].cached_tokens == 0
    assert out.tokens("t2") == cold_tokens
    st = b.get_stats()
    assert st["storage_errors"] >= 1 and st["storage_hit_tokens"] == 0


def test_storage_flags_are_checked():
    from kvship.engine.config import ServerArgs

    with pytest.raises(ValueError, match="needs --hicache-storage-path"):
        ServerArgs(hicache_storage="file").validate()
    with pytest.raises(ValueError, match="needs --hicache-storage-master"):
        ServerArgs(hicache_storage="mooncake").validate()
    with pytest.raises(ValueError, match="needs the radix cache"):
        ServerArgs(hicache_storage="file", hicache_storage_path="/tmp/x", disable_radix_cache=True).validate()


# --- Mooncake Store with its real master ----------------------------------------------------------------------------


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _mooncake_master_binary():
    try:
        import mooncake
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except (ImportError, OSError) as e:
        pytest.skip(f"the mooncake package has no distributed store here: {e}")
    path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    if not os.access(path, os.X_OK):
        path = shutil.which("mooncake_master") or ""
    if not path:
        pytest.skip("the mooncake package ships no mooncake_master binary here")
    return path


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    binary = _mooncake_master_binary()
    rpc, meta, metrics = _free_port(), _free_port(), _free_port()
    log = open(tmp_path_factory.mktemp("mooncake") / "master.log", "w")
    proc = subprocess.Popen(
        [
            binary,
            f"--rpc_port={rpc}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={meta}",
            f"--metrics_port={metrics}",
            "--enable_metric_reporting=false",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", rpc), 0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"mooncake_master did not start (exit {proc.poll()}); see {log.name}")
                time.sleep(0.1)
        yield f"127.0.0.1:{rpc}", f"http://127.0.0.1:{meta}/metadata"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_mooncake_store_round_trip_between_two_clients(mooncake_master):
    from kvship.engine.mem.hicache_store import MooncakePageStore

    master, metadata = mooncake_master
    writer = MooncakePageStore(master, metadata, 32 << 20, buffer_bytes=16 << 20)
    reader = MooncakePageStore(master, metadata, 32 << 20, buffer_bytes=16 << 20)
    a, a_alloc, a_kv, a_tier = make_cache(writer)
    b, _, b_kv, b_tier = make_cache(reader)
    try:
        tokens = list(range(90, 102))
        cached(a, a_alloc, a_kv, tokens)
        a.evict(12)
        a_tier.flush()
        assert a_tier.stats()["storage_errors"] == 0 and a_tier.stats()["storage_bytes_written"] > 0
        m = b.load_back(b.match_prefix(tokens + [5]), 100)
        assert m.length == 12 and read_tokens(b_kv, m.indices) == tokens
        assert b_kv.k_buffer[1][m.indices, 0, 1].long().tolist() == [t + 1000 for t in tokens]
        assert b_tier.stats()["storage_hit_tokens"] == 12
    finally:
        a_tier.close()
        b_tier.close()
    with pytest.raises(StoreError, match="HOST:PORT"):
        MooncakePageStore("", metadata, 1 << 20)
