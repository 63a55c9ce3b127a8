"""The split-KV absorbed extend / tree verify of the Triton MLA backend (engine/attention/mla_triton_extend.py,
``mla_extend_absorbed(..., num_splits=S)``; the split rule and scratch: engine/attention/mla_triton.py,
``MLAExtendSplits``).

* The kernel: for 1, 2, 4 and 16 splits, the single-pass kernel's output and a torch reference's, within float32
  tolerance, for requests of different prefixes (none, shorter than the splits, so some chunks are empty, and
  longer than a 32-token tile), causal and packed tree masks, bf16 (``kv_scale`` 1 and 1.7) and FP8 (e4m3,
  0.37) latent pools; a row that sees nothing gives zeros, not NaN; given scratch is used as it is and must be
  large enough.
* The rule: split counts from the padded batch, tokens per request, heads and SMs alone (no context length) for
  batches that pad to a graph size, capped by the context past them; one split (the single pass) for long
  extends or with ``KVSHIP_SPLIT_VERIFY=0``; static scratch for the largest verify graph.
* The backend: a TARGET_VERIFY and a short EXTEND through ``MLATritonBackend`` take the split path and give
  what the single pass gives (and the torch backend); the verify graphs' metadata (``TritonExtendMeta``) over
  static buffers with the static scratch gives the eager round bit for bit, again after new context lengths are
  written into those buffers in place (a replay).

Runs natively on CUDA, or on CPU under Triton's interpreter: ``test_mla_verify_split_tests_pass_in_the_triton_
interpreter`` runs the others in the session's one child pytest with ``TRITON_INTERPRET=1``
(tests/triton_interp.py).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from triton_interp import TEST_TIMEOUT_S, interpreter_outcomes

HAS_TRITON = importlib.util.find_spec("triton") is not None
KERNELS = HAS_TRITON and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernels = pytest.mark.skipif(not KERNELS, reason="Triton MLA kernels: need CUDA, or TRITON_INTERPRET=1 on CPU")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="the triton MLA backend imports triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
R, P = 32, 8  # kv_lora_rank, rope dims
SPLITS = (1, 2, 4, 16)
GRAPH_BS = (1, 2, 4, 8)


def _batch(g, pres, exts, pool_dtype, rows):
    """Requests with ``pres[b]`` cached + ``exts[b]`` new tokens at scattered slots of a latent buffer of
    ``pool_dtype`` (float32 values rounded to it)."""
    seqs = [p + e for p, e in zip(pres, exts)]
    slots = torch.randperm(200, generator=g)[: sum(seqs)] + 1  # 0 is the padding slot
    r2t = torch.zeros((8, 64), dtype=torch.int32)
    rows_t = torch.tensor(rows[: len(pres)])
    off = 0
    for row, n in zip(rows_t.tolist(), seqs):
        r2t[row, :n] = slots[off : off + n].to(torch.int32)
        off += n
    buf = (torch.randn((201, 1, R + P), generator=g) * 2).to(pool_dtype)
    q_starts = torch.tensor([sum(exts[:i]) for i in range(len(exts))], dtype=torch.int32)
    return buf, r2t, rows_t, torch.tensor(pres, dtype=torch.int32), torch.tensor(exts, dtype=torch.int32), q_starts


def _masks(g, exts, tree):
    if not tree:
        return None
    return [(torch.rand(e, e, generator=g) < 0.5).tril() | torch.eye(e, dtype=torch.bool) for e in exts]


def _mask_args(exts, masks):
    if masks is None:
        return {}
    return dict(
        tree_mask=torch.cat([m.reshape(-1).to(torch.uint8) for m in masks]).to(DEVICE),
        mask_starts=torch.tensor([sum(e * e for e in exts[:i]) for i in range(len(exts))]).to(DEVICE),
    )


def _reference(q, buf, r2t, rows, pres, exts, masks, scale, kv_scale):
    """Softmax attention of each new token over its visible positions, on the dequantized rows (float64)."""
    out = torch.zeros((q.shape[0], q.shape[1], R), dtype=torch.float64)
    q0 = 0
    for b, (row, pl, e) in enumerate(zip(rows.tolist(), pres, exts)):
        lat = buf[r2t[row, : pl + e].long(), 0].double() * kv_scale
        vis = torch.ones((e, pl + e), dtype=torch.bool)
        vis[:, pl:] = masks[b] if masks is not None else torch.ones(e, e, dtype=torch.bool).tril()
        s = torch.einsum("thd,nd->htn", q[q0 : q0 + e].double(), lat) * scale
        s = s.masked_fill(~vis, float("-inf"))
        w = torch.nan_to_num(torch.softmax(s, -1))  # a row that sees nothing: zeros
        out[q0 : q0 + e] = torch.einsum("htn,nr->thr", w, lat[:, :R])
        q0 += e
    return out.float()


@needs_kernels
@pytest.mark.parametrize(
    "tree,pool_dtype,kv_scale,heads",
    [
        (False, torch.bfloat16, 1.0, 4),
        (True, torch.bfloat16, 1.7, 20),  # 20 heads: two head blocks, the second partial
        (False, torch.float8_e4m3fn, 0.37, 3),
        (True, torch.float8_e4m3fn, 0.37, 4),
    ],
)
def test_split_absorbed_extend_equals_the_single_pass_and_the_reference(tree, pool_dtype, kv_scale, heads):
    """Prefixes 0, 2 (shorter than most split counts: empty chunks), 9 and 40 (past a 32-token tile), 1-5 new
    tokens each (two row blocks for the longest at 4 heads), at every split count."""
    from kvship.engine.attention.mla_triton_extend import mla_extend_absorbed

    g = torch.Generator().manual_seed(int(tree) * 10 + heads)
    pres, exts = [0, 2, 9, 40], [3, 1, 5, 2]
    buf, r2t, rows, pre_t, ext_t, q_starts = _batch(g, pres, exts, pool_dtype, rows=(4, 1, 6, 2))
    masks = _masks(g, exts, tree)
    q = torch.randn((sum(exts), heads, R + P), generator=g)
    scale = (R + P) ** -0.5
    dev = [t.to(DEVICE) for t in (q, buf, r2t, rows, pre_t, ext_t, q_starts)]
    kw = dict(kv_scale=kv_scale, **_mask_args(exts, masks))
    single = mla_extend_absorbed(*dev, max(exts), R, scale, **kw).cpu()
    ref = _reference(q, buf, r2t, rows, pres, exts, masks, scale, kv_scale)
    assert torch.allclose(single, ref, atol=1e-5, rtol=1e-5)
    for splits in SPLITS:
        got = mla_extend_absorbed(*dev, max(exts), R, scale, num_splits=splits, **kw).cpu()
        assert not torch.isnan(got).any(), splits
        assert torch.allclose(got, single, atol=1e-5, rtol=1e-5), splits
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), splits


@needs_kernels
def test_split_rows_that_see_nothing_give_zeros_not_nan():
    """A tree row with nothing visible (no prefix, a mask row of zeros): every chunk of it is empty; the merge
    gives zeros, as the single pass does, and its neighbours are unaffected."""
    from kvship.engine.attention.mla_triton_extend import mla_extend_absorbed

    g = torch.Generator().manual_seed(3)
    pres, exts = [0, 5], [3, 2]
    buf, r2t, rows, pre_t, ext_t, q_starts = _batch(g, pres, exts, torch.float32, rows=(3, 7))
    masks = [torch.tensor([[1, 0, 0], [0, 0, 0], [1, 0, 1]], dtype=torch.bool), torch.eye(2, dtype=torch.bool)]
    q = torch.randn((5, 4, R + P), generator=g)
    dev = [t.to(DEVICE) for t in (q, buf, r2t, rows, pre_t, ext_t, q_starts)]
    single = mla_extend_absorbed(*dev, 3, R, 0.2, **_mask_args(exts, masks)).cpu()
    got = mla_extend_absorbed(*dev, 3, R, 0.2, num_splits=4, **_mask_args(exts, masks)).cpu()
    assert not torch.isnan(got).any()
    assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.equal(single[1], got[1])
    ref = _reference(q, buf, r2t, rows, pres, exts, masks, 0.2, 1.0)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_split_extend_scratch_is_used_as_given_and_must_hold_every_part():
    from kvship.engine.attention.mla_triton_extend import mla_extend_absorbed, split_scratch_size

    g = torch.Generator().manual_seed(4)
    pres, exts = [6, 30], [4, 3]
    buf, r2t, rows, pre_t, ext_t, q_starts = _batch(g, pres, exts, torch.float32, rows=(0, 5))
    q = torch.randn((7, 4, R + P), generator=g)
    dev = [t.to(DEVICE) for t in (q, buf, r2t, rows, pre_t, ext_t, q_starts)]
    n_out, n_lse = split_scratch_size(7, 4, 4, R)
    scratch = (torch.full((n_out + 5,), float("nan"), device=DEVICE), torch.full((n_lse,), float("nan"), device=DEVICE))
    own = mla_extend_absorbed(*dev, 4, R, 0.3, num_splits=4)
    given = mla_extend_absorbed(*dev, 4, R, 0.3, num_splits=4, scratch=scratch)
    assert torch.equal(own, given)
    assert not torch.isnan(scratch[0][:n_out]).any() and not torch.isnan(scratch[1]).any()  # every part written
    short = (scratch[0][: n_out - 1], scratch[1])
    with pytest.raises(ValueError, match="short of"):
        mla_extend_absorbed(*dev, 4, R, 0.3, num_splits=4, scratch=short)
    with pytest.raises(ValueError, match="power of two"):
        mla_extend_absorbed(*dev, 4, R, 0.3, num_splits=3)


def _ctx(heads, sizes=GRAPH_BS, device=DEVICE, r2t=None):
    from kvship.engine.attention.base import AttentionContext
    from kvship.engine.mem.pools import ReqToTokenPool

    return AttentionContext(
        device=torch.device(device),
        dtype=torch.float32,
        kv_dtype=torch.float32,
        num_heads=heads,
        num_kv_heads=1,
        head_dim=R + P,
        page_size=1,
        req_to_token_pool=r2t if r2t is not None else ReqToTokenPool(4, 8, device),
        max_running_requests=16,
        cuda_graph_bs=sizes,
    )


@needs_triton
def test_split_count_comes_from_the_padded_batch_tokens_heads_and_sms_alone():
    """``graph_extend_splits``: programs ``bs x row blocks x head blocks``, splits enough for one per SM (a power
    of two, at most 16; 2 where the programs outnumber the SMs by at most 4x).  Eager extends that pad to a graph size take it whatever their contexts; larger batches
    are capped by their longest context; long extends and the knob off take the single pass."""
    from kvship.engine.attention.mla_triton import (
        SPLIT_EXTEND_MAX_EXT,
        MLADecodeSplits,
        MLAExtendSplits,
        graph_extend_splits,
    )
    from kvship.engine.attention.mla_triton_extend import absorbed_programs

    # DeepSeek-V2-Lite (16 heads) on 132 SMs: one token of 16 heads a program
    assert absorbed_programs(1, 16, 4) == 4 and graph_extend_splits(1, 4, 16, 132) == 16
    assert graph_extend_splits(8, 4, 16, 132) == 8  # 32 programs: 5 splits wanted -> 8
    assert graph_extend_splits(8, 8, 16, 132) == 4
    assert graph_extend_splits(64, 4, 16, 132) == 2  # programs past the SMs (up to 4x): 2, measured faster than 1
    assert graph_extend_splits(256, 16, 16, 132) == 1  # 4096 programs: the single pass
    # DeepSeek-V3 (128 heads): 8 head blocks
    assert graph_extend_splits(1, 1, 128, 132) == 16 and graph_extend_splits(1, 8, 128, 132) == 4
    assert graph_extend_splits(8, 4, 128, 132) == 2
    # few heads: several tokens share a program (4 heads: 4 tokens of 4 heads)
    assert absorbed_programs(2, 4, 5) == 4 and graph_extend_splits(2, 5, 4, 8) == 2

    ctx = _ctx(4, device="cpu")
    sp = MLAExtendSplits(ctx, MLADecodeSplits(ctx))
    sms = sp.decode.num_sms
    assert sp.num_splits(3, 4, [5, 9000, 2]) == graph_extend_splits(4, 4, 4, sms)  # pads to 4; no context read
    assert sp.num_splits(3, 4, [5, 7, 2]) == sp.graph_splits(3, 4) == sp.graph_splits(4, 4)
    big = MLAExtendSplits(_ctx(4, sizes=(1, 2), device="cpu"), MLADecodeSplits(_ctx(4, sizes=(1, 2), device="cpu")))
    assert big.graph_splits(3, 1) == 4  # 3 programs on 8 SMs: 3 splits wanted -> 4; past the graphs capped by
    # the longest context, one split per 128 tokens
    assert big.num_splits(3, 1, [100, 50, 3]) == 1 and big.num_splits(3, 1, [200, 50, 3]) == 2
    assert big.num_splits(3, 1, [9000, 50, 3]) == 4
    assert sp.num_splits(1, SPLIT_EXTEND_MAX_EXT + 1, [40]) == 1  # a long extend keeps the single pass
    off = MLAExtendSplits(ctx, MLADecodeSplits(ctx), enabled=False)
    assert off.num_splits(1, 4, [4000]) == 1 and off.graph_splits(1, 4) == 1


@needs_triton
def test_verify_graph_scratch_holds_the_largest_splitting_graph():
    from kvship.engine.attention.mla_triton import SPLIT_EXTEND_MAX_EXT, MLADecodeSplits, MLAExtendSplits
    from kvship.engine.attention.mla_triton_extend import split_scratch_size

    ctx = _ctx(4, device="cpu")
    sp = MLAExtendSplits(ctx, MLADecodeSplits(ctx))
    sp.init_graph_scratch(8, 4)
    want = max(
        split_scratch_size(b * 4, 4, sp.graph_splits(b, 4), R + P) for b in GRAPH_BS if sp.graph_splits(b, 4) > 1
    )
    assert (sp._scratch[0].numel(), sp._scratch[1].numel()) == want
    for b in GRAPH_BS:
        s = sp.graph_splits(b, 4)
        if s > 1:
            assert sp.graph_scratch(b * 4, 4, s, R) is sp._scratch
    assert sp.graph_scratch(100, 4, 16, R) is None  # more than it holds: the kernel allocates its own
    sp.init_graph_scratch(8, SPLIT_EXTEND_MAX_EXT + 1)
    assert sp._scratch is None  # graphs of long trees never split


class Bench:
    """One layer's latent pool (float32 or FP8 with a scale) full of random rows, a request table, and the
    triton and torch MLA backends over it at ``heads`` query heads."""

    def __init__(self, heads: int, seed: int, fp8: bool):
        from kvship.engine.attention.mla import MLALayerSpec, MLATorchBackend
        from kvship.engine.attention.mla_triton import MLATritonBackend
        from kvship.engine.mem.mla_pool import MLAKVPool
        from kvship.engine.mem.pools import ReqToTokenPool, quantize_kv

        self.g = torch.Generator().manual_seed(seed)
        self.heads = heads
        self.r2t = ReqToTokenPool(12, 97, DEVICE)
        dtype = torch.float8_e4m3fn if fp8 else torch.float32
        self.pool = MLAKVPool(300, 1, dtype, R, P, 1, DEVICE, latent_scales=[0.05] if fp8 else None)
        rows = torch.randn((301, 1, R + P), generator=self.g).to(DEVICE)
        self.pool.kv_buffer[0].copy_(quantize_kv(rows, 0.05) if fp8 else rows)
        ctx = _ctx(heads, r2t=self.r2t)
        self.triton = MLATritonBackend(ctx)
        self.torch = MLATorchBackend(ctx)
        self.layer = MLALayerSpec(
            layer_id=0,
            num_heads=heads,
            kv_lora_rank=R,
            qk_nope_head_dim=16,
            qk_rope_head_dim=P,
            v_head_dim=24,
            scaling=(R + P) ** -0.5,
        )

    def fill(self, rows, lens):
        for row, n in zip(rows, lens):
            slots = torch.randperm(300, generator=self.g)[:n] + 1
            self.r2t.req_to_token[row, :n] = slots.to(torch.int32).to(DEVICE)

    def batch(self, mode, rows, pre, ext, masks):
        from kvship.engine.forward_batch import build_forward_batch

        lens = [p + e for p, e in zip(pre, ext)]
        r2t = self.r2t.req_to_token
        return build_forward_batch(
            mode,
            input_ids=[0] * sum(ext),
            positions=[p + i for p, e in zip(pre, ext) for i in range(e)],
            req_pool_indices=rows,
            seq_lens=lens,
            seq_lens_cpu=lens,
            out_cache_loc=[int(r2t[r, p + i]) for r, p, e in zip(rows, pre, ext) for i in range(e)],
            req_to_token_pool=self.r2t,
            kv_pool=self.pool,
            attn_backend=self.triton,
            device=DEVICE,
            extend_lens=ext,
            prefix_lens=pre,
            tree_masks=masks,
        )


@needs_kernels
@pytest.mark.parametrize("mode_name,fp8", [("TARGET_VERIFY", False), ("TARGET_VERIFY", True), ("EXTEND", False)])
def test_backend_takes_the_split_path_and_gives_the_single_pass_output(mode_name, fp8):
    """Two requests (prefixes 3 and 60, trees of 4 and 3 nodes, or causal extends) through ``MLATritonBackend``:
    the metadata picks several splits; the output equals the single pass's (the same metadata forced to one
    split) and the torch backend's."""
    from kvship.engine.forward_batch import ForwardMode

    mode = ForwardMode[mode_name]
    b = Bench(4, seed=11 + fp8, fp8=fp8)
    rows, pre, ext = [1, 5], [3, 60], [4, 3]
    b.fill(rows, [p + e for p, e in zip(pre, ext)])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    masks = [tree, torch.ones(3, 3, dtype=torch.bool).tril()] if mode == ForwardMode.TARGET_VERIFY else None
    fb = b.batch(mode, rows, pre, ext, masks)
    q = torch.randn((sum(ext), 4, R + P), generator=b.g).to(DEVICE)
    latent = torch.randn((sum(ext), R + P), generator=b.g).to(DEVICE)
    b.triton.init_forward_metadata(fb)
    meta = b.triton.forward_metadata
    assert meta.num_splits == b.triton.extend_splits.graph_splits(2, 4) > 1
    split = b.triton.forward_extend(q, latent, None, b.layer, fb).cpu()
    assert meta.scratch is not None  # made at the first layer, kept for the others
    meta.num_splits, meta.scratch = 1, None
    single = b.triton.forward_extend(q, latent, None, b.layer, fb, save_kv_cache=False).cpu()
    assert torch.allclose(split, single, atol=1e-5, rtol=1e-5)
    b.torch.init_forward_metadata(fb)
    want = b.torch.forward_extend(q, latent, None, b.layer, fb, save_kv_cache=False).cpu()
    assert torch.allclose(split, want, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_verify_graph_metadata_with_static_scratch_equals_the_eager_round_for_any_context():
    """The verify graphs' path: ``init_verify_cuda_graph_state`` then ``TritonExtendMeta`` over static buffers
    (a graph of 4 requests, one a padding request: row 0, no prefix, a chain) gives the eager round of the 3 live
    requests bit for bit, writing the static scratch; then new rows and much longer prefixes written into the
    same buffers in place (what a replay sees) give the eager round of those, with the same split count."""
    from kvship.engine.attention.triton_backend import TritonExtendMeta
    from kvship.engine.forward_batch import ForwardMode

    k, gbs = 4, 4
    b = Bench(4, seed=21, fp8=False)
    be = b.triton
    be.init_verify_cuda_graph_state(8, k)
    o_static, lse_static = be.extend_splits._scratch
    static_pre = torch.zeros(gbs, dtype=torch.int32, device=DEVICE)
    static_rows = torch.zeros(gbs, dtype=torch.int64, device=DEVICE)
    static_mask = torch.zeros(gbs * k * k, dtype=torch.uint8, device=DEVICE)
    static_q = torch.zeros((gbs * k, 4, R + P), device=DEVICE)
    meta = TritonExtendMeta(
        static_pre,
        torch.full((gbs,), k, dtype=torch.int32, device=DEVICE),
        torch.arange(gbs, dtype=torch.int32, device=DEVICE) * k,
        k,
        static_mask,
        torch.arange(gbs, dtype=torch.int64, device=DEVICE) * (k * k),
    )
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    chain = torch.ones(k, k, dtype=torch.bool).tril()
    b.r2t.req_to_token[0, :k] = torch.arange(1, k + 1, dtype=torch.int32, device=DEVICE)  # the padding request
    splits = be.extend_splits.graph_splits(gbs, k)
    assert splits > 1
    for rows, pre in (([2, 6, 9], [3, 50, 17]), ([9, 1, 4], [88, 1, 40])):
        b.fill(rows, [p + k for p in pre])
        masks = [tree, chain, tree]
        fb = b.batch(ForwardMode.TARGET_VERIFY, rows, pre, [k] * 3, masks)
        q = torch.randn((3 * k, 4, R + P), generator=b.g).to(DEVICE)
        be.init_forward_metadata(fb)
        assert be.forward_metadata.num_splits == splits  # bs 3 pads to the graph's 4: the graph's count
        eager = be.forward_extend(q, None, None, b.layer, fb, save_kv_cache=False).cpu()
        # the live batch into the static buffers in place, a padding request after it
        static_pre.copy_(torch.tensor(pre + [0], dtype=torch.int32))
        static_rows.copy_(torch.tensor(rows + [0]))
        static_mask.copy_(torch.cat([m.reshape(-1) for m in masks + [chain]]).to(torch.uint8))
        static_q[: 3 * k].copy_(q)
        o_static.fill_(float("nan"))
        lse_static.fill_(float("nan"))
        be.forward_metadata = meta
        fb.req_pool_indices = static_rows
        got = be.forward_extend(static_q, None, None, b.layer, fb, save_kv_cache=False).cpu()
        parts = gbs * k * 4 * splits
        assert not torch.isnan(lse_static[:parts]).any() and not torch.isnan(o_static[: parts * R]).any()
        assert torch.equal(got[: 3 * k], eager)
        fb = b.batch(ForwardMode.TARGET_VERIFY, rows, pre, [k] * 3, masks)
        b.torch.init_forward_metadata(fb)
        want = b.torch.forward_extend(q, None, None, b.layer, fb, save_kv_cache=False).cpu()
        assert torch.allclose(eager, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this file's kernel tests run natively")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this is the interpreter's run already")
def test_mla_verify_split_tests_pass_in_the_triton_interpreter(request):
    """This file's other tests in a child pytest with ``TRITON_INTERPRET=1`` (set before triton is imported; the
    session's one such child, tests/triton_interp.py)."""
    pytest.importorskip("triton")
    interpreter_outcomes(request, "tests/test_mla_verify_split.py").check(passed=12)
