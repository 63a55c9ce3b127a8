"""Expert parallelism (``--ep-size``) on CPU (gloo, real rank processes) against one process.

One group of 2 rank processes runs, for tiny random Qwen3-MoE and Mixtral
checkpoints: ``--tp-size 2`` (EP 1: each rank holds half of every expert's
width), and ``--tp-size 2 --ep-size 2`` (half of the experts, whole) with both
dispatches (``all_reduce``, ``all_to_all``).  Each run does a prefill with logits at every position,
greedy decoding and a batched decode; rank 0 sends them back and they must
equal the single-process run (tokens) within ``ATOL`` (logits).  The same
group checks the layer on its own where one rank's experts get no token at
all (the router never picks them), and a one-token batch (a rank with no
token of its own in the all-to-all).  The server test runs ``kvship serve
--tp-size 2 --ep-size 2`` over ``/generate`` and reads the expert load in
``/metrics``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch
from conftest import KVDriver
from moe_fixtures import build_tiny_moe
from server_fixtures import free_port, start_server

from kvship.engine.config import ServerArgs
from kvship.engine.distributed.communicator import Communicator, GlooCommunicator
from kvship.engine.distributed.topology import Topology
from kvship.engine.layers.moe.layer import FusedMoE, expert_load
from kvship.engine.model_runner import ModelRunner

ATOL = 1e-4
RANK_TIMEOUT_S = 180
PROMPTS = [[5, 17, 33, 101, 7, 250, 64, 9, 12], [40, 41, 42, 300, 2, 77]]
GREEDY_TOKENS = 8
MODELS = ("qwen3_moe", "mixtral")
# (name, ep size, dispatch) run at --tp-size 2
CONFIGS = (("tp2_ep1", 1, "all_reduce"), ("tp2_ep2", 2, "all_reduce"), ("tp2_ep2_a2a", 2, "all_to_all"))


@pytest.fixture(scope="module")
def ep_model_dirs(tmp_path_factory) -> dict[str, str]:
    return {k: build_tiny_moe(str(tmp_path_factory.mktemp(f"ep_{k}")), k, seed=40 + i) for i, k in enumerate(MODELS)}


def _server_args(path: str, tp_size: int = 1, ep_size: int = 1, dispatch: str = "all_reduce") -> ServerArgs:
    return ServerArgs(
        model_path=path,
        max_total_tokens=1024,
        max_running_requests=8,
        tp_size=tp_size,
        ep_size=ep_size,
        ep_dispatch=dispatch,
    )


def _run_steps(runner) -> dict:
    drv = KVDriver(runner)
    req = drv.new()
    try:
        prefill = drv.extend([req], [PROMPTS[0]], all_logits=True)
    finally:
        drv.free(req)
    greedy = [drv.greedy(p, GREEDY_TOKENS) for p in PROMPTS]
    a, b = drv.new(), drv.new()
    try:
        drv.extend([a, b], PROMPTS)
        decode = drv.decode([a, b], [3, 4])
    finally:
        drv.free(a)
        drv.free(b)
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    return {
        "prefill": prefill.numpy(),
        "greedy": greedy,
        "decode": decode.numpy(),
        "experts_held": [tuple(m.w13_weight.shape) for m in moe],
        "load": expert_load(runner.model),
    }


def _layer_case(tp: Communicator, m: int, dispatch: str) -> "torch.Tensor":
    """A layer of 8 experts (top-2) where the router never picks experts 4..7 (all on rank 1)."""
    from kvship.engine.parallel.ep import ParallelFusedMoE

    g = torch.Generator().manual_seed(7)
    e, h, i = 8, 32, 16
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x, logits = torch.randn(m, h, generator=g), torch.randn(m, e, generator=g)
    logits[:, 4:] = -30.0
    layer = ParallelFusedMoE(FusedMoE(e, 2, h, i, renormalize=True, runner="torch"), tp, 2, dispatch)
    for ex in range(e):  # the loader's calls: every checkpoint expert, the rank keeps its own
        layer.w13_weight.weight_loader(layer.w13_weight, w13[ex, :i], (ex, "gate"))
        layer.w13_weight.weight_loader(layer.w13_weight, w13[ex, i:], (ex, "up"))
        layer.w2_weight.weight_loader(layer.w2_weight, w2[ex], (ex, "down"))
    with torch.no_grad():
        return layer(x, logits)


def _rank_main(rank: int, init_method: str, paths: dict, out: "mp.Queue") -> None:
    from kvship.engine.distributed.launch import join

    torch.set_num_threads(1)
    try:
        groups = join(_server_args("", 2), Topology(tp_size=2, rank=rank), init_method)
        tp = groups.tp
        results: dict = {}
        for cname, ep, dispatch in CONFIGS:
            for model in MODELS:
                runner = ModelRunner(_server_args(paths[model], 2, ep, dispatch), groups=groups)
                results[(cname, model)] = _run_steps(runner)
        layer = {(m, d): _layer_case(tp, m, d).numpy() for m in (1, 5) for d in ("all_reduce", "all_to_all")}
        if rank == 0:
            out.put(("ok", results, layer))
        else:
            out.put(("rank1", {k: r["experts_held"] for k, r in results.items()}, layer))
    except BaseException:  # noqa: BLE001 - report to the test, do not hang it
        out.put(("error", f"rank {rank}: {traceback.format_exc()}", None))
    out.close()
    out.join_thread()
    os._exit(0)  # skip the process group's teardown at exit (it waits for the other ranks)


@pytest.fixture(scope="module")
def ep_results(ep_model_dirs) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, init, ep_model_dirs, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in range(2):
            status, payload, layer = q.get(timeout=RANK_TIMEOUT_S)
            assert status != "error", payload
            got[status] = (payload, layer)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    results, layer = got["ok"]
    held, layer1 = got["rank1"]
    return {"results": results, "layer": {0: layer, 1: layer1}, "rank1_held": held}


@pytest.fixture(scope="module")
def single_results(ep_model_dirs) -> dict:
    torch.set_num_threads(1)
    return {m: _run_steps(ModelRunner(_server_args(p))) for m, p in ep_model_dirs.items()}


CASES = [(c[0], m) for c in CONFIGS for m in MODELS]


@pytest.mark.parametrize("config,model", CASES, ids=[f"{c}-{m}" for c, m in CASES])
def test_expert_parallel_ranks_give_single_process_tokens_and_logits(config, model, ep_results, single_results):
    ours, ref = ep_results["results"][(config, model)], single_results[model]
    assert ours["greedy"] == ref["greedy"]
    assert abs(ours["prefill"] - ref["prefill"]).max() < ATOL
    assert abs(ours["decode"] - ref["decode"]).max() < ATOL
    assert ours["load"] == ref["load"]  # every rank routes every token: rank 0 counts what one process does


def test_each_rank_holds_only_its_experts(ep_results, single_results):
    for model in MODELS:
        full = single_results[model]["experts_held"]  # w13 [E, 2I, H] of each sparse layer
        assert all(s[0] == 8 for s in full)
        half_width = [(8, s[1] // 2, s[2]) for s in full]
        assert ep_results["results"][("tp2_ep1", model)]["experts_held"] == half_width
        assert ep_results["rank1_held"][("tp2_ep1", model)] == half_width
        for config in ("tp2_ep2", "tp2_ep2_a2a"):
            half = [(4,) + s[1:] for s in full]
            assert ep_results["results"][(config, model)]["experts_held"] == half
            assert ep_results["rank1_held"][(config, model)] == half


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("dispatch", ["all_reduce", "all_to_all"])
def test_a_rank_whose_experts_get_no_token_still_gives_the_whole_layer(m, dispatch, ep_results):
    """Experts 4..7 (rank 1's) are never picked: rank 1 computes nothing yet joins the collectives and ends
    with the whole output too; with one token, rank 1 also has no token of its own to dispatch (all_to_all)."""
    from kvship.engine.layers.moe.runner import get_moe_runner
    from kvship.engine.layers.moe.topk import select_experts

    g = torch.Generator().manual_seed(7)
    e, h, i = 8, 32, 16
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x, logits = torch.randn(m, h, generator=g), torch.randn(m, e, generator=g)
    logits[:, 4:] = -30.0
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert (ids < 4).all()
    want = get_moe_runner("torch")(x, w13, w2, weights, ids)
    for rank in (0, 1):
        got = torch.from_numpy(ep_results["layer"][rank][(m, dispatch)])
        assert got.shape == (m, h) and (got - want).abs().max().item() < ATOL, f"rank {rank}"


# --- startup checks (no processes) -------------------------------------------------------
def test_expert_split_and_its_startup_errors(ep_model_dirs, tiny_llama_dir, tmp_path):
    from kvship.app.serve import check_tensor_parallel
    from kvship.engine.parallel.ep import expert_split

    # Qwen3-30B-A3B's 128 experts of width 768: --tp-size 4 --ep-size 4, then --tp-size 4 --ep-size 2
    assert [
        (s.start, s.num_local, s.inter_start, s.inter_local)
        for s in (expert_split(128, 768, 4, 4, r) for r in range(4))
    ] == [
        (0, 32, 0, 768),
        (32, 32, 0, 768),
        (64, 32, 0, 768),
        (96, 32, 0, 768),
    ]
    assert [
        (s.start, s.num_local, s.inter_start, s.inter_local)
        for s in (expert_split(128, 768, 4, 2, r) for r in range(4))
    ] == [
        (0, 64, 0, 384),
        (0, 64, 384, 384),
        (64, 64, 0, 384),
        (64, 64, 384, 384),
    ]
    assert expert_split(8, 32, 2, 2, 1).owner(3) == 0 and expert_split(8, 32, 2, 2, 1).owner(4) == 1
    with pytest.raises(ValueError, match="--ep-size 3 must divide --tp-size"):
        ServerArgs(model_path=tiny_llama_dir, tp_size=2, ep_size=3).validate()
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        check_tensor_parallel(ServerArgs(model_path=tiny_llama_dir, tp_size=2, ep_size=2))
    six = build_tiny_moe(str(tmp_path / "six"), "qwen3_moe", seed=3, num_experts=6)
    with pytest.raises(ValueError, match="--ep-size 4 does not divide the model's 6 experts"):
        check_tensor_parallel(ServerArgs(model_path=six, tp_size=4, ep_size=4))
    check_tensor_parallel(ServerArgs(model_path=six, tp_size=2, ep_size=2))
    with pytest.raises(ValueError, match="all_to_all needs --ep-size equal to --tp-size"):
        check_tensor_parallel(ServerArgs(model_path=six, tp_size=2, ep_size=1, ep_dispatch="all_to_all"))
    odd = build_tiny_moe(str(tmp_path / "odd"), "qwen3_moe", seed=3, moe_intermediate_size=30)
    with pytest.raises(ValueError, match=r"= 4 does not divide the experts' width \(moe_intermediate_size 30\)"):
        check_tensor_parallel(ServerArgs(model_path=odd, tp_size=4))
    check_tensor_parallel(ServerArgs(model_path=odd, tp_size=2, ep_size=2))
    shared = build_tiny_moe(str(tmp_path / "shared"), "qwen2_moe", seed=3, shared_expert_intermediate_size=50)
    with pytest.raises(ValueError, match=r"--tp-size 4 does not divide the shared expert's width \(50\)"):
        check_tensor_parallel(ServerArgs(model_path=shared, tp_size=4, ep_size=4))
    check_tensor_parallel(ServerArgs(model_path=ep_model_dirs["mixtral"], tp_size=2, ep_size=2))


# --- kvship serve --tp-size 2 --ep-size 2 ---------------------------------------------------
def test_serve_ep2_matches_one_process_over_http_and_exports_expert_load(ep_model_dirs, single_results):
    """/generate through a 2-rank EP worker gives the single-process greedy tokens; /metrics counts every
    routed (token, expert) pair: prompt + generated - 1 tokens times top-k, per sparse layer."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvship.common import metrics_names

    path = ep_model_dirs["qwen3_moe"]
    args = ["--model-path", path, "--max-total-tokens", "1024", "--tp-size", "2", "--ep-size", "2"]
    with start_server(args) as srv:
        greedy = {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
        r = srv.post("/generate", json={"input_ids": PROMPTS, "sampling_params": greedy})
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == single_results["qwen3_moe"]["greedy"]
        info = srv.get("/get_server_info").json()
        assert info["server_args"]["ep_size"] == 2
        text = srv.get("/metrics").text
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    tokens = [s for s in samples if s.name == metrics_names.MOE_EXPERT_TOKENS + "_total"]
    per_layer: dict[str, int] = {}
    for s in tokens:
        per_layer[s.labels["layer"]] = per_layer.get(s.labels["layer"], 0) + int(s.value)
    routed = sum(len(p) + GREEDY_TOKENS - 1 for p in PROMPTS) * 2  # top-2
    assert per_layer == {"0": routed, "2": routed}  # layer 1 is dense (mlp_only_layers)
    assert {s.labels["expert"] for s in tokens if s.labels["layer"] == "0"} == {str(e) for e in range(8)}
    imbalance = {s.labels["layer"]: s.value for s in samples if s.name == metrics_names.MOE_EXPERT_LOAD_IMBALANCE}
    assert set(imbalance) == {"0", "2"} and all(v >= 1.0 for v in imbalance.values())


def test_a_ranks_gguf_share_is_its_block_of_the_experts_and_reads_no_other(ep_model_dirs, tmp_path):
    """Rank 1 of ``--tp-size 2 --ep-size 2`` from a GGUF file (Mixtral as llama.cpp writes it): experts 4..7
    of every sparse layer equal the whole model's, and only their rows are dequantized."""
    from gguf_fixtures import write_gguf

    from kvship.engine.loaders import gguf_file, gguf_loader
    from kvship.engine.loaders.base import load_model
    from kvship.engine.model_config import ModelConfig

    path = str(tmp_path / "mixtral.gguf")
    write_gguf(ep_model_dirs["mixtral"], path, "llama")
    mc = ModelConfig.from_pretrained(path)
    whole = load_model(mc, "auto", "cpu")
    read: list[int] = []
    real = gguf_file.dequantize_expert_block

    def spy(t, expert, ranges):
        read.append(expert)
        return real(t, expert, ranges)

    gguf_loader.dequantize_expert_block = spy
    try:
        share = load_model(mc, "auto", "cpu", tp=GlooCommunicator(1, 2), ep=(2, "all_reduce"))
    finally:
        gguf_loader.dequantize_expert_block = real
    assert sorted(set(read)) == [4, 5, 6, 7] and len(read) == 3 * 3 * 4  # 3 layers x gate/up/down x 4 experts
    for i in range(3):
        mine, full = share.model.layers[i].mlp.experts, whole.model.layers[i].mlp.experts
        assert (mine.expert_start, mine.num_local_experts) == (4, 4)
        assert torch.equal(mine.w13_weight, full.w13_weight[4:]) and torch.equal(mine.w2_weight, full.w2_weight[4:])


def test_expert_load_series_parse_and_give_max_over_mean():
    from prometheus_client.parser import text_string_to_metric_families

    from kvship.engine.metrics import EngineMetrics

    m = EngineMetrics('tiny "moe"', lambda: {}, lambda: {3: [6, 2, 0, 0], 5: [0, 0, 0, 0]})
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    tokens = fams["kvship:moe_expert_tokens"]
    assert tokens.type == "counter" and len(tokens.samples) == 8
    assert {(s.labels["layer"], s.labels["expert"]): s.value for s in tokens.samples}[("3", "0")] == 6.0
    assert all(s.labels["model_name"] == 'tiny "moe"' for s in tokens.samples)
    ratio = {s.labels["layer"]: s.value for s in fams["kvship:moe_expert_load_imbalance"].samples}
    assert ratio == {"3": 3.0, "5": 1.0}  # 6 / mean 2; no token yet counts as balanced
    assert "kvship:moe_expert" not in EngineMetrics("dense", lambda: {}).render().decode()


# --- four ranks: every way of splitting 8 experts over --tp-size 4 ----------------------------
def _layer_world4(rank: int, init_method: str, out: "mp.Queue") -> None:
    """``--tp-size 4`` with ``--ep-size`` 1 (each expert's width 4 ways), 2 (2 experts blocks x 2 width
    halves) and 4 (whole experts, with both dispatches): rank ``rank``'s layer outputs for 7 tokens."""
    from kvship.engine.distributed.launch import join
    from kvship.engine.parallel.ep import ParallelFusedMoE

    torch.set_num_threads(1)
    try:
        tp = join(_server_args("", 4), Topology(tp_size=4, rank=rank), init_method).tp
        g = torch.Generator().manual_seed(11)
        e, h, i = 8, 32, 16
        w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
        x, logits = torch.randn(7, h, generator=g), torch.randn(7, e, generator=g)
        got = {}
        for ep, dispatch in ((1, "all_reduce"), (2, "all_reduce"), (4, "all_reduce"), (4, "all_to_all")):
            layer = ParallelFusedMoE(FusedMoE(e, 2, h, i, renormalize=True, runner="torch"), tp, ep, dispatch)
            for ex in range(e):
                layer.w13_weight.weight_loader(layer.w13_weight, w13[ex, :i], (ex, "gate"))
                layer.w13_weight.weight_loader(layer.w13_weight, w13[ex, i:], (ex, "up"))
                layer.w2_weight.weight_loader(layer.w2_weight, w2[ex], (ex, "down"))
            with torch.no_grad():
                got[(ep, dispatch)] = (tuple(layer.w13_weight.shape), layer(x, logits).numpy())
        out.put(("ok", rank, got))
    except BaseException:  # noqa: BLE001 - report to the test, do not hang it
        out.put(("error", rank, traceback.format_exc()))
    out.close()
    out.join_thread()
    os._exit(0)


def test_every_ep_size_dividing_tp4_gives_the_whole_layer_on_every_rank():
    from kvship.engine.layers.moe.runner import get_moe_runner
    from kvship.engine.layers.moe.topk import select_experts

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_layer_world4, args=(r, init, q), daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in range(4):
            status, rank, payload = q.get(timeout=RANK_TIMEOUT_S)
            assert status == "ok", payload
            got[rank] = payload
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    g = torch.Generator().manual_seed(11)
    e, h, i = 8, 32, 16
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x, logits = torch.randn(7, h, generator=g), torch.randn(7, e, generator=g)
    want = get_moe_runner("torch")(x, w13, w2, *select_experts(logits, 2, renormalize=True))
    held = {1: (8, 2 * i // 4, h), 2: (4, 2 * i // 2, h), 4: (2, 2 * i, h)}
    for rank, by_config in got.items():
        for (ep, dispatch), (shape, out) in by_config.items():
            assert shape == held[ep], (rank, ep)
            assert (torch.from_numpy(out) - want).abs().max().item() < ATOL, (rank, ep, dispatch)


def test_a_table_tuned_for_decode_only_leaves_larger_batches_to_the_defaults():
    """A table is consulted up to twice its largest tuned batch.  The H200's V2-Lite table holds one batch-1 GEMV
    entry (``bench/moe_layer.py --gemv-sweep --write-table --m 1``): batch 1 and 2 take it, larger batches the
    untuned choice.  Its Qwen3-30B-A3B table also has the decode batches 4-256 (``bench/moe_tune.py``, session
    35): a batch takes the nearest entry up to 512 tokens, and prefill-sized batches ``default_config``, never a
    GEMV."""
    from kvship.engine.layers.moe.kernel_config import GEMV_CONFIG, default_config, get_config, load_table

    h200 = "NVIDIA H200"
    table = load_table(64, 1408, torch.bfloat16, h200)
    assert set(table) == {1} and "gemv" in table[1], table
    assert get_config(1, 64, 1408, 6, torch.bfloat16, h200) == table[1]
    assert get_config(2, 64, 1408, 6, torch.bfloat16, h200) == table[1]
    assert get_config(4096, 64, 1408, 6, torch.bfloat16, h200) == default_config(4096, 64, 6)
    assert get_config(3, 64, 1408, 4, torch.bfloat16, h200) == {"gemv": dict(GEMV_CONFIG)}
    assert table[1]["gemv"] != GEMV_CONFIG  # the H200's own blocks, not the defaults

    table = load_table(128, 768, torch.bfloat16, h200)
    assert {1, 4, 8, 16, 32, 64, 128, 256} <= set(table) and max(table) == 256, table
    assert get_config(1, 128, 768, 8, torch.bfloat16, h200) == table[1] and "gemv" in table[1]
    assert get_config(2, 128, 768, 8, torch.bfloat16, h200) == table[1]
    assert get_config(3, 128, 768, 8, torch.bfloat16, h200) == table[4]
    assert get_config(100, 128, 768, 8, torch.bfloat16, h200) == table[128]
    assert get_config(512, 128, 768, 8, torch.bfloat16, h200) == table[256]
    for m in (513, 4096):
        assert get_config(m, 128, 768, 8, torch.bfloat16, h200) == default_config(m, 128, 8)


def test_a_ranks_experts_use_the_whole_layers_kernel_configs():
    """Under EP a rank's E/N experts carry the whole layer's load per expert, so ``ParallelFusedMoE`` asks its
    runner for the configs tuned for the model's expert count (``config_experts``): on the H100 the E=128 table
    (persistent GEMMs at 4096 tokens), where the rank's own count (64) has no table and gets the defaults that
    made the EP=2 layer 1.01x one GPU at 4096 tokens (docs/benchmarks.md, "Two GPUs")."""
    import torch.distributed as dist

    from kvship.engine.layers.moe.kernel_config import get_config
    from kvship.engine.layers.moe.runner import TorchMoERunner, register_moe_runner
    from kvship.engine.parallel.ep import ParallelFusedMoE

    h100 = "NVIDIA H100 80GB HBM3"
    assert get_config(4096, 128, 768, 8, torch.bfloat16, h100).get("persistent")
    assert not get_config(4096, 64, 768, 8, torch.bfloat16, h100).get("persistent")

    calls = []

    @register_moe_runner("test-recording")
    class Recording(TorchMoERunner):
        def __call__(self, x, w13, w2, topk_weights, topk_ids, absent=False, config_experts=None):
            calls.append((w13.shape[0], absent, config_experts))
            return super().__call__(x, w13, w2, topk_weights, topk_ids, absent, config_experts)

    # rank 0 of two, in a one-process gloo group (its all-reduce is the identity): the layer holds experts 0..3
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        tp = GlooCommunicator(rank=0, size=2, device_group=dist.group.WORLD)
        layer = ParallelFusedMoE(FusedMoE(8, 2, 32, 16, renormalize=True, runner="test-recording"), tp, 2)
        with torch.no_grad():
            layer(torch.randn(5, 32), torch.randn(5, 8))
    finally:
        dist.destroy_process_group()
    assert calls == [(4, True, 8)]
