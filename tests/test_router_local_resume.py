"""``kvship local`` as a faithful local deployment: its API key, worker restarts, and resumed streams.

One ``kvship local --prefill 2 --decode 2 --api-key ...`` (tiny random Llama on CPU, TCP transfer):

* the router requires the client key (none / wrong -> 401); the workers refuse it and take only the
  worker key, which the router sends them; the ``openai`` client with the key works end to end,
  streaming included;
* 40 concurrent streams, one decode worker SIGKILLed mid-burst: every stream ends with one
  ``[DONE]`` and the greedy text of an undisturbed run; ``kvship local`` logs the exit and restarts
  the worker, the router takes it back and routes to it again; KV slots are all free afterwards;
* the same with a prefill worker SIGKILLed mid-burst (streams whose decode side already answered
  get ``pd_request_failed`` from it and are resumed; the others are retried before their first byte).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest
from pd_fixtures import start_local
from test_router_resume import N_STREAMS, _bodies, _resumes, burst_with_a_kill, check_burst, wait_kv_free

pytestmark = pytest.mark.timeout(400)

KEY = "local-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


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
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--max-total-tokens",
        "8192",
        # 4 at once: a decode worker's 20 streams of a burst run in waves, so it stays busy long after its
        # first tokens and the watcher's polls of a busy worker on a loaded machine land inside the burst
        "--max-running-requests",
        "4",
        "--policy",
        "round_robin",
    ]
    with start_local(args, api_key=KEY) as c:
        yield c


def test_kvship_local_client_key_is_required_by_the_router_and_the_workers_take_only_the_worker_key(cluster):
    import openai

    url = cluster.url
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for headers in ({}, {"authorization": "Bearer wrong"}):
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 401
        r = httpx.post(url + "/v1/chat/completions", json=chat, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/health").status_code == 200  # open, as documented
    worker = cluster.workers("decode")[0]
    assert httpx.get(worker + "/v1/models").status_code == 401  # the workers want a key too ...
    assert httpx.get(worker + "/v1/models", headers=AUTH).status_code == 401  # ... never the client key
    assert httpx.get(worker + "/v1/models", headers=cluster.worker_headers).status_code == 200
    assert httpx.get(url + "/workers", headers=AUTH).status_code == 403  # the router's worker list neither
    assert [m["id"] for m in httpx.get(url + "/v1/models", headers=AUTH).json()["data"]] == ["tiny"]
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    out = client.chat.completions.create(model="tiny", messages=chat["messages"], max_tokens=6, temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens >= 1
    pieces = [
        ch.choices[0].text or ""
        for ch in client.completions.create(model="tiny", prompt="the fox", max_tokens=6, temperature=0, stream=True)
        if ch.choices
    ]
    assert (
        "".join(pieces)
        == client.completions.create(model="tiny", prompt="the fox", max_tokens=6, temperature=0).choices[0].text
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong").models.list()


async def test_decode_worker_sigkilled_mid_burst_streams_complete_and_the_worker_comes_back(cluster):
    # long enough that the watcher, polling a busy worker on a loaded machine, sees it mid-burst (with all 20
    # streams running at once, twice in CI the watcher's ~20 polls all fell before 64 tokens or after the end)
    bodies = _bodies(N_STREAMS, max_new=128)
    decode = cluster.workers("decode")
    victim = decode[0]
    old_pid = cluster.pid(victim)
    async with httpx.AsyncClient(timeout=120, headers=AUTH, limits=httpx.Limits(max_connections=200)) as c:
        # killed by a watcher of the worker itself (not of the client, which on a loaded machine may read the
        # first chunks only after the victim finished everything): once it made a stream's worth and is still busy
        results = await burst_with_a_kill(
            c,
            cluster.url,
            bodies,
            old_pid,
            victim,
            "x-kvship-decode",
            busy_tokens=2 * 128,  # two streams' worth, with the other waves still to run
            victim_auth=cluster.worker_headers["authorization"],
        )
        resumed = await check_burst(c, cluster.url, bodies, results)
        assert resumed >= 1
        assert _resumes((await c.get(cluster.url + "/metrics", headers=cluster.worker_headers)).text) == resumed
        # kvship local logged the exit and restarts the worker; the router takes it back
        deadline = time.monotonic() + 120
        while True:
            log = cluster.log("local", 400)
            workers = {
                w["url"]: w
                for w in (await c.get(cluster.url + "/workers", headers=cluster.worker_headers)).json()["workers"]
            }
            back = workers[victim]["healthy"]
            if back:
                try:
                    back = cluster.pid(victim) != old_pid
                except httpx.HTTPError:
                    back = False
            if back and "restarted" in log:
                break
            assert time.monotonic() < deadline, log
            time.sleep(0.5)
        name = next(n for n in ("decode-0", "decode-1") if f"{n} ({victim}) exited with status -9" in log)
        assert f"{name}.log" in log and f"{name} restarted" in log
        served_by = set()
        for _ in range(6):
            r = await c.post(
                cluster.url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 2}}
            )
            assert r.status_code == 200, r.text
            served_by.add(r.headers["x-kvship-decode"])
        assert victim in served_by  # the restarted worker takes traffic again
        # the prefill workers that were sending to the dead one reported their pair's failure, not their own
        workers = (await c.get(cluster.url + "/workers", headers=cluster.worker_headers)).json()["workers"]
        assert all(w["circuit"] == "closed" for w in workers if w["role"] == "prefill"), workers
    wait_kv_free(cluster.workers("prefill") + decode, headers=cluster.worker_headers)


async def test_prefill_worker_sigkilled_mid_burst_streams_complete_with_the_undisturbed_text(cluster):
    bodies = _bodies(N_STREAMS, max_new=32)
    victim = cluster.workers("prefill")[0]
    old_pid = cluster.pid(victim)
    async with httpx.AsyncClient(timeout=120, headers=AUTH, limits=httpx.Limits(max_connections=200)) as c:
        deadline = time.monotonic() + 60
        while True:  # the burst must reach the victim: every worker serving (the previous test's restart is over)
            workers = (await c.get(cluster.url + "/workers", headers=cluster.worker_headers)).json()["workers"]
            if all(w["state"] == "serving" for w in workers):
                break
            assert time.monotonic() < deadline, workers
            await asyncio.sleep(0.5)
        results = await burst_with_a_kill(c, cluster.url, bodies, old_pid, victim, "x-kvship-prefill", min_started=1)
        await check_burst(c, cluster.url, bodies, results)
        deadline = time.monotonic() + 120
        while True:  # restarted and taken back
            workers = {
                w["url"]: w
                for w in (await c.get(cluster.url + "/workers", headers=cluster.worker_headers)).json()["workers"]
            }
            if workers[victim]["healthy"]:
                with contextlib.suppress(httpx.HTTPError):
                    if cluster.pid(victim) != old_pid:
                        break
            assert time.monotonic() < deadline, cluster.log("local", 100)
            await asyncio.sleep(0.5)
    wait_kv_free(cluster.workers("prefill") + cluster.workers("decode"), headers=cluster.worker_headers)
