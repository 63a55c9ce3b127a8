"""PD through real processes: ``kvship local`` (router + prefill + decode workers) on loopback.

Greedy outputs through router -> prefill -> decode must equal the unified
scheduler's token for token, for every transfer backend, with 2 prefill x 2
decode workers, page sizes 1 and 16 and prompts longer than the chunked
prefill size; 200 concurrent requests must all come back intact; afterwards
every worker reports all its KV slots free.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pd_fixtures import make_prompts, start_local, unified_greedy

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 12
CHUNK = 32


async def _generate_all(
    url: str, prompts: list[list[int]], max_new: int, stream: bool = False, limit: int = 256
) -> list[dict]:
    sem = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=limit)) as client:

        async def one(ids: list[int]) -> dict:
            body = {
                "input_ids": ids,
                "stream": stream,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0},
            }
            async with sem:
                if not stream:
                    r = await client.post(url + "/generate", json=body)
                    assert r.status_code == 200, r.text
                    return r.json()
                last = None
                async with client.stream("POST", url + "/generate", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            last = json.loads(line[6:])
                assert last is not None
                return last

        return await asyncio.gather(*(one(p) for p in prompts))


def _check_equal(outs: list[dict], expected: list[list[int]]) -> None:
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length"), out
        assert out["output_ids"] == want, f"prompt {i}"


@pytest.fixture(scope="module")
def tcp_2x2(tiny_llama_dir):
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
        "--page-size",
        "16",
        "--chunked-prefill-size",
        str(CHUNK),
        "--max-total-tokens",
        "16384",
        "--policy",
        "round_robin",
    ]
    with start_local(args) as cluster:
        yield cluster


async def test_pd_2x2_through_router_equals_unified_with_page_16_and_chunked_prefill(tcp_2x2, tiny_llama_dir):
    prompts = make_prompts(40, seed=11, lo=1, hi=4 * CHUNK)
    assert sum(len(p) > CHUNK for p in prompts) >= 10
    outs = await _generate_all(tcp_2x2.url, prompts, MAX_NEW)
    _check_equal(outs, unified_greedy(tiny_llama_dir, prompts, MAX_NEW, page_size=16, chunked_prefill_size=CHUNK))
    workers = tcp_2x2.workers("prefill") + tcp_2x2.workers("decode")
    assert len(workers) == 4
    assert all(tcp_2x2.info(u)["kv_transfers_ok"] > 0 for u in workers), "a worker of the 2x2 pool was never used"
    tcp_2x2.wait_free(workers)


async def test_pd_streaming_through_router_equals_unified(tcp_2x2, tiny_llama_dir):
    prompts = make_prompts(8, seed=12, lo=5, hi=80)
    outs = await _generate_all(tcp_2x2.url, prompts, MAX_NEW, stream=True)
    _check_equal(outs, unified_greedy(tiny_llama_dir, prompts, MAX_NEW, page_size=16, chunked_prefill_size=CHUNK))
    tcp_2x2.wait_free(tcp_2x2.workers("prefill") + tcp_2x2.workers("decode"))


async def test_200_concurrent_requests_through_router_prefill_and_decode_come_back_intact(tcp_2x2, tiny_llama_dir):
    prompts = make_prompts(200, seed=13, lo=4, hi=48)
    outs = await _generate_all(tcp_2x2.url, prompts, 8)
    assert len(outs) == 200
    _check_equal(outs, unified_greedy(tiny_llama_dir, prompts, 8, page_size=16, chunked_prefill_size=CHUNK))
    assert len({o["meta_info"]["id"] for o in outs}) == 200
    tcp_2x2.wait_free(tcp_2x2.workers("prefill") + tcp_2x2.workers("decode"))


def test_openai_chat_completion_through_pd_router(tcp_2x2, tiny_llama_dir):
    body = {
        "model": tiny_llama_dir,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(tcp_2x2.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 8
    tcp_2x2.wait_free(tcp_2x2.workers("prefill") + tcp_2x2.workers("decode"))


def test_n_choices_get_their_own_rooms_and_all_match_greedy(tcp_2x2, tiny_llama_dir):
    prompt = make_prompts(1, seed=14, lo=40, hi=40)[0]
    r = httpx.post(
        tcp_2x2.url + "/generate",
        timeout=120,
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0, "n": 3}},
    )
    assert r.status_code == 200, r.text
    want = unified_greedy(tiny_llama_dir, [prompt], MAX_NEW, page_size=16, chunked_prefill_size=CHUNK)[0]
    assert [o["output_ids"] for o in r.json()] == [want] * 3
    tcp_2x2.wait_free(tcp_2x2.workers("prefill") + tcp_2x2.workers("decode"))


@pytest.mark.parametrize("backend,page_size", [("mooncake", 1), ("nixl", 16)])
async def test_pd_through_router_equals_unified_for_mooncake_and_nixl(tiny_llama_dir, backend, page_size):
    from kvship.engine.disagg import BackendUnavailableError, get_transfer_backend

    try:
        get_transfer_backend(backend)
    except BackendUnavailableError as e:
        pytest.skip(f"{backend} unavailable here: {e}")
    args = [
        "--transfer-backend",
        backend,
        "--model-path",
        tiny_llama_dir,
        "--device",
        "cpu",
        "--page-size",
        str(page_size),
        "--chunked-prefill-size",
        str(CHUNK),
        "--max-total-tokens",
        "16384",
    ]
    prompts = make_prompts(32, seed=20 + page_size, lo=1, hi=3 * CHUNK)
    with start_local(args) as cluster:
        outs = await _generate_all(cluster.url, prompts, MAX_NEW)
        _check_equal(
            outs, unified_greedy(tiny_llama_dir, prompts, MAX_NEW, page_size=page_size, chunked_prefill_size=CHUNK)
        )
        workers = cluster.workers("prefill") + cluster.workers("decode")
        assert all(cluster.info(u)["transfer_backend"] == backend for u in workers)
        cluster.wait_free(workers)
