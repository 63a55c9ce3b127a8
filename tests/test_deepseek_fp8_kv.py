"""The FP8 latent KV cache of DeepSeek (MLA) models (``--kv-cache-dtype fp8_e4m3``; docs/deepseek.md, "FP8 latent
cache"), on CPU, on a tiny random DeepSeek-V3 (tests/deepseek_fixtures.py) whose checkpoint carries a non-unit
``k_scale`` per layer:

* the pool: rows stored as ``quantize_kv(x, scale)`` and read as ``float(e4m3) * scale``; half the bytes of a
  16-bit pool per token, so a byte budget sizes twice the tokens; the checkpoint's per-layer K scale is the
  latent scale;
* the model over an FP8 pool equals a fake-quant reference: the same model with a float32 pool in which every
  latent row written is replaced by its FP8 round trip ``dequantize(quantize(x, s), s)`` -- logits of prefill,
  decode, an extend over a cached prefix (absorbed and decompressed, forced by ``KVSHIP_MLA_EXTEND``) and a tree
  verify, on ``torch_native`` and on ``triton`` (under ``TRITON_INTERPRET=1`` in a child pytest);
* greedy tokens through the scheduler (radix-cache hit) equal the reference's, MTP speculative decoding equals
  plain FP8 greedy, PD over tcp equals unified FP8, and a prefix loaded back from the host tier equals a cold FP8
  request.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from deepseek_fixtures import build_tiny_deepseek
from triton_interp import TEST_TIMEOUT_S, interpreter_outcomes

from kvship.engine.config import ServerArgs
from kvship.engine.mem.mla_pool import MLAKVPool
from kvship.engine.mem.pools import dequantize_kv, quantize_kv
from kvship.engine.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(300)

KEY = "v3_yarn_grouped"
# per-layer k_scale written into the checkpoint, exact in fp32 (the latent rows' magnitudes are ~1-3: the small
# scale spreads them over e4m3's range, the large one pushes small values into its subnormals); the MTP layer's own
SCALES = [0.0234375, 0.25, 1.5]
MTP_SCALE = 0.125
TRITON_HERE = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = [
    "torch_native",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(not TRITON_HERE, reason="Triton MLA kernels: CUDA, or TRITON_INTERPRET=1 on CPU"),
    ),
]
FP8 = dict(kv_cache_dtype="fp8_e4m3")


def add_kv_scales(model_dir: str, scales: dict[int, float]) -> str:
    """Write ``model.layers.<i>.self_attn.k_scale`` (one fp32 value) for each layer ``i`` of ``scales``."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    for i, s in scales.items():
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(s, dtype=torch.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory) -> str:
    path = build_tiny_deepseek(str(tmp_path_factory.mktemp("ds_fp8kv")), KEY, seed=30)
    return add_kv_scales(path, dict(enumerate(SCALES)))


def _fake_quant(runner: ModelRunner, scales, monkeypatch) -> ModelRunner:
    """``runner`` (a float32 latent pool) storing every latent row as its FP8 round trip with ``scales``."""
    pool = runner.kv_pool
    assert not pool.is_fp8
    store = pool.set_latent

    def set_latent(layer_id, loc, latent):
        s = scales[layer_id]
        store(layer_id, loc, dequantize_kv(quantize_kv(latent, s), s, latent.dtype))

    monkeypatch.setattr(pool, "set_latent", set_latent)
    # decode steps store through set_latent too (not mla_decode_prep's kernel store, which this hook cannot see):
    # the reference runs the layer's unfused decode, the FP8 runner under test the fused one
    if getattr(runner.attn_backend, "fused_decode_prep", False):
        monkeypatch.setattr(runner.attn_backend, "fused_decode_prep", False)
    return runner


# --- the pool ---------------------------------------------------------------------------------------------------
def test_fp8_latent_pool_stores_quantize_kv_and_reads_it_times_the_layer_scale():
    g = torch.Generator().manual_seed(0)
    scales = [0.5, 3.0]
    pool = MLAKVPool(16, 4, torch.float8_e4m3fn, 6, 2, 2, "cpu", scales)
    assert pool.is_fp8 and pool.scales(1) == (3.0, 3.0) and pool.k_scales == pool.v_scales == scales
    slots = torch.tensor([5, 9, 4, 17])
    for layer, s in enumerate(scales):
        x = torch.randn(4, 8, generator=g) * 40  # some values past 448 * 0.5: clamped on the store
        pool.set_latent(layer, slots, x)
        want = quantize_kv(x, s)
        buf = pool.get_latent_buffer(layer)
        assert buf.dtype == torch.float8_e4m3fn
        assert torch.equal(buf[slots, 0].view(torch.uint8), want.view(torch.uint8))  # the stored bytes
        got = pool.read_latent(layer, slots, torch.float32)
        assert got.shape == (4, 1, 8)
        assert torch.equal(got[:, 0], want.float() * s)  # the read: float(e4m3) * scale
        assert (got[:, 0] - x).abs().max() > 0  # FP8 rounded it
    # rows stored already as e4m3 (the host tier, PD) are copied as they are
    pool.set_latent(0, torch.tensor([1]), quantize_kv(torch.ones(1, 8), 1.0))
    assert torch.equal(pool.read_latent(0, torch.tensor([1]), torch.float32)[0, 0], torch.full((8,), 0.5))
    with pytest.raises(ValueError, match="layer 1: the latent KV scale must be a positive finite number"):
        MLAKVPool(16, 4, torch.float8_e4m3fn, 6, 2, 2, "cpu", [1.0, 0.0])
    with pytest.raises(ValueError, match="1 latent KV scales for 2 layers"):
        MLAKVPool(16, 4, torch.float8_e4m3fn, 6, 2, 2, "cpu", [1.0])
    # a pool that is not FP8 ignores scales and reads what it stores
    plain = MLAKVPool(16, 4, torch.float32, 6, 2, 2, "cpu", scales)
    assert not plain.is_fp8 and plain.scales(1) == (1.0, 1.0)


def test_fp8_latent_pool_takes_half_the_bytes_and_sizes_twice_the_tokens(ds_path, monkeypatch):
    import kvship.engine.model_runner as model_runner

    assert MLAKVPool.bytes_per_token(61, 576, torch.float8_e4m3fn) == 35_136  # DeepSeek-V3
    assert MLAKVPool.bytes_per_token(61, 576, torch.bfloat16) == 70_272
    # the CPU budget of the runner (what --mem-fraction-static's free memory is on CUDA) in bytes: 4000 tokens of
    # a bf16 latent pool (3 layers x 40 values x 2 bytes)
    from kvship.engine.mem.hicache import bytes_per_token

    monkeypatch.setattr(model_runner, "CPU_KV_BUDGET_BYTES", 4000 * 3 * 40 * 2)
    tokens = {}
    for kv in ("bfloat16", "fp8_e4m3"):
        runner = ModelRunner(ServerArgs(model_path=ds_path, device="cpu", dtype="bfloat16", kv_cache_dtype=kv))
        tokens[kv] = runner.max_total_tokens
        assert bytes_per_token(runner.kv_pool) == 3 * 40 * (1 if kv == "fp8_e4m3" else 2)
    assert tokens == {"bfloat16": 4000, "fp8_e4m3": 8000}


def test_checkpoint_k_scales_are_the_latent_scales_and_the_flag_is_accepted(ds_path):
    from kvship.engine.models.deepseek import check_mla_serving

    sa = ServerArgs(model_path=ds_path, device="cpu", max_total_tokens=64, **FP8)
    check_mla_serving(sa)  # no refusal
    pool = ModelRunner(sa).kv_pool
    assert pool.is_fp8 and pool.dtype == torch.float8_e4m3fn and pool.latent_scales == SCALES
    # --load-format dummy: no checkpoint scales, 1.0
    dummy = ModelRunner(ServerArgs(model_path=ds_path, device="cpu", max_total_tokens=64, load_format="dummy", **FP8))
    assert dummy.kv_pool.latent_scales == [1.0] * 3


# --- the model against its fake-quant reference -------------------------------------------------------------------
def _steps(runner: ModelRunner, kv_driver) -> list[torch.Tensor]:
    """Logits of: a prefill of two requests (17 and 5 tokens), two decode steps, an extend of both over their
    cached tokens (3 and 20 new), and a TARGET_VERIFY of a 4-node tree and a 3-token chain after them."""
    from test_mla_triton import _verify_step

    drv = kv_driver(runner)
    reqs = [drv.new(), drv.new()]
    out = [drv.extend(reqs, [list(range(5, 22)), list(range(40, 45))], all_logits=True)]
    out += [drv.decode(reqs, [7 + i, 9 + i]) for i in range(2)]
    out.append(drv.extend(reqs, [[3, 4, 5], list(range(50, 70))], all_logits=True))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    chain = torch.ones(3, 3, dtype=torch.bool).tril()
    out.append(_verify_step(runner, drv, reqs, [[11, 12, 13, 14], [21, 22, 23]], [tree, chain]))
    return out


@pytest.mark.parametrize("path", ["absorbed", "decompressed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_latent_cache_equals_the_fake_quant_reference(backend, path, ds_path, kv_driver, monkeypatch):
    """Every extend forced ``absorbed`` or ``decompressed`` (prefills and the extend over the cached prefix)."""
    monkeypatch.setenv("KVSHIP_MLA_EXTEND", path)  # read when the layers are built
    base = dict(model_path=ds_path, device=DEVICE, dtype="float32", max_total_tokens=256, attention_backend=backend)
    fp8 = ModelRunner(ServerArgs(**base, **FP8))
    assert fp8.kv_pool.is_fp8 and fp8.kv_pool.latent_scales == SCALES
    got = _steps(fp8, kv_driver)
    ref = _steps(_fake_quant(ModelRunner(ServerArgs(**base)), SCALES, monkeypatch), kv_driver)
    plain = _steps(ModelRunner(ServerArgs(**base)), kv_driver)
    moved = 0.0
    for a, b, c in zip(got, ref, plain):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < 1e-5
        assert torch.equal(a.argmax(-1), b.argmax(-1))  # the greedy tokens
        moved = max(moved, (a - c).abs().max().item())
    assert moved > 1e-3  # FP8 moved the logits: the reference is not the plain float32 model


# --- through the scheduler --------------------------------------------------------------------------------------
def _greedy(runner: ModelRunner, batches) -> tuple[list[list[int]], int, dict]:
    """Greedy tokens of ``batches`` (each list of prompts run to idle before the next: later ones hit the radix
    cache) through the unified scheduler (speculative where the runner's flags ask), the most cached tokens of a
    request of the second batch, and the scheduler's stats (every slot back in the pool or the radix cache)."""
    from pd_fixtures import Collector, run_until_idle

    from kvship.app.roles import scheduler_for_mode
    from kvship.engine.io_struct import GenerateRequest, SamplingParams

    out = Collector()
    sched = scheduler_for_mode("unified")(runner.server_args, runner, None, out)
    rids = []
    for n, prompts in enumerate(batches):
        for i, p in enumerate(prompts):
            rids.append(f"b{n}r{i}")
            sched.submit(GenerateRequest(rids[-1], list(p), SamplingParams(max_new_tokens=6, temperature=0.0)))
        run_until_idle(sched)
    st = sched.get_stats()
    assert st["running"] == 0 and st["waiting"] == 0
    cached = max(c.cached_tokens for c in out.chunks if c.rid.startswith("b1"))
    return [out.tokens(r) for r in rids], cached, st


SHARED = list(range(10, 27))
BATCHES = [[SHARED + [40, 41], list(range(60, 66))], [SHARED + [50, 51, 52, 53], SHARED + [70]]]


def test_fp8_greedy_with_a_radix_cache_hit_equals_the_fake_quant_reference(ds_path, monkeypatch):
    base = dict(model_path=ds_path, device="cpu", dtype="float32", max_total_tokens=512, page_size=4)
    tokens, cached, _ = _greedy(ModelRunner(ServerArgs(**base, **FP8)), BATCHES)
    ref, ref_cached, _ = _greedy(_fake_quant(ModelRunner(ServerArgs(**base)), SCALES, monkeypatch), BATCHES)
    assert cached >= 16 and ref_cached >= 16  # the shared whole pages came from the radix cache
    assert tokens == ref and all(len(t) == 6 for t in tokens)


def test_mtp_speculative_decoding_over_fp8_latent_pools_equals_plain_fp8_greedy(tmp_path):
    """The MTP layer carries its own k_scale: the draft pool is FP8 with it; the checkpoint loads with it."""
    from test_deepseek_mtp import add_mtp_layer

    from kvship.decode.spec.eagle_head import build_head
    from kvship.engine.mem.pools import ReqToTokenPool

    path = add_mtp_layer(build_tiny_deepseek(str(tmp_path), KEY, seed=61), seed=62)
    add_kv_scales(path, {**dict(enumerate(SCALES)), len(SCALES): MTP_SCALE})
    base = dict(model_path=path, device="cpu", dtype="float32", max_total_tokens=512, page_size=1, **FP8)
    runner = ModelRunner(ServerArgs(**base))
    assert runner.kv_pool.latent_scales == SCALES  # the model's layers only
    head = build_head(path, "eagle", runner.model, runner.model_config, runner.device)
    pool, _ = head.draft_attention(32, runner, ReqToTokenPool(2, 32, "cpu", host_mirror=False), 2, ())
    assert pool.is_fp8 and pool.latent_scales == [MTP_SCALE]
    spec = dict(
        speculative_algorithm="eagle",
        speculative_draft_model_path=path,
        speculative_num_steps=2,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=4,
    )
    want, _, _ = _greedy(runner, BATCHES)
    got, cached, st = _greedy(ModelRunner(ServerArgs(**base, **spec)), BATCHES)
    assert got == want and cached >= 16
    assert st["spec_rounds"] > 0 and st["spec_draft_tokens"] > st["spec_rounds"]  # drafted and verified


# --- PD and the host tier ---------------------------------------------------------------------------------------
def test_fp8_latent_pd_over_tcp_equals_unified_fp8(ds_path):
    from pd_fixtures import InProcessPD, make_prompts, unified_greedy

    from kvship.engine.disagg.wire import KVLayout

    kw = dict(page_size=4, chunked_prefill_size=16, max_total_tokens=1024, disable_radix_cache=True, **FP8)
    prompts = make_prompts(3, seed=17, lo=1, hi=40)
    expected = unified_greedy(ds_path, prompts, 6, **kw)
    with InProcessPD(ds_path, backend="tcp", prefill_kv=dict(transfer_threads=4), **kw) as pd:
        rids = pd.run_registered_first(prompts, 6)
        assert [pd.tokens(r) for r in rids] == expected
        assert pd.prefill.get_stats()["kv_transfers_ok"] == len(prompts)
        lay = pd.decode.kv_manager.layout
        # the pages move as bytes: one per latent value; both sides' dtype and scales are in the handshake
        assert (lay.kv_dtype, lay.page_bytes, lay.kv_scales) == ("float8_e4m3fn", 4 * 40, tuple(SCALES * 2))
        pd.wait_idle()
    # a float32 latent cache on the other side, or other scales, is refused before any byte moves
    plain = KVLayout(**{**lay.__dict__, "kv_dtype": "float32", "kv_scales": ()})
    assert "kv_dtype float8_e4m3fn != float32" in lay.mismatch(plain)
    rescaled = KVLayout(**{**lay.__dict__, "kv_scales": tuple([1.0] * 6)})
    assert "FP8 KV scales" in lay.mismatch(rescaled)


def test_fp8_prefix_loaded_back_from_the_host_tier_equals_a_cold_fp8_request(ds_path):
    from test_deepseek_hicache import _drain, _gen, _make, _turns

    _, _, turn2 = _turns(ds_path, disable_radix_cache=True, **FP8)
    cold, _, cold_out = _make(ds_path, disable_radix_cache=True, **FP8)
    cold.submit(_gen("t2", turn2, 8))
    _drain(cold)
    sched, out, prompt = _turns(ds_path, hicache_ratio=3.0, **FP8)
    assert prompt == turn2 and sched.cache.host.pool.dtype == torch.float8_e4m3fn
    assert sched.cache.match_prefix(turn2[:-1]).host_len >= 56, "turn 1's pages should be on the host tier"
    sched.submit(_gen("t2", turn2, 8))
    _drain(sched)
    st = sched.get_stats()
    assert out.finished("t2")[0].cached_tokens >= 56 and st["host_hit_tokens"] >= 56
    assert out.tokens("t2") == cold_out.tokens("t2") and len(out.tokens("t2")) == 8


# --- the Triton kernels -------------------------------------------------------------------------------------------
@pytest.mark.skipif(not TRITON_HERE, reason="Triton MLA kernels: CUDA, or TRITON_INTERPRET=1 on CPU")
def test_triton_kernels_read_an_fp8_latent_buffer_as_its_dequantized_rows():
    """Decode, absorbed extend (tree mask) and decompressed extend over an e4m3 buffer with ``kv_scale`` give what
    they give over the float32 buffer of its dequantized rows."""
    from test_mla_triton import _packed_batch

    from kvship.engine.attention.mla_triton import mla_decode
    from kvship.engine.attention.mla_triton_extend import mla_extend_absorbed, mla_extend_decompressed

    g = torch.Generator().manual_seed(5)
    r, p, h, s = 32, 8, 3, 0.05
    pres, exts = [5, 0, 33], [4, 19, 1]
    buf, r2t, rows, pre_t, ext_t, q_starts = _packed_batch(g, pres, exts, r + p)
    q8 = quantize_kv(buf, s)
    deq = q8.float() * s
    seqs = torch.tensor([a + b for a, b in zip(pres, exts)])
    dev = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    q = torch.randn((3, h, r + p), generator=g)
    one = [mla_decode(*dev(q, b, r2t, rows, seqs), r, 0.3, num_splits=2, kv_scale=k) for b, k in ((q8, s), (deq, 1))]
    assert torch.allclose(one[0].cpu(), one[1].cpu(), atol=1e-6)
    qe = torch.randn((sum(exts), h, r + p), generator=g)
    masks = [(torch.rand(e, e, generator=g) < 0.5).tril() | torch.eye(e, dtype=torch.bool) for e in exts]
    kw = dict(
        tree_mask=torch.cat([m.reshape(-1).to(torch.uint8) for m in masks]).to(DEVICE),
        mask_starts=torch.tensor([sum(e * e for e in exts[:i]) for i in range(3)]).to(DEVICE),
    )
    two = [
        mla_extend_absorbed(*dev(qe, b, r2t, rows, pre_t, ext_t, q_starts), max(exts), r, 0.3, kv_scale=k, **kw)
        for b, k in ((q8, s), (deq, 1))
    ]
    assert torch.allclose(two[0].cpu(), two[1].cpu(), atol=1e-6)
    dn, dv = 8, 12
    kv_starts = torch.tensor([0, int(seqs[0]), int(seqs[:2].sum())], dtype=torch.int32)
    k_nope = torch.randn((int(seqs.sum()), h, dn), generator=g)
    v = torch.randn((int(seqs.sum()), h, dv), generator=g)
    qd = torch.randn((sum(exts), h, dn + p), generator=g)
    three = [
        mla_extend_decompressed(
            *dev(qd, k_nope, v, b, r2t, rows, pre_t, ext_t, q_starts, kv_starts), max(exts), r, 0.3, kv_scale=k
        )
        for b, k in ((q8, s), (deq, 1))
    ]
    assert torch.allclose(three[0].cpu(), three[1].cpu(), atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, the triton cases above run natively")
def test_fp8_triton_cases_pass_in_the_triton_interpreter(request):
    """This file's ``triton`` cases in a child pytest with ``TRITON_INTERPRET=1`` (set before triton is imported; the
    session's one such child, tests/triton_interp.py)."""
    pytest.importorskip("triton")
    interpreter_outcomes(request, "tests/test_deepseek_fp8_kv.py").check(passed=3)
