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
    async with running_router(
        RouterConfig(debug_headers=True, worker_urls=[w.url for w in workers], policy="round_robin")
    ) as (url, _):
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
    async with running_router(RouterConfig(debug_headers=True, worker_urls=[w.url for w in workers])) as (url, _):
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


# values a client may put in any field: wrong types, out-of-range numbers, NaN, nesting
_ODD_VALUES = [None, True, 0, -1, 1.5, 2**70, "", "x" * 10, [], [1, 2], [[1], [2]], ["a", 1], {}, {"a": 1},
               [{"role": "user", "content": "hi"}], [{"role": 5}], [{"content": "hi"}], float("nan"), [True, 1], [-5],
               [{"role": "user", "content": [1, {"type": "text", "text": 5}]}], {"include_usage": "yes"}]  # fmt: skip
_ODD_FIELDS = ["model", "messages", "prompt", "stream", "session_id", "input_ids", "text", "stream_options", "n",
               "max_tokens", "sampling_params", "logprobs", "stop", "return_trace", "bootstrap_room", "kvship_resume",
               "rid", "temperature", "response_format", "tools"]  # fmt: skip


async def test_malformed_bodies_get_4xx_json_errors_never_5xx_and_the_workers_keep_serving(workers):
    """A seeded sweep of bodies with odd values in known fields (and cut-off JSON) through the router to real
    workers: every answer is a 2xx, or a 4xx with a JSON error body; afterwards both workers still serve."""
    import random

    rng = random.Random(19)
    routes = ["/v1/chat/completions", "/v1/completions", "/generate"]
    async with running_router(
        RouterConfig(debug_headers=True, worker_urls=[w.url for w in workers], max_retries=0)
    ) as (url, _):
        async with httpx.AsyncClient(timeout=60) as c:
            for _ in range(240):
                route = rng.choice(routes)
                body: dict = {"sampling_params": {"max_new_tokens": 3}} if route == "/generate" else {"max_tokens": 3}
                if rng.random() < 0.7:
                    body["model"] = "tiny"
                body.update(
                    {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}}.get(route, {})
                    if rng.random() < 0.6
                    else {}
                )
                if rng.random() < 0.6:
                    body["prompt" if route == "/v1/completions" else "text"] = "hi"
                for _ in range(rng.randint(0, 4)):
                    body[rng.choice(_ODD_FIELDS)] = rng.choice(_ODD_VALUES)
                raw = json.dumps(body)
                if rng.random() < 0.1:
                    raw = raw[: rng.randint(0, len(raw))]
                r = await c.post(url + route, content=raw, headers={"content-type": "application/json"})
                assert r.status_code < 500, (route, raw, r.status_code, r.text[:300])
                if r.status_code >= 400:
                    assert "error" in r.json(), (route, raw, r.text[:300])
            for route in routes:  # nested past any parser's depth limit
                r = await c.post(url + route, content=b"[" * 5000, headers={"content-type": "application/json"})
                assert r.status_code == 400 and "too deeply" in r.json()["error"]["message"], r.text[:300]
            for w in workers:  # still serving
                ok = await c.post(w.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
                assert ok.status_code == 200
