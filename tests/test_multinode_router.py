"""A decode worker spanning two "nodes" behind the router loses one node mid-stream (``kvship local``).

``kvship local --decode 2 --decode-tp-size 2 --decode-nnodes 2`` runs each decode worker as two ``kvship
serve --node-rank R`` process trees on this machine (tiny random Llama, CPU, gloo, tcp transfer; one TP=1
prefill worker).  Streams go through the router round robin; once one decode worker has generated a stream's
worth and is still busy, one of its nodes (node 1: launcher and rank; or node 0: rank 0 with HTTP) is SIGKILLed as a process
group.  Then:

* the other node of that worker exits by itself with status 1 within 30 s (a collective with the dead node
  failed; ``kvship local`` gives a worker's surviving nodes ``--shutdown-grace`` before it would stop them),
  and no process of either node's tree is left;
* every stream ends with one ``[DONE]`` and the greedy text of an undisturbed run: the router resumed the
  broken ones on the other decode worker;
* ``kvship local`` restarts the worker, both nodes at a new rendezvous, and the router routes to it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import httpx
import pytest
from pd_fixtures import start_local
from test_router_resume import _bodies, burst_with_a_kill, check_burst, wait_kv_free

pytestmark = pytest.mark.timeout(400)

EXIT_WITHIN_S = 30
STREAMS = 12


def _flag(cmdline: list[str], flag: str) -> str:
    return cmdline[cmdline.index(flag) + 1] if flag in cmdline else ""


def _worker_nodes(local_pid: int, url: str) -> list:
    """The node processes of the worker whose node 0 serves ``url`` (children of ``kvship local``), node 0
    first: node 0 is the one with that ``--port``, the others share its ``--dist-init-addr``."""
    import psutil

    port = url.rsplit(":", 1)[1]
    kids = [(p, p.cmdline()) for p in psutil.Process(local_pid).children()]
    head, cmd = next((p, c) for p, c in kids if "serve" in c and _flag(c, "--port") == port)
    addr = _flag(cmd, "--dist-init-addr")
    assert addr and _flag(cmd, "--node-rank") == "0", cmd
    others = [p for p, c in kids if p.pid != head.pid and _flag(c, "--dist-init-addr") == addr]
    return [head, *sorted(others, key=lambda p: int(_flag(p.cmdline(), "--node-rank")))]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    args = ["--prefill", "1", "--decode", "2", "--decode-tp-size", "2", "--decode-nnodes", "2"]
    args += ["--transfer-backend", "tcp", "--model-path", tiny_llama_dir, "--served-model-name", "tiny"]
    args += ["--device", "cpu", "--max-total-tokens", "8192", "--max-running-requests", "4"]
    args += ["--policy", "round_robin", "--dist-timeout", "20"]
    with start_local(args) as c:
        yield c


def test_kvship_local_runs_each_node_of_a_multi_node_worker_as_its_own_process_tree(cluster):
    decode = cluster.workers("decode")
    assert len(decode) == 2  # the router knows node 0 of each worker only
    for url in decode:
        nodes = _worker_nodes(cluster.proc.pid, url)
        assert [_flag(n.cmdline(), "--node-rank") for n in nodes] == ["0", "1"]
        assert all(os.getsid(n.pid) == n.pid for n in nodes)  # each node leads its own session
        assert cluster.info(url)["tp_size"] == 2
        node1 = f"http://127.0.0.1:{_flag(nodes[1].cmdline(), '--port')}"
        health = httpx.get(node1 + "/health", timeout=10).json()
        assert health["node_rank"] == 1 and [(s["rank"], s["alive"]) for s in health["ranks"]] == [(1, True)]


async def _all_serving(cluster, c: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 120
    while True:  # every worker healthy (a previous test's restart is over)
        workers = (await c.get(cluster.url + "/workers", headers=cluster.worker_headers)).json()["workers"]
        if len(workers) == 3 and all(w["state"] == "serving" and w["healthy"] for w in workers):
            return
        assert time.monotonic() < deadline, workers
        await asyncio.sleep(0.5)


@pytest.mark.parametrize("dead", [1, 0], ids=["node1-dies", "node0-dies"])
async def test_killing_one_node_of_a_decode_worker_mid_stream_ends_the_worker_resumes_its_streams_and_restarts_it(
    cluster, dead
):
    import psutil

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as c:
        await _all_serving(cluster, c)
        victim = cluster.workers("decode")[dead]  # each run hits the other worker
        nodes = _worker_nodes(cluster.proc.pid, victim)
        survivor = nodes[1 - dead]
        trees = [p for n in nodes for p in [n, *n.children(recursive=True)]]
        bodies = _bodies(STREAMS, max_new=48)
        results = await burst_with_a_kill(
            c,
            cluster.url,
            bodies,
            -nodes[dead].pid,  # that node's process group: its launcher or rank 0, and its ranks
            victim,
            "x-kvship-decode",
            busy_tokens=48,
            victim_auth=cluster.worker_headers["authorization"],
        )
        t_kill = time.monotonic()
        with contextlib.suppress(psutil.TimeoutExpired):
            survivor.wait(EXIT_WITHIN_S + 5)  # (not our child: psutil polls it)
        assert not survivor.is_running() or survivor.status() == psutil.STATUS_ZOMBIE
        assert time.monotonic() - t_kill < EXIT_WITHIN_S
        await asyncio.sleep(2)  # a rank notices its launcher is gone within a second
        left = [p.pid for p in trees if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"processes left: {left}"
        resumed = await check_burst(c, cluster.url, bodies, results)
        assert resumed >= 1
        # kvship local saw the other node exit 1 by itself, restarted the worker (both nodes) and the router
        # took it back
        deadline = time.monotonic() + 120
        while True:
            log = cluster.log("local", 400)
            name = next(n for n in ("decode-0", "decode-1") if f"{n} ({victim})" in log)
            node_name = {0: name, 1: f"{name}-node1"}
            gone = f"{node_name[dead]} (" in log and f"{node_name[1 - dead]} (" in log
            if gone and log.count(f"{name} restarted") >= 1:
                workers = {
                    w["url"]: w
                    for w in (await c.get(cluster.url + "/workers", headers=cluster.worker_headers)).json()["workers"]
                }
                if workers[victim]["healthy"]:
                    break
            assert time.monotonic() < deadline, log
            await asyncio.sleep(0.5)
        lines = [line for line in log.splitlines() if "exited with status" in line]
        assert any(line.split(" (")[0].endswith(node_name[dead]) and "status -9" in line for line in lines), lines
        assert any(line.split(" (")[0].endswith(node_name[1 - dead]) and "status 1;" in line for line in lines), lines
        new_nodes = _worker_nodes(cluster.proc.pid, victim)
        assert {p.pid for p in new_nodes}.isdisjoint(p.pid for p in nodes)
        served_by = set()
        for _ in range(6):
            r = await c.post(
                cluster.url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 2}}
            )
            assert r.status_code == 200, r.text
            served_by.add(r.headers["x-kvship-decode"])
        assert victim in served_by
    wait_kv_free(cluster.workers("prefill") + cluster.workers("decode"), headers=cluster.worker_headers)
