"""PD with workers that span two "nodes" on localhost (real ``kvship serve`` processes, gloo, every backend).

Per transfer backend (tcp, mooncake, nixl) three workers run on CPU with a tiny random Llama (4 heads / 2 KV
heads, so each rank of a TP=2 worker holds one KV head):

* ``P1``: a prefill worker at ``--tp-size 1``;
* ``P2``: a prefill worker at ``--tp-size 2 --nnodes 2``;
* ``D2``: a decode worker at ``--tp-size 2 --nnodes 2``.

Each two-node worker is two process trees (``--node-rank 0`` and ``1``, one ``--dist-init-addr``), and node 1
binds **127.0.0.2**, node 0 127.0.0.1: a rank that advertised its node 0's address instead of its own (for its
bootstrap server, its tcp data port or its Mooncake session) would be unreachable, so these runs show that
every rank registers its own KV and is reached at its own host (docs/parallel.md, "PD across nodes").

The PD requests are sent by hand the way the router sends them (the same request to the decode and the
prefill worker with one room): ``P1 -> D2`` is a decode worker spanning two nodes fed by a TP=1 prefill,
``P2 -> D2`` a prefill spanning two nodes feeding a TP=2 decode.  Greedy tokens equal the unified scheduler's
at TP=1, and afterwards every rank of every worker has all its KV slots back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import httpx
import pytest
from pd_fixtures import make_prompts, room_token, unified_greedy
from server_fixtures import ROOT, free_port

from kvship.engine.disagg import BackendUnavailableError, get_transfer_backend

PROMPTS = make_prompts(3, seed=32, lo=3, hi=40)
MAX_NEW = 6
NODE_HOSTS = ("127.0.0.1", "127.0.0.2")  # node r of a two-node worker binds its own loopback address
COMMON = ["--device", "cpu", "--max-total-tokens", "2048", "--page-size", "4", "--dist-timeout", "30"]


class Node:
    """One ``kvship serve`` process tree (its own session), with its log file."""

    def __init__(self, args: list[str], host: str, env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix=f"kvship-pd-mn-{self.port}-", suffix=".log")
        cmd = [sys.executable, "-m", "kvship.app.cli", "serve", *args, "--host", host, "--port", str(self.port)]
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path, "rb") as f:
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-n:])

    def healthy(self) -> bool:
        assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.log_tail()}"
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)


def _worker(mode: str, tp: int, nnodes: int, model: str, backend: str, env: dict[str, str]) -> list[Node]:
    """The node processes of one worker (node 0 first)."""
    args = ["--model-path", model, *COMMON, "--mode", mode, "--tp-size", str(tp)]
    args += ["--disaggregation-transfer-backend", backend]
    if mode == "prefill":
        args += ["--disaggregation-bootstrap-port", str(_free_port_run(tp))]
    if nnodes > 1:
        args += ["--nnodes", str(nnodes), "--dist-init-addr", f"127.0.0.1:{free_port()}"]
        return [Node(args + ["--node-rank", str(r)], NODE_HOSTS[r], env) for r in range(nnodes)]
    return [Node(args, NODE_HOSTS[0], env)]


def _free_port_run(n: int) -> int:
    from kvship.app.local import free_port_run

    return free_port_run(n)


@pytest.fixture(scope="module", params=["tcp", "mooncake", "nixl"])
def workers(request, tiny_llama_dir) -> Iterator[dict[str, list[Node]]]:
    backend = request.param
    try:
        get_transfer_backend(backend)
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVSHIP_KV_TRANSFER_SECRET=secrets.token_bytes(32).hex())
    env.pop("KVSHIP_API_KEY", None)
    out: dict[str, list[Node]] = {}
    try:
        out["P1"] = _worker("prefill", 1, 1, tiny_llama_dir, backend, env)
        out["P2"] = _worker("prefill", 2, 2, tiny_llama_dir, backend, env)
        out["D2"] = _worker("decode", 2, 2, tiny_llama_dir, backend, env)
        nodes = [n for w in out.values() for n in w]
        deadline = time.monotonic() + 240
        while not all(n.healthy() for n in nodes):
            assert time.monotonic() < deadline, "workers not healthy in time"
            time.sleep(0.3)
        yield out
    finally:
        for w in out.values():
            for n in w:
                n.stop()


def _pd_generate(prefill: Node, decode: Node, ids: list[int]) -> list[int]:
    """One request through ``prefill`` -> ``decode``, sent to both as the router does; decode's output ids."""
    port = httpx.get(prefill.url + "/get_server_info", timeout=10).json()["disaggregation_bootstrap_port"]
    room = random.getrandbits(62)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": room,
        "bootstrap_token": room_token(room),
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        d = pool.submit(httpx.post, decode.url + "/generate", json=body, timeout=120)
        p = pool.submit(httpx.post, prefill.url + "/generate", json=body, timeout=120)
        rd, rp = d.result(), p.result()
    assert rp.status_code == 200, rp.text
    assert rd.status_code == 200, rd.text
    return rd.json()["output_ids"]


def _wait_all_free(heads: list[Node], timeout: float = 30.0) -> None:
    """Every rank of every worker has all its KV slots back (``free_slots_per_rank`` at TP > 1)."""
    deadline = time.monotonic() + timeout
    while True:
        infos = {n.url: httpx.get(n.url + "/get_server_info", timeout=10).json() for n in heads}
        bad = {
            u: (i["free_slots"], i.get("free_slots_per_rank"), i["total_slots"])
            for u, i in infos.items()
            if i["free_slots"] != i["total_slots"]
            or any(f != i["total_slots"] for f in i.get("free_slots_per_rank") or [])
        }
        if not bad:
            return
        assert time.monotonic() < deadline, f"KV slots not back: {bad}"
        time.sleep(0.2)


@pytest.mark.parametrize("prefill", ["P1", "P2"], ids=["tp1-prefill", "prefill-over-2-nodes"])
def test_pd_with_a_worker_spanning_two_nodes_equals_unified_and_frees_every_ranks_kv(workers, prefill, tiny_llama_dir):
    want = unified_greedy(tiny_llama_dir, PROMPTS, MAX_NEW)
    src, dst = workers[prefill][0], workers["D2"][0]
    got = [_pd_generate(src, dst, ids) for ids in PROMPTS]
    assert got == want
    heads = [workers["P1"][0], workers["P2"][0], dst]
    _wait_all_free(heads)
    info = httpx.get(dst.url + "/get_server_info", timeout=10).json()
    assert info["tp_size"] == 2 and len(info["free_slots_per_rank"]) == 2
    health = httpx.get(workers["D2"][1].url + "/health", timeout=10).json()
    assert health["node_rank"] == 1 and [s["rank"] for s in health["ranks"]] == [1]


def test_decode_accepts_each_prefill_ranks_aux_slot_before_registering_with_that_rank():
    """Regression (seen as a flaky ``prefill wrote outside the room's own aux record slot`` in the two-node runs
    above): for a room after the first, decode's link to prefill rank 1 is already up, and decode sent rank 1 its
    ``Register`` before its transfer backend accepted rank 1's aux slot; a prefill rank whose prompt was ready
    writes at once, so its aux record could arrive first and fail the room.  Every ``Register`` must name a
    slot the backend already expects (in-process tcp managers, 2 prefill ranks -> 1 decode rank)."""
    from test_pd_tp import _pool

    from kvship.engine.disagg import AuxInfo, KVTransferConfig, create_kv_manager
    from kvship.engine.disagg.base import KVPoll
    from kvship.engine.disagg.wire import Register

    common = dict(backend="tcp", bootstrap_port=0, total_kv_heads=2, secret=b"kvship-test-kv-transfer-secret-0123")
    prefill = [create_kv_manager("prefill", _pool(1), KVTransferConfig(tp_size=2, tp_rank=r, **common)) for r in (0, 1)]
    addresses = [m.rank_addresses[0] for m in prefill]  # what TPKVManager gathers over the ranks
    for m in prefill:
        m.rank_addresses = addresses
    decode = create_kv_manager("decode", _pool(2), KVTransferConfig(**common))
    events: list[tuple[str, tuple]] = []
    expect_room = decode.backend.expect_room

    def recording_expect_room(key, pages, slots):  # what the backend accepts, in order with the Registers
        events.append(("expect", tuple(slots)))
        expect_room(key, pages, slots)

    decode.backend.expect_room = recording_expect_room
    try:
        for room in (7001, 7002):  # the second room finds both links up
            senders = [m.create_sender(room, room_token(room)) for m in prefill]
            for s in senders:  # prefill is ready before decode registers: it writes on the Register
                s.send([1, 2], AuxInfo(first_token_id=5, first_token_logprob=-0.1, prompt_len=6))
            links = {}
            for addr in addresses:
                link = decode.link_for(*addr)
                if id(link) not in links:
                    send = link.send
                    links[id(link)] = link

                    def recording_send(msg, _send=send):
                        if isinstance(msg, Register):
                            events.append(("register", (msg.aux_slot,)))
                        return _send(msg)

                    link.send = recording_send
            receiver = decode.create_receiver("127.0.0.1", prefill[0].bootstrap_port, room, room_token(room))
            receiver.init([3, 4])
            deadline = time.monotonic() + 20
            while not receiver.poll().is_terminal and time.monotonic() < deadline:
                time.sleep(0.01)
            assert receiver.poll() == KVPoll.Success, receiver.failure_reason
            for link in links.values():
                del link.send  # back to the class's method
        expected: set = set()
        registered = 0
        for kind, slots in events:
            if kind == "expect":
                expected = set(slots)
            else:
                assert slots[0] in expected, events
                registered += 1
        assert registered == 4, events  # two rooms, two prefill ranks each
    finally:
        for m in [decode, *prefill]:
            m.close()
