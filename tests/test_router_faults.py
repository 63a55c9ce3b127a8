"""Fault tolerance through the router: dead workers, health checks, circuit breakers, timeouts, shutdown."""

from __future__ import annotations

import asyncio
import collections
import signal
import time

import httpx
import pytest
from router_fixtures import router_log, router_process, running_router, start_double, start_doubles

from kvship.router.config import RouterConfig

pytestmark = pytest.mark.timeout(180)

CHAT = {"model": "double-model", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


async def worker_state(c: httpx.AsyncClient, url: str, worker_url: str) -> dict:
    [w] = [w for w in (await c.get(url + "/workers")).json()["workers"] if w["url"] == worker_url]
    return w


async def wait_for(predicate, timeout: float, step: float = 0.05) -> float:
    """Seconds until ``await predicate()`` is true; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await predicate():
            return time.monotonic() - t0
        await asyncio.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


async def test_killing_a_worker_under_load_fails_no_request_and_it_rejoins_after_restart():
    interval, threshold = 0.3, 2
    with start_doubles(3, delay=0.05) as doubles:
        victim = doubles[0]
        config = RouterConfig(
            debug_headers=True,
            worker_urls=[d.url for d in doubles],
            policy="round_robin",
            health_check_interval=interval,
            health_failure_threshold=threshold,
            retry_backoff_base=0.01,
            circuit_failure_threshold=100,
        )
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                results: list[tuple[int, str, bool]] = []  # status, worker, complete reply
                started: list[float] = []  # when each request was sent

                async def load(seconds: float) -> None:
                    async def one(i: int) -> None:
                        body = {**CHAT, "stream": i % 2 == 0}  # streams that had not started count too
                        started.append(time.monotonic())
                        r = await c.post(url + "/v1/chat/completions", json=body)
                        complete = (
                            r.text.rstrip().endswith("data: [DONE]")
                            if body["stream"]
                            else r.status_code == 200 and len(r.json()["choices"]) == 1
                        )
                        results.append((r.status_code, r.headers.get("x-kvship-worker", ""), complete))

                    tasks = []
                    t0 = time.monotonic()
                    i = 0
                    while time.monotonic() - t0 < seconds:
                        tasks.append(asyncio.create_task(one(i)))
                        i += 1
                        await asyncio.sleep(0.02)  # ~50 req/s
                    await asyncio.gather(*tasks)

                load_task = asyncio.create_task(load(3.0))
                await asyncio.sleep(1.0)
                victim.kill()
                killed_at = time.monotonic()

                async def victim_unhealthy() -> bool:
                    return not (await worker_state(c, url, victim.url))["healthy"]

                await wait_for(victim_unhealthy, timeout=10)
                detected = time.monotonic() - killed_at
                await load_task

                # under load on both sides of the kill (~50 req/s asked; a loaded 2-core box sends fewer)
                assert len(results) == len(started) > 60
                assert sum(t < killed_at for t in started) >= 20 and sum(t > killed_at for t in started) >= 40
                assert all(s == 200 for s, _, _ in results), collections.Counter(s for s, _, _ in results)
                # only a stream already under way on the victim may be cut short (with an error event)
                cut = [w for _, w, complete in results if not complete]
                assert all(w == victim.url for w in cut) and len(cut) <= 2, cut
                # one interval to the next check, threshold failed checks, plus slack for a loaded machine
                assert detected <= interval * (threshold + 1) + 1.5, detected

                victim.restart()

                async def victim_healthy() -> bool:
                    return (await worker_state(c, url, victim.url))["healthy"]

                await wait_for(victim_healthy, timeout=10)
                after = [
                    (await c.post(url + "/v1/chat/completions", json=CHAT)).headers["x-kvship-worker"] for _ in range(6)
                ]
                assert victim.url in after


async def test_a_started_stream_is_never_retried_when_its_worker_dies_and_resumes_are_off():
    # (with --max-resumes it is continued elsewhere instead: tests/test_router_resume.py)
    with start_double(name="dies", chunk_delay=0.1, die_after_chunks=2) as dying, start_double(name="fine") as fine:
        config = RouterConfig(
            debug_headers=True,
            worker_urls=[dying.url, fine.url],
            policy="round_robin",
            health_check_interval=60,
            max_resumes=0,
        )
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                outcomes = []
                for i in range(2):  # round robin: one of the two lands on the dying worker
                    lines = []
                    async with c.stream(
                        "POST",
                        url + "/v1/chat/completions",
                        json={**CHAT, "stream": True, "max_tokens": 6},
                        headers={"x-request-id": f"stream-{i}"},
                    ) as r:
                        worker = r.headers["x-kvship-worker"]
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                lines.append(line[6:])
                    outcomes.append((worker, lines))
                state = await worker_state(c, url, dying.url)
        fine_ids = [r["headers"]["x-request-id"] for r in fine.requests()]
    [(_, broken)] = [o for o in outcomes if o[0] == dying.url]
    assert len(broken) == 3  # two content chunks, then the router's error event
    assert '"worker_failed"' in broken[-1]
    broken_id = f"stream-{[o[0] for o in outcomes].index(dying.url)}"
    assert broken_id not in fine_ids and len(fine_ids) == 1  # not sent again elsewhere
    assert state["total_failures"] == 1
    [(_, ok)] = [o for o in outcomes if o[0] == fine.url]
    assert ok[-1] == "[DONE]"


async def test_circuit_breaker_opens_then_half_opens_after_cooldown_and_closes_on_success():
    with start_double(name="flaky", fail_next=1000, fail_status=500) as flaky, start_double(name="ok") as ok:
        config = RouterConfig(
            debug_headers=True,
            worker_urls=[flaky.url, ok.url],
            policy="round_robin",
            health_check_interval=60,
            circuit_failure_threshold=2,
            circuit_cooldown=1.0,
            max_retries=1,
            retry_backoff_base=0.01,
        )
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:

                async def send(n: int) -> list[int]:
                    return [(await c.post(url + "/v1/chat/completions", json=CHAT)).status_code for _ in range(n)]

                assert await send(4) == [200] * 4  # failures on flaky are retried on ok
                assert len(flaky.requests()) == 2
                state = await worker_state(c, url, flaky.url)
                assert state["circuit"] == "open" and state["healthy"]
                assert await send(6) == [200] * 6
                assert len(flaky.requests()) == 2  # open: no traffic at all
                metrics = (await c.get(url + "/metrics")).text
                assert f'kvship_router_circuit_state{{worker="{flaky.url}"}} 1.0' in metrics

                await asyncio.sleep(1.1)  # cool-down over: one trial, which fails
                assert await send(3) == [200] * 3
                assert len(flaky.requests()) == 3
                assert (await worker_state(c, url, flaky.url))["circuit"] == "open"

                flaky.control(fail_next=0)  # it recovers
                await asyncio.sleep(1.1)
                assert await send(4) == [200] * 4
                assert (await worker_state(c, url, flaky.url))["circuit"] == "closed"
                assert len(flaky.requests()) >= 5  # trial + round-robin share again


async def test_worker_failing_health_checks_leaves_and_rejoins_the_healthy_set():
    with start_doubles(2) as (a, b):
        config = RouterConfig(
            debug_headers=True,
            worker_urls=[a.url, b.url],
            policy="round_robin",
            health_check_interval=0.2,
            health_failure_threshold=2,
            health_success_threshold=2,
        )
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                a.control(healthy=False)

                async def a_state(healthy: bool):
                    async def check() -> bool:
                        return (await worker_state(c, url, a.url))["healthy"] is healthy

                    return check

                took = await wait_for(await a_state(False), timeout=5)
                assert took >= 0.2  # two failed checks, not one
                served = {
                    (await c.post(url + "/generate", json={"text": "x"})).headers["x-kvship-worker"] for _ in range(4)
                }
                assert served == {b.url}
                a.control(healthy=True)
                await wait_for(await a_state(True), timeout=5)
                served = {
                    (await c.post(url + "/generate", json={"text": "x"})).headers["x-kvship-worker"] for _ in range(4)
                }
                assert served == {a.url, b.url}


async def test_request_timeout_answers_504():
    with start_double(delay=3.0) as slow:
        config = RouterConfig(debug_headers=True, worker_urls=[slow.url], request_timeout=0.5, health_check_interval=60)
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                t0 = time.monotonic()
                r = await c.post(url + "/v1/chat/completions", json=CHAT)
                took = time.monotonic() - t0
                state = await worker_state(c, url, slow.url)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert took < 2.0
    assert state["in_flight"] == 0


async def test_client_disconnect_mid_stream_releases_the_worker():
    with start_double(chunk_delay=0.2, tokens=50) as slow:
        config = RouterConfig(debug_headers=True, worker_urls=[slow.url], health_check_interval=60)
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                async with c.stream(
                    "POST", url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 50}
                ) as r:
                    async for _ in r.aiter_raw():
                        break  # read one chunk, then hang up
                    assert (await worker_state(c, url, slow.url))["in_flight"] == 1

                async def released() -> bool:
                    return (await worker_state(c, url, slow.url))["in_flight"] == 0

                await wait_for(released, timeout=5)
                state = await worker_state(c, url, slow.url)
    assert state["total_failures"] == 0 and state["circuit"] == "closed"


def test_sigterm_drains_in_flight_streams_before_the_router_exits():
    with start_double(chunk_delay=0.25, tokens=8) as slow:
        with router_process(["--worker-urls", slow.url, "--shutdown-timeout", "20"]) as (url, proc):
            lines = []
            with httpx.Client(timeout=30) as c:
                with c.stream(
                    "POST", url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 8}
                ) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            if len(lines) == 1:
                                proc.send_signal(signal.SIGTERM)
            assert lines[-1] == "[DONE]" and len(lines) == 10  # 8 words + finish chunk + DONE
            assert proc.wait(timeout=20) == 0
            with pytest.raises(httpx.ConnectError):
                httpx.get(url + "/health", timeout=2)
            log = router_log(proc)
    assert "Traceback" not in log
