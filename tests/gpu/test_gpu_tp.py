"""Tensor parallelism's code path on one GPU: a world-size-1 NCCL group (docs/parallel.md).

``--tp-size 1`` never builds a process group, so before a multi-GPU run this
is the only place the parallel layers (column/row-parallel linears with their
NCCL all-reduce, vocab-parallel embedding and LM head with the logits
all-gather) run on CUDA, and the only place NCCL collectives are captured in
CUDA graphs.  A ``ModelRunner`` given such a group (the TP path forced on)
must decode exactly what the plain runner does:

* TP path with CUDA graphs (replays counted) == TP path eager, token for token
  (same kernels: graph capture of the NCCL all-reduce is exact);
* TP path with CUDA graphs == the plain runner with CUDA graphs, token for
  token (greedy; the SmolLM2 GGUF's real weights keep choices off near-ties);
  the GGUF goes through the shard loader (``CheckpointSlice``) here.

Run on the device: ``pytest -q tests/gpu/test_gpu_tp.py``.
"""

from __future__ import annotations

import gc
import socket

import pytest
import torch
from gpu_common import requires_cuda, smollm2_or_tiny_llama

from kvship.engine.config import ServerArgs
from kvship.engine.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu, requires_cuda]

GRAPH_BS = [1, 2, 4, 8]
STEPS = 32


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return smollm2_or_tiny_llama(tmp_path_factory, "tp_model", seed=23)


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


def make_runner(model_path: str, graphs: bool, groups=None) -> ModelRunner:
    sa = ServerArgs(
        model_path=model_path,
        device="cuda",
        dtype="bfloat16",
        attention_backend="triton",
        max_total_tokens=8192,
        max_running_requests=8,
        context_length=512,
        disable_cuda_graph=not graphs,
        cuda_graph_bs=GRAPH_BS,
        cuda_graph_max_bs=8,
    )
    return ModelRunner(sa, groups=groups)


def greedy(runner: ModelRunner, driver_cls, bs: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(500 + bs)
    vocab = runner.model_config.vocab_size
    d = driver_cls(runner)
    reqs = [d.new() for _ in range(bs)]
    prompts = [torch.randint(3, vocab, (5 + 7 * j,), generator=gen).tolist() for j in range(bs)]
    logits = d.extend(reqs, prompts)
    out: list[list[int]] = [[] for _ in range(bs)]
    for _ in range(STEPS):
        toks = logits.argmax(-1).tolist()
        for o, t in zip(out, toks):
            o.append(t)
        logits = d.decode(reqs, toks)
    for r in reqs:
        d.free(r)
    return out


def test_world_size_one_tp_path_with_cuda_graphs_equals_eager_and_the_plain_runner(model_path, nccl_world1, kv_driver):
    from kvship.engine.parallel.layers import RowParallelLinear, VocabParallelLMHead

    tp_graphs = make_runner(model_path, graphs=True, groups=nccl_world1)
    assert tp_graphs.cuda_graph_runner is not None and tp_graphs.tp_size == 1
    modules = list(tp_graphs.model.modules())
    assert any(isinstance(m, RowParallelLinear) for m in modules)  # the TP layers, not the plain ones
    assert any(isinstance(m, VocabParallelLMHead) for m in modules)
    tp_eager = make_runner(model_path, graphs=False, groups=nccl_world1)
    want = {}
    for bs in (1, 3, 8):  # 3 is padded to the captured 4
        before = tp_graphs.cuda_graph_runner.replays
        want[bs] = greedy(tp_graphs, kv_driver, bs)
        assert tp_graphs.cuda_graph_runner.replays > before, f"bs {bs} did not replay a graph"
        assert want[bs] == greedy(tp_eager, kv_driver, bs), f"bs {bs}: graph replay differs from eager"
    del tp_eager, tp_graphs
    gc.collect()
    torch.cuda.empty_cache()
    plain = make_runner(model_path, graphs=True)
    assert plain.tp is None and not any(isinstance(m, RowParallelLinear) for m in plain.model.modules())
    for bs in (1, 3, 8):
        assert greedy(plain, kv_driver, bs) == want[bs], f"bs {bs}: TP path differs from the plain runner"
