"""Ports a worker owns: picked out of Mooncake's range, and bound before the model loads.

CI once failed when ``kvship local`` gave prefill-0 an HTTP port that the worker's own Mooncake transfer
engine, started before the HTTP server, had taken meanwhile: the worker exited ("address already in use")
and kvship local's health check spoke HTTP to Mooncake's TCP transport.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from kvship.app.local import free_port_run
from kvship.common.ports import MOONCAKE_PORTS, free_port


def test_mooncake_engines_take_their_ports_in_the_range_we_keep_out_of():
    """The range is Mooncake's behaviour, not ours: check it against the real library."""
    engine_mod = pytest.importorskip("mooncake.engine")
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mooncake.engine import TransferEngine\n"
            "es = [TransferEngine() for _ in range(8)]\n"
            "for e in es: assert e.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') == 0\n"
            "print(*[e.get_rpc_port() for e in es])",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ports = [int(p) for p in out.stdout.split()]
    assert len(ports) == 8 and all(p in MOONCAKE_PORTS for p in ports), (ports, engine_mod.__file__)


def test_picked_ports_stay_out_of_mooncakes_range():
    picked = [free_port() for _ in range(300)]
    assert not [p for p in picked if p in MOONCAKE_PORTS]
    assert len(set(picked)) > 100  # still spread (a fixed answer would collide between children)
    runs = [free_port_run(4) for _ in range(100)]
    assert not [b for b in runs if any(p in MOONCAKE_PORTS for p in range(b, b + 4))]


def test_a_worker_whose_port_is_taken_exits_1_before_loading_the_model(tiny_llama_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        started = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "kvship.app.cli", "serve", "--model-path", tiny_llama_dir, "--device", "cpu"]
            + ["--host", "127.0.0.1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "Address already in use" in out.stderr
    assert "loaded " not in out.stderr and "Traceback" not in out.stderr  # the model was never loaded
    assert time.monotonic() - started < 60


def test_the_worker_owns_its_port_while_the_model_loads(tiny_llama_dir, tmp_path):
    """The port is bound before the engine is built: a bind to it during start-up fails, and the worker
    answers on it once ready (a request made meanwhile waits in the backlog instead of being refused)."""
    import httpx

    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvship.app.cli", "serve", "--model-path", tiny_llama_dir, "--device", "cpu"]
        + ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"],
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # bind the port ourselves until that fails: the worker has it
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    break
            time.sleep(0.01)
        text = (tmp_path / "serve.log").read_text()
        assert "serving tiny" not in text, text  # taken before the server started (uvicorn binds after this line)
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=120)  # waits in the backlog until served
        assert r.status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_kvship_local_starts_a_worker_again_when_its_picked_port_is_taken(tiny_llama_dir, tmp_path):
    """kvship local picks its workers' ports free and each worker binds its own seconds later; another process
    binding one in between (CI saw it once: decode-0 exited "cannot listen on ...: Address already in use") makes
    that worker exit at once, and kvship local starts it again on another port and points the router there."""
    import argparse

    from kvship.app import local
    from kvship.engine.config import dataclass_from_namespace

    parser = argparse.ArgumentParser()
    local.add_parser(parser.add_subparsers())
    ns = parser.parse_args(["local", "--model-path", tiny_llama_dir, "--device", "cpu", "--transfer-backend", "tcp"])
    cfg, flags = dataclass_from_namespace(local.LocalConfig, ns), dataclass_from_namespace(local.WorkerFlags, ns)
    dep = local.LocalDeployment(cfg, local.worker_argv(flags), "tcp", str(tmp_path))
    decode = dep.workers[-1]
    taken_url = decode.url
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(taken_url.rsplit(":", 1)[1])))
        taken.listen(1)
        try:
            dep.start()
            assert decode.port_retries == 1 and decode.url != taken_url
            assert decode.url in dep.router.argv and taken_url not in dep.router.argv
            assert decode.healthy() and dep.router.healthy()
        finally:
            dep.stop()


def test_the_health_check_of_a_port_another_protocol_holds_is_false_not_an_exception():
    """CI once saw ``kvship local`` die with ``BadStatusLine``: the router's picked port answered with a KV
    data-plane refusal (binary framing, not HTTP).  A health check there is False, like no listener at all, so
    the start-up loop goes on to notice the child that lost its port and retry it."""
    import threading

    from kvship.app.local_child import Child

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]

    def answer() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b'\x00\x00\x008{"v":1,"type":"refuse","reason":"authentication failed"}')

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        child = Child("router", [], f"http://127.0.0.1:{port}", "/dev/null", "/health", health_key="k")
        assert child.healthy() is False
    finally:
        srv.close()
        t.join(timeout=5)


def test_kvship_local_hands_out_no_port_twice_nor_the_routers(monkeypatch):
    """A child binds its port seconds after ``kvship local`` picked it, so a later pick must skip the ports
    already given (the router's first): forced collisions (every pick tries the same ports first) are stepped
    over, never reused."""
    from kvship.app import local

    tries = iter([20001, 20001, 20002, 20001, 20002, 20003, 20004] + list(range(20010, 20100)))
    monkeypatch.setattr(local, "free_port", lambda host="127.0.0.1": next(tries))
    dep = local.LocalDeployment.__new__(local.LocalDeployment)  # the port book alone, no children
    dep.ports_given = {20001}  # the router's --port
    got = [dep.pick_ports(), dep.pick_ports(), dep.pick_ports(2)]
    assert got[0] == 20002 and got[1] not in (20001, 20002) and got[2] not in (20001, 20002, got[1])
    assert dep.ports_given == {20001, got[0], got[1], got[2], got[2] + 1}
