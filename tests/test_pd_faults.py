"""PD failure handling with real processes (``kvship local``, 2 prefill x 2 decode, tcp).

Every scenario ends with the surviving workers reporting every KV slot free
(``free_slots == total_slots`` in ``/get_server_info``) and no request left in
any queue.  The tests of the shared cluster run in file order: two of them kill
a worker each, and the router keeps serving on what is left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time

import httpx
import pytest
from kv_faults import corrupt_kv_env
from pd_fixtures import make_prompts, room_token, start_local, unified_greedy

pytestmark = pytest.mark.timeout(400)

CHUNK = 32
TIMEOUT_S = 4


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    args = [
        "--prefill",
        "2",
        "--decode",
        "2",
        "--transfer-backend",
        "tcp",
        "--model-path",
        tiny_llama_dir,
        "--device",
        "cpu",
        "--chunked-prefill-size",
        str(CHUNK),
        "--max-total-tokens",
        "16384",
        "--policy",
        "round_robin",
        "--disaggregation-bootstrap-timeout",
        str(TIMEOUT_S),
        "--disaggregation-waiting-timeout",
        str(TIMEOUT_S),
        # killed workers stay dead and broken streams end with the error event: the worker-side paths
        # under test here (restarts and resumed streams: tests/test_router_local_resume.py)
        "--no-restart-workers",
        "--max-resumes",
        "0",
    ]
    with start_local(args) as c:
        yield c


def _all(c) -> list[str]:
    return c.workers("prefill") + c.workers("decode")


def _alive(c, urls: list[str]) -> list[str]:
    out = []
    for u in urls:
        try:
            httpx.get(u + "/health", timeout=2)
            out.append(u)
        except httpx.HTTPError:
            pass
    return out


def _error_message(resp: httpx.Response) -> str:
    return resp.json()["error"]["message"]


def test_transfer_timeouts_give_a_clear_error_and_free_the_slots(cluster):
    p, d = cluster.workers("prefill")[0], cluster.workers("decode")[0]
    port = cluster.info(p)["disaggregation_bootstrap_port"]
    body = {
        "input_ids": list(range(5, 60)),
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
    }
    t0 = time.monotonic()
    key = cluster.worker_headers  # the workers take only the worker key (docs/router.md, "Authentication")
    rooms = [random.getrandbits(62) for _ in range(2)]  # with their tokens (docs/pd.md, "KV plane authentication")
    only_decode = httpx.post(
        d + "/generate",
        json={**body, "bootstrap_room": rooms[0], "bootstrap_token": room_token(rooms[0])},
        timeout=60,
        headers=key,
    )
    only_prefill = httpx.post(
        p + "/generate",
        json={**body, "bootstrap_room": rooms[1], "bootstrap_token": room_token(rooms[1])},
        timeout=60,
        headers=key,
    )
    assert time.monotonic() - t0 < 4 * TIMEOUT_S + 10
    assert only_decode.status_code == 503, only_decode.text
    assert "KV transfer failed" in _error_message(only_decode)
    assert "timeout" in _error_message(only_decode) or "never received" in _error_message(only_decode)
    assert only_prefill.status_code == 503, only_prefill.text
    assert "bootstrap timeout" in _error_message(only_prefill)
    cluster.wait_free(_all(cluster))


def test_client_disconnect_frees_slots_on_both_sides(cluster):
    body = {
        "input_ids": list(range(5, 40)),
        "stream": True,
        "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True},
    }
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", cluster.url + "/generate", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream
    cluster.wait_free(_all(cluster))
    # disconnects while a request waits in a transfer stage (the prefill never gets it): decode in
    # its transfer queue, prefill in its bootstrap queue; both must free well before the timeouts
    p, d = cluster.workers("prefill")[0], cluster.workers("decode")[0]
    port = cluster.info(p)["disaggregation_bootstrap_port"]
    for url, stage in ((d, "transfer_queue"), (p, "bootstrap_queue")):
        room = random.getrandbits(62)
        payload = json.dumps(
            {
                "input_ids": list(range(5, 90)),
                "stream": True,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": port,
                "bootstrap_room": room,
                "bootstrap_token": room_token(room),
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            }
        ).encode()
        host, http_port = url.removeprefix("http://").split(":")
        t0 = time.monotonic()
        sock = socket.create_connection((host, int(http_port)), timeout=10)
        auth = cluster.worker_headers["authorization"].encode()  # the workers take only the worker key
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
            + auth
            + b"\r\nContent-Length: %d\r\n\r\n" % len(payload)
            + payload
        )
        _wait_for(lambda: cluster.info(url)[stage], 10, f"the request to reach {stage}")
        sock.close()
        cluster.wait_free(_all(cluster), timeout=TIMEOUT_S)
        assert time.monotonic() - t0 < TIMEOUT_S, "freed by the timeout, not by the disconnect"


def _wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def test_prefill_killed_while_decode_waits_for_kv_then_retry_on_other_pair_succeeds(cluster, tiny_llama_dir):
    prefills, decodes = cluster.workers("prefill"), cluster.workers("decode")
    pids = {u: cluster.pid(u) for u in prefills}
    prompt = make_prompts(1, seed=32, lo=300, hi=300)[0]
    result: dict = {}
    # Freeze both prefills so the one that gets the request is caught before it can ship anything.
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: result.update(resp=cluster.generate(prompt, max_new=8, timeout=120)))
        t.start()

        def busy_prefill():
            for w in httpx.get(cluster.url + "/workers", timeout=5, headers=cluster.worker_headers).json()["workers"]:
                if w["role"] == "prefill" and w["in_flight"]:
                    return w["url"]
            return None

        victim = _wait_for(busy_prefill, 10, "the router to pick a prefill")
        for u, pid in pids.items():
            if u != victim:
                os.kill(pid, signal.SIGCONT)
        # decode has allocated and registered the prompt's pages: it waits for KV that will never come
        _wait_for(lambda: any(cluster.info(u)["transfer_queue"] for u in decodes), 10, "decode to register")
    except BaseException:
        for pid in pids.values():
            os.kill(pid, signal.SIGCONT)  # never leave a worker frozen behind a failed test
        raise
    os.kill(pids[victim], signal.SIGKILL)
    t.join(120)
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvship-prefill"] != victim  # the router retried on the other pair
    assert resp.json()["output_ids"] == unified_greedy(tiny_llama_dir, [prompt], 8, chunked_prefill_size=CHUNK)[0]
    survivors = _alive(cluster, prefills + decodes)
    assert victim not in survivors and len(survivors) == 3
    cluster.wait_free(survivors)


def _router_sees_only_live_workers(cluster) -> bool:
    """Every worker the router still calls healthy answers (a worker killed by an earlier test of this module
    is out of rotation), so this test's pair is two live workers."""
    listed = httpx.get(cluster.url + "/workers", timeout=5, headers=cluster.worker_headers).json()["workers"]
    healthy = [w["url"] for w in listed if w.get("healthy")]
    return bool(healthy) and set(_alive(cluster, healthy)) == set(healthy)


def test_decode_killed_mid_stream_router_reports_it_and_prefill_frees(cluster):
    _wait_for(lambda: _router_sees_only_live_workers(cluster), 30, "the router to drop the workers killed before")
    body = {
        "input_ids": list(range(7, 30)),
        "stream": True,
        "sampling_params": {"max_new_tokens": 1900, "temperature": 0, "ignore_eos": True},
    }
    events = []
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", cluster.url + "/generate", json=body) as r:
            assert r.status_code == 200
            victim = r.headers["x-kvship-decode"]
            killed = False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3 and not killed:
                    os.kill(cluster.pid(victim), signal.SIGKILL)
                    killed = True
    errors = [json.loads(e)["error"] for e in events if e.startswith("{") and "error" in json.loads(e)]
    assert errors and "mid-stream" in errors[-1]["message"], events[-3:]
    survivors = _alive(cluster, _all(cluster))
    assert victim not in survivors
    cluster.wait_free(survivors)
    # the deployment still serves on the remaining pair
    assert cluster.generate(list(range(5, 20)), max_new=4).status_code == 200
    cluster.wait_free(survivors)


def test_corrupted_page_is_detected_by_checksum_and_the_request_fails_cleanly(tiny_llama_dir):
    args = [
        "--transfer-backend",
        "tcp",
        "--model-path",
        tiny_llama_dir,
        "--device",
        "cpu",
        "--page-size",
        "16",
        "--max-total-tokens",
        "8192",
        "--kv-transfer-checksum",
    ]
    # test-only hook (tests/kv_faults.py) loaded into the workers: every transfer gets a wrong page
    with start_local(args, env=corrupt_kv_env(every=1)) as c:
        resp = c.generate(list(range(5, 70)), max_new=4)
        assert resp.status_code == 503, resp.text
        assert "checksum mismatch" in _error_message(resp)
        c.wait_free(_all(c))
