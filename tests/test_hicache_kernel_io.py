"""The host KV tier's kernel I/O (``--hicache-io-backend kernel``; docs/cache.md, "Copies"): ``copy_pages`` moves
pages bit for bit, the tier's write-backs and load-backs through it equal the copy thread's, and the scheduler
with it gives the cold greedy tokens and leaks nothing.

The kernel is Triton: on a machine without CUDA these cases run in the session's interpreter child
(tests/triton_interp.py); the refusal where Triton cannot run is checked in this process.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from triton_interp import TEST_TIMEOUT_S, interpreter_outcomes

from kvship.engine.mem.hicache import HostTier, resolve_io_backend
from kvship.engine.mem.mla_pool import MLAKVPool
from kvship.engine.mem.pools import KVPool

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_HERE = importlib.util.find_spec("triton") is not None and (torch.cuda.is_available() or INTERPRETED)
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason="Triton runs on CUDA or in its interpreter (child below)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if DEV == "cuda" else t


@needs_triton
@pytest.mark.parametrize(
    "dtype,shape,ps",
    [
        (torch.bfloat16, (17 * 16, 2, 8), 16),  # whole pages of 32-bit words
        (torch.float8_e4m3fn, (9 * 4, 1, 18), 4),  # FP8 bytes, rows of 18 bytes: words that straddle no row
        (torch.float32, (40, 1, 3), 1),  # single slots
        (torch.float8_e4m3fn, (40, 1, 3), 1),  # rows of 3 bytes: moved as bytes
    ],
)
def test_copy_pages_moves_the_named_pages_bit_for_bit_and_nothing_else(dtype, shape, ps):
    from kvship.engine.mem.page_copy import copy_pages

    g = torch.Generator().manual_seed(ps)
    src = [_host(torch.randn(shape, generator=g).to(dtype)) for _ in range(3)]  # 3 buffers: a pair + one alone
    dst = [torch.zeros(shape, device=DEV).to(dtype) for _ in range(3)]
    pages = shape[0] // ps
    sp = torch.randperm(pages, generator=g)[:6]
    dp = torch.randperm(pages, generator=g)[:6]
    copy_pages(dst, dp.to(DEV), src, sp.to(DEV), ps, programs=3, block=16)
    for d, s in zip(dst, src):
        dv = d.cpu().view(torch.uint8).unflatten(0, (-1, ps))
        sv = s.view(torch.uint8).unflatten(0, (-1, ps))
        assert torch.equal(dv[dp], sv[sp])
        rest = torch.ones(pages, dtype=torch.bool)
        rest[dp] = False
        assert not dv[rest].any()


def _fill(bufs, seed):
    g = torch.Generator().manual_seed(seed)
    for buf in bufs:
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))


@needs_triton
@pytest.mark.parametrize("pool_kind", ["gqa", "mla_fp8"])
@pytest.mark.parametrize("aligned", [True, False])
def test_kernel_write_back_and_load_back_equal_the_copy_threads(pool_kind, aligned):
    """The same write-back and load-back through both I/O backends leave the same bytes in both pools."""
    ps = 4
    pools = []
    for io in ("kernel", "copy"):
        if pool_kind == "gqa":
            kv = KVPool(32 * ps, ps, torch.bfloat16, 2, 8, 3, DEV)
            bufs = kv.k_buffer + kv.v_buffer
        else:
            kv = MLAKVPool(32 * ps, ps, torch.float8_e4m3fn, 12, 4, 3, DEV)
            bufs = kv.kv_buffer
        _fill(bufs, 5)
        pools.append((kv, HostTier(kv, 16 * ps, io_backend=io), bufs))
    if aligned:
        src = (torch.tensor([5, 2, 9])[:, None] * ps + torch.arange(ps)).flatten()
        dst = (torch.tensor([11, 3, 20])[:, None] * ps + torch.arange(ps)).flatten()
    else:  # slots that are not whole pages: copied slot by slot
        src = torch.tensor([7, 3, 12, 13, 1, 30, 2, 9]) + ps
        dst = torch.tensor([17, 6, 25, 29, 40, 41, 50, 60]) + ps
    results = []
    for kv, host, bufs in pools:
        assert host.io_backend in ("kernel", "copy")
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
    (kernel_bufs, kernel_host), (copy_bufs, copy_host) = results
    assert kernel_host.io_backend == "kernel" and copy_host.io_backend == "copy"
    for a, b in zip(kernel_bufs, copy_bufs):
        assert torch.equal(a, b)
    for ka, ca in zip(kernel_host.pool.layers, copy_host.pool.layers):
        for a, b in zip(ka, ca):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@needs_triton
def test_a_kernel_write_back_into_host_pages_a_started_load_still_reads_comes_after_the_load():
    """Host pages freed while a load-back that reads them is queued are rewritten by a later write-back only
    after the load read them: the load brings back the first rows, the host then holds the second."""
    ps = 2
    kv = KVPool(16 * ps, ps, torch.float32, 1, 2, 2, DEV)
    host = HostTier(kv, 2 * ps, io_backend="kernel")  # room for exactly the one page written below
    _fill(kv.k_buffer + kv.v_buffer, 9)
    a = torch.arange(ps) + 3 * ps
    b = torch.arange(ps) + 5 * ps
    dst = torch.arange(ps) + 9 * ps
    want_a = [k[a].clone() for k in kv.k_buffer]
    want_b = [k[b].clone() for k in kv.k_buffer]
    slots = host.write_back(a)
    host.load_back(slots, dst)
    host.free(slots)  # deferred: the queued load still reads them
    loads = host.start_loads()
    again = host.write_back(b)  # reuses the freed page
    assert again is not None and torch.equal(torch.sort(again).values, torch.sort(slots).values)
    loads.finish()
    host.sync_writes()
    assert all(torch.equal(k[dst].cpu(), w.cpu()) for k, w in zip(kv.k_buffer, want_a))
    assert all(torch.equal(h[again], w.cpu()) for h, w in zip(host.pool.k_buffer, want_b))


@needs_triton
def test_a_kernel_write_back_beside_a_running_load_does_not_wait_for_it(monkeypatch):
    """Host pages freed while a load may still read them are held until it is done; a write-back that finds
    other room takes that and does not order the stream behind the load (no ``drain``): decode steps keep
    running beside a load-back (docs/cache.md, "Load-ahead").  Short of room, it waits and takes them."""
    from kvship.engine.mem.hicache import LayerLoads

    ps = 2
    kv = KVPool(16 * ps, ps, torch.float32, 1, 2, 2, DEV)
    host = HostTier(kv, 3 * ps, io_backend="kernel")
    _fill(kv.k_buffer + kv.v_buffer, 11)
    a, b, c = (torch.arange(ps) + k * ps for k in (3, 5, 7))
    drains = []
    real_drain = host.drain
    monkeypatch.setattr(host, "drain", lambda: (drains.append(1), real_drain())[1])
    running = {"done": False}
    real_done = LayerLoads.done
    monkeypatch.setattr(LayerLoads, "done", lambda self: running["done"] and real_done(self))
    slots = host.write_back(a)
    ticket = host.load_back(slots, torch.arange(ps) + 9 * ps)
    host.start_loads()
    assert host.load_state(ticket) is not None and host.load_state(ticket) != "done"
    host.free(slots)  # the running load may still read it: held
    assert host.available_size() == 2 * ps
    assert host.write_back(b) is not None and not drains  # other room: no wait for the load
    assert host.available_size() == ps
    running["done"] = True  # the load is done: the held page returns
    assert host.load_state(ticket) == "done" and host.available_size() == 2 * ps
    running["done"] = False
    more = host.write_back(c)
    assert more is not None and host.write_back(a) is not None and host.available_size() == 0
    host.load_back(more, torch.arange(ps) + 11 * ps)
    host.start_loads()
    host.free(more)  # held again; now the pool is full
    assert host.available_size() == 0 and not drains
    assert host.write_back(b) is not None and drains == [1]  # short of room: it waits for the load, then reuses


@needs_triton
def test_the_scheduler_with_kernel_io_gives_the_cold_tokens_and_leaks_nothing(tiny_llama_dir):
    from tests.test_hicache import check_host_io_round_trip

    check_host_io_round_trip(tiny_llama_dir, "kernel", DEV)


def test_io_backend_auto_is_kernel_on_cuda_and_copy_elsewhere_and_unknown_names_are_refused():
    assert resolve_io_backend("auto", torch.device("cpu")) == "copy"
    assert resolve_io_backend("auto", torch.device("cuda", 0)) == "kernel"
    assert resolve_io_backend("copy", torch.device("cuda", 0)) == "copy"
    with pytest.raises(ValueError, match="unknown host KV tier I/O backend 'nvme'"):
        resolve_io_backend("nvme", torch.device("cpu"))


@pytest.mark.skipif(TRITON_HERE, reason="Triton can run here: nothing to refuse")
def test_kernel_io_where_triton_cannot_run_is_refused_at_startup_naming_the_way_out():
    kv = KVPool(16, 4, torch.float32, 1, 2, 2, "cpu")
    with pytest.raises(ValueError, match="use --hicache-io-backend copy"):
        HostTier(kv, 16, io_backend="kernel")


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, the kernel cases above run natively")
def test_kernel_io_cases_pass_in_the_triton_interpreter(request):
    """This file's Triton cases in a child pytest with ``TRITON_INTERPRET=1`` (the session's one such child,
    tests/triton_interp.py)."""
    pytest.importorskip("triton")
    interpreter_outcomes(request, "tests/test_hicache_kernel_io.py").check(passed=12)
