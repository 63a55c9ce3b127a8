"""The chunked Triton ``align_block_size`` (count, scan, scatter kernels) against ``moe_align_block_size``.

Outputs must be identical (``torch.equal`` on ``sorted_ids``, every ``expert_ids`` entry and
``num_tokens_post_padded``), so the GEMMs see the same blocks whichever path aligned them.  The
internal buffers are poisoned before the kernels run, so an entry no kernel writes fails.  On CPU:
``TRITON_INTERPRET=1 pytest tests/gpu/test_gpu_moe_align.py`` (shapes kept small: the interpreter is slow).
"""

from __future__ import annotations

import pytest
import torch
from gpu_common import cuda_or_interpreter, kernel_device

from kvship.engine.layers.moe import triton_moe
from kvship.engine.layers.moe.align import moe_align_block_size

pytestmark = [pytest.mark.gpu, cuda_or_interpreter]


def _poisoned_empty(monkeypatch):
    # torch.empty hands back recycled memory that may already hold the right values: fill it with junk
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(-7) if t.dtype in (torch.int32, torch.int64) else t

    monkeypatch.setattr(torch, "empty", poisoned)


def _ids(n: int, e: int, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        ids = torch.randint(0, e, (n,), generator=g)
    elif kind == "one":  # every pair on one expert (the last: its run is the only one)
        ids = torch.full((n,), e - 1)
    elif kind == "skewed":  # half the experts get nothing, a few get most
        ids = (torch.rand(n, generator=g) ** 3 * (e // 2)).long() * 2
    else:  # sorted input: the scatter must keep the pair order within each expert
        ids = torch.randint(0, e, (n,), generator=g).sort().values
    return ids.to(kernel_device())


def _assert_same(got, want):
    assert [t.dtype for t in got] == [torch.int32] * 3
    assert torch.equal(got[2], want[2]), (got[2], want[2])
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0])


@pytest.mark.parametrize(
    "n,e,block_m,chunk,kind",
    [
        (1, 8, 16, 256, "uniform"),  # one pair
        (300, 128, 64, 256, "uniform"),  # n not a multiple of the chunk, most experts empty
        (1000, 7, 16, 64, "uniform"),  # E not a power of 2, 16 chunks
        (1000, 60, 128, 32, "skewed"),  # zero-pair experts between full ones, 32-pair chunks
        (2000, 1, 64, 256, "one"),  # a single expert
        (2047, 129, 16, 256, "one"),  # everything on the last of 129 experts (the EP sentinel's shape)
        (4096, 129, 128, 256, "uniform"),  # a multiple of the chunk, E + 1 experts
        (3000, 129, 16, 32, "uniform"),  # 94 chunks on 9 scan programs (16 experts each, the last one)
        (3000, 129, 16, 8, "uniform"),  # 375 chunks: each scan program runs two chunk tiles
        (4000, 1000, 64, 128, "skewed"),  # 1024-wide expert vectors (the layout program), 63 scan programs
        (300, 1000, 64, 256, "uniform"),  # 300 blocks on 2 programs: several fill tiles per program
        (777, 33, 16, 16, "sorted"),  # tiny chunks, already grouped input
        (513, 3, 4, 256, "uniform"),  # a block size below the padding tile
    ],
)
def test_chunked_align_equals_the_torch_align(monkeypatch, n, e, block_m, chunk, kind):
    ids = _ids(n, e, kind, seed=n + e)
    want = moe_align_block_size(ids, block_m, e)
    _poisoned_empty(monkeypatch)
    _assert_same(triton_moe._align_chunked(ids, block_m, e, chunk), want)


@pytest.mark.parametrize("m,k", [(40, 8), (500, 4)])
@pytest.mark.parametrize("e,block_m", [(128, 16), (60, 64), (256, 128), (2048, 16)])
def test_align_block_size_picks_a_path_with_the_torch_outputs(monkeypatch, m, k, e, block_m):
    """Decode sizes take the one-program kernel, larger batches the chunked kernels, > 1024 experts torch."""
    calls = []
    chunked = triton_moe._align_chunked
    monkeypatch.setattr(triton_moe, "_align_chunked", lambda *a: calls.append(1) or chunked(*a))
    logits = torch.randn(m, e, generator=torch.Generator().manual_seed(m * e)).to(kernel_device())
    ids = torch.topk(logits, k).indices.to(torch.int32)
    _assert_same(triton_moe.align_block_size(ids, block_m, e), moe_align_block_size(ids, block_m, e))
    n_p2, e_p2 = triton_moe.triton.next_power_of_2(m * k), triton_moe.triton.next_power_of_2(max(e, 16))
    assert bool(calls) == (n_p2 * e_p2 > triton_moe._ALIGN_MAX_CELLS and e <= triton_moe._ALIGN_MAX_EXPERTS)


@pytest.mark.parametrize("m,e,k", [(40, 128, 8), (200, 60, 4)])
def test_fused_experts_through_the_chunked_align_matches_the_torch_runner(monkeypatch, m, e, k):
    """The aligned GEMMs on the chunked align's blocks, also with absent experts (ids -1: in no run)."""
    from kvship.engine.layers.moe.kernel_config import default_config
    from kvship.engine.layers.moe.runner import get_moe_runner
    from kvship.engine.layers.moe.topk import select_experts

    calls = []
    chunked = triton_moe._align_chunked
    monkeypatch.setattr(triton_moe, "_align_chunked", lambda *a: calls.append(a[2]) or chunked(*a))
    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    h, i = (256, 96) if dev.type == "cuda" else (64, 48)
    g = torch.Generator().manual_seed(m + e)
    x = torch.randn(m, h, generator=g).to(dev, dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(dev, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(dev, dtype)
    logits = torch.randn(m, e, generator=g).to(dev)
    logits[:, e // 2] = -1e4  # one expert never gets a token
    weights, ids = select_experts(logits, k, renormalize=True)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for absent in (False, True):
        if absent:
            ids = torch.where(torch.arange(ids.numel(), device=dev).view(ids.shape) % 3 == 0, -1, ids)
        out = triton_moe.fused_experts(x, w13, w2, weights, ids, config=default_config(m, e, k), absent=absent)
        ref = get_moe_runner("torch")(x.float(), w13.float(), w2.float(), weights, ids)
        out, ref = out.double().cpu(), ref.double().cpu()
        assert not torch.isnan(out).any()
        assert ((out - ref).norm() / ref.norm()).item() < tol
    assert calls == [e, e]  # both calls went through the chunked kernels, absent pairs in no run
