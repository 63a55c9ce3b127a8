"""Selective disaggregation (``kvship router --pd --pd-selective``, docs/router.md).

The rule (``kvship.router.selective``) on its own, then through real processes: ``kvship local`` with one
prefill and one decode worker, where prompts with at most ``--pd-selective-max-tokens`` tokens left to prefill
are served by the decode worker alone (it prefills them itself) and longer ones go through the prefill worker;
greedy outputs equal the unified scheduler's either way, and the decisions are counted by reason.
"""

from __future__ import annotations

import json

import httpx
import pytest
from pd_fixtures import make_prompts, start_local, unified_greedy

from kvship.router.circuit import CircuitBreaker
from kvship.router.config import RouterConfig
from kvship.router.core import Router
from kvship.router.selective import SelectiveDisagg
from kvship.router.wire import RoutingRequest
from kvship.router.worker import Worker

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 8
LIMIT = 48  # --pd-selective-max-tokens of the cluster below


def _ids_request(ids: list[int]) -> RoutingRequest:
    raw = json.dumps({"input_ids": ids}).encode()
    return RoutingRequest.parse("/generate", raw)


def test_short_prompts_and_cached_prefixes_stay_on_decode_long_ones_go_through_prefill():
    rule = SelectiveDisagg(RouterConfig(pd=True, pd_selective=True, pd_selective_max_tokens=LIMIT))
    decode = Worker(url="http://d0:1", role="decode", breaker=CircuitBreaker(5, 30))
    assert rule.decide(decode, _ids_request(list(range(1, LIMIT + 1)))).reason == "short"
    long_prompt = list(range(100, 100 + 3 * LIMIT))
    first = rule.decide(decode, _ids_request(long_prompt))
    assert (first.local, first.reason, first.tokens, first.uncached) == (False, "long", 3 * LIMIT, 3 * LIMIT)
    again = rule.decide(decode, _ids_request(long_prompt + [7] * (LIMIT // 2)))  # its prefix is cached there now
    assert (again.local, again.reason, again.uncached) == (True, "cached", LIMIT // 2)
    other = rule.decide(
        Worker(url="http://d1:1", role="decode", breaker=CircuitBreaker(5, 30)), _ids_request(long_prompt + [7])
    )
    assert other.reason == "long", "another decode worker does not hold that prefix"
    text = RoutingRequest.parse("/v1/completions", json.dumps({"model": "m", "prompt": "x" * (4 * LIMIT + 1)}).encode())
    assert rule.decide(decode, text).tokens == LIMIT + 1  # text prompts: ceil(characters / 4) tokens


def test_pd_selective_needs_pd():
    with pytest.raises(ValueError, match="--pd-selective needs --pd"):
        Router(RouterConfig(pd_selective=True, worker_urls=["http://a:1"]))


@pytest.fixture(scope="module")
def selective(tiny_llama_dir):
    args = ["--prefill", "1", "--decode", "1", "--transfer-backend", "tcp", "--model-path", tiny_llama_dir]
    args += ["--device", "cpu", "--page-size", "16", "--max-total-tokens", "8192", "--policy", "round_robin"]
    args += ["--pd-selective", "--pd-selective-max-tokens", str(LIMIT)]
    with start_local(args) as cluster:
        yield cluster


def _generate(cluster, ids: list[int], stream: bool = False) -> tuple[list[int], httpx.Headers]:
    body = {"input_ids": ids, "stream": stream, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0}}
    if not stream:
        r = cluster.generate(ids, MAX_NEW)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"], r.headers
    last = None
    with httpx.stream("POST", cluster.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
        headers = r.headers
    assert last is not None
    return last["output_ids"], headers


def _selective_counts(cluster) -> dict[tuple[str, str], float]:
    text = httpx.get(cluster.url + "/metrics", headers=cluster.worker_headers, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("kvship_router_pd_selective_total{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1 : line.index("}")].split(","))
            out[(labels["route"].strip('"'), labels["reason"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


def test_short_prompts_skip_prefill_long_go_through_it_and_greedy_output_is_equal(selective, tiny_llama_dir):
    decode, prefill = selective.workers("decode")[0], selective.workers("prefill")[0]
    short = make_prompts(3, seed=21, lo=5, hi=LIMIT)
    long = make_prompts(2, seed=22, lo=3 * LIMIT, hi=4 * LIMIT)
    prompts = short + long
    expected = unified_greedy(tiny_llama_dir, prompts, MAX_NEW, page_size=16)
    before = selective.info(decode)["kv_transfers_ok"]
    for i, ids in enumerate(prompts):
        out, headers = _generate(selective, ids, stream=i % 2 == 1)
        assert out == expected[i], f"prompt {i} ({len(ids)} tokens)"
        assert headers["x-kvship-worker"] == decode
        if len(ids) <= LIMIT:
            assert "x-kvship-prefill" not in headers, f"prompt {i} went through prefill"
        else:
            assert headers["x-kvship-prefill"] == prefill
    assert selective.info(decode)["kv_transfers_ok"] - before == len(long)
    counts = _selective_counts(selective)
    assert counts[("decode", "short")] >= len(short) and counts[("pd", "long")] >= len(long)
    selective.wait_free([decode, prefill])


def test_a_prompt_whose_prefix_decode_caches_is_served_by_decode_alone(selective, tiny_llama_dir):
    decode = selective.workers("decode")[0]
    base = make_prompts(1, seed=23, lo=3 * LIMIT, hi=3 * LIMIT)[0]
    follow = base + make_prompts(1, seed=24, lo=LIMIT // 2, hi=LIMIT // 2)[0]
    expected = unified_greedy(tiny_llama_dir, [base, follow], MAX_NEW, page_size=16)
    out, headers = _generate(selective, base)
    assert out == expected[0] and "x-kvship-prefill" in headers
    cached_before = selective.info(decode)["cached_tokens"]
    out, headers = _generate(selective, follow)
    assert out == expected[1] and "x-kvship-prefill" not in headers
    assert selective.info(decode)["cached_tokens"] - cached_before >= 16, "decode did not reuse its cached prefix"
    assert _selective_counts(selective)[("decode", "cached")] >= 1
