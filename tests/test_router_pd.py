"""PD mode: each request goes to a prefill and a decode test-double worker with bootstrap fields injected."""

from __future__ import annotations

import asyncio
import contextlib
import json

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
    return RouterConfig(
        debug_headers=True, pd=True, prefill=[p.url for p in prefill], decode=[d.url for d in decode], **kw
    )


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
        rooms, tokens = set(), set()
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
            token = p_req["body"].get("bootstrap_token")  # the room's token (docs/pd.md), the same to both
            assert isinstance(token, str) and len(token) >= 32
            assert (
                p_req["body"]
                == d_req["body"]
                == {"text": "hello", "sampling_params": {}, **boot, "bootstrap_token": token}
            )
            rooms.add(boot["bootstrap_room"])
            tokens.add(token)
        assert len(rooms) == 4 and len(tokens) == 4
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


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("code", ["pd_request_failed", None])
async def test_a_worker_reporting_its_pairs_failure_is_retried_elsewhere_but_keeps_its_circuit_closed(role, code):
    """A live PD worker answers 503 ``pd_request_failed`` when its peer died mid-transfer: the request goes to
    another pair, but the reporter's circuit stays closed (the CI flake this fixes: one decode worker's
    death opened the circuit of the prefill worker paired with it for 30 s).  Any other 503 opens it."""
    with pd_fleet(2, 2) as (prefill, decode):
        reporter = (prefill if role == "prefill" else decode)[0]
        reporter.control(fail_next=3, fail_status=503, fail_code=code)
        config = pd_config(
            prefill,
            decode,
            policy="round_robin",
            prefill_policy="round_robin",
            circuit_failure_threshold=2,
            circuit_cooldown=600,
        )
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                rs = [await c.post(url + "/generate", json={"text": f"t{i}"}) for i in range(6)]
                state = {w["url"]: w for w in (await c.get(url + "/workers")).json()["workers"]}[reporter.url]
                metrics = (await c.get(url + "/metrics")).text
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        assert len(reporter.requests()) >= 2
        failures = 3 if code == "pd_request_failed" else 2  # (an open circuit gets no more attempts)
        assert state["circuit"] == ("closed" if code else "open") and state["total_failures"] == failures, state
        assert (
            f'kvship_router_worker_failures_total{{reason="http_503",worker="{reporter.url}"}} {failures}.0' in metrics
        )


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
        async with running_router(pd_config(prefill, [], admin_api_key="adm")) as (url, _):
            async with httpx.AsyncClient(timeout=30, headers={"authorization": "Bearer adm"}) as c:
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


# -- a decode worker that dies right after a chat stream's role chunk --------------------------------------


def _chat_event(delta: dict, finish=None, ids=None, prompt_ids=None) -> bytes:
    obj = {"id": "c", "object": "chat.completion.chunk", "model": "fake", "created": 1}
    obj["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    obj["kvship_token_ids"] = ids or []
    if prompt_ids is not None:
        obj["kvship_prompt_ids"] = prompt_ids
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@contextlib.asynccontextmanager
async def _fake_worker(mode: str, chat):
    """A worker in this event loop (aiohttp): the info routes the router reads, and ``chat(request, response)``
    writing a prepared SSE response of ``/v1/chat/completions`` (and of ``/v1/completions``)."""
    from aiohttp import web

    async def info(_):
        port = 9100 if mode == "prefill" else None
        return web.json_response({"served_model_name": "fake", "mode": mode, "disaggregation_bootstrap_port": port})

    async def ok(_):
        return web.json_response({"model_path": "/models/fake", "is_generation": True})

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(request):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await chat(request, response)
        return response

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/get_server_info", info)
    app.router.add_get("/get_model_info", ok)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)  # (a resumed stream's continuation)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_a_decode_worker_dying_after_its_chat_role_chunk_fails_the_attempt_instead_of_waiting_for_prefill():
    """Decode answers a chat stream's role chunk before its room reaches prefill.  When it dies then, prefill
    waits for that registration until its bootstrap timeout, and its first token may never come as an event
    (text the detokenizer holds back): the router waited with it, the client's stream hung for minutes (the
    layer-wise resume-test time-outs).  Now decode's stream ending fails the attempt at once: prefill's call is
    closed (the worker aborts the room) and the request goes to another pair."""
    calls = {"prefill": [], "decode": 0}
    role = {"role": "assistant", "content": ""}

    async def prefill(request, response):
        i = len(calls["prefill"])
        closed = asyncio.Event()
        calls["prefill"].append(closed)
        await response.write(_chat_event(role, prompt_ids=[1, 2, 3]))
        # the first attempt's room is never registered (its decode died): like a prefill worker, say
        # nothing more until the router gives up on the call; later attempts finish
        for _ in range(600 if i == 0 else 5):
            await asyncio.sleep(0.02)
            if request.transport is None or request.transport.is_closing():
                closed.set()
                return
        await response.write(_chat_event({}, finish="length"))
        await response.write(b"data: [DONE]\n\n")

    async def decode(request, response):
        calls["decode"] += 1
        await response.write(_chat_event(role, prompt_ids=[1, 2, 3]))
        if calls["decode"] == 1:
            await asyncio.sleep(0.1)
            request.transport.abort()  # SIGKILLed before it registered the room
            return
        for k, word in enumerate(["hello", " there"]):
            await response.write(_chat_event({"content": word}, ids=[10 + k]))
        await response.write(_chat_event({}, finish="length"))
        await response.write(b"data: [DONE]\n\n")

    async with (
        _fake_worker("prefill", prefill) as p,
        _fake_worker("decode", decode) as d0,
        _fake_worker("decode", decode) as d1,
    ):
        config = RouterConfig(
            debug_headers=True,
            pd=True,
            prefill=[p],
            decode=[d0, d1],
            health_check_interval=60,
            retry_backoff_base=0.01,
            max_resumes=2,
        )
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}

                async def read() -> tuple[httpx.Response, list[str]]:
                    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                        return r, [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]

                r, events = await asyncio.wait_for(read(), 10)
        assert r.status_code == 200 and events[-1] == "[DONE]"
        objs = [json.loads(e) for e in events[:-1]]
        assert "".join(o["choices"][0]["delta"].get("content") or "" for o in objs if o["choices"]) == "hello there"
        assert calls["decode"] == 2 and len(calls["prefill"]) == 2
        assert calls["prefill"][0].is_set()  # the first attempt's prefill call was closed, not left to time out


@pytest.mark.parametrize("code", ["pd_request_failed", "engine_dead"])
async def test_a_decode_stream_failing_on_its_pair_is_resumed_and_keeps_the_decode_circuit_closed(code):
    """Mid-stream, a decode worker whose prefill peer died says so with an error event ``pd_request_failed``:
    the stream is resumed on another pair and that decode worker's circuit stays closed; any other failure
    (``engine_dead``: the worker's own model loop) opens it (threshold 1 here)."""
    calls = {"decode": []}
    role = {"role": "assistant", "content": ""}

    async def prefill(request, response):
        await response.write(_chat_event(role, prompt_ids=[1, 2, 3]))
        await response.write(_chat_event({}, finish="length"))
        await response.write(b"data: [DONE]\n\n")

    def decode_for(url_box):
        async def decode(request, response):
            calls["decode"].append((url_box[0], request.path))
            if request.path == "/v1/completions":  # the continuation: a token-id prompt
                for obj in ({"text": " there", "finish_reason": None}, {"text": "", "finish_reason": "length"}):
                    event = {"id": "k", "object": "text_completion", "choices": [{"index": 0, **obj}]}
                    event["kvship_token_ids"] = [11] if obj["text"] else []
                    await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                await response.write(b"data: [DONE]\n\n")
                return
            await response.write(_chat_event(role, prompt_ids=[1, 2, 3]))
            if len(calls["decode"]) == 1:
                await response.write(_chat_event({"content": "hello"}, ids=[10]))
                err = {"error": {"message": "KV transfer: the peer went away", "code": code}}
                await response.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                return

        return decode

    b0, b1 = [""], [""]
    async with (
        _fake_worker("prefill", prefill) as p,
        _fake_worker("decode", decode_for(b0)) as d0,
        _fake_worker("decode", decode_for(b1)) as d1,
    ):
        b0[0], b1[0] = d0, d1
        config = RouterConfig(
            debug_headers=True,
            pd=True,
            prefill=[p],
            decode=[d0, d1],
            health_check_interval=60,
            retry_backoff_base=0.01,
            circuit_failure_threshold=1,
            circuit_cooldown=600,
            decode_policy="round_robin",
        )
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
                async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
                workers = {w["url"]: w for w in (await c.get(url + "/workers")).json()["workers"]}
        assert r.status_code == 200 and events[-1] == "[DONE]", events
        objs = [json.loads(e) for e in events[:-1]]
        assert "".join(o["choices"][0]["delta"].get("content") or "" for o in objs if o["choices"]) == "hello there"
        [(first, route0), (second, route1)] = calls["decode"]
        assert first != second and route1 == "/v1/completions"  # resumed on the other decode worker
        failed = workers[first]
        assert failed["total_failures"] == 1
        assert failed["circuit"] == ("closed" if code == "pd_request_failed" else "open"), failed
