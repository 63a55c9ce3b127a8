"""Expert parallelism on one GPU: the Triton runner's "absent" pairs, and a world-size-1 NCCL group.

* The ``triton`` runner with ``absent=True`` (ids of ``-1`` for experts on
  other ranks) against the ``torch`` runner over the same local experts
  (bf16: relative error <= 1e-2; under ``TRITON_INTERPRET=1`` on CPU in float32,
  1e-4), including a batch where no pair is local.
* ``ParallelFusedMoE`` over a world-size-1 NCCL group (``--tp-size 1`` never
  builds one, so this is the only single-GPU run of the path): the
  ``all_reduce`` dispatch captured in a CUDA graph (NCCL all-reduce inside the
  graph) replays equal to eager, and the ``all_to_all`` dispatch (eager:
  ``all_to_all_single`` + all-gather over NCCL) equals it.
* A tiny Qwen3-MoE ``ModelRunner`` on that group (every layer parallel, the
  experts in ``ParallelFusedMoE``): CUDA-graph decode equals eager decode
  token for token.

Run on the device: ``pytest -q tests/gpu/test_gpu_ep.py``.
"""

from __future__ import annotations

import socket

import pytest
import torch
from gpu_common import cuda_or_interpreter, kernel_device, requires_cuda

from kvship.engine.layers.moe.runner import get_moe_runner
from kvship.engine.layers.moe.topk import select_experts

pytestmark = [pytest.mark.gpu]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@cuda_or_interpreter
@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("none_local", [False, True])
def test_triton_runner_skips_absent_pairs_like_the_torch_runner(m, none_local):
    """8 experts, this rank holds 4..7 (local ids 0..3); pairs routed to 0..3 are -1 (absent)."""
    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    e, k, h, i = 8, 2, 64, 48
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, h, generator=g).to(dev, dtype)
    w13 = (torch.randn(e // 2, 2 * i, h, generator=g) * h**-0.5).to(dev, dtype)
    w2 = (torch.randn(e // 2, h, i, generator=g) * i**-0.5).to(dev, dtype)
    logits = torch.randn(m, e, generator=g).to(dev)
    if none_local:
        logits[:, 4:] = -1e4
    weights, ids = select_experts(logits, k, renormalize=True)
    local = ids - 4
    local = torch.where(local >= 0, local, -1)
    out = get_moe_runner("triton")(x, w13, w2, weights, local, absent=True)
    ref = get_moe_runner("torch")(x.float(), w13.float(), w2.float(), weights, local, absent=True)
    assert out.shape == x.shape and out.dtype == dtype
    if none_local:
        assert (local < 0).all() and torch.count_nonzero(out) == 0
    else:
        assert _rel(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-4)


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
    # world-size-1 groups: the TP, PP and EP axes are all the world's NCCL communicator
    yield init_distributed(Topology(), f"tcp://127.0.0.1:{port}", torch.device("cuda", 0), timeout_s=60)
    dist.destroy_process_group()


@requires_cuda
@pytest.mark.parametrize("m", [1, 8, 64])
def test_world_size_one_ep_layer_replays_in_a_cuda_graph_and_all_to_all_equals_it(m, nccl_world1):
    from kvship.engine.layers.moe.layer import FusedMoE
    from kvship.engine.parallel.ep import ParallelFusedMoE

    dev = torch.device("cuda")
    base = FusedMoE(64, 8, 1024, 352, renormalize=True, dtype=torch.bfloat16, runner="triton")
    layer = ParallelFusedMoE(base, nccl_world1.tp, ep_size=1, dispatch="all_to_all").to(dev)
    with torch.no_grad():
        layer.w13_weight.normal_(0, 0.03)
        layer.w2_weight.normal_(0, 0.05)
    x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(m, 64, device=dev)
    plain = FusedMoE(64, 8, 1024, 352, renormalize=True, dtype=torch.bfloat16, runner="triton").to(dev)
    with torch.no_grad():
        plain.w13_weight.copy_(layer.w13_weight)
        plain.w2_weight.copy_(layer.w2_weight)
    with torch.inference_mode():
        eager_a2a = layer(x, logits)  # not capturing: the all_to_all dispatch (also warms Triton up)
        assert _rel(eager_a2a, plain(x, logits)) < 1e-2
        layer.dispatch = "all_reduce"
        layer(x, logits)  # warm the all_reduce path (absent-pair kernels, NCCL) up outside the graph
        layer.dispatch = "all_to_all"
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream), nccl_world1.graph_capture():
            out = layer(x, logits)  # capturing: all_to_all is not capture-safe, so the all_reduce dispatch
        torch.cuda.current_stream().wait_stream(stream)
        layer.dispatch = "all_reduce"
        for seed in range(3):
            g = torch.Generator(device=dev).manual_seed(seed)
            x.copy_(torch.randn(m, 1024, device=dev, generator=g))
            logits.copy_(torch.randn(m, 64, device=dev, generator=g))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, layer(x, logits)), f"replay {seed} differs from eager"
        assert int(layer.expert_load().sum()) > 0


@requires_cuda
def test_world_size_one_ep_model_cuda_graph_decode_equals_eager(nccl_world1, tmp_path, kv_driver):
    from moe_fixtures import build_tiny_moe

    from kvship.engine.config import ServerArgs
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.parallel.ep import ParallelFusedMoE

    path = build_tiny_moe(str(tmp_path / "qwen3_moe"), "qwen3_moe", seed=33)

    def runner(graphs: bool) -> ModelRunner:
        sa = ServerArgs(
            model_path=path,
            device="cuda",
            dtype="bfloat16",
            attention_backend="triton",
            max_total_tokens=4096,
            max_running_requests=8,
            context_length=256,
            disable_cuda_graph=not graphs,
            cuda_graph_bs=[1, 2, 4, 8],
            cuda_graph_max_bs=8,
        )
        return ModelRunner(sa, groups=nccl_world1)

    def greedy(r: ModelRunner, bs: int) -> list[list[int]]:
        d = kv_driver(r)
        reqs = [d.new() for _ in range(bs)]
        gen = torch.Generator().manual_seed(bs)
        logits = d.extend(reqs, [torch.randint(3, 380, (4 + 3 * j,), generator=gen).tolist() for j in range(bs)])
        out: list[list[int]] = [[] for _ in range(bs)]
        for _ in range(16):
            toks = logits.argmax(-1).tolist()
            for o, t in zip(out, toks):
                o.append(t)
            logits = d.decode(reqs, toks)
        for q in reqs:
            d.free(q)
        return out

    graph_runner, eager_runner = runner(True), runner(False)
    assert graph_runner.cuda_graph_runner is not None
    assert any(isinstance(m, ParallelFusedMoE) for m in graph_runner.model.modules())
    for bs in (1, 3, 8):
        before = graph_runner.cuda_graph_runner.replays
        assert greedy(graph_runner, bs) == greedy(eager_runner, bs), f"bs {bs}"
        assert graph_runner.cuda_graph_runner.replays > before
