"""The host KV tier's copy-engine I/O (``--hicache-io-backend dma``; docs/cache.md, "Copies"): the pages a copy
names become runs and descriptors that move exactly those bytes, an out-of-range page moves nothing, the tier's
write-backs and load-backs through it equal the copy thread's, and the scheduler with it gives the cold greedy
tokens and leaks nothing.

On CUDA the descriptors go to ``cudaMemcpyBatchAsync``; on CPU (CI) the same descriptors are executed by
``memmove``, so every case here runs in both places.
"""

from __future__ import annotations

import pytest
import torch

from kvship.engine.mem import dma_copy
from kvship.engine.mem.hicache import HostTier, resolve_io_backend
from kvship.engine.mem.mla_pool import MLAKVPool
from kvship.engine.mem.pools import KVPool

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if DEV == "cuda" else t


def _fill(bufs, seed):
    g = torch.Generator().manual_seed(seed)
    for buf in bufs:
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))


def test_page_runs_join_pairs_where_both_sides_advance_by_one():
    d, s, n = dma_copy.page_runs([3, 4, 5, 9, 10, 2, 8], [7, 8, 9, 1, 2, 3, 3])
    assert d.tolist() == [3, 9, 2, 8] and s.tolist() == [7, 1, 3, 3] and n.tolist() == [3, 2, 1, 1]
    d, s, n = dma_copy.page_runs([], [])
    assert d.size == s.size == n.size == 0
    with pytest.raises(ValueError, match="3 destination pages for 2 source pages"):
        dma_copy.page_runs([1, 2, 3], [1, 2])


@pytest.mark.parametrize(
    "dtype,shape,ps",
    [
        (torch.bfloat16, (17 * 16, 2, 8), 16),  # whole pages
        (torch.float8_e4m3fn, (9 * 4, 1, 18), 4),  # FP8 bytes, rows of 18 bytes
        (torch.float32, (40, 1, 3), 1),  # single slots
        (torch.float8_e4m3fn, (40, 1, 3), 1),  # rows of 3 bytes
    ],
)
def test_copy_pages_moves_the_named_pages_bit_for_bit_and_nothing_else(dtype, shape, ps):
    g = torch.Generator().manual_seed(ps)
    src = [_host(torch.randn(shape, generator=g).to(dtype)) for _ in range(3)]
    dst = [torch.zeros(shape, device=DEV).to(dtype) for _ in range(3)]
    pages = shape[0] // ps
    sp = torch.tensor([5, 6, 7, 1, 0, 8])  # runs of 3, 1, 1 and 1 pages on both sides
    dp = torch.tensor([2, 3, 4, 8, 0, 6])
    issued = dma_copy.copy_pages(dst, dp, src, sp, ps)
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert issued == 3 * dma_copy.page_runs(dp, sp)[0].size
    for d, s in zip(dst, src):
        dv = d.cpu().view(torch.uint8).unflatten(0, (-1, ps))
        sv = s.view(torch.uint8).unflatten(0, (-1, ps))
        assert torch.equal(dv[dp], sv[sp])
        rest = torch.ones(pages, dtype=torch.bool)
        rest[dp] = False
        assert not dv[rest].any()


def test_a_page_past_a_buffers_end_is_refused_and_nothing_moves():
    src = [_host(torch.ones(8, 2))]
    dst = [torch.zeros(8, 2, device=DEV)]
    with pytest.raises(ValueError, match="past the end"):
        dma_copy.copy_pages(dst, torch.tensor([0, 4]), src, torch.tensor([1, 2]), 2)  # dst page 4 of 0..3
    with pytest.raises(ValueError, match="past the end"):
        dma_copy.copy_pages(dst, torch.tensor([1]), src, torch.tensor([3]), 4)  # src page 3 of 0..1
    with pytest.raises(ValueError, match="negative page"):
        dma_copy.copy_pages(dst, torch.tensor([-1]), src, torch.tensor([0]), 2)
    with pytest.raises(ValueError, match="rows"):
        dma_copy.copy_pages(dst, torch.tensor([0]), [_host(torch.ones(8, 3))], torch.tensor([0]), 2)
    assert not dst[0].any()


@pytest.mark.parametrize("pool_kind", ["gqa", "mla_fp8"])
@pytest.mark.parametrize("aligned", [True, False])
def test_dma_write_back_and_load_back_equal_the_copy_threads(pool_kind, aligned):
    """The same write-back and load-back through both I/O backends leave the same bytes in both pools."""
    ps = 4
    results = []
    for io in ("dma", "copy"):
        if pool_kind == "gqa":
            kv = KVPool(32 * ps, ps, torch.bfloat16, 2, 8, 3, DEV)
            bufs = kv.k_buffer + kv.v_buffer
        else:
            kv = MLAKVPool(32 * ps, ps, torch.float8_e4m3fn, 12, 4, 3, DEV)
            bufs = kv.kv_buffer
        _fill(bufs, 5)
        host = HostTier(kv, 16 * ps, io_backend=io)
        assert host.io_backend == io
        if aligned:
            src = (torch.tensor([5, 6, 9])[:, None] * ps + torch.arange(ps)).flatten()
            dst = (torch.tensor([11, 12, 20])[:, None] * ps + torch.arange(ps)).flatten()
        else:  # slots that are not whole pages: copied slot by slot
            src = torch.tensor([7, 3, 12, 13, 1, 30, 2, 9]) + ps
            dst = torch.tensor([17, 6, 25, 29, 40, 41, 50, 60]) + ps
        host_slots = host.write_back(src)
        for b in bufs:  # the device rows change right after the write-back: it took them already
            raw = b.view(torch.uint8)
            raw[src.to(raw.device)] = 255 - raw[src.to(raw.device)]
        host.load_back(host_slots, dst)
        host.start_loads().finish()
        host.sync_writes()
        host.free(host_slots)
        host.drain()
        assert host.available_size() == host.total_slots
        results.append(([b.cpu().view(torch.uint8).clone() for b in bufs], host))
    (dma_bufs, dma_host), (copy_bufs, copy_host) = results
    for a, b in zip(dma_bufs, copy_bufs):
        assert torch.equal(a, b)
    for ka, ca in zip(dma_host.pool.layers, copy_host.pool.layers):
        for a, b in zip(ka, ca):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_dma_write_back_into_host_pages_a_started_load_still_reads_comes_after_the_load():
    """Host pages freed while a load-back that reads them runs are rewritten by a later write-back only after
    the load read them: the load brings back the first rows, the host then holds the second."""
    ps = 2
    kv = KVPool(16 * ps, ps, torch.float32, 1, 2, 2, DEV)
    host = HostTier(kv, ps, io_backend="dma")  # room for exactly the one page written below
    _fill(kv.k_buffer + kv.v_buffer, 9)
    a = torch.arange(ps) + 3 * ps
    b = torch.arange(ps) + 5 * ps
    dst = torch.arange(ps) + 9 * ps
    want_a = [k[a].clone() for k in kv.k_buffer]
    want_b = [k[b].clone() for k in kv.k_buffer]
    slots = host.write_back(a)
    host.load_back(slots, dst)
    host.free(slots)
    loads = host.start_loads()
    again = host.write_back(b)  # the pool is short: it waits for the load, then reuses the freed page
    assert again is not None and torch.equal(torch.sort(again).values, torch.sort(slots).values)
    loads.finish()
    host.sync_writes()
    assert all(torch.equal(k[dst].cpu(), w.cpu()) for k, w in zip(kv.k_buffer, want_a))
    assert all(torch.equal(h[again], w.cpu()) for h, w in zip(host.pool.k_buffer, want_b))


def test_the_scheduler_with_dma_io_gives_the_cold_tokens_and_leaks_nothing(tiny_llama_dir):
    from tests.test_hicache import check_host_io_round_trip

    check_host_io_round_trip(tiny_llama_dir, "dma", DEV)


def test_dma_is_a_named_backend_auto_stays_kernel_on_cuda():
    assert resolve_io_backend("dma", torch.device("cpu")) == "dma"
    assert resolve_io_backend("dma", torch.device("cuda", 0)) == "dma"
    assert resolve_io_backend("auto", torch.device("cuda", 0)) == "kernel"
