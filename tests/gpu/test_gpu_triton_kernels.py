"""Triton kernels against float64 references (GPU: bf16 inputs; CPU interpreter: float32).

On CPU: ``TRITON_INTERPRET=1 pytest tests/gpu/test_gpu_triton_kernels.py`` (needs ``triton``).

Tolerance (relative Frobenius error ``|out - ref| / |ref|``): bf16 1e-2,
float32 1e-4.  Inputs are random every run and outputs are poisoned (NaN)
before each kernel so unwritten elements fail.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_common import cuda_or_interpreter, kernel_device

pytestmark = [pytest.mark.gpu, cuda_or_interpreter]


@pytest.fixture
def dev() -> torch.device:
    return kernel_device()


def _dtype(dev: torch.device) -> torch.dtype:
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def _tol(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 1e-4


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double().cpu()
    ref = ref.double().cpu()
    assert not torch.isnan(out).any(), "kernel left NaN (unwritten or bad math)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | None) -> torch.Tensor:
    """q [lq, H, D], k/v [lk, Hkv, D]; causal with queries at positions offset..offset+lq-1 when given."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal_offset is not None:
        qpos = torch.arange(q.shape[0])[:, None] + causal_offset
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def _pool(dev, dtype, slots=600, hkv=2, d=64):
    return (torch.randn(slots, hkv, d, dtype=dtype, device=dev), torch.randn(slots, hkv, d, dtype=dtype, device=dev))


def packed_extend_inputs(dev, dtype, prefix: list[int], ext: list[int], group: int, head_dim: int, hkv: int = 2):
    """Random packed q / new K / new V for requests with ``prefix`` cached and ``ext`` new tokens, a pool
    holding the prefixes and (as the backend stores them first) the new tokens, and their slot table.
    Returns (q, k_new, v_new, k_buf, v_buf, req_to_token, starts, totals)."""
    h = hkv * group
    bs = len(ext)
    total = [p + e for p, e in zip(prefix, ext)]
    k_buf, v_buf = _pool(dev, dtype, slots=1000, hkv=hkv, d=head_dim)
    r2t = _assign_slots(total, bs, 256, 1000, dev)
    t = sum(ext)
    starts = [sum(ext[:i]) for i in range(bs)]
    q = torch.randn(t, h, head_dim, dtype=dtype, device=dev)
    k_new = torch.randn(t, hkv, head_dim, dtype=dtype, device=dev)
    v_new = torch.randn(t, hkv, head_dim, dtype=dtype, device=dev)
    for i in range(bs):
        slots = r2t[i, prefix[i] : total[i]].long()
        k_buf[slots] = k_new[starts[i] : starts[i] + ext[i]]
        v_buf[slots] = v_new[starts[i] : starts[i] + ext[i]]
    return q, k_new, v_new, k_buf, v_buf, r2t, starts, total


def _assign_slots(lens: list[int], rows: int, width: int, slots: int, dev) -> torch.Tensor:
    r2t = torch.zeros(rows, width, dtype=torch.int32)
    perm = torch.randperm(slots - 1)[: sum(lens)] + 1  # slot 0 is the padding slot
    off = 0
    for i, n in enumerate(lens):
        r2t[i, :n] = perm[off : off + n].to(torch.int32)
        off += n
    return r2t.to(dev)


@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_indices_kernel_lists_the_pages_of_each_request(dev, page_size):
    from kvship.engine.attention.triton_ops.kv_indices import build_kv_indices

    rows, width = 6, 256
    r2t = torch.zeros(rows, width, dtype=torch.int32)
    for r in range(rows):  # request r owns pages r*20+1 ... laid out page-aligned like the allocator does
        pages = torch.randperm(width // page_size)[: width // page_size] + 1 + r * 1000
        r2t[r] = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:width].to(torch.int32)
    r2t = r2t.to(dev)
    pool_idx = torch.tensor([4, 0, 5, 2], device=dev)
    lens = [1, 33, 0, 200]
    pages = [(n + page_size - 1) // page_size for n in lens]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    out = torch.full((int(indptr[-1]) + 3,), -7, dtype=torch.int32, device=dev)
    build_kv_indices(r2t, pool_idx, torch.tensor(lens, device=dev), indptr, out, page_size)
    want: list[int] = []
    for row, n in zip(pool_idx.tolist(), lens):
        want += [int(r2t[row, j * page_size]) // page_size for j in range((n + page_size - 1) // page_size)]
    got = out.tolist()
    assert got[: len(want)] == want
    assert got[len(want) :] == [-7, -7, -7], "kernel wrote past the last request's pages"


@pytest.mark.parametrize("group,head_dim", [(2, 64), (4, 128), (3, 64)])
@pytest.mark.parametrize("num_splits", [1, 5, 16])
def test_triton_decode_kernel_matches_reference(dev, group, head_dim, num_splits):
    """Split-KV decode: the split kernel, then the merge kernel."""
    from kvship.engine.attention.triton_ops.decode_attention import MAX_KV_SPLITS, decode_attention

    dtype = _dtype(dev)
    hkv = 2
    h = hkv * group
    k_buf, v_buf = _pool(dev, dtype, slots=1200, hkv=hkv, d=head_dim)
    lens = [1, 7, 64, 130, 400]
    bs = len(lens)
    r2t = _assign_slots(lens, bs + 2, 512, 1200, dev)
    pool_idx = torch.arange(bs, device=dev)
    q = torch.randn(bs, h, head_dim, dtype=dtype, device=dev)
    o = torch.full_like(q, float("nan"))
    mid_o = torch.empty(bs, h, MAX_KV_SPLITS, head_dim, dtype=torch.float32, device=dev)
    mid_l = torch.empty(bs, h, MAX_KV_SPLITS, dtype=torch.float32, device=dev)
    decode_attention(
        q, k_buf, v_buf, o, r2t, pool_idx, torch.tensor(lens, device=dev), mid_o, mid_l, num_splits,
        1.0 / math.sqrt(head_dim),
    )  # fmt: skip
    for i, n in enumerate(lens):
        slots = r2t[i, :n].long()
        ref = _ref_attention(q[i : i + 1], k_buf[slots], v_buf[slots], None)
        assert _rel(o[i : i + 1], ref) < _tol(dtype), f"request {i} (len {n})"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_triton_decode_tiles_agree_with_the_reference(dev, kv_fp8, head_dim):
    """Stage 1's tile choices (keys a step, warps, pipeline stages, a register cap) each match
    the float64 reference on a bf16/fp32 pool and an FP8 pool (read as ``e4m3 * scale``), lengths that end
    mid-step included; the default tile run twice gives the same bits; an unknown launch key is refused."""
    from kvship.engine.attention.triton_ops.decode_attention import MAX_KV_SPLITS, decode_attention

    dtype = _dtype(dev)
    hkv, group = 4, 4  # head dim 128 takes the default register cap on an FP8 pool (stage1_tile)
    h = hkv * group
    k_buf, v_buf = _pool(dev, dtype, slots=900, hkv=hkv, d=head_dim)
    scales = {}
    if kv_fp8:
        k_buf, v_buf = k_buf.to(torch.float8_e4m3fn), v_buf.to(torch.float8_e4m3fn)
        scales = {"k_scale": 0.5, "v_scale": 1.5}
    lens = [1, 70, 300]
    bs = len(lens)
    r2t = _assign_slots(lens, bs + 1, 512, 900, dev)
    pool_idx = torch.arange(bs, device=dev)
    seq = torch.tensor(lens, device=dev)
    q = torch.randn(bs, h, head_dim, dtype=dtype, device=dev)

    def run(launch):
        o = torch.full_like(q, float("nan"))
        mid_o = torch.empty(bs, h, MAX_KV_SPLITS, head_dim, dtype=torch.float32, device=dev)
        mid_l = torch.empty(bs, h, MAX_KV_SPLITS, dtype=torch.float32, device=dev)
        decode_attention(
            q, k_buf, v_buf, o, r2t, pool_idx, seq, mid_o, mid_l, 3, 0.125, launch=launch, **scales,
        )  # fmt: skip
        return o

    kf = k_buf.float() * scales.get("k_scale", 1.0)
    vf = v_buf.float() * scales.get("v_scale", 1.0)
    refs = [
        _ref_attention(q[i : i + 1] * math.sqrt(head_dim) * 0.125, kf[r2t[i, :n].long()], vf[r2t[i, :n].long()], None)
        for i, n in enumerate(lens)
    ]
    base = run(None)
    assert torch.equal(run(None), base)
    tiles = (
        None,
        {"num_stages": 2},
        {"block_n": 32, "num_warps": 8},
        {"block_n": 16, "num_stages": 1},
        {"maxnreg": 168},
    )
    for launch in tiles:
        got = base if launch is None else run(launch)
        for i, ref in enumerate(refs):
            assert _rel(got[i : i + 1], ref) < _tol(dtype), f"{launch}: request {i} (len {lens[i]})"
    if kv_fp8:  # the products in fp16 (a bf16 model's default on an FP8 pool): within fp16's rounding
        got = run({"dot_f16": True})
        for i, ref in enumerate(refs):
            assert _rel(got[i : i + 1], ref) < max(_tol(dtype), 2e-3), f"dot_f16: request {i} (len {lens[i]})"
        # the pages read as int32 words and converted as loaded (PTX on a GPU, integer operations under the
        # interpreter): the same values, so within the same rounding of the fp16 products
        # (only the keys or only the values as words too)
        words = ({"dot_f16": True, "words": w} for w in (True, "k", "v"))
        for launch in (*words, {"dot_f16": True, "words": True, "block_n": 32}):
            got_w = run(launch)
            for i, ref in enumerate(refs):
                assert _rel(got_w[i : i + 1], ref) < max(_tol(dtype), 2e-3), f"{launch}: request {i} (len {lens[i]})"
            assert (got_w.float() - got.float()).abs().max().item() < 2e-3
    with pytest.raises(ValueError, match="unknown launch keys"):
        run({"kv_heads": 3})
    with pytest.raises(ValueError, match="'words' takes"):
        run({"words": "kv"})


@pytest.mark.parametrize("group,head_dim", [(2, 64), (4, 128)])
def test_triton_extend_kernel_matches_reference_with_and_without_prefix(dev, group, head_dim):
    from kvship.engine.attention.triton_ops.extend_attention import extend_attention

    dtype = _dtype(dev)
    prefix = [0, 5, 70, 0]
    ext = [9, 1, 100, 65]
    bs = len(ext)
    q, k_new, v_new, k_buf, v_buf, r2t, starts, total = packed_extend_inputs(dev, dtype, prefix, ext, group, head_dim)
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
    )
    for i in range(bs):
        slots = r2t[i, : total[i]].long()
        ref = _ref_attention(q[starts[i] : starts[i] + ext[i]], k_buf[slots], v_buf[slots], prefix[i])
        assert _rel(o[starts[i] : starts[i] + ext[i]], ref) < _tol(dtype), f"request {i}"


def test_merge_state_equals_softmax_over_both_parts(dev):
    from kvship.engine.attention.triton_ops.merge_state import merge_state

    dtype = _dtype(dev)
    t, h, d = 37, 4, 64
    o_a = torch.randn(t, h, d, dtype=dtype, device=dev)
    o_b = torch.randn(t, h, d, dtype=dtype, device=dev)
    lse_a = torch.randn(t, h, device=dev) * 3
    lse_b = torch.randn(t, h, device=dev) * 3
    lse_b[:5] = float("-inf")  # no prefix keys for these tokens
    o_b[5:9] = float("nan")  # rows a kernel never wrote: b_valid says so
    lse_b[5:9] = float("nan")
    valid = torch.ones(t, dtype=torch.int8, device=dev)
    valid[5:9] = 0
    out = torch.full_like(o_a, float("nan"))
    merge_state(o_a, lse_a, o_b, lse_b, out, valid)
    w = torch.stack([lse_a, lse_b]).double().cpu().softmax(0)
    ref = o_a.double().cpu() * w[0][..., None] + o_b.double().cpu() * w[1][..., None]
    ref[:9] = o_a[:9].double().cpu()
    assert _rel(out, ref) < _tol(dtype)
    assert torch.equal(out[:9].cpu(), o_a[:9].cpu())


def test_fused_rmsnorm_matches_the_pytorch_layer(dev):
    from kvship.engine.layers.fused_ops_cuda import rmsnorm
    from kvship.engine.layers.rmsnorm import RMSNorm

    dtype = _dtype(dev)
    layer = RMSNorm(576, 1e-5, dtype).to(dev)
    with torch.no_grad():
        layer.weight.copy_(1 + 0.1 * torch.randn(576))
    x = torch.randn(13, 576, dtype=dtype, device=dev)
    r = torch.randn(13, 576, dtype=dtype, device=dev)
    with torch.no_grad():
        assert _rel(rmsnorm(x, layer.weight, 1e-5), layer._norm(x)) < _tol(dtype)
        y, s = rmsnorm(x, layer.weight, 1e-5, r)
        y_ref, s_ref = layer._norm(x + r), x + r
    assert torch.equal(s, s_ref)
    assert _rel(y, y_ref) < _tol(dtype)


def test_fused_silu_and_mul_matches_the_pytorch_layer(dev):
    from kvship.engine.layers.activation import GatedActivation
    from kvship.engine.layers.fused_ops_cuda import silu_and_mul

    dtype = _dtype(dev)
    x = torch.randn(9, 2 * 1536, dtype=dtype, device=dev)
    assert _rel(silu_and_mul(x), GatedActivation("silu")(x)) < _tol(dtype)


@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (32, 8, 128)])
def test_fused_rope_rotates_q_and_k_in_place_like_the_pytorch_layer(dev, hq, hk, d):
    from kvship.engine.layers.fused_ops_cuda import rope_inplace
    from kvship.engine.layers.rotary import RotaryEmbedding

    dtype = _dtype(dev)
    rope = RotaryEmbedding(d, 4096, 100000.0).to(dev)
    t = 11
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype, device=dev)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v_before = qkv[:, (hq + hk) * d :].clone()
    pos = torch.randint(0, 4096, (t,), device=dev)
    q_ref, k_ref = rope(pos, q.clone(), k.clone())
    rope_inplace(pos, q, k, rope.cos_sin_cache)
    assert _rel(q, q_ref) < _tol(dtype) and _rel(k, k_ref) < _tol(dtype)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before), "rope touched v"


def test_fused_kv_store_writes_what_set_kv_buffer_writes(dev):
    if dev.type != "cuda":
        pytest.skip("the fused store runs on CUDA pools only (CPU pools take set_kv_buffer)")
    from kvship.engine.attention.triton_ops.kv_store import store_kv
    from kvship.engine.mem.pools import KVPool

    pools = [KVPool(256, 16, torch.bfloat16, 2, 64, 2, dev) for _ in range(2)]
    for p in pools:
        for buf in p.buffers():
            buf.fill_(7.0)
    loc = torch.tensor([17, 3, 200, 201, 64], device=dev)
    k = torch.randn(5, 128, dtype=torch.float32, device=dev)  # float32 rows: cast to the pool dtype
    v = torch.randn(5, 2, 64, dtype=torch.float32, device=dev)
    pools[0].set_kv_buffer(1, loc, k, v)
    store_kv(pools[1], 1, loc, k, v)
    for a, b in zip(pools[0].buffers(), pools[1].buffers()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (32, 8, 128)])
def test_fused_rope_and_kv_store_equals_rope_then_store(dev, hq, hk, d):
    """One kernel rotating q/k in place and writing the rotated k and v into the pool gives exactly what
    ``rope_inplace`` followed by ``KVPool.set_kv_buffer`` gives, and leaves every other pool slot alone."""
    from kvship.engine.layers.fused_ops_cuda import rope_inplace
    from kvship.engine.layers.rotary import RotaryEmbedding

    dtype = _dtype(dev)
    rope = RotaryEmbedding(d, 4096, 500000.0).to(dev)
    t, slots = 13, 300
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype, device=dev)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)  # strided rows, as the fused q/k/v projection leaves them
    pos = torch.randint(0, 4096, (t,), device=dev)
    loc = (torch.randperm(slots - 1)[:t] + 1).to(dev)
    kb_ref = torch.randn(slots, hk, d, dtype=dtype, device=dev)
    vb_ref = torch.randn(slots, hk, d, dtype=dtype, device=dev)
    kb, vb = kb_ref.clone(), vb_ref.clone()
    q_ref, k_ref = rope_inplace(pos, q.clone(), k.clone(), rope.cos_sin_cache)
    kb_ref[loc] = k_ref
    vb_ref[loc] = v
    v_before = v.clone()
    rope_inplace(pos, q, k, rope.cos_sin_cache, store=(v, kb, vb, loc))
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(kb, kb_ref) and torch.equal(vb, vb_ref)
    assert torch.equal(v, v_before)
    with pytest.raises(ValueError):
        rope_inplace(pos, q, k, rope.cos_sin_cache, store=(v, kb[:, :1], vb, loc))


@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (32, 4, 128)])
def test_fused_qk_norm_rope_and_kv_store_equals_the_norms_then_rope(dev, hq, hk, d):
    """Qwen3's per-head q/k RMSNorm inside the RoPE + KV-store kernel gives what the two ``RMSNorm`` layers
    followed by the kernel give (bf16: within one ulp of the normalised value, the sum of squares runs in two
    halves), and writes the normalised, rotated keys into the pool."""
    from kvship.engine.layers.fused_ops_cuda import rope_inplace
    from kvship.engine.layers.rmsnorm import RMSNorm
    from kvship.engine.layers.rotary import RotaryEmbedding

    dtype = _dtype(dev)
    rope = RotaryEmbedding(d, 4096, 1000000.0).to(dev)
    q_norm, k_norm = RMSNorm(d, 1e-6, dtype).to(dev), RMSNorm(d, 1e-6, dtype).to(dev)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(0.5, 1.5)
    t, slots = 11, 200
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype, device=dev) * 3
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    pos = torch.randint(0, 4096, (t,), device=dev)
    loc = (torch.randperm(slots - 1)[:t] + 1).to(dev)
    kb = torch.zeros(slots, hk, d, dtype=dtype, device=dev)
    vb = torch.zeros(slots, hk, d, dtype=dtype, device=dev)
    with torch.no_grad():
        q_ref, k_ref = rope_inplace(
            pos, q_norm(q.clone()).contiguous(), k_norm(k.clone()).contiguous(), rope.cos_sin_cache
        )
        rope_inplace(
            pos, q, k, rope.cos_sin_cache, store=(v, kb, vb, loc), qk_norm=(q_norm.weight, k_norm.weight, 1e-6)
        )
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(q.float(), q_ref.float(), atol=tol, rtol=tol)
    assert torch.allclose(k.float(), k_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(kb[loc], k) and torch.equal(vb[loc], v)
    with pytest.raises(ValueError):
        rope_inplace(pos, q, k, rope.cos_sin_cache, qk_norm=(q_norm.weight[:-1], k_norm.weight, 1e-6))
