"""Expert parallelism's absent pairs (id ``-1``: an expert another rank holds) in the Triton MoE runner.

The alignment leaves them out of every run, whichever path aligns (``align.moe_align_block_size``'s torch ops,
the one-program kernel, the chunked kernels), so the grouped GEMMs never read or write them, and the top-k sum
skips their rows of the per-pair output (docs/parallel.md, "Dispatch").  The layout is checked against a check
written from that definition, every path against the torch one, and ``fused_experts(absent=True)`` (bf16 and
FP8 block runners) against the torch runner, which skips absent pairs itself, including a rank with every pair
absent.  The Triton cases run on CUDA, or on CPU in the session's Triton-interpreter child
(tests/triton_interp.py).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from triton_interp import TEST_TIMEOUT_S, interpreter_outcomes

from kvship.engine.layers.moe.align import moe_align_block_size

TRITON_HERE = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason="Triton runs on CUDA or in its interpreter (child below)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(n: int, e: int, absent_every: int, seed: int) -> torch.Tensor:
    ids = torch.randint(0, e, (n,), generator=torch.Generator().manual_seed(seed))
    return torch.where(torch.arange(n) % absent_every == 0, -1, ids).to(DEV)


def check_absent_layout(out, ids: torch.Tensor, block_m: int, e: int) -> None:
    """Every present pair exactly once, in its expert's run, in pair order; no absent pair anywhere; runs padded
    from the present pairs' counts only; each block's expert id that of its run."""
    sorted_ids, expert_ids, ntp = (t.cpu() for t in out)
    flat = ids.reshape(-1).cpu().long()
    n = flat.numel()
    present = flat >= 0
    counts = torch.bincount(flat[present], minlength=e)
    padded = (counts + block_m - 1) // block_m * block_m
    assert ntp.item() == padded.sum().item()
    used = sorted_ids[: ntp.item()]
    assert torch.equal(used[used < n].long().sort().values, torch.nonzero(present).flatten())
    assert bool((sorted_ids[ntp.item() :] == n).all())  # past the last run: padding only
    start = 0
    for ex in range(e):
        run = used[start : start + padded[ex]]
        assert torch.equal(run[run < n].long(), torch.nonzero(flat == ex).flatten()), ex
        assert bool((expert_ids[start // block_m : (start + padded[ex]) // block_m] == ex).all()), ex
        start += padded[ex].item()


@pytest.mark.parametrize("n,e,block_m", [(40, 8, 16), (300, 128, 64), (999, 7, 4)])
@pytest.mark.parametrize("absent_every", [3, 1])
def test_torch_align_leaves_absent_pairs_out(n, e, block_m, absent_every):
    ids = _ids(n, e, absent_every, seed=n * e)
    check_absent_layout(moe_align_block_size(ids.cpu(), block_m, e), ids, block_m, e)


@needs_triton
@pytest.mark.parametrize("n,e,block_m,chunk", [(40, 8, 16, 256), (300, 128, 64, 64), (999, 7, 4, 32)])
@pytest.mark.parametrize("absent_every", [3, 1])
def test_triton_aligns_leave_absent_pairs_out(n, e, block_m, chunk, absent_every):
    """The chunked kernels and, where the pairs fit it, the one-program kernel: the torch path's outputs."""
    from kvship.engine.layers.moe import triton_moe

    ids = _ids(n, e, absent_every, seed=n + e)
    want = [t.to(DEV) for t in moe_align_block_size(ids.cpu(), block_m, e)]
    got = triton_moe._align_chunked(ids, block_m, e, chunk)
    check_absent_layout(got, ids, block_m, e)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if n * triton_moe.triton.next_power_of_2(max(e, 16)) <= triton_moe._ALIGN_MAX_CELLS:
        one = triton_moe.align_block_size(ids, block_m, e)
        blocks = want[2].item() // block_m
        assert torch.equal(one[0], want[0]) and torch.equal(one[2], want[2])
        assert torch.equal(one[1][:blocks], want[1][:blocks])


@needs_triton
@pytest.mark.parametrize("m", [3, 40])
@pytest.mark.parametrize("absent_every", [3, 1])
def test_triton_fused_experts_with_absent_pairs_matches_the_torch_runner(m, absent_every):
    """Aligned GEMMs (the GEMV kernels have their own test) on pairs with absent ids: the torch runner's result;
    a rank with every pair absent gives zeros."""
    from kvship.engine.layers.moe.kernel_config import default_config
    from kvship.engine.layers.moe.runner import get_moe_runner
    from kvship.engine.layers.moe.topk import select_experts
    from kvship.engine.layers.moe.triton_moe import fused_experts

    e, k, h, inter = 8, 2, 64, 48
    g = torch.Generator().manual_seed(m * absent_every)
    x = torch.randn(m, h, generator=g).to(DEV)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * h**-0.5).to(DEV)
    w2 = (torch.randn(e, h, inter, generator=g) * inter**-0.5).to(DEV)
    weights, ids = select_experts(torch.randn(m, e, generator=g).to(DEV), k, renormalize=True)
    ids = torch.where(torch.arange(m * k, device=DEV).view(m, k) % absent_every == 0, -1, ids)
    out = fused_experts(x, w13, w2, weights, ids, config=default_config(m, e, k), absent=True)
    ref = get_moe_runner("torch")(x, w13, w2, weights, ids, absent=True)
    assert not torch.isnan(out).any()
    if absent_every == 1:
        assert not out.any()
    else:
        assert ((out - ref).norm() / ref.norm()).item() < 1e-4


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_moe_absent_kernel_cases_pass_in_the_triton_interpreter(request):
    """This file's Triton cases in the session's Triton-interpreter child (tests/triton_interp.py)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA runs the kernel cases directly")
    pytest.importorskip("triton")
    interpreter_outcomes(request, "tests/test_moe_absent.py").check(passed=10)
