"""The router in front of real ``kvship serve`` workers (tiny random Llama on CPU; tests/server_fixtures.py)."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest
import server_fixtures
from router_fixtures import running_router

from kvship.router.config import RouterConfig

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPTS = [
    "The quick brown fox",
    "What is the capital of France?",
    "Hello, world! This is",
    "KV caches store keys and values",
]


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    args = [
        "--model-path",
        tiny_llama_dir,
        "--served-model-name",
        "tiny",
        "--max-total-tokens",
        "4096",
        "--max-running-requests",
        "8",
    ]
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(server_fixtures.start_server(args)) for _ in range(2)]


async def test_greedy_outputs_through_the_router_equal_a_worker_hit_directly(workers):
    async with running_router(RouterConfig(worker_urls=[w.url for w in workers], policy="round_robin")) as (url, _):
        async with httpx.AsyncClient(timeout=120) as c:
            for prompt in PROMPTS:
                comp = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
                chat = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                gen = {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
                for path, body, pick in (
                    ("/v1/completions", comp, lambda j: j["choices"][0]["text"]),
                    ("/v1/chat/completions", chat, lambda j: j["choices"][0]["message"]["content"]),
                    ("/generate", gen, lambda j: j["text"]),
                ):
                    routed = await c.post(url + path, json=body)
                    assert routed.status_code == 200, routed.text
                    assert routed.headers["x-kvship-worker"] in [w.url for w in workers]
                    assert pick(routed.json())  # twelve tokens of text, not nothing
                    for w in workers:
                        direct = await c.post(w.url + path, json=body)
                        assert direct.status_code == 200, direct.text
                        assert pick(routed.json()) == pick(direct.json()), (path, prompt)


async def test_streaming_from_a_real_worker_arrives_incrementally_and_matches_the_full_reply(workers):
    async with running_router(RouterConfig(worker_urls=[w.url for w in workers])) as (url, _):
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
            full = (await c.post(url + "/v1/completions", json=body)).json()["choices"][0]["text"]
            t0 = time.monotonic()
            stamps, pieces = [], []
            async with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        stamps.append(time.monotonic() - t0)
                        choices = json.loads(line[6:]).get("choices") or []
                        pieces.extend(ch.get("text") or "" for ch in choices)
    assert "".join(pieces) == full
    assert len(stamps) > 3
    assert stamps[0] < stamps[-1]  # the first chunk came before the request finished
