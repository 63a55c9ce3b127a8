"""The router over real HTTP on loopback, in front of test-double workers (tests/router_fixtures.py)."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import time

import httpx
import pytest
from router_fixtures import reply_words, running_router, start_double, start_doubles

from kvship.router.config import RouterConfig

pytestmark = pytest.mark.timeout(120)

CHAT = {"model": "double-model", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


@pytest.fixture(scope="module")
def doubles():
    with start_doubles(3) as ds:
        yield ds


@pytest.fixture(autouse=True)
def reset_doubles(request):
    if "doubles" in request.fixturenames:
        for d in request.getfixturevalue("doubles"):
            d.control(delay=0.0, chunk_delay=0.0, fail_next=0, fail_status=503, healthy=True, tokens=4)


def cfg(doubles, **kw) -> RouterConfig:
    kw.setdefault("health_check_interval", 0.5)
    return RouterConfig(debug_headers=True, worker_urls=[d.url for d in doubles], **kw)


def received(doubles, request_id: str) -> list[str]:
    """Names of the doubles that got a request with this id."""
    return [d.name for d in doubles for r in d.requests() if r["headers"].get("x-request-id") == request_id]


async def test_router_forwards_request_and_tags_reply_with_worker_and_request_id(doubles):
    async with running_router(cfg(doubles, policy="round_robin")) as (url, _):
        async with httpx.AsyncClient() as c:
            r = await c.post(url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "rid-123"})
            direct = httpx.post(r.headers["x-kvship-worker"] + "/v1/chat/completions", json=CHAT)
            r2 = await c.post(url + "/generate", json={"text": "Say hello.", "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "rid-123"
    assert r.headers["x-kvship-worker"] in [d.url for d in doubles]
    assert r.json()["choices"] == direct.json()["choices"]
    assert received(doubles, "rid-123") == [d.name for d in doubles if d.url == r.headers["x-kvship-worker"]]
    assert r2.status_code == 200 and r2.headers["x-request-id"]  # one was made up
    assert r2.json()["text"] == " ".join(reply_words(json.dumps("Say hello."), 3))


async def test_unusable_request_ids_are_replaced_by_fresh_ones(doubles):
    async with running_router(cfg(doubles)) as (url, _):
        async with httpx.AsyncClient() as c:
            r = await c.post(url + "/generate", json={"text": "x"}, headers={"x-request-id": "a b" + "c" * 300})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert len(rid) == 32 and " " not in rid
    assert len(received(doubles, rid)) == 1


async def test_streaming_reaches_the_client_chunk_by_chunk(doubles):
    for d in doubles:
        d.control(chunk_delay=0.3, tokens=5)
    async with running_router(cfg(doubles)) as (url, _):
        async with httpx.AsyncClient(timeout=30) as c:
            t0 = time.monotonic()
            arrivals = []
            body = {**CHAT, "stream": True, "max_tokens": 5}
            async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        arrivals.append((time.monotonic() - t0, line[6:]))
    total = arrivals[-1][0]
    assert arrivals[-1][1] == "[DONE]"
    assert total >= 1.4  # 5 chunks x 0.3 s
    assert arrivals[0][0] < total - 1.0  # the first chunk came long before the end
    gaps = [b[0] - a[0] for a, b in zip(arrivals[:5], arrivals[1:6])]
    assert sum(g > 0.15 for g in gaps) >= 3  # not buffered into one burst


async def test_openai_client_works_through_the_router(doubles):
    import openai

    async with running_router(cfg(doubles)) as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = await client.chat.completions.create(model="double-model", messages=CHAT["messages"], max_tokens=3)
        pieces = []
        stream = await client.chat.completions.create(
            model="double-model", messages=CHAT["messages"], max_tokens=3, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        models = await client.models.list()
        await client.close()
    assert out.choices[0].message.content == "".join(pieces)  # same prompt, same worker reply, streamed or not
    assert len(pieces) == 3
    assert [m.id for m in models.data] == ["double-model"]


async def test_models_is_the_union_of_workers_and_requests_route_by_model():
    with start_double(name="a", model="alpha") as a, start_double(name="b", model="beta") as b:
        async with running_router(RouterConfig(debug_headers=True, worker_urls=[a.url, b.url])) as (url, _):
            async with httpx.AsyncClient() as c:
                models = (await c.get(url + "/v1/models")).json()
                workers = [
                    (await c.post(url + "/v1/completions", json={"model": "beta", "prompt": f"p{i}"})).headers[
                        "x-kvship-worker"
                    ]
                    for i in range(6)
                ]
                unknown = await c.post(
                    url + "/v1/completions",
                    json={"model": "gamma", "prompt": "p"},
                    headers={"x-request-id": "unknown-model"},
                )
        assert sorted(m["id"] for m in models["data"]) == ["alpha", "beta"]
        assert set(workers) == {b.url}
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found" and "alpha" in unknown.json()["error"]["message"]
        assert received([a, b], "unknown-model") == []


@pytest.mark.parametrize(
    "path,content,status",
    [
        ("/v1/chat/completions", b"{oops", 400),
        ("/v1/chat/completions", b'{"model": "double-model"}', 400),
        ("/v1/completions", b'{"model": "double-model", "prompt": "' + b"x" * 5000 + b'"}', 413),
        ("/generate", b'{"stream": 1, "text": "x"}', 400),
    ],
)
async def test_bad_requests_get_4xx_without_reaching_a_worker(doubles, path, content, status):
    async with running_router(cfg(doubles, max_request_bytes=4096)) as (url, _):
        async with httpx.AsyncClient() as c:
            r = await c.post(
                url + path, content=content, headers={"x-request-id": "bad-1", "content-type": "application/json"}
            )

            # a chunked body (no Content-Length) over the limit is cut off too
            async def body():
                for _ in range(10):
                    yield b"x" * 1000

            big = await c.post(url + "/generate", content=body(), headers={"x-request-id": "bad-2"})
    assert r.status_code == status
    assert "error" in r.json() and r.json()["error"]["message"]
    assert big.status_code == 413
    assert received(doubles, "bad-1") == [] and received(doubles, "bad-2") == []


async def test_api_key_is_required_everywhere_but_health_and_only_the_worker_key_goes_to_workers(doubles):
    config = cfg(doubles, api_key="sekret", admin_api_key="adm", worker_api_key="wkey")
    async with running_router(config) as (url, _):
        async with httpx.AsyncClient() as c:
            good = {"authorization": "Bearer sekret", "x-request-id": "auth-ok"}
            assert (await c.get(url + "/health")).status_code == 200
            for method, path in (
                ("POST", "/v1/chat/completions"),
                ("GET", "/v1/models"),
                ("GET", "/metrics"),
                ("GET", "/workers"),
                ("GET", "/slo"),
                ("POST", "/workers"),
                ("DELETE", "/workers?url=x"),
            ):
                r = await c.request(method, url + path, json=CHAT, headers={"authorization": "Bearer wrong"})
                assert r.status_code == 401, path
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert (await c.request(method, url + path, json=CHAT)).status_code == 401
            ok = await c.post(url + "/v1/chat/completions", json=CHAT, headers=good)
            assert ok.status_code == 200
            assert (await c.get(url + "/v1/models", headers=good)).status_code == 200
            assert (await c.get(url + "/workers", headers=good)).status_code == 403  # a client key
            assert (await c.get(url + "/workers", headers={"authorization": "Bearer wkey"})).status_code == 200
            assert (await c.get(url + "/slo", headers={"authorization": "Bearer adm"})).status_code == 200
            worker_key_as_client = await c.post(
                url + "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer wkey"}
            )
            assert worker_key_as_client.status_code == 403
    [rec] = [r for d in doubles for r in d.requests() if r["headers"].get("x-request-id") == "auth-ok"]
    assert rec["headers"]["authorization"] == "Bearer wkey"


async def test_rate_limit_answers_429_with_retry_after_when_the_queue_is_full(doubles):
    config = cfg(doubles, rate_limit_rps=0.5, rate_limit_burst=2, rate_limit_queue_size=1, rate_limit_queue_timeout=5)
    async with running_router(config) as (url, _):
        async with httpx.AsyncClient(timeout=30) as c:
            rs = await asyncio.gather(*(c.post(url + "/v1/chat/completions", json=CHAT) for _ in range(6)))
            metrics = (await c.get(url + "/metrics")).text
    codes = collections.Counter(r.status_code for r in rs)
    assert codes == {200: 3, 429: 3}  # burst 2 + 1 queued (its token comes 2 s later)
    limited = [r for r in rs if r.status_code == 429]
    assert all(int(r.headers["retry-after"]) >= 1 for r in limited)
    assert all(r.json()["error"]["code"] == "rate_limited" for r in limited)
    assert "kvship_router_rate_limited_total 3.0" in metrics


async def test_no_healthy_worker_gives_503_with_a_clear_body():
    async with running_router(
        RouterConfig(debug_headers=True, worker_urls=["http://127.0.0.1:9"], health_check_interval=60)
    ) as (url, _):
        async with httpx.AsyncClient() as c:
            r = await c.post(url + "/generate", json={"text": "x"})
            ready = await c.get(url + "/readiness")
    assert r.status_code == 503
    assert "no healthy unified worker" in r.json()["error"]["message"]
    assert ready.status_code == 503


async def test_worker_5xx_before_any_byte_is_retried_on_another_worker(doubles):
    doubles[0].control(fail_next=100, fail_status=503)
    async with running_router(cfg(doubles, policy="round_robin", retry_backoff_base=0.01)) as (url, _):
        async with httpx.AsyncClient() as c:
            rs = [
                await c.post(url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": f"retry-{i}"})
                for i in range(6)
            ]
            metrics = (await c.get(url + "/metrics")).text
    assert all(r.status_code == 200 for r in rs)
    assert all(r.headers["x-kvship-worker"] != doubles[0].url for r in rs)
    assert any(received(doubles, f"retry-{i}")[:1] == ["w0"] for i in range(6))  # w0 was tried and failed
    assert 'kvship_router_retries_total{route="/v1/chat/completions"}' in metrics


async def test_worker_4xx_is_passed_through_without_retry(doubles):
    for d in doubles:
        d.control(fail_next=1, fail_status=422)
    async with running_router(cfg(doubles)) as (url, _):
        async with httpx.AsyncClient() as c:
            r = await c.post(url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "four22"})
    assert r.status_code == 422
    assert r.json()["error"]["message"].endswith("told to fail")
    assert len(received(doubles, "four22")) == 1


async def test_all_attempts_failing_returns_the_last_worker_error(doubles):
    for d in doubles:
        d.control(fail_next=100, fail_status=500)
    async with running_router(cfg(doubles, max_retries=2, retry_backoff_base=0.01)) as (url, _):
        async with httpx.AsyncClient() as c:
            r = await c.post(url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "all-fail"})
    assert r.status_code == 500
    assert sorted(received(doubles, "all-fail")) == ["w0", "w1", "w2"]  # three different workers tried


async def test_admin_api_adds_lists_and_removes_workers(doubles):
    config = RouterConfig(debug_headers=True, health_check_interval=0.5, admin_api_key="adm")
    async with running_router(config) as (url, _):
        async with httpx.AsyncClient(headers={"authorization": "Bearer adm"}) as c:
            assert (await c.post(url + "/generate", json={"text": "x"})).status_code == 503
            added = await c.post(url + "/workers", json={"url": doubles[1].url})
            dup = await c.post(url + "/workers", json={"url": doubles[1].url + "/"})
            bad = await c.post(url + "/workers", json={"url": "http://127.0.0.1:9"})
            wrong_role = await c.post(url + "/workers", json={"url": doubles[2].url, "role": "decode"})
            listing = (await c.get(url + "/workers")).json()
            served = await c.post(url + "/generate", json={"text": "x"})
            removed = await c.delete(url + "/workers", params={"url": doubles[1].url})
            missing = await c.delete(url + "/workers", params={"url": doubles[1].url})
            after = await c.post(url + "/generate", json={"text": "x"})
    assert added.status_code == 200 and added.json()["healthy"] and added.json()["model"] == "double-model"
    assert dup.status_code == 200
    assert bad.status_code == 400 and "could not register" in bad.json()["error"]["message"]
    assert wrong_role.status_code == 400
    [w] = listing["workers"]
    assert w["url"] == doubles[1].url and w["circuit"] == "closed" and w["in_flight"] == 0
    assert served.status_code == 200 and served.headers["x-kvship-worker"] == doubles[1].url
    assert removed.status_code == 200 and missing.status_code == 404
    assert after.status_code == 503


async def test_metrics_count_requests_latency_and_worker_state(doubles):
    async with running_router(cfg(doubles)) as (url, _):
        async with httpx.AsyncClient() as c:
            await c.post(url + "/v1/chat/completions", json=CHAT)
            async with c.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                await r.aread()
            text = (await c.get(url + "/metrics")).text
    assert 'kvship_router_requests_total{route="/v1/chat/completions",status="200"' in text
    assert 'kvship_router_request_latency_seconds_count{route="/v1/chat/completions"} 2.0' in text
    assert 'kvship_router_ttft_seconds_count{route="/v1/chat/completions"} 1.0' in text
    for d in doubles:
        assert f'kvship_router_worker_healthy{{worker="{d.url}"}} 1.0' in text
        assert f'kvship_router_circuit_state{{worker="{d.url}"}} 0.0' in text
        assert f'kvship_router_worker_in_flight{{worker="{d.url}"}} 0.0' in text
    assert "kvship_router_cache_aware_match_ratio_count 2.0" in text


@pytest.mark.parametrize("policy", ["round_robin", "random", "shortest_queue", "power_of_two", "cache_aware"])
async def test_every_policy_serves_requests_over_all_workers(doubles, policy):
    for d in doubles:
        d.control(delay=0.02)
    async with running_router(cfg(doubles, policy=policy)) as (url, _):
        async with httpx.AsyncClient() as c:
            prompts = [f"{i} distinct prompt {random.random()}" * 3 for i in range(30)]
            rs = await asyncio.gather(
                *(c.post(url + "/v1/completions", json={"model": "double-model", "prompt": p}) for p in prompts)
            )
    assert all(r.status_code == 200 for r in rs)
    used = collections.Counter(r.headers["x-kvship-worker"] for r in rs)
    assert len(used) == 3, used


async def test_session_id_sticks_to_one_worker_over_http(doubles):
    async with running_router(cfg(doubles, policy="round_robin")) as (url, _):
        async with httpx.AsyncClient() as c:
            by_header = {
                (await c.post(url + "/v1/chat/completions", json=CHAT, headers={"x-session-id": "s-1"})).headers[
                    "x-kvship-worker"
                ]
                for _ in range(6)
            }
            by_field = {
                (await c.post(url + "/v1/chat/completions", json={**CHAT, "session_id": "s-2"})).headers[
                    "x-kvship-worker"
                ]
                for _ in range(6)
            }
            free = {
                (await c.post(url + "/v1/chat/completions", json=CHAT)).headers["x-kvship-worker"] for _ in range(6)
            }
    assert len(by_header) == 1 and len(by_field) == 1 and len(free) == 3


async def test_cache_aware_keeps_each_tenant_on_one_worker_over_http(doubles):
    for d in doubles:
        d.control(delay=0.03)
    rng = random.Random(7)
    tenants = [
        f"You are assistant number {t}. "
        + " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(300))
        for t in range(6)
    ]
    placements: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    async with running_router(cfg(doubles, policy="cache_aware")) as (url, _):
        async with httpx.AsyncClient(timeout=30) as c:

            async def one(i: int) -> None:
                t = rng.randrange(len(tenants))
                body = {
                    "model": "double-model",
                    "messages": [
                        {"role": "system", "content": tenants[t]},
                        {"role": "user", "content": f"question {i}?"},
                    ],
                }
                r = await c.post(url + "/v1/chat/completions", json=body)
                assert r.status_code == 200
                placements[t][r.headers["x-kvship-worker"]] += 1

            for start in range(0, 120, 6):  # 6 requests in flight at a time, tenants interleaved
                await asyncio.gather(*(one(i) for i in range(start, start + 6)))
    load = collections.Counter()
    for t, counter in placements.items():
        assert counter.most_common(1)[0][1] / sum(counter.values()) >= 0.9, (t, counter)
        load.update(counter)
    assert max(load.values()) <= 2 * (sum(load.values()) / 3), load
