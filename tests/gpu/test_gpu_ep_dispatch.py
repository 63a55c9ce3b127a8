"""The ``static`` expert-parallel dispatch on one GPU, over a world-size-1 NCCL group (not yet run on a device).

* Captured in a CUDA graph (the equal-split ``all_to_all_single`` and the
  all-gather inside the graph: ``all_to_all_equal`` is capture-safe on NCCL),
  replays equal eager for new tokens and routing, bit for bit, and equal the
  plain layer within bf16 rounding.
* Two-batch overlap (eager, async NCCL collectives) equals the plain layer.

The multi-rank equality is on CPU (tests/test_ep_dispatch.py); the two-GPU
figures come from ``bench/ep_dispatch.py`` (docs/parallel.md, "Dispatch").
Run on the device: ``pytest -q tests/gpu/test_gpu_ep_dispatch.py``.
"""

from __future__ import annotations

import socket

import pytest
import torch
from gpu_common import requires_cuda

pytestmark = [pytest.mark.gpu]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def nccl_world1():
    import torch.distributed as dist

    from kvship.engine.distributed.groups import init_distributed
    from kvship.engine.distributed.topology import Topology

    if dist.is_initialized():
        pytest.skip("a process group already exists in this pytest process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield init_distributed(Topology(), f"tcp://127.0.0.1:{port}", torch.device("cuda", 0), timeout_s=60)
    dist.destroy_process_group()


@requires_cuda
@pytest.mark.parametrize("m", [1, 8, 64])
def test_static_dispatch_replays_in_a_cuda_graph_and_overlap_equals_it(m, nccl_world1):
    from kvship.engine.layers.moe.layer import FusedMoE
    from kvship.engine.parallel.ep import ParallelFusedMoE

    dev = torch.device("cuda")
    base = FusedMoE(64, 8, 1024, 352, renormalize=True, dtype=torch.bfloat16, runner="triton")
    layer = ParallelFusedMoE(base, nccl_world1.tp, ep_size=1, dispatch="static").to(dev)
    plain = FusedMoE(64, 8, 1024, 352, renormalize=True, dtype=torch.bfloat16, runner="triton").to(dev)
    with torch.no_grad():
        layer.w13_weight.normal_(0, 0.03)
        layer.w2_weight.normal_(0, 0.05)
        plain.w13_weight.copy_(layer.w13_weight)
        plain.w2_weight.copy_(layer.w2_weight)
    x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(m, 64, device=dev)
    with torch.inference_mode():
        eager = layer(x, logits)  # also warms Triton and NCCL up outside the graph
        assert _rel(eager, plain(x, logits)) < 1e-2
        layer.two_batch_overlap = True
        assert _rel(layer(x, logits), eager) < 1e-2
        layer.two_batch_overlap = False
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream), nccl_world1.graph_capture():
            assert nccl_world1.tp.can_run("all_to_all_equal")
            out = layer(x, logits)
        torch.cuda.current_stream().wait_stream(stream)
        for seed in range(3):
            g = torch.Generator(device=dev).manual_seed(seed)
            x.copy_(torch.randn(m, 1024, device=dev, generator=g))
            logits.copy_(torch.randn(m, 64, device=dev, generator=g))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, layer(x, logits)), f"replay {seed} differs from eager"
