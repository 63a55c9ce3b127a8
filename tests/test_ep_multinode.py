"""Expert parallelism across nodes: ``--tp-size 4 --ep-size 4`` over two "nodes" on localhost (real processes).

Each node is its own ``kvship serve --nnodes 2 --node-rank R`` process tree (gloo): node 0 runs ranks 0-1
(rank 0 serves HTTP), node 1 ranks 2-3, and each rank holds 2 of the tiny Qwen3-MoE's 8 experts
(tests/moe_fixtures.py; layers 0 and 2 sparse).  With either dispatch (``all_reduce``: one all-reduce of the
partial outputs; ``all_to_all``: tokens sent to the ranks holding their experts, across the nodes) the greedy
tokens equal the single process's, and ``/metrics`` counts every routed (token, expert) pair once.
"""

from __future__ import annotations

import contextlib

import pytest
from conftest import KVDriver
from moe_fixtures import build_tiny_moe
from server_fixtures import enter_together, free_port, start_server

from kvship.engine.config import ServerArgs
from kvship.engine.model_runner import ModelRunner

PROMPTS = [[5, 17, 33, 101, 7, 250, 64, 9, 12], [40, 41, 42, 300, 2, 77]]
GREEDY_TOKENS = 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return build_tiny_moe(str(tmp_path_factory.mktemp("ep_mn_qwen3_moe")), "qwen3_moe", seed=40)


@pytest.fixture(scope="module")
def single_greedy(moe_dir) -> list[list[int]]:
    drv = KVDriver(ModelRunner(ServerArgs(model_path=moe_dir, max_total_tokens=1024, max_running_requests=8)))
    return [drv.greedy(p, GREEDY_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("dispatch", ["all_reduce", "all_to_all"])
def test_ep4_over_two_nodes_gives_the_single_process_tokens(moe_dir, single_greedy, dispatch):
    common = ["--model-path", moe_dir, "--max-total-tokens", "1024", "--tp-size", "4", "--ep-size", "4"]
    common += ["--ep-dispatch", dispatch, "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    common += ["--dist-timeout", "30"]
    with contextlib.ExitStack() as stack:
        nodes = enter_together(stack, [start_server(common + ["--node-rank", str(r)], timeout=240) for r in (0, 1)])
        greedy = {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
        r = nodes[0].post("/generate", json={"input_ids": PROMPTS, "sampling_params": greedy})
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == single_greedy
        health = nodes[1].get("/health").json()
        assert health["node_rank"] == 1 and [(s["rank"], s["alive"]) for s in health["ranks"]] == [(2, True), (3, True)]
        info = nodes[0].get("/get_server_info").json()
        assert (info["tp_size"], info["server_args"]["ep_size"], info["server_args"]["nnodes"]) == (4, 4, 2)
        metrics = nodes[0].get("/metrics").text
    routed = sum(len(p) + GREEDY_TOKENS - 1 for p in PROMPTS) * 2  # top-2, per sparse layer (0 and 2)
    per_layer: dict[str, int] = {}
    for line in metrics.splitlines():
        if line.startswith("kvship:moe_expert_tokens_total{"):
            layer = line.split('layer="', 1)[1].split('"', 1)[0]
            per_layer[layer] = per_layer.get(layer, 0) + int(float(line.rsplit(" ", 1)[1]))
    assert per_layer == {"0": routed, "2": routed}
