"""``cuda_graph_runner.collector_paused``: the guard every loop of CUDA-graph captures runs in (the GPU test
``tests/gpu/test_gpu_cuda_graph.py`` shows captures surviving garbage with CUDA finalizers)."""

from __future__ import annotations

import gc

import pytest

from kvship.engine.cuda_graph_runner import collector_paused


class _Cycle:
    finalized = 0

    def __init__(self):
        self.me = self  # only the cyclic collector frees it

    def __del__(self):
        _Cycle.finalized += 1


def test_collects_first_then_keeps_the_collector_off_inside():
    gc.collect()
    _Cycle.finalized = 0
    enabled = gc.isenabled()
    gc.disable()  # the garbage below must wait for collector_paused's own collection
    try:
        _Cycle()
        _Cycle()
        assert _Cycle.finalized == 0
        gc.enable()
        with collector_paused():
            assert _Cycle.finalized == 2  # collected on entry, before any capture
            assert not gc.isenabled()  # no automatic collection inside
        assert gc.isenabled()
    finally:
        (gc.enable if enabled else gc.disable)()


def test_restores_the_collector_as_it_was_also_on_error():
    enabled = gc.isenabled()
    try:
        gc.enable()
        with pytest.raises(RuntimeError):
            with collector_paused():
                raise RuntimeError("capture failed")
        assert gc.isenabled()
        gc.disable()
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        (gc.enable if enabled else gc.disable)()
