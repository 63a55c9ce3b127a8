"""A worker spanning two "nodes" on localhost, and topologies that must fail fast (real ``kvship serve`` processes).

Each node is its own ``kvship serve --nnodes 2 --node-rank R --dist-init-addr 127.0.0.1:PORT`` process tree
(its own session): node 0 is rank 0 (HTTP, tokenizer), node 1 a launcher of rank 1 that answers ``/health`` with
its rank's state.  Greedy tokens equal the single process at ``--tp-size 1``; when either node dies, the other
exits non-zero within a bounded time.  Bad topologies exit at once with one error line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import KVDriver, build_tiny_model
from server_fixtures import ROOT, enter_together, free_port, start_server

from kvship.engine.config import ServerArgs
from kvship.engine.model_runner import ModelRunner

PROMPTS = [[5, 17, 33, 101, 7, 250, 64, 9, 12], [40, 41, 42, 300, 2, 77]]
GREEDY_TOKENS = 8
EXIT_WITHIN_S = 30


def _serve(args: list[str], timeout: float = 60) -> tuple[int, list[str], float]:
    """Run ``kvship serve args`` to its end: (exit code, its ERROR lines, seconds)."""
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "kvship.app.cli", "serve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    errors = [line for line in (out.stdout + out.stderr).splitlines() if " ERROR " in line]
    return out.returncode, errors, time.monotonic() - t0


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--tp-size", "3", "--nnodes", "2"], 2, "3 ranks do not split evenly over --nnodes 2"),
        (["--tp-size", "2", "--nnodes", "2", "--node-rank", "2"], 2, "--node-rank 2 is out of range for --nnodes 2"),
        (["--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--no-addr"], 2, "needs --dist-init-addr"),
        (["--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-timeout", "2"], 1, "cannot reach"),
    ],
    ids=["sizes", "node-rank", "no-addr", "unreachable"],
)
def test_bad_topology_fails_fast_with_one_clear_line(tiny_llama_dir, args, code, message):
    if "--no-addr" in args:
        args = [a for a in args if a != "--no-addr"]
    else:  # a port nothing listens on
        args = args + ["--dist-init-addr", f"127.0.0.1:{free_port()}"]
    rc, errors, seconds = _serve(["--model-path", tiny_llama_dir, "--port", str(free_port()), *args])
    assert rc == code, errors
    assert len(errors) == 1 and message in errors[0], errors
    assert seconds < 25, f"took {seconds:.1f} s"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("mn_qwen3")), "qwen3", seed=4)


@pytest.fixture(scope="module")
def tp1_greedy(qwen3_dir) -> list[list[int]]:
    drv = KVDriver(ModelRunner(ServerArgs(model_path=qwen3_dir, max_total_tokens=1024, max_running_requests=8)))
    return [drv.greedy(p, GREEDY_TOKENS) for p in PROMPTS]


def _two_nodes(stack: contextlib.ExitStack, path: str, parallel: tuple[str, ...] = ("--tp-size", "2")) -> list:
    common = ["--model-path", path, "--max-total-tokens", "1024", *parallel, "--nnodes", "2"]
    common += ["--dist-init-addr", f"127.0.0.1:{free_port()}", "--dist-timeout", "20"]
    nodes = [start_server(common + ["--node-rank", str(r)], keep_log=True, timeout=240) for r in (0, 1)]
    return enter_together(stack, nodes)


def _wait_exit(handle, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while handle.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not handle.alive(), f"still running {seconds} s after the other node died:\n{handle.log_tail()}"
    return handle.proc.returncode


@pytest.mark.parametrize("victim", [1, 0], ids=["node1-dies", "node0-dies"])
def test_tp2_over_two_nodes_matches_tp1_and_the_other_node_exits_when_one_dies(qwen3_dir, tp1_greedy, victim):
    import psutil

    with contextlib.ExitStack() as stack:
        nodes = _two_nodes(stack, qwen3_dir)
        greedy = {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
        r = nodes[0].post("/generate", json={"input_ids": PROMPTS, "sampling_params": greedy})
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == tp1_greedy
        health = nodes[1].get("/health").json()
        assert health["node_rank"] == 1 and [(s["rank"], s["alive"]) for s in health["ranks"]] == [(1, True)]
        assert nodes[0].get("/get_server_info").json()["tp_size"] == 2

        tree = [psutil.Process(nodes[victim].proc.pid)] + psutil.Process(nodes[victim].proc.pid).children(True)
        other = nodes[1 - victim]
        other_tree = [psutil.Process(other.proc.pid)] + psutil.Process(other.proc.pid).children(True)
        os.killpg(nodes[victim].proc.pid, signal.SIGKILL)  # the whole node: its launcher and its ranks
        assert _wait_exit(other, EXIT_WITHIN_S) == 1
        assert "tensor-parallel" in other.log_tail(200)
        time.sleep(2)  # the other node's ranks follow their launcher
        left = [p.pid for p in tree + other_tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"processes left: {left}"


def test_pp2_over_two_nodes_matches_tp1_one_stage_a_node_and_node1_dying_ends_node0(qwen3_dir, tp1_greedy):
    """``--pp-size 2 --nnodes 2``: stage 0 (layers 0-1, rank 0, HTTP) on node 0, stage 1 on node 1; the stages'
    hidden states, device ids and results cross the "nodes" (docs/parallel.md, "Pipeline parallelism")."""
    import psutil

    with contextlib.ExitStack() as stack:
        nodes = _two_nodes(stack, qwen3_dir, ("--pp-size", "2"))
        greedy = {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
        r = nodes[0].post("/generate", json={"input_ids": PROMPTS, "sampling_params": greedy})
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == tp1_greedy
        info = nodes[0].get("/get_server_info").json()
        assert info["pp_size"] == 2 and info["pp_chained_launches"] > 0, info
        assert nodes[1].get("/health").json()["node_rank"] == 1

        other_tree = [psutil.Process(nodes[0].proc.pid)] + psutil.Process(nodes[0].proc.pid).children(True)
        os.killpg(nodes[1].proc.pid, signal.SIGKILL)
        assert _wait_exit(nodes[0], EXIT_WITHIN_S) == 1
        time.sleep(2)
        left = [p.pid for p in other_tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"processes left: {left}"


@pytest.mark.parametrize("sizes", [("--tp-size", "2"), ("--pp-size", "2")], ids=["tp2", "pp2"])
def test_torchrun_started_ranks_serve_what_tp1_does(qwen3_dir, tp1_greedy, sizes):
    """``torchrun --nproc-per-node 2 -m kvship.app.cli serve --tp-size 2`` (or ``--pp-size 2``: one stage a
    rank): torchrun starts both ranks (kvship spawns none), the topology comes from its environment, rank 0
    serves HTTP."""
    import httpx

    port = free_port()
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "kvship.app.cli", "serve", "--model-path", qwen3_dir, "--max-total-tokens", "1024"]
    cmd += [*sizes, "--port", str(port)]
    with open(os.devnull, "wb") as devnull:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=devnull, stderr=devnull, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"torchrun exited with {proc.returncode}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "not healthy in time"
            time.sleep(0.3)
        greedy = {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(
            f"http://127.0.0.1:{port}/generate", json={"input_ids": PROMPTS, "sampling_params": greedy}, timeout=60
        )
        assert [o["output_ids"] for o in r.json()] == tp1_greedy
        info = httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=10).json()
        want = (2, 1) if sizes[0] == "--tp-size" else (1, 2)
        assert (info["tp_size"], info["pp_size"]) == want, info
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the agent only: its ranks run in sessions of their own
        proc.wait(10)
    # the ranks notice their agent is gone and exit: none is left serving
    deadline = time.monotonic() + 30
    while _ranks_serving(port):
        assert time.monotonic() < deadline, f"ranks of the killed torchrun still run: {_ranks_serving(port)}"
        time.sleep(0.5)


def _ranks_serving(port: int) -> list[int]:
    """Pids of processes whose command line is a ``kvship serve`` on ``port``."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            continue
        if b"serve" in argv and b"--port" in argv and str(port).encode() in argv:
            found.append(int(pid))
    return found
