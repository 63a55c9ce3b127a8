"""The CPU path never needs FlashInfer or Triton, and the CUDA-graph size list covers the scheduler's batches."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from kvship.engine.config import ServerArgs
from kvship.engine.cuda_graph_runner import cuda_graph_batch_sizes

_BLOCKED_RUN = textwrap.dedent("""
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("flashinfer", "triton"):
                raise ImportError(f"blocked: {name}")
            return None

    sys.meta_path.insert(0, Block())
    import torch
    from kvship.engine.attention.base import create_attention_backend
    from kvship.engine.config import ServerArgs
    from kvship.engine.forward_batch import ForwardMode, build_forward_batch
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.sampler import create_sampler
    import kvship.engine.scheduler  # noqa: F401

    r = ModelRunner(ServerArgs(model_path=sys.argv[1], max_total_tokens=64))
    assert r.cuda_graph_runner is None
    row = r.req_to_token_pool.alloc()
    slots = r.allocator.alloc(3)
    r.req_to_token_pool.write(row, 0, slots)
    ids = torch.tensor([5, 6, 7])
    fb = build_forward_batch(ForwardMode.EXTEND, input_ids=ids, positions=torch.arange(3),
                             req_pool_indices=torch.tensor([row]), seq_lens=torch.tensor([3]), seq_lens_cpu=[3],
                             out_cache_loc=slots, req_to_token_pool=r.req_to_token_pool, kv_pool=r.kv_pool,
                             attn_backend=r.attn_backend, extend_lens=[3], prefix_lens=[0])
    assert torch.isfinite(r.forward(fb).next_token_logits).all()
    assert create_sampler("auto", "cpu").name == "torch"
    for name in ("triton", "flashinfer"):
        try:
            create_attention_backend(name, r.attn_context)
        except ValueError as e:
            assert "unavailable" in str(e), e
        else:
            raise AssertionError(f"{name} backend created without its package")
    assert not any(m.split(".")[0] in ("flashinfer", "triton") for m in sys.modules)
    print("ok")
""")


def test_cpu_engine_runs_with_flashinfer_and_triton_unimportable(tiny_llama_dir):
    res = subprocess.run(
        [sys.executable, "-c", _BLOCKED_RUN, tiny_llama_dir], capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_default_cuda_graph_sizes_cover_every_batch_up_to_max_running_requests():
    sizes = cuda_graph_batch_sizes(ServerArgs(max_running_requests=50), 50)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 50 and sizes == sorted(sizes)
    assert all(b <= 50 for b in sizes)
    assert cuda_graph_batch_sizes(ServerArgs(cuda_graph_max_bs=24), 64)[-1] == 24


def test_explicit_cuda_graph_sizes_are_kept_as_given():
    sa = ServerArgs(cuda_graph_bs=[1, 3, 17, 64], cuda_graph_max_bs=64)
    assert cuda_graph_batch_sizes(sa, 64) == [1, 3, 17, 64]
    assert cuda_graph_batch_sizes(sa, 20) == [1, 3, 17]
