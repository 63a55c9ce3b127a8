"""The Triton MLA kernels (split-KV decode: engine/attention/mla_triton.py; extend and tree verify:
engine/attention/mla_triton_extend.py) against torch references and the torch_native backend.

Runs under Triton's interpreter on CPU (``TRITON_INTERPRET=1``: tests/test_deepseek.py starts it in a
child pytest) or natively on CUDA.  float32; the sums run in another order than SDPA's, so 1e-5.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton MLA kernel: needs CUDA, or TRITON_INTERPRET=1 on CPU",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# greedy tokens per request through the scheduler: two decode steps (or MTP rounds) after every prefill and every
# extend over a radix-cache prefix, the kernels more tokens would run again (each costs seconds in the interpreter)
MAX_NEW = 3
# the tiny DeepSeek-V3 of the model-level tests: a dense layer and a MoE one (a third would run the same kernels
# once more per forward)
LAYERS = 2


def _reference(q, buf, r2t, rows, lens, r, scale):
    out = []
    for b, (row, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        lat = buf[r2t[row, :n].long(), 0].float()  # [n, D]
        s = torch.einsum("hd,nd->hn", q[b].float(), lat) * scale
        out.append(torch.softmax(s, dim=-1) @ lat[:, :r])
    return torch.stack(out)


@pytest.mark.parametrize("heads,r,p,splits", [(4, 32, 8, 4), (20, 32, 16, 8), (3, 24, 8, 1)])
def test_split_kv_mla_decode_equals_the_reference(heads, r, p, splits):
    from kvship.engine.attention.mla_triton import mla_decode

    g = torch.Generator().manual_seed(heads + r)
    lens = torch.tensor([1, 7, 45, 70])  # shorter and longer than the splits and the 32-token blocks
    slots = torch.randperm(200, generator=g)[: int(lens.sum())] + 1  # scattered slots; 0 is the padding slot
    r2t = torch.zeros((6, 80), dtype=torch.int32)
    rows = torch.tensor([5, 0, 3, 2])
    off = 0
    for row, n in zip(rows.tolist(), lens.tolist()):
        r2t[row, :n] = slots[off : off + n].to(torch.int32)
        off += n
    buf = torch.randn((201, 1, r + p), generator=g)
    q = torch.randn((4, heads, r + p), generator=g)
    scale = (r + p) ** -0.5
    args = [t.to(DEVICE) for t in (q, buf, r2t, rows, lens)]
    got = mla_decode(*args[:3], args[3], args[4], r, scale, num_splits=splits)
    ref = _reference(q, buf, r2t, rows, lens, r, scale)
    assert got.shape == (4, heads, r)
    assert torch.allclose(got.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_mla_decode_with_q_pe_apart_equals_the_joined_queries():
    """``q_pe=``: the absorbed queries and the rope part as two strided views give the joined queries' output."""
    from kvship.engine.attention.mla_triton import mla_decode

    g = torch.Generator().manual_seed(3)
    heads, r, p = 4, 32, 8
    lens = torch.tensor([5, 40])
    r2t = torch.arange(1, 1 + 2 * 48, dtype=torch.int32).view(2, 48)
    buf = torch.randn((120, 1, r + p), generator=g)
    q = torch.randn((2, heads, r + p), generator=g)
    q_lat = q[..., :r].transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, R] through [H, T, R] strides
    q_pe = torch.randn((2, heads, 24 + p), generator=g)[..., 24:]  # a slice of wider rows
    q_pe.copy_(q[..., r:])
    args = [t.to(DEVICE) for t in (buf, r2t, torch.tensor([0, 1]), lens)]
    joined = mla_decode(q.to(DEVICE), *args, r, 0.3, num_splits=2)
    apart = mla_decode(q_lat.to(DEVICE), *args, r, 0.3, num_splits=2, q_pe=q_pe.to(DEVICE))
    assert torch.equal(joined.cpu(), apart.cpu())


def test_mla_decode_with_w_uv_applies_it_in_the_merge():
    """``w_uv=``: the merge kernel applies W_UV (``_mla_merge_uv``) and gives the plain decode's rows times it,
    float32 sums in another order (1e-5), with two and one splits and V not a multiple of the program's rows;
    a W_UV of the wrong shape is refused."""
    from kvship.engine.attention.mla_triton import mla_decode

    g = torch.Generator().manual_seed(8)
    heads, r, p, v = 3, 32, 8, 20
    lens = torch.tensor([6, 33])
    r2t = torch.arange(1, 1 + 2 * 40, dtype=torch.int32).view(2, 40)
    buf = torch.randn((100, 1, r + p), generator=g)
    q = torch.randn((2, heads, r + p), generator=g)
    w_kv = torch.randn((heads, 16 + v, r), generator=g)
    w_uv = w_kv[:, 16:]  # a slice of the heads' stacked W_UK / W_UV rows, as the model passes it
    args = [t.to(DEVICE) for t in (buf, r2t, torch.tensor([1, 0]), lens)]
    for splits in (2, 1):
        plain = mla_decode(q.to(DEVICE), *args, r, 0.3, num_splits=splits)
        got = mla_decode(q.to(DEVICE), *args, r, 0.3, num_splits=splits, w_uv=w_uv.to(DEVICE))
        want = torch.einsum("thr,hvr->thv", plain.cpu(), w_uv)
        assert got.shape == (2, heads, v)
        assert torch.allclose(got.cpu(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="w_uv must be"):
        mla_decode(q.to(DEVICE), *args, r, 0.3, num_splits=2, w_uv=w_uv[:2].to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_mla_decode_prep_equals_the_layers_ops_bit_for_bit(dtype, interleave, fp8):
    """``mla_decode_prep`` (norm + rotary + latent store in one kernel) against what the eager layer runs:
    ``RMSNorm``, ``DeepseekRotary``, the concatenation and ``MLAKVPool.set_latent`` (FP8: quantized)."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter casts float32 to bfloat16 by truncation (a GPU rounds to nearest even)")
    from kvship.engine.attention.mla_prep import mla_decode_prep
    from kvship.engine.layers.rmsnorm import RMSNorm
    from kvship.engine.mem.mla_pool import MLAKVPool
    from kvship.engine.models.deepseek import DeepseekRotary

    g = torch.Generator().manual_seed(7)
    t, h, d_nope, r, p = 3, 5, 12, 24, 8
    scaling = {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 32,
        "mscale": 0.7,
        "mscale_all_dim": 0.7,
    }
    with torch.device(DEVICE):  # the reference runs the layer's ops on the kernel's device (same rsqrt, same casts)
        rotary = DeepseekRotary(p, 256, 10000.0, scaling, interleave)
        norm = RMSNorm(r, 1e-6, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(r, generator=g) + 0.5)
    q = (torch.randn((t, h, d_nope + p), generator=g) * 2).to(dtype).to(DEVICE)
    kv_a = (torch.randn((t, r + p + 3), generator=g) * 2).to(dtype).to(DEVICE)[:, : r + p]  # a view into wider rows
    positions = torch.tensor([0, 17, 200], device=DEVICE)
    loc = torch.tensor([9, 2, 30], device=DEVICE)
    pool_dtype = torch.float8_e4m3fn if fp8 else dtype
    scales = [0.37] if fp8 else None
    want_pool = MLAKVPool(32, 1, pool_dtype, r, p, 1, DEVICE, latent_scales=scales)
    got_pool = MLAKVPool(32, 1, pool_dtype, r, p, 1, DEVICE, latent_scales=scales)
    # the eager layer's ops
    q_pe, k_pe = rotary(positions, q[..., d_nope:], kv_a[:, r:])
    c = norm(kv_a[:, :r].contiguous())
    want_pool.set_latent(0, loc, torch.cat([c, k_pe], dim=-1))
    want_q = torch.cat([q[..., :d_nope], q_pe], dim=-1)
    # the kernel, in place
    got_q = q.clone()
    mla_decode_prep(
        got_q, kv_a, positions, rotary.cos_sin_cache, norm.weight, norm.eps,
        got_pool.kv_buffer[0], loc, got_pool.latent_scale(0), interleave, d_nope,
    )  # fmt: skip
    got_bytes, want_bytes = got_pool.kv_buffer[0].view(torch.uint8), want_pool.kv_buffer[0].view(torch.uint8)
    if dtype == torch.float32 and DEVICE == "cuda":
        # a GPU contracts float32 products and sums into FMAs (PyTorch's separate kernels cannot): an ulp apart
        assert torch.allclose(got_q, want_q, rtol=1e-6, atol=1e-6)
        if fp8:  # then an e4m3 rounding may fall the other way: at most one step
            assert (got_bytes.int() - want_bytes.int()).abs().max().item() <= 1
        else:
            assert torch.allclose(got_pool.kv_buffer[0], want_pool.kv_buffer[0], rtol=1e-6, atol=1e-6)
        return
    if dtype == torch.bfloat16:
        # on an H200 the bfloat16 results differed from PyTorch's kernels (2026-11-29): a product rounded one step
        # apart moves a rotated value by a rounding step of its operands, which a cancelling sum does not shrink;
        # so: within two bfloat16 steps of the largest operand (a wrong pair or sign would be off by O(1))
        step = 2.0**-6 * q.float().abs().max().item()
        assert (got_q.float() - want_q.float()).abs().max().item() <= step
        assert torch.equal(got_q[..., :d_nope], q[..., :d_nope])  # q_nope untouched
        got_f, want_f = got_pool.kv_buffer[0].float(), want_pool.kv_buffer[0].float()
        if fp8:
            assert (got_bytes.int() - want_bytes.int()).abs().max().item() <= 1
        else:
            assert torch.equal(got_f[:, :, :r], want_f[:, :, :r])  # the norm: the very same rounding
            assert (got_f - want_f).abs().max().item() <= 2.0**-6 * kv_a.float().abs().max().item()
        return
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_bytes, want_bytes)


def test_mla_decode_refuses_mismatched_latent_rows():
    from kvship.engine.attention.mla_triton import mla_decode

    with pytest.raises(ValueError, match="do not match queries"):
        mla_decode(
            torch.zeros(1, 2, 40),
            torch.zeros(4, 1, 36),
            torch.zeros(1, 4, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            32,
            1.0,
        )


def _verify_step(runner, drv, reqs, trees, masks):
    """A TARGET_VERIFY forward of draft trees (``trees[b]`` tokens, ``masks[b]`` their tree mask) after each
    request's tokens; logits of every tree node.  The tree's slots are freed afterwards (nothing accepted)."""
    from kvship.engine.forward_batch import ForwardMode, build_forward_batch

    prefix = [len(q.tokens) for q in reqs]
    seq = [p + len(t) for p, t in zip(prefix, trees)]
    locs = runner.allocator.alloc_extend(prefix, seq, [q.slots[-1] for q in reqs])
    off = 0
    for q, p, toks in zip(reqs, prefix, trees):
        runner.req_to_token_pool.write(q.row, p, locs[off : off + len(toks)])
        off += len(toks)
    n = sum(len(t) for t in trees)
    fb = build_forward_batch(
        ForwardMode.TARGET_VERIFY,
        input_ids=torch.tensor([t for toks in trees for t in toks], dtype=torch.int64, device=DEVICE),
        positions=torch.tensor([p + d for p, m in zip(prefix, masks) for d in (m.sum(1) - 1).tolist()], device=DEVICE),
        req_pool_indices=torch.tensor([q.row for q in reqs], dtype=torch.int64, device=DEVICE),
        seq_lens=torch.tensor(seq, dtype=torch.int64, device=DEVICE),
        seq_lens_cpu=seq,
        out_cache_loc=locs.to(DEVICE),
        req_to_token_pool=runner.req_to_token_pool,
        kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
        device=DEVICE,
        extend_lens=[len(t) for t in trees],
        prefix_lens=prefix,
        logits_indices=torch.arange(n, device=DEVICE),
        tree_masks=masks,
    )
    logits = runner.forward(fb).next_token_logits
    runner.allocator.free(locs.tolist())
    return logits


def test_triton_mla_backend_decodes_like_the_torch_backend(tmp_path, kv_driver, monkeypatch):
    """A tiny DeepSeek-V3 through the model runner: ``--attention-backend triton`` gives the torch_native
    backend's logits at the extends (decompressed kernel the first time; over a cached prefix the second time the
    model's extend switch picks the path, the same for both backends), every decode
    step (split-KV kernel) and every node of a tree verify (absorbed kernel with the tree masks)."""
    from deepseek_fixtures import build_tiny_deepseek

    from kvship.engine.attention.mla_triton import MLATritonBackend
    from kvship.engine.config import ServerArgs
    from kvship.engine.model_runner import ModelRunner

    path = build_tiny_deepseek(str(tmp_path), "v3_yarn_grouped", seed=30, num_hidden_layers=LAYERS)
    runs = {}
    for backend in ("torch_native", "triton", "triton_merge_uv"):
        # the third: W_UV inside the decode merge kernel (KVSHIP_MLA_MERGE_UV_TOKENS)
        monkeypatch.setenv("KVSHIP_MLA_MERGE_UV_TOKENS", "16" if backend == "triton_merge_uv" else "0")
        # float32 on CUDA too (its default is bfloat16): the 1e-4 below is a float32 tolerance
        sa = ServerArgs(
            model_path=path,
            device=DEVICE,
            dtype="float32",
            max_total_tokens=256,
            attention_backend=backend.removesuffix("_merge_uv"),
        )
        runner = ModelRunner(sa)
        drv = kv_driver(runner)
        reqs = [drv.new(), drv.new()]
        runs[backend] = [drv.extend(reqs, [list(range(5, 22)), list(range(40, 45))], all_logits=True)]
        runs[backend] += [drv.decode(reqs, [7 + i, 9 + i]) for i in range(2)]
        runs[backend].append(drv.extend(reqs, [[3, 4, 5], list(range(50, 70))], all_logits=True))
        # trees: root -> {a, b}, a -> c (siblings must not see each other); a 3-token chain
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        chain = torch.ones(3, 3, dtype=torch.bool).tril()
        runs[backend].append(_verify_step(runner, drv, reqs, [[11, 12, 13, 14], [21, 22, 23]], [tree, chain]))
        if backend != "torch_native":
            assert isinstance(runner.attn_backend, MLATritonBackend)
    # float32: 1e-4 on CPU; on an H200 the two backends' float32 logits were 3.9e-4 apart (FMA contraction in the
    # kernels, another summation order), so 1e-3 there
    tol = 1e-4 if DEVICE == "cpu" else 1e-3
    for name in ("triton", "triton_merge_uv"):
        for a, b in zip(runs["torch_native"], runs[name]):
            assert (a - b).abs().max().item() < tol, name


def _packed_batch(g, pres, exts, dim, rows=(4, 1, 6)):
    """Requests with ``pres[b]`` cached + ``exts[b]`` new tokens at scattered slots of a latent buffer."""
    seqs = [p + e for p, e in zip(pres, exts)]
    slots = torch.randperm(300, generator=g)[: sum(seqs)] + 1  # 0 is the padding slot
    r2t = torch.zeros((8, 64), dtype=torch.int32)
    rows_t = torch.tensor(rows[: len(pres)])
    off = 0
    for row, n in zip(rows_t.tolist(), seqs):
        r2t[row, :n] = slots[off : off + n].to(torch.int32)
        off += n
    buf = torch.randn((301, 1, dim), generator=g)
    q_starts = torch.tensor([sum(exts[:i]) for i in range(len(exts))], dtype=torch.int32)
    return buf, r2t, rows_t, torch.tensor(pres, dtype=torch.int32), torch.tensor(exts, dtype=torch.int32), q_starts


def _visible(p, e, tree):
    vis = torch.ones((e, p + e), dtype=torch.bool)
    vis[:, p:] = tree if tree is not None else torch.ones(e, e, dtype=torch.bool).tril()
    return vis


@pytest.mark.parametrize("tree,h", [(False, 3), (True, 3), (True, 20)])
def test_absorbed_extend_and_tree_verify_equal_the_reference(tree, h):
    """Causal extends (a request longer than one block of tokens, one with no prefix) and tree verify (random
    tree masks with the diagonal set) over the latent pool; 20 heads: two head blocks, the second partial."""
    from kvship.engine.attention.mla_triton_extend import mla_extend_absorbed

    g = torch.Generator().manual_seed(7 + tree)
    r, p = 32, 8
    pres, exts = ([5, 0, 33], [4, 19, 1]) if not tree else ([9, 40, 2], [4, 6, 1])
    buf, r2t, rows, pre_t, ext_t, q_starts = _packed_batch(g, pres, exts, r + p)
    masks = [(torch.rand(e, e, generator=g) < 0.5).tril() | torch.eye(e, dtype=torch.bool) for e in exts]
    q = torch.randn((sum(exts), h, r + p), generator=g)
    scale = (r + p) ** -0.5
    kw = {}
    if tree:
        kw = dict(
            tree_mask=torch.cat([m.reshape(-1).to(torch.uint8) for m in masks]).to(DEVICE),
            mask_starts=torch.tensor([sum(e * e for e in exts[:i]) for i in range(3)]).to(DEVICE),
        )
    dev = [t.to(DEVICE) for t in (q, buf, r2t, rows, pre_t, ext_t, q_starts)]
    got = mla_extend_absorbed(*dev, max(exts), r, scale, **kw).cpu()
    for b, (row, pl, e) in enumerate(zip(rows.tolist(), pres, exts)):
        lat = buf[r2t[row, : pl + e].long(), 0]
        qb = q[int(q_starts[b]) : int(q_starts[b]) + e]
        s = torch.einsum("thd,nd->htn", qb, lat) * scale
        s = s.masked_fill(~_visible(pl, e, masks[b] if tree else None), float("-inf"))
        ref = torch.einsum("htn,nr->thr", torch.softmax(s, -1), lat[:, :r])
        assert torch.allclose(got[int(q_starts[b]) : int(q_starts[b]) + e], ref, atol=1e-5, rtol=1e-5), b


def test_decompressed_extend_over_a_cached_prefix_equals_the_reference():
    """Per-head keys ``[k_nope | k_pe]`` (k_pe read from the pool through req_to_token), causal over prefix + new."""
    from kvship.engine.attention.mla_triton_extend import mla_extend_decompressed

    g = torch.Generator().manual_seed(11)
    h, r, dn, p, dv = 2, 16, 8, 4, 12
    pres, exts = [6, 0, 30], [3, 18, 2]
    buf, r2t, rows, pre_t, ext_t, q_starts = _packed_batch(g, pres, exts, r + p)
    seqs = [a + b for a, b in zip(pres, exts)]
    kv_starts = torch.tensor([sum(seqs[:i]) for i in range(3)], dtype=torch.int32)
    k_nope = torch.randn((sum(seqs), h, dn), generator=g)
    v = torch.randn((sum(seqs), h, dv), generator=g)
    q = torch.randn((sum(exts), h, dn + p), generator=g)
    scale = (dn + p) ** -0.5
    dev = [t.to(DEVICE) for t in (q, k_nope, v, buf, r2t, rows, pre_t, ext_t, q_starts, kv_starts)]
    got = mla_extend_decompressed(*dev, max(exts), r, scale).cpu()
    assert got.shape == (sum(exts), h, dv)
    for b, (row, pl, e) in enumerate(zip(rows.tolist(), pres, exts)):
        k0, q0, n = int(kv_starts[b]), int(q_starts[b]), pl + e
        pe = buf[r2t[row, :n].long(), 0, r:]
        key = torch.cat([k_nope[k0 : k0 + n], pe[:, None].expand(n, h, p)], dim=-1)
        s = torch.einsum("thd,nhd->htn", q[q0 : q0 + e], key) * scale
        s = s.masked_fill(~_visible(pl, e, None), float("-inf"))
        ref = torch.einsum("htn,nhv->thv", torch.softmax(s, -1), v[k0 : k0 + n])
        assert torch.allclose(got[q0 : q0 + e], ref, atol=1e-5, rtol=1e-5), b


def _greedy(sa, batches):
    """Greedy tokens of ``batches`` (lists of prompts, each list run to idle before the next: later batches hit
    the radix cache) through the unified scheduler; also its stats."""
    from pd_fixtures import Collector, run_until_idle

    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner

    out = Collector()
    sched = scheduler_for_mode("unified")(sa, ModelRunner(sa), None, out)
    rids = []
    for n, prompts in enumerate(batches):
        for i, p in enumerate(prompts):
            rids.append(f"b{n}r{i}")
            sched.submit(GenerateRequest(rids[-1], list(p), SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)))
        run_until_idle(sched)
    cached = max((c.cached_tokens for c in out.chunks if c.rid.startswith("b1")), default=0)
    return [out.tokens(r) for r in rids], cached, sched.get_stats()


@pytest.mark.timeout(120)
def test_triton_mla_backend_greedy_equals_torch_native_with_prefix_hits_and_mtp_tree_verify(tmp_path, monkeypatch):
    """Tiny DeepSeek-V3 (with an MTP layer) through the scheduler: ``--attention-backend triton`` (Triton
    extends over a radix-cache prefix by the model's extend switch, split-KV decode, absorbed tree verify of MTP drafts with
    ``eagle_topk 2``, the verify forwards' norm, rotary and latent store by ``mla_decode_prep`` as in decode)
    gives torch_native's greedy tokens."""
    from deepseek_fixtures import build_tiny_deepseek
    from test_deepseek_mtp import add_mtp_layer

    from kvship.engine.config import ServerArgs
    from kvship.engine.forward_batch import ForwardMode
    from kvship.engine.models.deepseek import MLAAttention

    prepped = []  # the forward mode of every attention that ran mla_decode_prep
    real = MLAAttention._prepped
    monkeypatch.setattr(
        MLAAttention,
        "_prepped",
        lambda self, p, q, kv, fb: (prepped.append(fb.forward_mode), real(self, p, q, kv, fb))[1],
    )

    path = add_mtp_layer(
        build_tiny_deepseek(str(tmp_path), "v3_yarn_grouped", seed=61, num_hidden_layers=LAYERS), seed=62
    )
    shared = list(range(10, 27))
    batches = [[shared + [40, 41], list(range(60, 66))], [shared + [50, 51, 52, 53], shared + [70]]]
    spec = dict(
        speculative_algorithm="eagle",
        speculative_draft_model_path=path,
        speculative_num_steps=2,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=4,
    )
    runs = {}
    for backend in ("torch_native", "triton"):
        base = dict(
            model_path=path,
            device=DEVICE,
            dtype="float32",
            max_total_tokens=512,
            page_size=1,
            attention_backend=backend,
        )
        runs[backend] = _greedy(ServerArgs(**base), batches)
        runs[backend + "+mtp"] = _greedy(ServerArgs(**base, **spec), batches)
    tokens, cached, _ = runs["torch_native"]
    assert cached >= 16  # the second batch's shared pages came from the radix cache
    assert all(len(t) == MAX_NEW for t in tokens)
    for name in ("triton", "torch_native+mtp", "triton+mtp"):
        assert runs[name][0] == tokens, name
        assert runs[name][1] >= 16, name
    st = runs["triton+mtp"][2]
    assert st["spec_rounds"] > 0 and st["spec_draft_tokens"] > st["spec_rounds"]
    assert ForwardMode.TARGET_VERIFY in prepped and ForwardMode.DECODE in prepped  # verify took the prep kernel too
