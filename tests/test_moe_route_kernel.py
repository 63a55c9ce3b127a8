"""The one-kernel expert selection (engine/layers/moe/topk_triton.py) against the PyTorch routing it replaces on
CUDA: ``topk.select_experts`` (softmax top-k) and ``DeepseekRouter.select`` (softmax / sigmoid scoring, grouped
choice, the correction bias, renormalisation, scaling).  Same experts in the same order, weights to float32
rounding.  Runs natively on CUDA, or under Triton's interpreter (tests/triton_interp.py's child on CPU)."""

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


def _logits(m, e, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((m, e), generator=g) * 2).to(DEV)


def _torch_select(logits, top_k, renormalize):
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


@needs_triton
@pytest.mark.parametrize("e,top_k", [(64, 6), (128, 8), (60, 4), (8, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_top_k_equals_select_experts(e, top_k, renormalize):
    from kvship.engine.layers.moe.topk_triton import route

    logits = _logits(7, e, e + top_k)
    w, ids = route(logits, top_k, "softmax", renormalize)
    rw, rids = _torch_select(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.cpu(), rids.cpu())
    assert torch.allclose(w.cpu(), rw.cpu(), rtol=1e-6, atol=1e-7)


@needs_triton
@pytest.mark.parametrize(
    "scoring,method,n_group,topk_group,renorm,scale",
    [
        ("softmax", "greedy", 1, 1, False, 1.0),  # DeepSeek-V2-Lite
        ("softmax", "group_limited_greedy", 8, 3, False, 16.0),  # DeepSeek-V2
        ("sigmoid", "noaux_tc", 8, 4, True, 2.5),  # DeepSeek-V3
        ("sigmoid", "noaux_tc", 4, 2, True, 1.0),
        ("sigmoid", "greedy", 1, 1, True, 1.0),
    ],
)
def test_grouped_routing_equals_the_deepseek_router(scoring, method, n_group, topk_group, renorm, scale):
    from kvship.engine.deepseek_config import GroupedRouting
    from kvship.engine.layers.moe.topk_triton import route
    from kvship.engine.models.deepseek import DeepseekRouter

    e, top_k = 64, 6
    routing = GroupedRouting(scoring, method, n_group, topk_group, scale)
    router = DeepseekRouter(16, e, top_k, renorm, routing)
    g = torch.Generator().manual_seed(n_group * 7 + topk_group)
    bias = None
    if routing.has_correction_bias:
        bias = (torch.randn(e, generator=g) * 0.1).to(DEV)
        with torch.no_grad():
            router.e_score_correction_bias.copy_(bias.cpu())
    logits = _logits(9, e, n_group + topk_group)
    # the PyTorch path on CPU (select takes the kernel on CUDA)
    rw, rids = router.select(logits.cpu())
    w, ids = route(logits, top_k, scoring, renorm, 1e-20, method, n_group, topk_group, bias, scale)
    assert torch.equal(ids.cpu(), rids)
    assert torch.allclose(w.cpu(), rw, rtol=1e-6, atol=1e-7)
    # the expert load counted in the same kernel equals the PyTorch path's count_routed, with and without the
    # CUDA graphs' KV slots (rows writing slot 0 are padding and count nothing)
    for slots in (None, torch.tensor([0, 3, 5, 0, 1, 2, 0, 9, 4])):
        got, want = torch.zeros(e, dtype=torch.int64, device=DEV), torch.zeros(e, dtype=torch.int64)
        route(logits, top_k, scoring, renorm, 1e-20, method, n_group, topk_group, bias, scale, got,
              None if slots is None else slots.to(DEV))  # fmt: skip
        router.select(logits.cpu(), want, slots)
        assert torch.equal(got.cpu(), want) and int(want.sum()) == top_k * (9 if slots is None else 6)


@needs_triton
@pytest.mark.parametrize("m,e,hidden,dtype", [(1, 64, 2048, torch.bfloat16), (5, 60, 300, torch.float32),
                                              (16, 256, 512, torch.bfloat16), (3, 8, 64, torch.float16)])  # fmt: skip
def test_router_logits_kernel_equals_the_float32_linear(m, e, hidden, dtype):
    """``router_logits`` (a decode batch's router GEMV in one kernel) against ``F.linear(x.float(), w)``: float32
    sums in another order, so within float32 rounding of the products' magnitude."""
    from kvship.engine.layers.moe.topk_triton import LOGITS_MAX_ROWS, router_logits

    g = torch.Generator().manual_seed(m * e)
    x = torch.randn((m, hidden), generator=g).to(dtype).to(DEV)
    w = torch.randn((e, hidden), generator=g).to(DEV)
    got = router_logits(x, w)
    want = torch.nn.functional.linear(x.float(), w)
    assert got.dtype == torch.float32 and got.shape == (m, e)
    assert torch.allclose(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-5 * hidden**0.5)
    # outside what it takes: None (the caller keeps cuBLAS)
    big = torch.zeros((LOGITS_MAX_ROWS + 1, hidden), dtype=dtype, device=DEV)
    assert router_logits(big, w) is None and router_logits(x, w.to(torch.bfloat16)) is None


@needs_triton
@pytest.mark.parametrize("m,e,hidden,dtype", [(1, 64, 2048, torch.bfloat16), (3, 60, 300, torch.float32),
                                              (4, 256, 512, torch.bfloat16), (2, 8, 64, torch.float16)])  # fmt: skip
def test_normed_router_logits_equal_the_norm_then_the_float32_linear(m, e, hidden, dtype):
    """``router_logits_normed`` (the residual add, the RMSNorm and the router's logits in one kernel) against
    ``RMSNorm(x, residual)`` then ``F.linear(h.float(), w)``: the new residual bit for bit on CUDA, the normalised
    rows within a rounding step or two (the sum of squares in another order), the logits within float32 rounding
    of the products of the rows it returns."""
    from kvship.engine.layers.moe.topk_triton import NORMED_MAX_ROWS, router_logits_normed
    from kvship.engine.layers.rmsnorm import RMSNorm

    g = torch.Generator().manual_seed(m * e + 1)
    x = torch.randn((m, hidden), generator=g).to(dtype).to(DEV)
    r = torch.randn((m, hidden), generator=g).to(dtype).to(DEV)
    w = torch.randn((e, hidden), generator=g).to(DEV)
    norm = RMSNorm(hidden, 1e-6, dtype).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
    got = router_logits_normed(x, r, norm.weight, norm.eps, w)
    assert got is not None
    logits, h, res = got
    sum_ref = (x.float() + r.float()).to(dtype)
    # one rounding step of the dtype (relative); Triton's interpreter truncates to bf16 / fp16 where the GPU rounds
    # to nearest, so there each rounding may be a step off
    step = {torch.float32: 1.2e-7, torch.bfloat16: 7.9e-3, torch.float16: 9.8e-4}[dtype]
    if DEV == "cuda":
        assert torch.equal(res, sum_ref)
    else:
        assert ((res.float() - sum_ref.float()).abs() <= step * sum_ref.float().abs()).all()
    var = res.float().pow(2).mean(-1, keepdim=True)  # the norm of the sum the kernel returned
    h_ref = (norm.weight.float() * (res.float() * torch.rsqrt(var + norm.eps)).to(dtype).float()).to(dtype)
    steps = 2 if DEV == "cuda" else 3
    assert ((h.float() - h_ref.float()).abs() <= steps * step * h_ref.float().abs() + 1e-6).all()
    want = torch.nn.functional.linear(h.float(), w)
    assert logits.dtype == torch.float32 and logits.shape == (m, e)
    assert torch.allclose(logits.cpu(), want.cpu(), rtol=1e-5, atol=1e-5 * hidden**0.5)
    # outside what it takes: None (the caller norms apart)
    big = torch.zeros((NORMED_MAX_ROWS + 1, hidden), dtype=dtype, device=DEV)
    assert router_logits_normed(big, big, norm.weight, norm.eps, w) is None
    assert router_logits_normed(x, r, norm.weight, norm.eps, w.to(torch.bfloat16)) is None


def test_fits_takes_whole_groups_and_at_most_max_experts():
    from kvship.engine.layers.moe import topk_triton as tt

    assert tt.fits(64, 6) and tt.fits(256, 8, 8) and not tt.fits(64, 6, 5) and not tt.fits(4, 6)
    assert not tt.fits(tt.MAX_EXPERTS * 2, 8)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, the kernel cases above run natively")
def test_route_kernel_cases_pass_in_the_triton_interpreter(request):
    """This file's kernel cases in the session's Triton-interpreter child (tests/triton_interp.py)."""
    pytest.importorskip("triton")
    interpreter_outcomes(request, "tests/test_moe_route_kernel.py").check(passed=22)
