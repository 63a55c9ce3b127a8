"""The L2 prefetch plan of a decoder layer (``engine/layers/l2_prefetch.py``): each latency-bound window
takes the weights read after it, up to its budget, from where the window before it stopped; nothing is asked
for twice or before it is read, absent weights are skipped.  The prefetch kernel itself needs a Hopper GPU
(tests/gpu/test_gpu_cuda_graph.py)."""

from __future__ import annotations

import torch

from kvship.engine.layers.l2_prefetch import plan_windows, prefetcher_for


def _w(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes // 2, dtype=torch.bfloat16)


def _bytes(regions) -> list[tuple[int, int, int]]:
    return [(id(t), start, n) for t, start, n in regions]


def test_windows_continue_where_the_last_stopped():
    qkv, o, gu, down = _w(100), _w(40), _w(300), _w(150)
    plans = plan_windows([qkv, o, gu, down], [(0, 60), (1, 120), (2, 200)])
    assert _bytes(plans[0]) == [(id(qkv), 0, 60)]
    # the attention window starts at o (qkv is read before it), then gate/up
    assert _bytes(plans[1]) == [(id(o), 0, 40), (id(gu), 0, 80)]
    # the last window continues gate/up from byte 80, then down
    assert _bytes(plans[2]) == [(id(gu), 80, 200)]
    total = {}
    for p in plans:
        for t, start, n in p:
            assert start == total.get(id(t), 0)  # contiguous, never twice
            total[id(t)] = start + n
    assert total[id(gu)] <= 300


def test_budgets_past_the_weights_stop_at_their_end_and_absent_weights_are_skipped():
    qkv, down = _w(64), _w(32)
    plans = plan_windows([qkv, None, None, down], [(0, 10), (1, 1000), (2, 1000)])
    assert _bytes(plans[0]) == [(id(qkv), 0, 10)]
    assert _bytes(plans[1]) == [(id(down), 0, 32)]
    assert plans[2] == []
    assert plan_windows([qkv], [(0, 0)]) == [[]]


def test_no_prefetcher_off_cuda(monkeypatch):
    monkeypatch.setenv("KVSHIP_L2_PREFETCH", "1")
    assert prefetcher_for(torch.device("cpu")) is None
