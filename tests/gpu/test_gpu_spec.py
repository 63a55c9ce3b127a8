"""Speculative decoding on the GPU backends: the tree-mask extend kernel and lossless greedy decoding.

The kernel test also runs on CPU under ``TRITON_INTERPRET=1``; the engine tests need CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_common import HAS_CUDA, NO_CUDA_REASON, cuda_or_interpreter, kernel_device
from test_gpu_triton_kernels import _rel, packed_extend_inputs

pytestmark = [pytest.mark.gpu]


def _masked_ref(q, k, v, prefix: int, tree: torch.Tensor) -> torch.Tensor:
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    allowed = torch.cat([torch.ones(tree.shape[0], prefix, dtype=torch.bool), tree.cpu()], dim=1)
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@cuda_or_interpreter
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_extend_with_tree_masks_matches_masked_attention(head_dim):
    from kvship.decode.spec.tree import DraftTree
    from kvship.engine.attention.triton_ops.extend_attention import extend_attention

    dev = kernel_device()
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    trees = [DraftTree(1, [2, 3, 4, 5, 6], [0, 0, 1, 1, 3]), DraftTree.chain(1, [2, 3]), DraftTree(1, [], [])]
    prefix = [7, 0, 130]
    ext = [t.size for t in trees]
    bs = len(trees)
    q, k_new, v_new, k_buf, v_buf, r2t, starts, total = packed_extend_inputs(dev, dtype, prefix, ext, 4, head_dim)
    masks = [tr.mask() for tr in trees]
    flat = torch.cat([m.reshape(-1).to(torch.uint8) for m in masks]).to(dev)
    offs = torch.tensor([sum(e * e for e in ext[:i]) for i in range(bs)], dtype=torch.int64, device=dev)
    o = torch.full_like(q, float("nan"))
    extend_attention(
        q,
        k_new,
        v_new,
        o,
        k_buf,
        v_buf,
        r2t,
        torch.arange(bs, device=dev),
        torch.tensor(prefix, device=dev),
        torch.tensor(ext, device=dev),
        torch.tensor(starts, device=dev),
        max(ext),
        1.0 / math.sqrt(head_dim),
        flat,
        offs,
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for i in range(bs):
        slots = r2t[i, : total[i]].long()
        ref = _masked_ref(q[starts[i] : starts[i] + ext[i]], k_buf[slots], v_buf[slots], prefix[i], masks[i])
        assert _rel(o[starts[i] : starts[i] + ext[i]], ref) < tol, f"request {i}"


@cuda_or_interpreter
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 2), (64, 3)])
def test_split_verify_attention_matches_masked_attention(head_dim, group):
    """The split-KV verify path (decode stage 1 per draft token over its prefix, then the tree under its mask)
    equals masked attention, for trees, a chain, a lone root and a request without a prefix."""
    from kvship.decode.spec.tree import DraftTree
    from kvship.engine.attention.triton_ops.verify_attention import VERIFY_KV_SPLITS, verify_attention

    dev = kernel_device()
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    trees = [
        DraftTree(1, [2, 3, 4, 5, 6], [0, 0, 1, 1, 3]),
        DraftTree.chain(1, [2, 3]),
        DraftTree(1, [], []),
        DraftTree.chain(1, [2, 3, 4]).padded(6),
    ]
    prefix = [7, 0, 200, 61]  # 200: four splits of MIN_SPLIT_LEN
    ext = [t.size for t in trees]
    bs = len(trees)
    q, k_new, v_new, k_buf, v_buf, r2t, starts, total = packed_extend_inputs(dev, dtype, prefix, ext, group, head_dim)
    masks = [tr.mask() for tr in trees]
    flat = torch.cat([m.reshape(-1).to(torch.uint8) for m in masks]).to(dev)
    offs = [sum(e * e for e in ext[:i]) for i in range(bs)]
    rows, pre, local, size, mrow = [], [], [], [], []
    for i, e in enumerate(ext):
        for j in range(e):
            rows.append(i), pre.append(prefix[i]), local.append(j), size.append(e), mrow.append(offs[i] + j * e)
    n = len(rows)

    def t(v, dt=torch.int32):
        return torch.tensor(v, dtype=dt, device=dev)

    h = q.shape[1]
    mid_o = torch.empty(n, h, VERIFY_KV_SPLITS, head_dim, dtype=torch.float32, device=dev)
    mid_l = torch.empty(n, h, VERIFY_KV_SPLITS, dtype=torch.float32, device=dev)
    o = torch.full_like(q, float("nan"))
    verify_attention(
        q, k_new, v_new, o, k_buf, v_buf, r2t, t(rows, torch.int64), t(pre), t(local), t(size),
        t(mrow, torch.int64), flat, mid_o, mid_l, max(ext), 1.0 / math.sqrt(head_dim),
    )  # fmt: skip
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for i in range(bs):
        slots = r2t[i, : total[i]].long()
        ref = _masked_ref(q[starts[i] : starts[i] + ext[i]], k_buf[slots], v_buf[slots], prefix[i], masks[i])
        assert _rel(o[starts[i] : starts[i] + ext[i]], ref) < tol, f"request {i}"
    # a request alone computes bit for bit what it computed in the batch (eager vs graph replays agree)
    a, e = starts[2], ext[2]
    alone = torch.full_like(q[a : a + e], float("nan"))
    verify_attention(
        q[a : a + e], k_new[a : a + e], v_new[a : a + e], alone, k_buf, v_buf, r2t, t([2] * e, torch.int64),
        t([prefix[2]] * e), t(list(range(e))), t([e] * e), t([j * e for j in range(e)], torch.int64),
        masks[2].reshape(-1).to(torch.uint8).to(dev), mid_o, mid_l, 16, 1.0 / math.sqrt(head_dim),
    )  # fmt: skip
    assert torch.equal(alone, o[a : a + e])


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)
@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_gpu_verify_graphs_replay_what_the_eager_verify_computes(tmp_path, backend):
    """Speculative rounds replayed from the verify CUDA graphs give the tokens of eager verify rounds.

    (Speculative vs plain decoding is compared token for token on CPU, tests/test_spec_decode.py: on the GPU
    the two run different kernels -- split-KV decode vs the masked extend, Triton dots in TF32 for float32 --
    so near-tied logits of a tiny random model may flip there, as they do between any two kernels.)"""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed on this machine")
    from conftest import build_tiny_model
    from pd_fixtures import Collector, _server_args, run_until_idle

    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner

    # head dim 64 (FlashInfer's kernels need >= 64); flashinfer runs 16-bit models only
    model_dir = build_tiny_model(
        str(tmp_path),
        "llama",
        seed=11,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    dtype = "bfloat16" if backend == "flashinfer" else "float32"
    g = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(3, 200, (3,), generator=g).tolist() * 8)[: 10 + i] for i in range(8)]

    def run(graphs: bool):
        sa = _server_args(
            model_dir,
            device="cuda",
            attention_backend=backend,
            dtype=dtype,
            speculative_algorithm="ngram",
            speculative_eagle_topk=2,
            disable_cuda_graph=not graphs,
            cuda_graph_bs=[8],
        )
        out = Collector()
        sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, out)
        assert (sched.speculator.graphs is not None) == graphs
        for i, p in enumerate(prompts):
            sched.submit(GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=32, temperature=0.0)))
        run_until_idle(sched)
        st = sched.get_stats()
        assert st["free_slots"] == st["total_slots"] and st["spec_rounds"] > 0
        if graphs:
            assert sched.speculator.graphs.replays > 0
        return [out.tokens(f"r{i}") for i in range(len(prompts))]

    assert run(graphs=True) == run(graphs=False)


@cuda_or_interpreter
@pytest.mark.parametrize("k", [1, 4, 8, 6])
def test_tree_kernel_equals_the_torch_reference(k):
    """The Triton tree kernel (run inside the verify graphs) writes the reference's positions and mask, over a
    buffer holding an earlier replay's mask (it clears its rows)."""
    from kvship.decode.spec.tree_build import build_tree_arrays_reference
    from kvship.decode.spec.tree_build_cuda import tree_kernel_launch

    dev = kernel_device()
    g = torch.Generator().manual_seed(k)
    parents = torch.tensor(
        [[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, k)] for _ in range(7)],
        dtype=torch.int32,
    )
    prefix = torch.randint(0, 1000, (7,), generator=g, dtype=torch.int32)
    want_pos, want_mask = build_tree_arrays_reference(parents, prefix)
    pos = torch.full((7 * k,), -1, dtype=torch.int64, device=dev)
    mask = torch.ones(7 * k * k, dtype=torch.uint8, device=dev)
    tree_kernel_launch(parents.to(dev), prefix.to(dev), pos, mask)
    assert torch.equal(pos.cpu(), want_pos) and torch.equal(mask.cpu(), want_mask)
