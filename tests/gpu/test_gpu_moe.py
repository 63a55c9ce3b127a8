"""The ``triton`` fused-MoE runner against the ``torch`` runner, CUDA graphs over MoE decode.

GPU: bf16 inputs, relative Frobenius error ``|triton - ref| / |ref|`` <= 1e-2
where ``ref`` is the torch runner in float32 on the same (bf16-rounded)
weights.  CPU: ``TRITON_INTERPRET=1 pytest tests/gpu/test_gpu_moe.py`` runs
the tiny-shape tests in float32 (1e-4); the sweep and the graph tests need
CUDA.  Outputs are compared where some experts get no token and at ``M = 0``.
"""

from __future__ import annotations

import gc

import pytest
import torch
from gpu_common import cuda_or_interpreter, kernel_device, requires_cuda

from kvship.engine.layers.moe.runner import get_moe_runner
from kvship.engine.layers.moe.topk import select_experts

pytestmark = [pytest.mark.gpu]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _problem(m: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, dev: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, h, generator=g).to(dev, dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(dev, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(dev, dtype)
    logits = torch.randn(m, e, generator=g).to(dev)
    if e > k + 1:
        logits[:, e // 2] = -1e4  # one expert never gets a token
    weights, ids = select_experts(logits, k, renormalize=True)
    return x, w13, w2, weights, ids


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:
    return get_moe_runner("torch")(x.float(), w13.float(), w2.float(), weights, ids)


@cuda_or_interpreter
@pytest.mark.parametrize("m", [0, 1, 7, 33])
def test_triton_runner_matches_torch_runner_on_a_tiny_shape(m):
    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x, w13, w2, weights, ids = _problem(m, 8, 2, 64, 48, dtype, dev, seed=m)
    out = get_moe_runner("triton")(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == dtype
    if m:
        assert _rel(out, _reference(x, w13, w2, weights, ids)) < (1e-2 if dtype == torch.bfloat16 else 1e-4)


@cuda_or_interpreter
@pytest.mark.parametrize("h,i", [(64, 48), (64, 64), (96, 64)])
def test_aligned_kernels_with_and_without_whole_tiles(h, i):
    """The aligned GEMMs' unmasked K loop (H and I whole tiles) and the masked one give the reference result,
    and padding rows (each expert's run padded to BLOCK_SIZE_M) are never stored."""
    from kvship.engine.layers.moe.triton_moe import fused_experts

    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x, w13, w2, weights, ids = _problem(21, 8, 2, h, i, dtype, dev, seed=h + i)
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=2, num_warps=4, num_stages=2)
    out = fused_experts(x, w13, w2, weights, ids, config=cfg)
    assert _rel(out, _reference(x, w13, w2, weights, ids)) < (1e-2 if dtype == torch.bfloat16 else 1e-4)


@cuda_or_interpreter
@pytest.mark.parametrize("m,e,k,renormalize", [(1, 8, 2, True), (5, 128, 8, True), (3, 60, 4, False), (0, 8, 2, True)])
def test_fused_routing_kernel_equals_select_experts(m, e, k, renormalize):
    from kvship.engine.layers.moe.topk_triton import route

    logits = torch.randn(m, e, device=kernel_device())
    want_w, want_ids = select_experts(logits, k, renormalize)
    got_w, got_ids = route(logits, k, "softmax", renormalize)
    assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids) and torch.allclose(got_w, want_w, atol=1e-6)
    # the expert-load count in the same kernel: every pick, or only rows whose KV slot is not 0 (padding)
    from kvship.engine.layers.moe.topk import count_routed

    for slots in (None, torch.arange(m, device=logits.device) % 2):
        got_c, want_c = (torch.zeros(e, dtype=torch.int64, device=logits.device) for _ in range(2))
        route(logits, k, "softmax", renormalize, counts=got_c, rows_slots=slots)
        count_routed(want_c, want_ids, slots)
        assert torch.equal(got_c, want_c)


@cuda_or_interpreter
@pytest.mark.parametrize("unroll", [0, 1], ids=["down_padded", "down_unrolled"])
@pytest.mark.parametrize("m,e,k", [(1, 8, 2), (2, 16, 8), (3, 6, 4), (1, 128, 8), (2, 16, 6)])
def test_gemv_path_equals_the_aligned_path_with_absent_experts(m, e, k, unroll):
    """The alignment-free GEMV kernels (decode batches of a few pairs) give the aligned GEMMs' output, also
    with ids of -1 (experts on another rank under expert parallelism) that add nothing; both down kernels (the
    experts as a padded tile axis, or unrolled into one accumulator: ``DOWN_UNROLL``)."""
    from kvship.engine.layers.moe.kernel_config import GEMV_CONFIG, default_config
    from kvship.engine.layers.moe.triton_moe import fused_experts

    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x, w13, w2, weights, ids = _problem(m, e, k, 256 if dev.type == "cuda" else 64, 96, dtype, dev, seed=e + k)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    gemv = {"gemv": dict(GEMV_CONFIG, BLOCK_K=64, DOWN_BLOCK_K=64, DOWN_UNROLL=unroll)}
    for absent in (False, True):
        if absent:
            ids = torch.where(torch.arange(ids.numel(), device=dev).view(ids.shape) % 3 == 0, -1, ids)
        want = fused_experts(x, w13, w2, weights, ids, config=default_config(m, e, k), absent=absent)
        got = fused_experts(x, w13, w2, weights, ids, config=gemv, absent=absent)
        assert _rel(got, want) < tol and _rel(got, _reference(x, w13, w2, weights, ids)) < tol


@cuda_or_interpreter
@pytest.mark.parametrize(
    "m,k,e,block_m", [(1, 8, 128, 16), (3, 2, 8, 16), (16, 8, 128, 16), (5, 2, 6, 4), (32, 8, 128, 32)]
)
def test_one_program_align_equals_the_torch_align(m, k, e, block_m):
    from kvship.engine.layers.moe.align import moe_align_block_size
    from kvship.engine.layers.moe.triton_moe import align_block_size

    logits = torch.randn(m, e, device=kernel_device())
    logits[:, e // 2] = -1e9  # an expert with no pair
    ids = torch.topk(logits, k).indices.to(torch.int32)
    want, got = moe_align_block_size(ids, block_m, e), align_block_size(ids, block_m, e)
    blocks = want[2].item() // block_m
    assert torch.equal(want[0], got[0]) and torch.equal(want[2], got[2])
    assert torch.equal(want[1][:blocks], got[1][:blocks])


@requires_cuda
@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("e", [8, 64, 128])
@pytest.mark.parametrize("m", [1, 7, 64, 512, 4096])
def test_triton_runner_matches_torch_runner_bf16(m, e, k):
    # I = 352 is not a multiple of the N tiles: the column masks are exercised too
    x, w13, w2, weights, ids = _problem(m, e, k, 1024, 352, torch.bfloat16, torch.device("cuda"), seed=m + e + k)
    out = get_moe_runner("triton")(x, w13, w2, weights, ids)
    assert _rel(out, _reference(x, w13, w2, weights, ids)) < 1e-2


@requires_cuda
@pytest.mark.parametrize("m", [1, 8, 64])
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing(m):
    from kvship.engine.layers.moe.layer import FusedMoE

    dev = torch.device("cuda")
    layer = FusedMoE(64, 8, 1024, 352, renormalize=True, dtype=torch.bfloat16, runner="triton").to(dev)
    with torch.no_grad():
        layer.w13_weight.normal_(0, 0.03)
        layer.w2_weight.normal_(0, 0.05)
    x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(m, 64, device=dev)
    with torch.inference_mode():
        layer(x, logits)  # warm up (Triton compiles)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            out = layer(x, logits)
        torch.cuda.current_stream().wait_stream(stream)
        for seed in range(3):  # new tokens and new routing each replay
            g = torch.Generator(device=dev).manual_seed(seed)
            x.copy_(torch.randn(m, 1024, device=dev, generator=g))
            logits.copy_(torch.randn(m, 64, device=dev, generator=g))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, layer(x, logits)), f"replay {seed} differs from eager"


def _greedy_moe(d, bs: int) -> list[list[int]]:
    """24 greedy decode steps of ``bs`` seeded prompts (5, 8, 11, ... tokens) through the KV driver ``d``."""
    reqs = [d.new() for _ in range(bs)]
    gen = torch.Generator().manual_seed(bs)
    logits = d.extend(reqs, [torch.randint(3, 380, (5 + 3 * j,), generator=gen).tolist() for j in range(bs)])
    out: list[list[int]] = [[] for _ in range(bs)]
    for _ in range(24):
        toks = logits.argmax(-1).tolist()
        for o, t in zip(out, toks):
            o.append(t)
        logits = d.decode(reqs, toks)
    for q in reqs:
        d.free(q)
    return out


@requires_cuda
def test_moe_model_cuda_graph_decode_equals_eager_token_for_token(tmp_path, kv_driver, monkeypatch, request):
    """Graphs (prefill and decode) with programmatic dependent launch on (the default on Hopper) against eager
    steps with it off: the same tokens, and the same expert load.  (With PDL off a batch-1 step may take the
    norm-inside-the-GEMV kernel, which rounds the normalised row at another point; this model has no near-tie
    there.  Qwen2-MoE's tiny model has one at step 10: docs/benchmarks.md, session 37.)"""
    from moe_fixtures import build_tiny_moe

    from kvship.engine.config import ServerArgs
    from kvship.engine.layers import fused_dispatch
    from kvship.engine.layers.moe.layer import expert_load, reset_expert_load
    from kvship.engine.model_runner import ModelRunner

    path = build_tiny_moe(str(tmp_path / "qwen3_moe"), "qwen3_moe", seed=31)

    def runner(graphs: bool) -> ModelRunner:
        return ModelRunner(
            ServerArgs(
                model_path=path,
                device="cuda",
                dtype="bfloat16",
                attention_backend="triton",
                max_total_tokens=8192,
                max_running_requests=16,
                context_length=512,
                disable_cuda_graph=not graphs,
                cuda_graph_bs=[1, 2, 4, 8, 16],
                cuda_graph_max_bs=16,
            )
        )

    def pdl(flag: str) -> None:
        monkeypatch.setenv("KVSHIP_PDL", flag)
        fused_dispatch._PDL.clear()

    request.addfinalizer(fused_dispatch._PDL.clear)  # later tests read the default again, not this test's last flag

    def greedy(r: ModelRunner, bs: int) -> list[list[int]]:
        pdl("1" if r.cuda_graph_runner is not None else "0")
        return _greedy_moe(kv_driver(r), bs)

    pdl("1")  # captured with PDL
    graph_runner = runner(True)
    pdl("0")
    eager_runner = runner(False)
    assert graph_runner.cuda_graph_runner is not None
    for bs in (1, 3, 16):  # 3 replays in the graph of 4: its padding row stays out of the expert load
        for r in (graph_runner, eager_runner):
            reset_expert_load(r.model)
        before = graph_runner.cuda_graph_runner.replays
        assert greedy(graph_runner, bs) == greedy(eager_runner, bs), f"bs {bs}"
        assert graph_runner.cuda_graph_runner.replays > before
        tokens = sum(5 + 3 * j for j in range(bs)) + 24 * bs  # prompts, then 24 decode steps of bs rows
        for r in (graph_runner, eager_runner):
            load = expert_load(r.model)
            assert load and all(sum(c) == tokens * 2 for c in load.values()), (bs, {k: sum(c) for k, c in load.items()})
    del graph_runner, eager_runner
    gc.collect()
    torch.cuda.empty_cache()


@requires_cuda
def test_shared_expert_on_a_side_stream_gives_the_one_stream_tokens(tmp_path, kv_driver, monkeypatch):
    """Qwen2-MoE's gated shared expert beside the routed experts on a second stream (docs/deepseek.md, "Two
    streams"), captured in the decode and prefill graphs: the same kernels on the same inputs, so the same greedy
    tokens as graphs captured on one stream, at batches 1, 3 (padded to 4) and 16."""
    from moe_fixtures import build_tiny_moe

    from kvship.engine.config import ServerArgs
    from kvship.engine.model_runner import ModelRunner

    path = build_tiny_moe(str(tmp_path / "qwen2_moe"), "qwen2_moe", seed=31)

    def greedy(tokens: int) -> dict[int, list[list[int]]]:
        monkeypatch.setenv("KVSHIP_SIDE_STREAM_TOKENS", str(tokens))
        r = ModelRunner(
            ServerArgs(
                model_path=path, device="cuda", dtype="bfloat16", attention_backend="triton",
                max_total_tokens=8192, max_running_requests=16, context_length=512,
                cuda_graph_bs=[1, 2, 4, 8, 16], cuda_graph_max_bs=16,
            )
        )  # fmt: skip
        assert r.cuda_graph_runner is not None
        got = {}
        for bs in (1, 3, 16):
            got[bs] = _greedy_moe(kv_driver(r), bs)
        del r
        gc.collect()
        torch.cuda.empty_cache()
        return got

    assert greedy(16) == greedy(0)


@cuda_or_interpreter
@pytest.mark.parametrize("m,e,k,inter", [(5, 8, 2, 96), (33, 16, 4, 80), (64, 6, 3, 64)])
def test_one_dot_gate_up_equals_the_two_dot_kernel(m, e, k, inter):
    """``one_dot`` (gate and up rows interleaved in one weight tile, one MMA a step, split after) gives the
    two-accumulator kernel's output, also where ``inter`` is not a whole number of N tiles."""
    from kvship.engine.layers.moe.kernel_config import default_config
    from kvship.engine.layers.moe.triton_moe import fused_experts

    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x, w13, w2, weights, ids = _problem(m, e, k, 128, inter, dtype, dev, seed=m + e)
    cfg = dict(default_config(m, e, k), BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32)
    cfg.pop("gemv", None)
    want = fused_experts(x, w13, w2, weights, ids, config=cfg)
    got = fused_experts(x, w13, w2, weights, ids, config=dict(cfg, one_dot=True))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert _rel(got, want) < tol and _rel(got, _reference(x, w13, w2, weights, ids)) < tol


@cuda_or_interpreter
@pytest.mark.parametrize(
    "m,e,k,inter,absent", [(5, 8, 2, 96, False), (33, 16, 4, 80, True), (64, 6, 3, 64, False), (700, 128, 8, 768, True)]
)
def test_tma_weight_tiles_equal_the_pointer_kernels(m, e, k, inter, absent):
    """``"tma"`` (the weight tiles fetched by the tensor memory accelerator: gate/up one block of gate rows and
    one of up rows, down a ``[1, N, K]`` block of ``w2``) gives the pointer kernels' output, also where ``inter``
    is not a whole number of N tiles (TMA reads zeros past it) and with ids of -1 (expert parallelism).  On a
    Hopper GPU (and in the interpreter) the descriptors are really built, not the pointer fallback."""
    from kvship.engine.layers.moe import triton_moe
    from kvship.engine.layers.moe.triton_moe import fused_experts

    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if m > 64 and dev.type != "cuda":
        pytest.skip("the Qwen3-30B-A3B-sized case needs CUDA")
    h = 2048 if m > 64 else 128
    x, w13, w2, weights, ids = _problem(m, e, k, h, inter, dtype, dev, seed=m + e)
    if absent:
        ids = torch.where(torch.arange(ids.numel(), device=dev).view(ids.shape) % 5 == 0, -1, ids)
    big = m > 64 and dev.type == "cuda"
    cfg = dict(BLOCK_SIZE_M=64 if big else 16, BLOCK_SIZE_N=64 if big else 32, BLOCK_SIZE_K=64 if big else 32)
    cfg.update(GROUP_SIZE_M=8, num_warps=4, num_stages=3, one_dot=True)
    down = dict(BLOCK_SIZE_N=cfg["BLOCK_SIZE_N"], BLOCK_SIZE_K=cfg["BLOCK_SIZE_K"], num_warps=4, num_stages=3)
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] >= 9:
        assert triton_moe._weight_desc(w13, (e * 2, inter, h), (2, 32, 32)) is not None
        assert triton_moe._weight_desc(w2, (e, h, inter), (1, 32, 32)) is not None
    want = fused_experts(x, w13, w2, weights, ids, config=dict(cfg, down=down), absent=absent)
    got = fused_experts(x, w13, w2, weights, ids, config=dict(cfg, tma=True, down=dict(down, tma=True)), absent=absent)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert _rel(got, want) < tol
    if not absent:  # (the pointer kernels' absent experts are checked against the reference above)
        assert _rel(got, _reference(x, w13, w2, weights, ids)) < tol


@cuda_or_interpreter
@pytest.mark.parametrize("m,e,k,inter,absent,tma", [(5, 8, 2, 96, False, False), (33, 16, 4, 80, True, True),
                                                    (64, 6, 3, 64, False, True), (700, 128, 8, 768, True, True),
                                                    (4096, 128, 8, 768, False, True)])  # fmt: skip
def test_persistent_gemms_equal_one_program_per_tile(m, e, k, inter, absent, tma):
    """``"persistent"`` (about one program per multiprocessor, four in the interpreter, each looping over the
    tiles of the rows actually used) gives the one-program-per-tile kernels' output bit for bit: each tile is
    the same MMAs in the same order, only the program that runs it differs.  Tiny shapes walk several tiles
    per program; on CUDA the Qwen3-30B-A3B shape runs with the H100 table's tiles."""
    from kvship.engine.layers.moe.triton_moe import fused_experts

    dev = kernel_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if m > 64 and dev.type != "cuda":
        pytest.skip("the Qwen3-30B-A3B-sized cases need CUDA")
    h = 2048 if m > 64 else 128
    x, w13, w2, weights, ids = _problem(m, e, k, h, inter, dtype, dev, seed=m + e + 1)
    if absent:
        ids = torch.where(torch.arange(ids.numel(), device=dev).view(ids.shape) % 5 == 0, -1, ids)
    big = m > 64
    cfg = dict(BLOCK_SIZE_M=128 if big else 16, BLOCK_SIZE_N=128 if big else 32, BLOCK_SIZE_K=64 if big else 32)
    cfg.update(GROUP_SIZE_M=8, num_warps=8 if big else 4, num_stages=3, one_dot=True, tma=tma)
    down = dict(BLOCK_SIZE_N=256 if big else 32, BLOCK_SIZE_K=cfg["BLOCK_SIZE_K"], num_warps=cfg["num_warps"])
    down.update(num_stages=4 if big else 3, tma=tma)
    want = fused_experts(x, w13, w2, weights, ids, config=dict(cfg, down=down), absent=absent)
    for persistent in ({"persistent": True}, {"down": dict(down, persistent=True)}):
        got = fused_experts(x, w13, w2, weights, ids, config={**cfg, "down": down, **persistent}, absent=absent)
        assert torch.equal(got, want), persistent
    both = dict(cfg, persistent=True, down=dict(down, persistent=True))
    got = fused_experts(x, w13, w2, weights, ids, config=both, absent=absent)
    assert torch.equal(got, want)
    if not absent:
        assert _rel(got, _reference(x, w13, w2, weights, ids)) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
