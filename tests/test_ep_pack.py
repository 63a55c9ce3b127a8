"""The ``static`` dispatch's Triton packing kernels (``engine/parallel/ep_pack.py``) against its torch path.

Runs on CUDA, or on CPU in the session's Triton-interpreter child (tests/triton_interp.py).  For 2 and 4 ranks,
every rank of the block, token counts that do and do not divide by the ranks (padded tokens, empty rows),
idle and skewed routing, float32 and bfloat16 rows (an odd hidden size: padded rows), int32 and int64 ids:
``pack_rows`` writes the meta and hidden bytes of every send row as the torch path does (the padding bytes are
never read), and ``sum_partials`` sums the returned partials bit for bit as the torch path does.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from triton_interp import TEST_TIMEOUT_S, interpreter_outcomes

TRITON_HERE = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
needs_triton = pytest.mark.skipif(not TRITON_HERE, reason="Triton runs on CUDA or in its interpreter (child below)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
E, K = 8, 3


def _case(m: int, hidden: int, dtype: torch.dtype, routing: str, id_dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(dtype)
    logits = torch.randn(m, E, generator=g)
    if routing == "skewed":
        logits[:, 2:] -= 30.0  # every token's top picks among experts 0-1 (rank 0) first
    weights, ids = torch.topk(torch.softmax(logits, -1), K)
    if routing == "idle":
        ids[:, -1] = -1  # an absent pick (as EPLB-free layers never make, but the packing must keep it absent)
    return x.to(DEV), weights.to(DEV), ids.to(id_dtype).to(DEV)


@needs_triton
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["random", "skewed", "idle"])
def test_ep_pack_kernels_equal_the_torch_path(n, m, dtype, routing):
    from kvship.engine.parallel.ep_dispatch import pack, row_bytes, split_rows, unpack

    hidden = 33 if dtype == torch.bfloat16 else 24
    id_dtype = torch.int32 if m % 2 else torch.int64
    x, weights, ids = _case(m, hidden, dtype, routing, id_dtype, seed=100 * n + m)
    for rank in range(n):
        ref = pack(x, weights, ids, n, rank, E // n, kernels=False)
        got = pack(x, weights, ids, n, rank, E // n, kernels=True)
        assert got.send.shape == ref.send.shape == (n * ref.per, row_bytes(K, hidden, dtype))
        assert torch.equal(got.row, ref.row) and torch.equal(got.hit, ref.hit)
        for a, b in zip(split_rows(got.send, K, hidden, dtype), split_rows(ref.send, K, hidden, dtype)):
            assert torch.equal(a, b), (rank, a, b)
        # into a given buffer (the exchange's own): the same bytes
        buf = torch.full_like(ref.send, 7)
        into = pack(x, weights, ids, n, rank, E // n, out=buf, kernels=True)
        assert into.send.data_ptr() == buf.data_ptr()
        assert all(
            torch.equal(a, b) for a, b in zip(split_rows(buf, K, hidden, dtype), split_rows(ref.send, K, hidden, dtype))
        )
        back = torch.randn(n * ref.per, hidden, generator=torch.Generator().manual_seed(rank)).to(dtype).to(DEV)
        got_sum, ref_sum = unpack(ref, back, dtype, kernels=True), unpack(ref, back, dtype, kernels=False)
        if DEV == "cpu" and dtype == torch.bfloat16:  # the interpreter casts float32 -> bf16 by truncation
            torch.testing.assert_close(got_sum.float(), ref_sum.float(), rtol=2**-7, atol=0)
        else:  # CUDA: round to nearest, one cast of the same float32 sum
            assert torch.equal(got_sum, ref_sum)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_ep_pack_kernel_cases_pass_in_the_triton_interpreter(request):
    """This file's kernel cases in the session's Triton-interpreter child (tests/triton_interp.py)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA runs the kernel cases directly")
    pytest.importorskip("triton")
    interpreter_outcomes(request, "tests/test_ep_pack.py").check(passed=38)


@needs_triton
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_ep_pack_local_ids_kernel_equals_the_torch_form(id_dtype):
    """``local_expert_ids``: a rank's own experts as local ids, every other id (and an absent -1) as -1."""
    from kvship.engine.parallel.ep import local_expert_ids

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(-1, 16, (37, 3), generator=g).to(id_dtype).to(DEV)
    for start, n in ((0, 4), (4, 4), (12, 4), (0, 16)):
        got, ref = local_expert_ids(ids, start, n, kernels=True), local_expert_ids(ids, start, n, kernels=False)
        assert got.dtype == ref.dtype == torch.int32 and torch.equal(got, ref), (start, n)
        assert ((got >= -1) & (got < n)).all()
    assert local_expert_ids(ids[:0], 0, 4, kernels=True).shape == (0, 3)
