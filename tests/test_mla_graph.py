"""CUDA graphs of the Triton MLA decode backend (engine/attention/mla_triton.py), checked without a GPU.

* Eager decode with the graph-stable split count (a function of the CUDA-graph size a batch pads to, the head
  count and the SM count) equals the torch reference backend, for batch sizes that pad to several graph sizes,
  one past the largest (the adaptive count), and contexts shorter than the split count.
* The graph hooks driven as ``CudaGraphRunner`` drives them (``init_cuda_graph_state``, the capture hook over
  static input buffers holding padding rows, then the replay hook after the live batch is copied into those
  buffers in place, twice): the same metadata object, run again, equals the reference each time, writes the
  graph's own scratch, and computes bit for bit what the eager step of the same batch computes, whose split
  count is the graph's.  (``torch.cuda.graph`` itself needs a GPU: tests/gpu/test_gpu_deepseek_graphs.py.)
* The speculative verify graphs hand ``forward_extend`` the Triton extend metadata (``TritonExtendMeta``): it
  computes the eager tree verify.

Runs natively on CUDA, or on CPU under Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before triton is
imported, so ``test_mla_graph_tests_pass_in_the_triton_interpreter`` runs this file's other tests in a child pytest
with it (the session's one such child for every file's Triton cases: tests/triton_interp.py).
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
GRAPH_BS = (1, 2, 4, 8)
R, P = 32, 8  # kv_lora_rank, rope dims
SLOTS = 400
MAX_CTX = 96


class Bench:
    """A latent pool of one layer full of random rows, a request table, and the triton and torch MLA backends
    over it (the context a DeepSeek model runner would give them, at ``heads`` query heads)."""

    def __init__(self, heads: int, seed: int):
        from kvship.engine.attention.base import AttentionContext
        from kvship.engine.attention.mla import MLALayerSpec, MLATorchBackend
        from kvship.engine.attention.mla_triton import MLATritonBackend
        from kvship.engine.mem.mla_pool import MLAKVPool
        from kvship.engine.mem.pools import ReqToTokenPool

        self.g = torch.Generator().manual_seed(seed)
        self.heads = heads
        self.r2t = ReqToTokenPool(12, MAX_CTX + 1, DEVICE)
        self.pool = MLAKVPool(SLOTS, 1, torch.float32, R, P, 1, DEVICE)
        self.pool.kv_buffer[0].copy_(torch.randn((SLOTS + 1, 1, R + P), generator=self.g))
        ctx = AttentionContext(
            device=DEVICE,
            dtype=torch.float32,
            kv_dtype=torch.float32,
            num_heads=heads,
            num_kv_heads=1,
            head_dim=R + P,
            page_size=1,
            req_to_token_pool=self.r2t,
            max_running_requests=12,
            cuda_graph_bs=GRAPH_BS,
        )
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

    def fill_rows(self, rows: list[int], lens: list[int]) -> None:
        """Request table rows ``rows`` hold ``lens`` scattered slots (slot 0 is the padding slot)."""
        for row, n in zip(rows, lens):
            slots = torch.randperm(SLOTS, generator=self.g)[:n] + 1
            self.r2t.req_to_token[row, :n] = slots.to(torch.int32).to(DEVICE)

    def batch(self, rows, lens, backend, seq_lens=None, req_pool_indices=None, out_cache_loc=None):
        """A DECODE ForwardBatch of requests at ``rows`` with contexts ``lens`` (new token last); the tensors
        given (static buffers) are used as they are."""
        from kvship.engine.forward_batch import ForwardMode, build_forward_batch

        bs = len(lens)
        r2t = self.r2t.req_to_token
        return build_forward_batch(
            ForwardMode.DECODE,
            input_ids=[0] * bs,
            positions=[n - 1 for n in lens],
            req_pool_indices=rows if req_pool_indices is None else req_pool_indices,
            seq_lens=lens if seq_lens is None else seq_lens,
            seq_lens_cpu=lens,
            out_cache_loc=[int(r2t[r, n - 1]) for r, n in zip(rows, lens)] if out_cache_loc is None else out_cache_loc,
            req_to_token_pool=self.r2t,
            kv_pool=self.pool,
            attn_backend=backend,
            device=DEVICE,
        )

    def queries(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed queries ``[bs, H, R + P]`` and the new tokens' latent rows ``[bs, R + P]``."""
        q = torch.randn((bs, self.heads, R + P), generator=self.g).to(DEVICE)
        return q, torch.randn((bs, R + P), generator=self.g).to(DEVICE)

    def reference(self, rows, lens, q, latent) -> torch.Tensor:
        """The torch_native MLA backend's decode of the same batch (it stores the new rows too)."""
        fb = self.batch(rows, lens, self.torch)
        self.torch.init_forward_metadata(fb)
        return self.torch.forward_decode(q, latent, None, self.layer, fb).cpu()


@needs_kernels
@pytest.mark.parametrize(
    "heads,rows,lens",
    [
        (4, [3], [5]),  # bs 1: 8 splits over 5 tokens, three splits empty
        (4, [3], [1]),  # a context of one token: one split holds it
        (4, [0, 7], [2, 70]),  # bs 2: 4 splits, one context shorter than that
        (4, [5, 1, 2], [3, 33, 64]),  # bs 3 pads to 4: 2 splits
        (20, [4, 6, 8, 9, 10, 11], [1, 7, 40, 65, 90, 2]),  # 2 head blocks; bs 6 pads to 8: 1 split
        (4, list(range(10)), [9 * i + 1 for i in range(10)]),  # past the largest graph: by the longest context
    ],
)
def test_eager_decode_with_graph_stable_splits_equals_the_reference(heads, rows, lens):
    from kvship.engine.attention.mla_triton import decode_splits, graph_decode_splits

    b = Bench(heads, seed=sum(lens) + heads)
    b.fill_rows(rows, lens)
    q, latent = b.queries(len(lens))
    want = b.reference(rows, lens, q, latent)
    fb = b.batch(rows, lens, b.triton)
    b.triton.init_forward_metadata(fb)
    splits = b.triton.forward_metadata.num_splits
    bs = len(lens)
    if bs <= GRAPH_BS[-1]:
        padded = next(g for g in GRAPH_BS if g >= bs)
        assert splits == graph_decode_splits(padded, heads, b.triton.splits.num_sms)
    else:
        assert splits == decode_splits(max(lens))
    got = b.triton.forward_decode(q, latent, None, b.layer, fb).cpu()
    assert got.shape == (bs, heads, R)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@needs_triton
def test_graph_split_count_fills_the_gpu_by_batch_and_heads_alone():
    """Enough (request, head block, split) programs for one per SM, rounded up to a power of two, capped."""
    from kvship.engine.attention.mla_triton import MAX_GRAPH_SPLITS, graph_decode_splits

    assert graph_decode_splits(1, 128, 132) == MAX_GRAPH_SPLITS  # 8 head blocks: 17 splits wanted, capped at 16
    assert graph_decode_splits(4, 128, 132) == 8  # 32 programs: 5 splits wanted -> 8
    assert graph_decode_splits(16, 16, 132) == 16  # one head block: 9 -> 16
    assert graph_decode_splits(24, 128, 132) == 1
    assert graph_decode_splits(256, 128, 132) == 1
    assert graph_decode_splits(2, 4, 8) == 4 and graph_decode_splits(3, 4, 8) == 4  # 3 as such: the caller pads


@needs_kernels
def test_graph_hooks_over_static_buffers_equal_the_reference_and_the_eager_step():
    """The runner's sequence for a graph of 4: state for 8, capture hook over padding rows (row 0, length 1,
    slot 0), the capture's forward; then twice: a live batch of 3 copied into the static buffers in place (a
    padding row after it), the replay hook, the same forward again."""
    from kvship.engine.forward_batch import ForwardMode

    heads, gbs, max_bs = 4, 4, 8
    b = Bench(heads, seed=5)
    be = b.triton
    be.init_cuda_graph_state(max_bs, max_bs)
    static = torch.zeros((3, max_bs), dtype=torch.int64, device=DEVICE)  # rows, lengths, slots
    rpi, seq, loc = static[0], static[1], static[2]
    seq.fill_(1)
    pad = [1] * gbs
    fb = b.batch([0] * gbs, pad, be, seq_lens=seq[:gbs], req_pool_indices=rpi[:gbs], out_cache_loc=loc[:gbs])
    be.init_forward_metadata_capture_cuda_graph(gbs, gbs, rpi[:gbs], seq[:gbs], ForwardMode.DECODE)
    meta = be.forward_metadata
    o_scratch, lse_scratch = meta.scratch
    q_static = torch.zeros((gbs, heads, R + P), device=DEVICE)
    lat_static = torch.zeros((gbs, R + P), device=DEVICE)
    be.forward_decode(q_static, lat_static, None, b.layer, fb)  # what the capture records

    for rows, lens in (([2, 6, 9], [3, 50, 17]), ([9, 1, 4], [81, 1, 6])):  # new rows and lengths in place
        b.fill_rows(rows, lens)
        q, latent = b.queries(3)
        r2t = b.r2t.req_to_token
        live = torch.tensor(
            [rows, lens, [int(r2t[r, n - 1]) for r, n in zip(rows, lens)]], dtype=torch.int64, device=DEVICE
        )
        static[:, :3].copy_(live)
        rpi[3], seq[3], loc[3] = 0, 1, 0  # the padding row
        q_static[:3].copy_(q)
        lat_static[:3].copy_(latent)
        o_scratch.fill_(float("nan"))
        lse_scratch.fill_(float("nan"))
        be.init_forward_metadata_replay_cuda_graph(gbs, rpi[:gbs], seq[:gbs], 3 + sum(lens), ForwardMode.DECODE)
        assert be.forward_metadata is meta  # replay refreshes nothing host-side
        got = be.forward_decode(q_static, lat_static, None, b.layer, fb)[:3].cpu()
        parts = gbs * heads * meta.num_splits
        assert not torch.isnan(lse_scratch[:parts]).any() and not torch.isnan(o_scratch[: parts * R]).any()
        want = b.reference(rows, lens, q, latent)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        # the eager step of the same 3 requests: the graph's split count, the graph's numbers bit for bit
        eager_fb = b.batch(rows, lens, be)
        be.init_forward_metadata(eager_fb)
        assert be.forward_metadata.num_splits == meta.num_splits and be.forward_metadata.scratch is None
        eager = be.forward_decode(q, latent, None, b.layer, eager_fb).cpu()
        assert torch.equal(eager, got)
        be.forward_metadata = meta  # back to the "captured" metadata for the next replay


@needs_triton
def test_graph_hooks_refuse_what_a_graph_cannot_hold():
    from kvship.engine.attention.base import AttentionContext
    from kvship.engine.attention.mla_triton import MLATritonBackend
    from kvship.engine.forward_batch import ForwardMode
    from kvship.engine.mem.pools import ReqToTokenPool

    def backend(sizes):
        ctx = AttentionContext(
            device=torch.device("cpu"),
            dtype=torch.float32,
            kv_dtype=torch.float32,
            num_heads=4,
            num_kv_heads=1,
            head_dim=R + P,
            page_size=1,
            req_to_token_pool=ReqToTokenPool(4, 8, "cpu"),
            max_running_requests=8,
            cuda_graph_bs=sizes,
        )
        return MLATritonBackend(ctx)

    be = backend(GRAPH_BS)
    assert be.supports_cuda_graph
    idx, lens = torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        be.init_forward_metadata_capture_cuda_graph(2, 2, idx, lens, ForwardMode.DECODE)
    be.init_cuda_graph_state(4, 4)
    for mode in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY):
        with pytest.raises(ValueError, match=f"decode graphs only, not {mode.name}"):
            be.init_forward_metadata_capture_cuda_graph(2, 2, idx, lens, mode)
        with pytest.raises(ValueError, match=f"decode graphs only, not {mode.name}"):
            be.init_forward_metadata_replay_cuda_graph(2, idx, lens, 2, mode)
    with pytest.raises(ValueError, match="outside the captured sizes"):
        be.init_forward_metadata_capture_cuda_graph(8, 8, idx, lens, ForwardMode.DECODE)  # state for up to 4
    with pytest.raises(ValueError, match="no CUDA-graph batch size"):
        backend(()).init_cuda_graph_state(4, 4)


@needs_kernels
def test_mla_decode_scratch_must_hold_every_part():
    from kvship.engine.attention.mla_triton import mla_decode

    q = torch.zeros(2, 4, R + P, device=DEVICE)
    lat = torch.zeros(3, 1, R + P, device=DEVICE)
    r2t = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    rows, lens = torch.zeros(2, dtype=torch.int64, device=DEVICE), torch.ones(2, dtype=torch.int64, device=DEVICE)
    short = (torch.zeros(2 * 4 * 2 * R - 1, device=DEVICE), torch.zeros(2 * 4 * 2, device=DEVICE))
    with pytest.raises(ValueError, match="short of"):
        mla_decode(q, lat, r2t, rows, lens, R, 1.0, num_splits=2, scratch=short)
    fits = (torch.zeros(2 * 4 * 2 * R, device=DEVICE), torch.zeros(2 * 4 * 2, device=DEVICE))
    assert mla_decode(q, lat, r2t, rows, lens, R, 1.0, num_splits=2, scratch=fits).shape == (2, 4, R)


@needs_kernels
def test_verify_graph_metadata_runs_the_eager_tree_verify():
    """TARGET_VERIFY of two draft trees: the backend's own metadata and the ``TritonExtendMeta`` the verify graphs
    hand it (kvship.decode.spec.graphs) give the same attention."""
    from kvship.engine.attention.triton_backend import extend_meta
    from kvship.engine.forward_batch import ForwardMode, build_forward_batch

    b = Bench(4, seed=9)
    rows, pre, ext = [1, 5], [6, 30], [4, 3]
    lens = [p + e for p, e in zip(pre, ext)]
    b.fill_rows(rows, lens)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    chain = torch.ones(3, 3, dtype=torch.bool).tril()
    r2t = b.r2t.req_to_token
    locs = [int(r2t[r, p + i]) for r, p, e in zip(rows, pre, ext) for i in range(e)]
    fb = build_forward_batch(
        ForwardMode.TARGET_VERIFY,
        input_ids=[0] * sum(ext),
        positions=[p + i for p, e in zip(pre, ext) for i in range(e)],
        req_pool_indices=rows,
        seq_lens=lens,
        seq_lens_cpu=lens,
        out_cache_loc=locs,
        req_to_token_pool=b.r2t,
        kv_pool=b.pool,
        attn_backend=b.triton,
        device=DEVICE,
        extend_lens=ext,
        prefix_lens=pre,
        tree_masks=[tree, chain],
    )
    q = torch.randn((sum(ext), 4, R + P), generator=b.g).to(DEVICE)
    latent = torch.randn((sum(ext), R + P), generator=b.g).to(DEVICE)
    b.triton.init_forward_metadata(fb)
    eager = b.triton.forward_extend(q, latent, None, b.layer, fb).cpu()
    b.triton.forward_metadata = extend_meta(fb, DEVICE)
    graphs = b.triton.forward_extend(q, latent, None, b.layer, fb, save_kv_cache=False).cpu()
    assert torch.equal(eager, graphs)
    b.torch.init_forward_metadata(fb)
    want = b.torch.forward_extend(q, latent, None, b.layer, fb, save_kv_cache=False).cpu()
    assert torch.allclose(eager, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this file's kernel tests run natively")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this is the interpreter's run already")
def test_mla_graph_tests_pass_in_the_triton_interpreter(request):
    """This file's other tests in a child pytest with ``TRITON_INTERPRET=1`` (set before triton is imported; the
    session's one such child, tests/triton_interp.py)."""
    pytest.importorskip("triton")
    interpreter_outcomes(request, "tests/test_mla_graph.py").check(passed=11)
