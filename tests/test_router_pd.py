"""PD mode: each request goes to a prefill and a decode test-double worker with bootstrap fields injected."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from router_fixtures import running_router, start_double

from kvship.router.config import RouterConfig

pytestmark = pytest.mark.timeout(120)

CHAT = {"model": "double-model", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


@contextlib.contextmanager
def pd_fleet(n_prefill: int = 2, n_decode: int = 2):
    with contextlib.ExitStack() as stack:
        prefill = [
            stack.enter_context(start_double(name=f"p{i}", mode="prefill", bootstrap_port=8998 + i))
            for i in range(n_prefill)
        ]
        decode = [stack.enter_context(start_double(name=f"d{i}", mode="decode")) for i in range(n_decode)]
        yield prefill, decode


def pd_config(prefill, decode, **kw) -> RouterConfig:
    kw.setdefault("health_check_interval", 60)
    kw.setdefault("retry_backoff_base", 0.01)
    return RouterConfig(pd=True, prefill=[p.url for p in prefill], decode=[d.url for d in decode], **kw)


def got(double, request_id: str) -> list[dict]:
    return [r for r in double.requests() if r["headers"].get("x-request-id") == request_id]


async def test_pd_sends_the_request_to_both_workers_with_the_prefill_bootstrap_fields():
    with pd_fleet() as (prefill, decode):
        async with running_router(pd_config(prefill, decode, policy="round_robin")) as (url, _):
            async with httpx.AsyncClient() as c:
                rs = [
                    await c.post(
                        url + "/generate",
                        json={"text": "hello", "sampling_params": {}},
                        headers={"x-request-id": f"pd-{i}"},
                    )
                    for i in range(4)
                ]
                workers = (await c.get(url + "/workers")).json()
        rooms = set()
        for i, r in enumerate(rs):
            assert r.status_code == 200
            p_url, d_url = r.headers["x-kvship-prefill"], r.headers["x-kvship-decode"]
            assert r.headers["x-kvship-worker"] == d_url
            [p] = [p for p in prefill if p.url == p_url]
            [d] = [d for d in decode if d.url == d_url]
            boot = r.json()["bootstrap"]
            assert boot["bootstrap_host"] == "127.0.0.1" and boot["bootstrap_port"] == p.bootstrap_port
            assert 0 <= boot["bootstrap_room"] < 2**63
            [p_req] = got(p, f"pd-{i}")
            [d_req] = got(d, f"pd-{i}")
            assert p_req["body"] == d_req["body"] == {"text": "hello", "sampling_params": {}, **boot}
            rooms.add(boot["bootstrap_room"])
        assert len(rooms) == 4
        assert {r.headers["x-kvship-prefill"] for r in rs} == {p.url for p in prefill}
        assert {w["role"] for w in workers["workers"]} == {"prefill", "decode"} and workers["pd"]
        assert sorted(w["bootstrap_port"] for w in workers["workers"] if w["role"] == "prefill") == [8998, 8999]


async def test_pd_streams_the_decode_workers_reply():
    with pd_fleet(1, 1) as (prefill, decode):
        decode[0].control(chunk_delay=0.2)
        async with running_router(pd_config(prefill, decode)) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                loop = asyncio.get_running_loop()
                t0, times, lines = loop.time(), [], []
                async with c.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                    assert r.headers["x-kvship-decode"] == decode[0].url
                    assert r.headers["x-kvship-prefill"] == prefill[0].url
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            times.append(loop.time() - t0)
        assert lines[-1] == "[DONE]" and len(lines) == 6
        assert times[0] < times[-1] - 0.5


async def test_pd_retries_on_another_prefill_worker_when_prefill_fails_first():
    with pd_fleet(2, 1) as (prefill, decode):
        prefill[0].control(fail_next=100, fail_status=503)
        decode[0].control(delay=0.3)  # the decode call is still waiting when prefill fails
        config = pd_config(prefill, decode, policy="round_robin", prefill_policy="round_robin")
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                rs = [
                    await c.post(url + "/generate", json={"text": f"t{i}"}, headers={"x-request-id": f"r{i}"})
                    for i in range(2)
                ]
        assert all(r.status_code == 200 for r in rs)
        assert all(r.headers["x-kvship-prefill"] == prefill[1].url for r in rs)
        assert all(r.json()["bootstrap"]["bootstrap_port"] == prefill[1].bootstrap_port for r in rs)
        tried = [i for i in range(2) if got(prefill[0], f"r{i}")]
        assert tried  # the failing prefill was tried first at least once
        for i in tried:  # ... and its decode call was sent again with a new room
            rooms = {r["body"]["bootstrap_room"] for r in got(decode[0], f"r{i}")}
            assert len(rooms) == 2


async def test_pd_retries_on_another_decode_worker_when_decode_fails():
    with pd_fleet(1, 2) as (prefill, decode):
        decode[0].control(fail_next=100, fail_status=500)
        config = pd_config(prefill, decode, decode_policy="round_robin")
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                rs = [await c.post(url + "/generate", json={"text": f"t{i}"}) for i in range(4)]
        assert all(r.status_code == 200 and r.headers["x-kvship-decode"] == decode[1].url for r in rs)


async def test_pd_prefill_client_error_reaches_the_client_and_cancels_decode():
    with pd_fleet(1, 1) as (prefill, decode):
        prefill[0].control(fail_next=1, fail_status=400)
        decode[0].control(delay=5.0)
        async with running_router(pd_config(prefill, decode)) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                r = await c.post(url + "/generate", json={"text": "x"})
                took = loop.time() - t0
                state = {w["url"]: w for w in (await c.get(url + "/workers")).json()["workers"]}
        assert r.status_code == 400 and took < 3.0
        assert state[decode[0].url]["in_flight"] == 0 and state[prefill[0].url]["in_flight"] == 0


async def test_pd_waits_for_both_roles_and_forwards_batches_with_one_room():
    with pd_fleet(1, 1) as (prefill, decode):
        async with running_router(pd_config(prefill, [])) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                assert (await c.get(url + "/readiness")).status_code == 503
                none = await c.post(url + "/generate", json={"text": "x"})
                wrong = await c.post(url + "/workers", json={"url": decode[0].url, "role": "prefill"})
                no_role = await c.post(url + "/workers", json={"url": decode[0].url})
                added = await c.post(url + "/workers", json={"url": decode[0].url, "role": "decode"})
                assert (await c.get(url + "/readiness")).status_code == 200
                batch = await c.post(url + "/v1/completions", json={"model": "double-model", "prompt": ["a", "b"]})
                one = await c.post(url + "/v1/completions", json={"model": "double-model", "prompt": "a"})
        assert none.status_code == 503 and "decode" in none.json()["error"]["message"]
        assert wrong.status_code == 400 and "decode" in wrong.json()["error"]["message"]
        assert no_role.status_code == 400
        assert added.status_code == 200 and added.json()["role"] == "decode"
        assert batch.status_code == 200  # workers use room + i for item i
        assert isinstance(batch.json()["bootstrap"]["bootstrap_room"], int)
        assert one.status_code == 200
