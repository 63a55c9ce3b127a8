"""Session affinity (``--session-affinity``, docs/router.md "Sessions"): the router over real HTTP in front of
test-double workers (tests/router_fixtures.py).

A session key (body ``session_id``, header ``x-session-id``, else the OpenAI ``user`` field) pins its requests
to one worker even under round-robin; when that worker dies the session moves, the request that found it dead
succeeds on another worker, and the move is counted by reason.
"""

from __future__ import annotations

import asyncio
import collections
import re

import httpx
import pytest
from router_fixtures import running_router, start_doubles

from kvship.router.config import RouterConfig

pytestmark = pytest.mark.timeout(120)

CHAT = {"model": "double-model", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


@pytest.fixture(scope="module")
def doubles():
    with start_doubles(3) as ds:
        yield ds


def cfg(doubles, **kw) -> RouterConfig:
    kw.setdefault("health_check_interval", 0.3)
    kw.setdefault("health_failure_threshold", 1)
    return RouterConfig(debug_headers=True, worker_urls=[d.url for d in doubles], policy="round_robin", **kw)


def moves(metrics_text: str) -> dict[str, float]:
    found = re.findall(r'^kvship_router_session_moves_total\{reason="(\w+)"\} (\S+)$', metrics_text, re.M)
    return {reason: float(value) for reason, value in found}


async def _session_workers(c: httpx.AsyncClient, url: str, sessions: dict[str, dict], rounds: int) -> dict:
    seen: dict[str, collections.Counter] = {s: collections.Counter() for s in sessions}
    for _ in range(rounds):  # interleaved, so round-robin alone would spread every session over all workers
        rs = await asyncio.gather(*(c.post(url + "/v1/chat/completions", **kw) for kw in sessions.values()))
        for s, r in zip(sessions, rs):
            assert r.status_code == 200, r.text
            seen[s][r.headers["x-kvship-worker"]] += 1
    return seen


async def test_a_sessions_requests_land_on_one_worker(doubles):
    sessions = {f"h{i}": {"json": CHAT, "headers": {"x-session-id": f"h{i}"}} for i in range(3)}
    sessions |= {f"u{i}": {"json": {**CHAT, "user": f"user-{i}"}} for i in range(3)}
    sessions |= {f"b{i}": {"json": {**CHAT, "session_id": f"b{i}"}} for i in range(2)}
    async with running_router(cfg(doubles)) as (url, _):
        async with httpx.AsyncClient(timeout=30) as c:
            seen = await _session_workers(c, url, sessions, rounds=20)
    for s, counter in seen.items():
        assert counter.most_common(1)[0][1] / sum(counter.values()) >= 0.95, (s, counter)
    assert len({counter.most_common(1)[0][0] for counter in seen.values()}) == 3, "sessions were not spread"


async def test_without_session_affinity_a_session_key_does_not_pin(doubles):
    sessions = {"h": {"json": CHAT, "headers": {"x-session-id": "h"}}, "u": {"json": {**CHAT, "user": "alice"}}}
    async with running_router(cfg(doubles, session_affinity=False)) as (url, _):
        async with httpx.AsyncClient(timeout=30) as c:
            seen = await _session_workers(c, url, sessions, rounds=6)
    assert all(len(counter) > 1 for counter in seen.values()), seen


async def test_killing_a_sessions_worker_moves_the_session_and_the_next_request_succeeds(doubles):
    async with running_router(cfg(doubles)) as (url, _):
        async with httpx.AsyncClient(timeout=30) as c:
            body = {**CHAT, "user": "carol"}
            first = (await c.post(url + "/v1/chat/completions", json=body)).headers["x-kvship-worker"]
            victim = next(d for d in doubles if d.url == first)
            victim.kill()
            try:
                r = await c.post(url + "/v1/chat/completions", json=body)  # finds it dead: retried, moved
                assert r.status_code == 200, r.text
                moved_to = r.headers["x-kvship-worker"]
                assert moved_to != first
                after = [(await c.post(url + "/v1/chat/completions", json=body)) for _ in range(10)]
                assert all(a.status_code == 200 and a.headers["x-kvship-worker"] == moved_to for a in after)
                counted = moves((await c.get(url + "/metrics")).text)
                assert counted.get("failed", 0) + counted.get("unavailable", 0) >= 1, counted
                # a worker the health checks take out moves its sessions too (reason "unavailable")
                other = next(d for d in doubles if d.url == moved_to)
                other.control(healthy=False)
                await asyncio.sleep(1.0)
                r = await c.post(url + "/v1/chat/completions", json=body)
                assert r.status_code == 200 and r.headers["x-kvship-worker"] not in (first, moved_to)
                assert moves((await c.get(url + "/metrics")).text).get("unavailable", 0) >= 1
            finally:
                victim.restart()
                for d in doubles:
                    d.control(healthy=True)
