"""EPLB (``--ep-num-redundant-experts``, ``--eplb-rebalance-interval``) on CPU: placement logic, then real
rank processes (gloo) at EP=2 and EP=4 against one process.

The placement tests are pure (no process).  One module fixture starts a group
of 2 and a group of 4 rank processes at once; each runs a tiny random
Qwen3-MoE (8 experts, top-2) with redundant experts (EP=2: the ``all_reduce``,
``all_to_all`` and ``static`` dispatches and the block-FP8 model; EP=4:
``all_reduce``): greedy decoding with the initial placement, then with a
rebalance every 3 forwards (so placements change and weights move between
ranks in the middle of the generations and of a batched decode), and a layer
on its own whose router favours two experts, rebalanced by hand between two
forwards.  Tokens must equal the single process's, logits within ``ATOL``, and
the KV pool must be whole again after.  Then ``kvship serve`` with rebalancing
over HTTP, and ``bench/eplb.py`` at its smallest.  docs/parallel.md, "Expert
load balancing (EPLB)".
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import traceback

import pytest
import torch
from conftest import KVDriver
from moe_fixtures import build_tiny_moe
from server_fixtures import free_port

from kvship.engine.config import ServerArgs
from kvship.engine.distributed.topology import Topology
from kvship.engine.model_runner import ModelRunner
from kvship.engine.parallel.eplb import (
    check_eplb,
    compute_placement,
    max_over_mean,
    rank_loads,
    replica_counts,
    transfer_plan,
)

ATOL = 1e-4
RANK_TIMEOUT_S = 240
PROMPTS = [[5, 17, 33, 101, 7, 250, 64, 9, 12], [40, 41, 42, 300, 2, 77]]
GREEDY_TOKENS = 8
# ep size -> its group's runs (redundant experts, dispatch): E = 8, so E + R divides by the ep size
GROUPS = {2: ((2, "all_reduce"), (4, "all_to_all"), (2, "static")), 4: ((4, "all_reduce"),)}


# --- placement (pure) ----------------------------------------------------------------------------------------
def _zipf(n: int, s: float = 1.2, scale: float = 10000.0) -> list[float]:
    return [round(scale / (i + 1) ** s) for i in range(n)]


def _check_valid(placement: list[int], num_experts: int, num_slots: int) -> None:
    assert len(placement) == num_slots
    assert set(placement) == set(range(num_experts))  # every logical expert has >= 1 replica


@pytest.mark.parametrize("experts,ranks,redundant", [(16, 4, 8), (64, 8, 32), (128, 8, 64)])
def test_skewed_load_is_balanced_within_1_2_with_enough_redundant_slots(experts, ranks, redundant):
    load = _zipf(experts)
    random.Random(experts).shuffle(load)  # hot experts anywhere, not in the first block
    slots = experts + redundant
    placement = compute_placement(load, slots, ranks)
    _check_valid(placement, experts, slots)
    assert max_over_mean(rank_loads(placement, load, ranks)) <= 1.2
    # the contiguous split without redundancy (plain EP) is far worse on the same load
    plain = [e for e in range(experts)]
    assert max_over_mean(rank_loads(plain, load, ranks)) > 1.3


def test_idle_experts_keep_one_replica_and_hot_ones_get_the_extra_slots():
    load = [0] * 8 + [1000, 10, 0, 0, 500, 0, 0, 0]
    placement = compute_placement(load, 24, 4)
    _check_valid(placement, 16, 24)
    counts = replica_counts(load, 24, 4)
    assert sum(counts) == 24 and min(counts) == 1
    # hot experts up to one replica per rank (more would gain nothing), then the warm one; idle ones keep one
    assert counts[8] == counts[12] == 4 and counts[9] == 3 and sum(counts[e] > 1 for e in range(16)) == 3
    assert sorted(placement.index(8, 6 * r, 6 * r + 6) // 6 for r in range(4)) == [0, 1, 2, 3]
    assert placement.count(8) == counts[8]
    assert compute_placement([0] * 8, 12, 4) == compute_placement([0] * 8, 12, 4)  # all idle: still valid
    _check_valid(compute_placement([0] * 8, 12, 4), 8, 12)


def test_placement_is_deterministic_keeps_slots_and_plans_moves_from_holders():
    load = _zipf(16)
    a, b = compute_placement(load, 24, 4), compute_placement(list(load), 24, 4)
    assert a == b
    # the replicas of one expert go to different ranks where they can
    for r in range(4):
        mine = a[r * 6 : (r + 1) * 6]
        assert len(set(mine)) == len(mine)
    # rebalancing onto the same load keeps every slot: nothing moves
    assert compute_placement(load, 24, 4, previous=a) == a and transfer_plan(a, a, 4) == []
    new = compute_placement(list(reversed(load)), 24, 4, previous=a)
    _check_valid(new, 16, 24)
    plan = transfer_plan(a, new, 4)
    assert plan and {d for _, d in plan} == {s for s in range(24) if a[s] != new[s]}
    for src, dst in plan:
        assert a[src] == new[dst]  # the source holds the expert in the old placement
        local = [s for s in range(24) if a[s] == new[dst] and s // 6 == dst // 6]
        if local:
            assert src == local[0]  # a copy on the destination's own rank is preferred


def test_startup_errors_are_one_line(ep_dir, tiny_llama_dir):
    from kvship.app.serve import check_tensor_parallel

    check_eplb(8, 0, 1, 1)
    check_eplb(8, 4, 4, 4)
    with pytest.raises(ValueError, match="10 slots do not divide by --ep-size 4"):
        check_eplb(8, 2, 4, 4)
    with pytest.raises(ValueError, match="needs --ep-size = --tp-size > 1"):
        check_eplb(8, 4, 2, 4)
    with pytest.raises(ValueError, match="--ep-num-redundant-experts needs --ep-size equal to --tp-size"):
        ServerArgs(model_path=ep_dir, tp_size=2, ep_size=1, ep_num_redundant_experts=2).validate()
    with pytest.raises(ValueError, match=">= 0"):
        ServerArgs(model_path=ep_dir, tp_size=2, ep_size=2, eplb_rebalance_interval=-1).validate()
    with pytest.raises(ValueError, match="9 slots do not divide by --ep-size 2"):
        check_tensor_parallel(ServerArgs(model_path=ep_dir, tp_size=2, ep_size=2, ep_num_redundant_experts=1))
    check_tensor_parallel(ServerArgs(model_path=ep_dir, tp_size=2, ep_size=2, ep_num_redundant_experts=2))
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        check_tensor_parallel(ServerArgs(model_path=tiny_llama_dir, tp_size=2, ep_size=2, ep_num_redundant_experts=2))


# --- rank processes ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ep_dir(tmp_path_factory) -> str:
    return build_tiny_moe(str(tmp_path_factory.mktemp("eplb_qwen3_moe")), "qwen3_moe", seed=71)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> str:
    """The same model in block-128 FP8 (experts' width 256: whole blocks; docs/quantization.md)."""
    from kvship.engine.layers.quantization.writer import write_fp8_checkpoint

    d = tmp_path_factory.mktemp("eplb_fp8")
    dims = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    src = build_tiny_moe(str(d / "src"), "qwen3_moe", seed=25, intermediate_size=256, moe_intermediate_size=256, **dims)
    return write_fp8_checkpoint(src, str(d / "block"), "fp8_block")


def _server_args(path: str, tp: int = 1, redundant: int = 0, interval: int = 0, dispatch="all_reduce"):
    return ServerArgs(
        model_path=path,
        max_total_tokens=1024,
        max_running_requests=8,
        tp_size=tp,
        ep_size=tp,
        ep_dispatch=dispatch,
        ep_num_redundant_experts=redundant,
        eplb_rebalance_interval=interval,
    )


def _run_steps(runner) -> dict:
    drv = KVDriver(runner)
    total = runner.allocator.available_size()
    greedy = [drv.greedy(p, GREEDY_TOKENS) for p in PROMPTS]
    a, b = drv.new(), drv.new()
    try:
        drv.extend([a, b], PROMPTS)
        decode = [drv.decode([a, b], [3, 4]), drv.decode([a, b], [5, 6]), drv.decode([a, b], [7, 8])]
    finally:
        drv.free(a)
        drv.free(b)
    out = {
        "greedy": greedy,
        "decode": torch.cat(decode).numpy(),
        "pool_whole": runner.allocator.available_size() == total,
    }
    if runner.eplb is not None:
        out["eplb"] = runner.eplb.stats()
    return out


def _layer_case(tp) -> dict:
    """One EPLB layer (8 experts, top-2, 4 redundant) whose router favours experts 0 and 5: forward, a
    rebalance by hand from the counted load, forward again; both equal the dense reference."""
    from kvship.engine.layers.moe.layer import FusedMoE
    from kvship.engine.parallel.eplb import EPLBFusedMoE, EPLBManager

    g = torch.Generator().manual_seed(11)
    e, h, i = 8, 32, 16
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x, logits = torch.randn(9, h, generator=g), torch.randn(9, e, generator=g)
    logits[:, 0] += 4.0
    logits[:, 5] += 3.0
    layer = EPLBFusedMoE(FusedMoE(e, 2, h, i, renormalize=True, runner="torch"), tp, tp.size, "all_reduce", "", 4)
    for ex in range(e):
        layer.w13_weight.weight_loader(layer.w13_weight, w13[ex, :i], (ex, "gate"))
        layer.w13_weight.weight_loader(layer.w13_weight, w13[ex, i:], (ex, "up"))
        layer.w2_weight.weight_loader(layer.w2_weight, w2[ex], (ex, "down"))
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.ModuleDict({"mlp": layer})])})
    manager = EPLBManager(model, tp, interval=0)
    before = list(layer.placement)
    with torch.inference_mode():
        y0 = layer(x, logits)
        last = manager.rebalance()
        y1 = layer(x, logits)
        placed = list(layer.placement)
        idle = manager.rebalance()  # routed since: the same batch once more, already balanced for
        layer.reset_expert_load_()  # counters reset since the last rebalance: the window is what they hold
        layer(x, logits)
        after_reset = manager.rebalance()
    return {
        "y": (y0.numpy(), y1.numpy()),
        "placements": (before, placed, list(layer.placement)),
        "last": last,
        "again": (idle, after_reset),
    }


def _rank_main(size: int, rank: int, init_method: str, paths: dict, out: "mp.Queue") -> None:
    from kvship.engine.distributed.launch import join

    torch.set_num_threads(1)
    try:
        groups = join(_server_args("", size), Topology(tp_size=size, rank=rank), init_method)
        results: dict = {}
        for redundant, dispatch in GROUPS[size]:
            for interval in (0, 3):
                runner = ModelRunner(_server_args(paths["bf"], size, redundant, interval, dispatch), groups=groups)
                results[(redundant, dispatch, interval)] = _run_steps(runner)
        if size == 2:  # FP8 experts: the block scales move with their weights
            runner = ModelRunner(_server_args(paths["fp8"], size, 2, 3), groups=groups)
            results["fp8"] = _run_steps(runner)
            layer = next(m for m in runner.model.modules() if hasattr(m, "placement"))
            results["fp8"]["params"] = sorted(n for n, _ in layer.named_parameters(recurse=False))
        results["layer"] = _layer_case(groups.tp)
        out.put((size, rank, "ok", results))
    except BaseException:  # noqa: BLE001 - report to the test, do not hang it
        out.put((size, rank, "error", f"ep {size} rank {rank}: {traceback.format_exc()}"))
    out.close()
    out.join_thread()
    os._exit(0)  # skip the process group's teardown at exit (it waits for the other ranks)


@pytest.fixture(scope="module")
def eplb_results(ep_dir, fp8_dir) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for size in GROUPS:  # both groups at once
        init = f"tcp://127.0.0.1:{free_port()}"
        procs += [
            ctx.Process(target=_rank_main, args=(size, r, init, {"bf": ep_dir, "fp8": fp8_dir}, q), daemon=True)
            for r in range(size)
        ]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            size, rank, status, payload = q.get(timeout=RANK_TIMEOUT_S)
            assert status == "ok", payload
            got[(size, rank)] = payload
        for p in procs:
            p.join(30)
            assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return got


@pytest.fixture(scope="module")
def single_result(ep_dir) -> dict:
    torch.set_num_threads(1)
    return _run_steps(ModelRunner(_server_args(ep_dir)))


def test_fp8_experts_move_with_their_block_scales(eplb_results, fp8_dir):
    want = _run_steps(ModelRunner(_server_args(fp8_dir)))
    for rank in range(2):
        ours = eplb_results[(2, rank)]["fp8"]
        assert "w13_weight_scale_inv" in ours["params"] and "w2_weight_scale_inv" in ours["params"]
        assert ours["eplb"]["rebalances"] == 6 and ours["eplb"]["moved_slots_total"] > 0
        assert ours["greedy"] == want["greedy"] and ours["pool_whole"]
        assert abs(ours["decode"] - want["decode"]).max() < 1e-3


CASES = [(size, r, d, i) for size, runs in GROUPS.items() for r, d in runs for i in (0, 3)]


@pytest.mark.parametrize(
    "size,redundant,dispatch,interval", CASES, ids=[f"ep{c[0]}-r{c[1]}-{c[2]}-i{c[3]}" for c in CASES]
)
def test_redundant_experts_and_rebalancing_give_single_process_tokens(
    size, redundant, dispatch, interval, eplb_results, single_result
):
    for rank in range(size):
        ours = eplb_results[(size, rank)][(redundant, dispatch, interval)]
        assert ours["greedy"] == single_result["greedy"], f"rank {rank}"
        assert abs(ours["decode"] - single_result["decode"]).max() < ATOL
        assert ours["pool_whole"]
        stats = ours["eplb"]
        assert stats["num_redundant_experts"] == redundant
        if interval:  # 2 greedy runs of 8 tokens + 4 batched steps = 20 forwards: 6 rebalances mid-generation
            assert stats["rebalances"] == 6 and 0 <= stats["last_rebalance"]["layers"] <= 2
            assert stats["moved_slots_total"] > 0  # weights did move between ranks mid-generation
        else:
            assert stats["rebalances"] == 0
    # every rank agrees on the placements
    placements = [eplb_results[(size, r)][(redundant, dispatch, interval)]["eplb"]["placement"] for r in range(size)]
    assert all(p == placements[0] for p in placements)


def test_a_rebalance_moves_weights_between_ranks_and_keeps_the_layer_output(eplb_results):
    from kvship.engine.layers.moe.runner import get_moe_runner
    from kvship.engine.layers.moe.topk import select_experts

    g = torch.Generator().manual_seed(11)
    e, h, i = 8, 32, 16
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x, logits = torch.randn(9, h, generator=g), torch.randn(9, e, generator=g)
    logits[:, 0] += 4.0
    logits[:, 5] += 3.0
    weights, ids = select_experts(logits, 2, renormalize=True)
    want = get_moe_runner("torch")(x, w13, w2, weights, ids)
    for size in GROUPS:
        for rank in range(size):
            case = eplb_results[(size, rank)]["layer"]
            before, after, final = case["placements"]
            assert before != after and after.count(0) >= 2  # the hot expert got replicas
            # the same load again (and after a counter reset): no gain, so nothing moves
            assert final == after and [a["moved_slots"] for a in case["again"]] == [0, 0]
            assert case["last"]["moved_slots"] > 0
            assert case["last"]["rank_load_max_over_mean_after"] < case["last"]["rank_load_max_over_mean_before"]
            for y in case["y"]:
                assert abs(torch.from_numpy(y) - want).max().item() < ATOL, f"ep {size} rank {rank}"


def test_bench_reports_balanced_load_and_equal_output(tmp_path):
    """bench/eplb.py at its smallest (2 gloo ranks): the rebalanced rank load and the outputs' difference."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "bench", "eplb.py"), "--experts", "8", "--redundant", "4"]
    cmd += ["--topk", "2", "--tokens", "256", "--iters", "1", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, timeout=120, capture_output=True)
    res = json.loads((tmp_path / "eplb_ep2.json").read_text())
    load = res["rank_load_max_over_mean"]
    assert load["eplb_rebalanced"] <= 1.2 and load["eplb_rebalanced"] <= load["plain_ep"]
    assert res["max_abs_diff"] < ATOL and res["rebalance"]["layers"] == 1


def test_serve_with_rebalancing_keeps_greedy_tokens_and_reports_rank_load(ep_dir, single_result):
    """``kvship serve --tp-size 2 --ep-size 2 --ep-num-redundant-experts 2 --eplb-rebalance-interval 3``: the
    real scheduler loop on both ranks rebalances mid-request; /generate gives the one-process greedy tokens and
    /get_server_info the EPLB figures."""
    from server_fixtures import start_server

    args = ["--model-path", ep_dir, "--max-total-tokens", "1024", "--tp-size", "2", "--ep-size", "2"]
    args += ["--ep-num-redundant-experts", "2", "--eplb-rebalance-interval", "3"]
    with start_server(args) as srv:
        greedy = {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
        for prompt, want in zip(PROMPTS, single_result["greedy"]):  # one at a time: the same steps as the runner
            r = srv.post("/generate", json={"input_ids": prompt, "sampling_params": greedy})
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == want
        info = srv.get("/get_server_info").json()
        log = srv.log_tail()
    eplb = info["eplb"]
    assert eplb["num_redundant_experts"] == 2 and eplb["rebalance_interval"] == 3
    assert eplb["rebalances"] >= 4 and eplb["moved_slots_total"] > 0
    last = eplb["last_rebalance"]
    assert 0 <= last["layers"] <= 2 and last["rank_load_max_over_mean_after"] >= 1.0
    assert "EPLB rebalance" in log
