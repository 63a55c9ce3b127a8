"""Two GPUs: tensor and expert parallelism through real ``kvship serve`` workers (issue 15).

Skipped unless CUDA sees at least two GPUs (``requires_two_gpus``).  First,
in this process: dummy weights (``--load-format dummy``) drawn by CUDA
generators are the same model at every TP / EP size (rank 1 on GPU 1 against
the whole model drawn on GPU 0), and the Llama-3.1-8B shape loads in seconds.
Then one module fixture starts every worker at once (tiny models, so they
share the GPUs: a worker's rank 0 on GPU 0, rank 1 on GPU 1); each answers one
``/generate`` call of ``len(PROMPT_LENS)`` prompts (one batch of 4, a captured
graph size; ``NEW_TOKENS`` greedy tokens each, with the top-2 logprobs):

=====================  ==========================================================
tiny random Llama      ``--tp-size 1`` vs ``--tp-size 2``, float32 and bfloat16
(transformers)         (the ranks' NCCL all-reduces and logits all-gather)
same, float32          ``--tp-size 2`` with CUDA graphs vs ``--disable-cuda-graph``
                       (NCCL all-reduce captured in the graphs replays as eager)
tiny random Qwen3-MoE  ``--tp-size 1`` vs ``--tp-size 2 --ep-size 2`` (float32),
                       and ``/metrics``' expert load: a one-token prompt leaves 6
                       of the 8 experts of every sparse layer without a token
                       (under EP a rank may hold none of the 2 picked), and both
                       workers route it alike
=====================  ==========================================================

"Same greedy ids" (``assert_same_greedy``): until the ids part, the top
logprobs agree within ``tie_tol``; where they part, the reference was at a
near-tie (the other worker took the reference's other top-2 token, within
``tie_tol`` of its first choice): a split reduction rounds otherwise than a
whole one.  float32: 1e-3 (Triton's float32 dots set to full precision);
bfloat16: 0.1, where tiny random models often tie exactly.  MoE runs in
float32: in bfloat16 a router near-tie flips an expert, which moves the
logits far more than rounding (seen on CPU).  All workers use the ``triton``
attention backend and no prefix cache.

Run on the device: ``pytest -q tests/gpu/test_gpu_two_gpus.py`` (about a minute).
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
from conftest import build_tiny_model
from gpu_common import requires_cuda
from moe_fixtures import build_tiny_moe
from server_fixtures import ROOT, enter_together, start_server

requires_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: runs on the 2-GPU device machine (issue 15)"
)
pytestmark = [pytest.mark.gpu, requires_cuda, requires_two_gpus]

NEW_TOKENS = 40
PROMPT_LENS = (5, 17, 29, 40)
TIE_TOL = {"float32": 1e-3, "bfloat16": 0.1}
FP32_ENV = {"TRITON_F32_DEFAULT": "ieee"}  # float32 Triton dots in full precision, not TF32
# no prefix cache: every call computes its prompts whole; graphs: decode 1, 2, 4, 8, prefill up to 128 tokens
COMMON = [
    "--device", "cuda", "--attention-backend", "triton", "--context-length", "512", "--disable-radix-cache",
    "--max-total-tokens", "4096", "--max-running-requests", "8", "--cuda-graph-max-bs", "8",
    "--prefill-graph-max-tokens", "128",
]  # fmt: skip
# worker name -> (model, dtype, extra flags)
WORKERS = {
    "llama_fp32_tp1": ("llama", "float32", []),
    "llama_fp32_tp2": ("llama", "float32", ["--tp-size", "2"]),
    "llama_fp32_tp2_eager": ("llama", "float32", ["--tp-size", "2", "--disable-cuda-graph"]),
    "llama_bf16_tp1": ("llama", "bfloat16", []),
    "llama_bf16_tp2": ("llama", "bfloat16", ["--tp-size", "2"]),
    "moe_tp1": ("qwen3_moe", "float32", []),
    "moe_tp2_ep2": ("qwen3_moe", "float32", ["--tp-size", "2", "--ep-size", "2"]),
    # the static dispatch, its exchange over peer memory (KVSHIP_EP_EXCHANGE=p2p: ``PEER_EXCHANGE``), in decode and
    # prefill graphs
    "moe_tp2_ep2_static": ("qwen3_moe", "float32", ["--tp-size", "2", "--ep-size", "2", "--ep-dispatch", "static"]),
}

PEER_EXCHANGE = {"moe_tp2_ep2_static": {"KVSHIP_EP_EXCHANGE": "p2p"}}  # worker name -> more environment


# --- dummy weights on the GPUs (in this process, before any worker starts) ----------------------------
def test_dummy_rank_on_gpu1_is_its_block_of_the_dummy_model_drawn_on_gpu0(tmp_path, monkeypatch):
    """CUDA generators: rank 1 of ``--tp-size 2 --ep-size 2`` drawn on GPU 1 holds exactly its block of the
    dummy Qwen3-MoE drawn whole on GPU 0 (blocks of 1000 elements, so shard bounds cut through them)."""
    from test_dummy_loader_tp import _dummy_as_safetensors

    from kvship.engine.distributed.communicator import NcclCommunicator
    from kvship.engine.loaders import dummy
    from kvship.engine.loaders.base import load_model
    from kvship.engine.model_config import ModelConfig

    monkeypatch.setattr(dummy, "BLOCK_ELEMENTS", 1000)
    path = build_tiny_moe(str(tmp_path / "moe"), "qwen3_moe", seed=17)
    whole = ModelConfig.from_pretrained(_dummy_as_safetensors(path, str(tmp_path / "whole"), device="cuda:0"))
    mc = ModelConfig.from_pretrained(path, dtype=torch.float32)
    rank1 = NcclCommunicator(rank=1, size=2)
    mine = dict(load_model(mc, "dummy", "cuda:1", tp=rank1, ep=(2, "all_reduce")).named_parameters())
    want = dict(load_model(whole, "safetensors", "cpu", tp=rank1, ep=(2, "all_reduce")).named_parameters())
    assert mine.keys() == want.keys()
    assert all(p.device == torch.device("cuda", 1) for p in mine.values())
    differ = [k for k in mine if not torch.equal(mine[k].cpu(), want[k])]
    assert not differ, differ[:5]


def test_dummy_llama3_8b_loads_in_seconds_on_one_gpu(tmp_path):
    """The Llama-3.1-8B shape (16 GB of bf16) drawn on GPU 0 at --tp-size 1, norms 1, the rest N(0, 0.02)."""
    import time

    from kvship.engine.loaders.base import load_model
    from kvship.engine.model_config import ModelConfig

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from decode_latency import write_model_dir

    mc = ModelConfig.from_pretrained(write_model_dir("llama3-8b", str(tmp_path)), dtype="bfloat16")
    torch.cuda.synchronize(0)
    t0 = time.perf_counter()
    model = load_model(mc, "dummy", "cuda:0")
    torch.cuda.synchronize(0)
    seconds = time.perf_counter() - t0
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) > 8e9
    assert bool((params["model.norm.weight"] == 1).all())
    std = params["model.layers.31.mlp.down_proj.weight"].float().std().item()
    assert 0.019 < std < 0.021, std
    assert seconds < 60, f"dummy Llama-3.1-8B took {seconds:.1f} s"
    del model, params
    torch.cuda.empty_cache()


# --- workers ---------------------------------------------------------------------------------------
def _p2p_rank(rank: int, init_method: str, out, sentinel: bool = False) -> None:
    """One rank of ``test_p2p_all_reduce_...``: the group's one-shot all-reduce against NCCL's, eager and in a
    CUDA graph; with ``sentinel`` the small tensors take the sentinel exchange, and one row's all-reduce with the
    next RMSNorm inside replays from a graph as the all-reduce then the norm kernel; rank 0 reports."""
    import torch.distributed as dist

    from kvship.engine.distributed.groups import init_distributed
    from kvship.engine.distributed.topology import Topology
    from kvship.engine.layers.fused_ops_cuda import rmsnorm

    os.environ["KVSHIP_TP_ALLREDUCE"] = "p2p"  # the default, said here so a caller's environment cannot turn it off
    os.environ["KVSHIP_TP_ALLREDUCE_SENTINEL"] = "1" if sentinel else "0"
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    tp = init_distributed(Topology(tp_size=2, rank=rank), init_method, dev, timeout_s=120).tp
    report = {"p2p": tp.p2p is not None, "sentinel": bool(tp.p2p and tp.p2p.sentinel_max), "eager": [], "graph": None}
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    # 256 x 4096 bf16 (2 MiB) is past one-shot's range: two-shot
    for rows, dtype in (
        (1, torch.bfloat16),
        (7, torch.bfloat16),
        (64, torch.bfloat16),
        (256, torch.bfloat16),
        (3, torch.float32),
    ):
        x = torch.randn(rows, 4096, device=dev, dtype=dtype, generator=g)
        ref = x.clone()
        dist.all_reduce(ref, group=tp.device_group)  # NCCL
        report["eager"].append((rows, str(dtype), torch.equal(tp.all_reduce(x.clone()), ref)))
    static = torch.randn(8, 4096, device=dev, dtype=torch.bfloat16, generator=g)
    tp.all_reduce(static.clone())  # warm-up outside the capture
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    work = static.clone()
    with torch.cuda.graph(graph):
        tp.all_reduce(work)
    same = []
    for _ in range(3):
        fresh = torch.randn(8, 4096, device=dev, dtype=torch.bfloat16, generator=g)
        work.copy_(fresh)
        graph.replay()
        ref = fresh.clone()
        dist.all_reduce(ref, group=tp.device_group)
        same.append(torch.equal(work, ref))
    report["graph"] = same
    # one row (8 KiB: the push kernel, or the sentinel exchange) and its norm, twelve replays (both parities)
    row, res = (
        torch.zeros(1, 4096, device=dev, dtype=torch.bfloat16),
        torch.zeros(1, 4096, device=dev, dtype=torch.bfloat16),
    )
    w = (torch.rand(4096, device=dev, generator=g) + 0.5).to(torch.bfloat16)
    tp.all_reduce(row.clone())
    torch.cuda.synchronize(dev)
    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        summed = tp.all_reduce(row.clone())
        fused = tp.all_reduce_rmsnorm(row, res, w, 1e-6)
    small = []
    for _ in range(12):
        fresh = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16, generator=g)
        row.copy_(fresh)
        res.copy_(torch.randn(1, 4096, device=dev, dtype=torch.bfloat16, generator=g))
        g1.replay()
        ref = fresh.clone()
        dist.all_reduce(ref, group=tp.device_group)
        ok = torch.equal(summed, ref)
        if fused is not None:
            want_y, want_res = rmsnorm(ref, w, 1e-6, res)
            ok = ok and torch.equal(fused[0], want_y) and torch.equal(fused[1], want_res)
        small.append(ok)
    report["small_graph"] = small
    report["fused_norm"] = fused is not None
    dist.destroy_process_group()
    if rank == 0:
        out.put(report)


def _exchange_rank(rank: int, init_method: str, out) -> None:
    """One rank of ``test_peer_exchange_...``: the group's all-to-all and all-gather over peer memory against
    NCCL's, eager and in a CUDA graph, and the static dispatch of a MoE layer through it; rank 0 reports."""
    import torch.distributed as dist

    from kvship.engine.distributed.groups import init_distributed
    from kvship.engine.distributed.topology import Topology
    from kvship.engine.layers.moe.layer import FusedMoE
    from kvship.engine.parallel.ep import ParallelFusedMoE

    os.environ["KVSHIP_EP_EXCHANGE"] = "p2p"
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    tp = init_distributed(Topology(tp_size=2, rank=rank), init_method, dev, timeout_s=120).tp
    report = {"exchange": tp.enable_peer_exchange(dev), "eager": [], "graph": None, "layer": None}
    g = torch.Generator(device=dev).manual_seed(200 + rank)
    for rows, dtype in ((2, torch.bfloat16), (64, torch.float32), (4096, torch.bfloat16)):
        x = torch.randn(rows, 2048, device=dev, dtype=dtype, generator=g)
        ref, got = torch.empty_like(x), torch.empty_like(x)
        dist.all_to_all_single(ref, x, group=tp.device_group)
        tp.all_to_all(got, x)
        gref = torch.empty((2 * rows, 2048), device=dev, dtype=dtype)
        ggot = torch.empty_like(gref)
        dist.all_gather_into_tensor(gref, x, group=tp.device_group)
        tp.all_gather_into(ggot, x)
        report["eager"].append((rows, str(dtype), torch.equal(got, ref), torch.equal(ggot, gref)))
    src = torch.zeros(128, 2048, device=dev, dtype=torch.bfloat16)
    dst, gathered = torch.empty_like(src), torch.empty((256, 2048), device=dev, dtype=torch.bfloat16)
    tp.all_to_all(dst, src)  # warm-up outside the capture
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with tp.graph_capture(), torch.cuda.graph(graph):
        tp.all_to_all(dst, src)
        tp.all_gather_into(gathered, src)
    same = []
    for _ in range(3):
        src.copy_(torch.randn(128, 2048, device=dev, dtype=torch.bfloat16, generator=g))
        graph.replay()
        ref, gref = torch.empty_like(src), torch.empty_like(gathered)
        dist.all_to_all_single(ref, src, group=tp.device_group)
        dist.all_gather_into_tensor(gref, src, group=tp.device_group)
        same.append(torch.equal(dst, ref) and torch.equal(gathered, gref))
    report["graph"] = same
    # a MoE layer (8 experts, top-2): static over peer memory equals the all-reduce dispatch, eager and in a graph
    with dev:
        layer = ParallelFusedMoE(FusedMoE(8, 2, 256, 128, renormalize=True, dtype=torch.float32), tp, 2, "static")
    torch.manual_seed(7)  # the same weights and tokens on both ranks
    with torch.no_grad():
        layer.w13_weight.normal_(0, 0.1)
        layer.w2_weight.normal_(0, 0.1)
    x = torch.randn(37, 256, device=dev)
    logits = torch.randn(37, 8, device=dev)
    with torch.inference_mode():
        static = layer(x, logits)
        layer.dispatch = "all_reduce"
        plain = layer(x, logits)
        layer.dispatch = "static"
        static_out = layer(x, logits)
        torch.cuda.synchronize(dev)
        lg = torch.cuda.CUDAGraph()
        with tp.graph_capture(), torch.cuda.graph(lg):
            static_out = layer(x, logits)
        lg.replay()
    report["layer"] = (float((static - plain).abs().max()), float((static_out - plain).abs().max()))
    dist.destroy_process_group()
    if rank == 0:
        out.put(report)


def test_peer_exchange_equals_nccl_eager_and_in_cuda_graphs():
    """``KVSHIP_EP_EXCHANGE=p2p`` (``engine/parallel/p2p_exchange.py``): the group's equal-split all-to-all and
    all-gather pulled over peer memory move NCCL's bytes exactly, eager and replayed from a CUDA graph, and a MoE
    layer's ``static`` dispatch through them equals the all-reduce dispatch (float32: bit-equal at two ranks)."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_exchange_rank, args=(r, init_method, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        report = q.get(timeout=180)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert report["exchange"], "the two GPUs' group fell back to NCCL for the exchange (see the rank logs)"
    assert all(a and b for _, _, a, b in report["eager"]), report
    assert report["graph"] == [True, True, True], report
    assert report["layer"] == (0.0, 0.0), report


@pytest.mark.parametrize("sentinel", [False, True])
def test_p2p_all_reduce_equals_nccl_eager_and_in_cuda_graphs(sentinel):
    """With ``KVSHIP_TP_ALLREDUCE=p2p`` the TP group's small all-reduces go over peer memory
    (``engine/parallel/p2p_all_reduce.py``): at two ranks the push, one-shot and two-shot sums are NCCL's bit for
    bit (one rounding of a + b), eager and replayed from a CUDA graph; with ``KVSHIP_TP_ALLREDUCE_SENTINEL=1`` the
    tensors up to 16 KiB take the sentinel exchange (its self-check passed) with the same bits, and a row's
    all-reduce with the norm inside replays twelve times as NCCL's sum then the norm kernel."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_p2p_rank, args=(r, init_method, q, sentinel)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        report = q.get(timeout=120)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert report["p2p"], "the two H100s' group fell back to NCCL for small all-reduces (see the rank logs)"
    assert all(ok for _, _, ok in report["eager"]), report
    assert report["graph"] == [True, True, True], report
    assert report["sentinel"] == sentinel, report
    assert report["small_graph"] == [True] * 12 and report["fused_norm"], report


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(15)
    return [[300 + i] + torch.randint(3, 300, (n - 1,), generator=gen).tolist() for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> dict:
    paths = {
        "llama": build_tiny_model(str(tmp_path_factory.mktemp("two_gpu_llama")), "llama", seed=15),
        "qwen3_moe": build_tiny_moe(str(tmp_path_factory.mktemp("two_gpu_moe")), "qwen3_moe", seed=16),
    }
    managers = [
        start_server(
            ["--model-path", paths[model], "--dtype", dtype, *COMMON, *extra],
            timeout=300,
            keep_log=True,
            env={**(FP32_ENV if dtype == "float32" else {}), **PEER_EXCHANGE.get(name, {})} or None,
        )
        for name, (model, dtype, extra) in WORKERS.items()
    ]
    with contextlib.ExitStack() as stack:
        yield dict(zip(WORKERS, enter_together(stack, managers)))


def generate(srv, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[dict]:
    """One ``/generate`` call for all ``prompts`` (one batch): ids and top-2 logprobs per token."""
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": prompts, "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 2}
    r = srv.post("/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [{"ids": o["output_ids"], "top2": o["meta_info"]["output_top_logprobs"]} for o in r.json()]


def assert_same_greedy(ref: list[dict], got: list[dict], tie_tol: float, what: str) -> None:
    """``got``'s ids equal ``ref``'s, with top logprobs within ``tie_tol``; where the ids part, ``ref`` was at a
    near-tie (module docstring)."""
    for i, (a, b) in enumerate(zip(ref, got)):
        assert len(a["ids"]) == len(b["ids"]) == NEW_TOKENS, what
        at = next((j for j, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), NEW_TOKENS)
        drift = max(abs(a["top2"][j][0][0] - b["top2"][j][0][0]) for j in range(at)) if at else 0.0
        assert drift <= tie_tol, f"{what}: prompt {i}'s top logprobs differ by {drift:.3g} before token {at}"
        if at == NEW_TOKENS:
            continue
        top2 = {tok: lp for lp, tok, _ in a["top2"][at][:2]}  # an exact tie may list the choice second
        took = b["ids"][at]
        assert took in top2 and max(top2.values()) - top2[took] <= tie_tol, (
            f"{what}: prompt {i} parts at token {at} from the reference, which was not at a near-tie there "
            f"(took {took}, reference {a['ids'][at]}, its top-2 {a['top2'][at][:2]})"
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_gives_tp1_greedy_tokens(dtype, workers, prompts):
    tag = "fp32" if dtype == "float32" else "bf16"
    ref = generate(workers[f"llama_{tag}_tp1"], prompts)
    got = generate(workers[f"llama_{tag}_tp2"], prompts)
    assert_same_greedy(ref, got, TIE_TOL[dtype], f"tiny Llama {dtype}, TP=2 vs TP=1")
    assert workers[f"llama_{tag}_tp2"].get("/get_server_info").json()["tp_size"] == 2


def test_tp2_cuda_graphs_replay_nccl_all_reduce_as_eager(workers, prompts):
    graphs, eager = workers["llama_fp32_tp2"], workers["llama_fp32_tp2_eager"]
    logs = [open(srv.log_path, errors="replace").read() for srv in (graphs, eager)]
    assert "decode CUDA graphs" in logs[0] and "decode CUDA graphs" not in logs[1]
    ref = generate(eager, prompts)
    assert_same_greedy(ref, generate(graphs, prompts), TIE_TOL["float32"], "TP=2 graphs vs TP=2 eager")


def _expert_tokens(srv) -> dict[tuple[str, str], int]:
    from prometheus_client.parser import text_string_to_metric_families

    from kvship.common import metrics_names

    samples = [s for fam in text_string_to_metric_families(srv.get("/metrics").text) for s in fam.samples]
    name = metrics_names.MOE_EXPERT_TOKENS + "_total"
    return {(s.labels["layer"], s.labels["expert"]): int(s.value) for s in samples if s.name == name}


def test_moe_ep2_gives_tp1_tokens_and_expert_load_with_idle_experts(workers, prompts):
    one, ep = workers["moe_tp1"], workers["moe_tp2_ep2"]
    assert ep.get("/get_server_info").json()["server_args"]["ep_size"] == 2
    # one one-token prompt, one token: 2 of 8 experts per sparse layer (0 and 2; layer 1 is dense) get it
    first = [generate(srv, [[350]], new_tokens=1) for srv in (one, ep)]
    assert first[0][0]["ids"] == first[1][0]["ids"]
    load = [_expert_tokens(srv) for srv in (one, ep)]
    assert load[0] == load[1]
    for layer in ("0", "2"):
        counts = [load[1][(layer, str(e))] for e in range(8)]
        assert sum(counts) == 2 and counts.count(0) == 6, (layer, counts)

    ref, got = generate(one, prompts), generate(ep, prompts)
    assert_same_greedy(ref, got, TIE_TOL["float32"], "tiny Qwen3-MoE float32, TP=2 EP=2 vs TP=1")
    static = workers["moe_tp2_ep2_static"]
    assert "expert-parallel exchange: over peer memory" in open(static.log_path, errors="replace").read()
    got = generate(static, prompts)
    assert_same_greedy(ref, got, TIE_TOL["float32"], "tiny Qwen3-MoE float32, EP=2 static over peer memory vs TP=1")
    routed = 2 * sum(n + NEW_TOKENS - 1 for n in PROMPT_LENS) + 2  # top-2, plus the first request's token
    for layer in ("0", "2"):
        assert sum(v for (lay, _), v in _expert_tokens(ep).items() if lay == layer) == routed
