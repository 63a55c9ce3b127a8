"""The host KV tier's layer-by-layer load-back on CUDA (docs/cache.md, "Load-back"): a side stream copies each
layer and records an event, the forward's stream waits for the layer it reaches.

* Every layer's rows are in the device pool, as the forward's stream sees them, once that layer's ``wait``
  returned (pinned host pool, a few thousand pages so the copies take a while).
* A prompt whose prefix was evicted to the host tier and loaded back gives the greedy tokens of a cold request,
  and counts the host hit (the CPU test's scenario, on the GPU with the launcher's per-layer gate).
"""

from __future__ import annotations

import pytest
import torch
from gpu_common import requires_cuda

from kvship.engine.mem.hicache import HostTier
from kvship.engine.mem.pools import KVPool

pytestmark = [pytest.mark.gpu, requires_cuda]
# every I/O backend (--hicache-io-backend; docs/cache.md, "Copies"): kernel is the default on CUDA
io_backends = pytest.mark.parametrize("io", ["kernel", "dma", "copy"])


@io_backends
def test_each_layer_is_in_place_on_the_forward_stream_once_its_wait_returns(io):
    layers, slots, heads, dim = 6, 1 << 15, 8, 128
    kv = KVPool(slots, 16, torch.bfloat16, heads, dim, layers, "cuda")
    host = HostTier(kv, slots, io_backend=io)
    src = torch.arange(16, slots, dtype=torch.int64)  # host slots (page 0 unused)
    dst = torch.flip(src, [0])  # device slots, another order
    for layer in range(layers):
        rows = torch.randn((src.numel(), heads, dim), dtype=torch.bfloat16)
        host.pool.k_buffer[layer][src] = rows
        host.pool.v_buffer[layer][src] = -rows
    for layer in range(layers):
        kv.k_buffer[layer].zero_()
        kv.v_buffer[layer].zero_()
    torch.cuda.synchronize()
    host.load_back(src, dst)
    loads = host.start_loads()
    assert loads is not None
    dst_dev = dst.cuda()
    for layer in range(layers):
        loads.wait(layer)  # the current stream now waits for this layer's copy
        got_k = kv.k_buffer[layer].index_select(0, dst_dev).cpu()
        got_v = kv.v_buffer[layer].index_select(0, dst_dev).cpu()
        assert torch.equal(got_k, host.pool.k_buffer[layer][src])
        assert torch.equal(got_v, host.pool.v_buffer[layer][src])
    loads.finish()


@io_backends
def test_prefix_loaded_back_on_the_gpu_gives_the_cold_tokens(tiny_llama_dir, io):
    from tests.test_hicache import _drain, _gen, _sched

    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(3, 384, (n,), generator=g).tolist()  # noqa: E731
    first, others, tail = rand(100), [rand(120) for _ in range(4)], rand(10)
    # triton attention: the shared tiny model's head_dim 16 is under what FlashInfer's merge kernel takes (an
    # H200 run of 2026-11-29 failed there, in VariableLengthMergeStates, before reaching the tier)
    kw = dict(device="cuda", page_size=4, attention_backend="triton")
    sched, _, out = _sched(tiny_llama_dir, max_total_tokens=256, hicache_ratio=4.0, hicache_io_backend=io, **kw)
    assert sched.cache.host.io_backend == io
    sched.submit(_gen("t1", first, 8))
    _drain(sched)
    for i, ids in enumerate(others):
        sched.submit(_gen(f"other{i}", ids, 8))
        _drain(sched)
    turn2 = first + out.tokens("t1") + tail
    assert sched.cache.match_prefix(turn2[:-1]).host_len >= 96
    sched.submit(_gen("t2", turn2, 12))
    _drain(sched)
    assert out.finished("t2")[0].cached_tokens >= 96
    cold, _, cold_out = _sched(tiny_llama_dir, max_total_tokens=1024, **kw)
    cold.submit(_gen("c", turn2, 12))
    _drain(cold)
    assert out.tokens("t2") == cold_out.tokens("c")


@io_backends
def test_a_write_back_takes_the_rows_before_later_kernels_overwrite_them_and_loads_back_after(io):
    """The write-back's device read is ordered on the current stream before the kernels queued after it, and
    its host rows are written before a load-back handed over after it reads them (no wait between)."""
    layers, heads, dim, ps = 4, 8, 128, 16
    kv = KVPool(1 << 14, ps, torch.bfloat16, heads, dim, layers, "cuda")
    host = HostTier(kv, 1 << 13, io_backend=io)
    for layer in range(layers):
        kv.k_buffer[layer].normal_()
        kv.v_buffer[layer].normal_()
    src = (torch.arange(40, 104)[:, None] * ps + torch.arange(ps)).flatten()  # 64 whole pages
    dst = (torch.arange(500, 564)[:, None] * ps + torch.arange(ps)).flatten()
    want = [kv.k_buffer[layer][src.cuda()].cpu() for layer in range(layers)]
    slots = host.write_back(src)
    assert slots is not None
    for layer in range(layers):  # queued after the write-back's gather on the same stream
        kv.k_buffer[layer].fill_(7.0)
    host.load_back(slots, dst)
    loads = host.start_loads()
    loads.finish()
    for layer in range(layers):
        assert torch.equal(kv.k_buffer[layer][dst.cuda()].cpu(), want[layer])
    host.sync_writes()
