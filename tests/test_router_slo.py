"""Live SLO figures of the router (kvship.router.slo; docs/router.md, "SLO figures").

Unit tests of the per-request meter and the windowed summary, then a load
generator (httpx, streaming) against a real router and a real ``kvship serve``
CPU worker: the router's ``GET /slo`` medians and rate agree within 10% with
what the load generator measured itself.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import pytest
import server_fixtures
from router_fixtures import router_process

from kvship.common import metrics_names as names
from kvship.router.metrics import RouterMetrics
from kvship.router.slo import RequestMeter, RequestSample, SLOTracker, percentile


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def test_meter_times_token_events_of_a_chat_stream_however_the_bytes_are_split():
    clock = Clock()
    meter = RequestMeter(started=100.0, clock=clock)
    events = [
        (100.010, _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})),  # no token
        (100.050, _sse({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})),
        (100.060, _sse({"choices": [{"index": 0, "delta": {}}]})),  # held back text: no token event
        (100.075, _sse({"choices": [{"index": 0, "delta": {"content": "lo"}}]})),
        (100.105, _sse({"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}]})),
        (100.106, _sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})),
        (100.107, _sse(b"[DONE]")),
    ]
    blob = b"".join(e for _, e in events)
    # feed in awkward pieces: each event's bytes arrive at that event's time, split mid-event
    for t, e in events:
        clock.t = t
        meter.feed(e[:7])
        meter.feed(e[7:])
    clock.t = 100.110
    s = meter.stream_sample()
    assert s.ttft == pytest.approx(0.050)
    assert s.itls == pytest.approx([0.025, 0.030])
    assert s.output_tokens == 4  # the worker's usage wins over the 3 events
    assert s.e2e == pytest.approx(0.110)
    assert blob.count(b"data:") == 7


def test_meter_counts_generate_events_by_completion_tokens_and_bodies_by_usage():
    clock = Clock()
    meter = RequestMeter(started=100.0, clock=clock)
    for i, t in enumerate((100.02, 100.03, 100.045), start=1):
        clock.t = t
        meter.feed(_sse({"text": "x" * i, "meta_info": {"completion_tokens": i}}))
    clock.t = 100.05
    meter.feed(_sse({"text": "xxx", "meta_info": {"completion_tokens": 3, "finish_reason": {"type": "length"}}}))
    s = meter.stream_sample()
    assert s.ttft == pytest.approx(0.02) and s.itls == pytest.approx([0.01, 0.015]) and s.output_tokens == 3
    clock.t = 100.5
    body = json.dumps({"choices": [{"text": "abc"}], "usage": {"completion_tokens": 7}}).encode()
    b = RequestMeter.body_sample(100.0, body, clock=clock)
    assert (b.e2e, b.output_tokens, b.ttft, b.itls) == (pytest.approx(0.5), 7, None, [])
    batch = json.dumps([{"meta_info": {"completion_tokens": 2}}, {"meta_info": {"completion_tokens": 5}}]).encode()
    assert RequestMeter.body_sample(100.0, batch, clock=clock).output_tokens == 7


def test_percentile_interpolates_between_order_statistics():
    assert percentile([], 0.5) is None
    assert percentile([5.0], 0.99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile(list(map(float, range(101))), 0.9) == pytest.approx(90.0)


def test_summary_covers_the_window_only_and_rates_use_the_elapsed_time():
    clock = Clock(1000.0)
    metrics = RouterMetrics()
    tracker = SLOTracker(metrics, window_s=60, clock=clock)
    empty = tracker.summary()
    assert empty["requests"] == 0 and empty["ttft_p50_ms"] is None and empty["kv_transfer_gbps"] is None
    clock.t = 1010.0
    tracker.record("/v1/completions", RequestSample(e2e=1.0, output_tokens=10, ttft=0.5, itls=[0.05, 0.07]))
    clock.t = 1080.0  # the first request is now out of the 60 s window
    for ttft in (0.1, 0.2, 0.3):
        tracker.record("/v1/completions", RequestSample(e2e=0.5, output_tokens=20, ttft=ttft, itls=[0.01]))
    s = tracker.summary()
    assert s["window_s"] == 60 and s["requests"] == 3
    assert s["ttft_p50_ms"] == pytest.approx(200.0) and s["itl_p50_ms"] == pytest.approx(10.0)
    assert s["e2e_p99_ms"] == pytest.approx(500.0)
    assert s["requests_per_second"] == pytest.approx(3 / 60) and s["output_tokens_per_second"] == pytest.approx(1.0)
    assert tracker.summary(window_s=30)["window_s"] == 30
    # the same figures as Prometheus series, under the names of kvship.common.metrics_names
    text = metrics.render().decode()
    for name in names.ROUTER_SLO_METRICS:
        assert name in text, name
    assert f'{names.ROUTER_TTFT}_count{{route="/v1/completions"}} 4.0' in text


def test_kv_transfer_rate_sums_decode_workers_and_survives_a_counter_reset():
    clock = Clock(0.0)
    tracker = SLOTracker(RouterMetrics(), window_s=60, clock=clock)
    tracker.record_kv_bytes("http://d1", 0)
    tracker.record_kv_bytes("http://d2", 5_000_000_000)
    clock.t = 10.0
    tracker.record_kv_bytes("http://d1", 10_000_000_000)  # 1 GB/s
    tracker.record_kv_bytes("http://d2", 10_000_000_000)  # 0.5 GB/s
    assert tracker.summary()["kv_transfer_gbps"] == pytest.approx(1.5)
    clock.t = 20.0
    tracker.record_kv_bytes("http://d2", 1_000)  # d2 restarted: its series starts again
    assert tracker.summary()["kv_transfer_gbps"] == pytest.approx(1.0)


def test_per_role_figures_sum_token_rates_queues_and_kv_usage_over_each_roles_workers():
    clock = Clock(0.0)
    tracker = SLOTracker(RouterMetrics(), window_s=60, clock=clock)
    assert tracker.summary()["roles"] == {}
    info = lambda p, g, run, wait, use: dict(  # noqa: E731
        prompt_tokens=p, generation_tokens=g, running=run, waiting=wait, token_usage=use
    )
    tracker.record_worker("http://p1", "prefill", info(0, 0, 1, 0, 0.1))
    tracker.record_worker("http://p2", "prefill", info(500, 10, 0, 0, 0.2))
    tracker.record_worker("http://d1", "decode", {**info(0, 0, 3, 1, 0.5), "kv_transfer_bytes": 0})
    one = tracker.summary()["roles"]
    assert one["prefill"]["prompt_tokens_per_second"] is None  # one scrape each: no rate yet
    assert (one["prefill"]["running"], one["decode"]["queue_depth"]) == (1, 1)
    clock.t = 10.0
    tracker.record_worker("http://p1", "prefill", info(2000, 10, 2, 3, 0.4))  # 200 prompt tok/s
    tracker.record_worker("http://p2", "prefill", info(1500, 20, 1, 1, 0.8))  # 100 prompt tok/s
    tracker.record_worker("http://d1", "decode", {**info(0, 400, 4, 0, 0.9), "kv_transfer_bytes": 10**10})
    roles = tracker.summary()["roles"]
    assert roles["prefill"] == {
        "workers": 2,
        "prompt_tokens_per_second": 300.0,
        "generation_tokens_per_second": 2.0,
        "queue_depth": 4,
        "running": 3,
        "kv_usage": 0.6,
        "kv_usage_max": 0.8,
    }
    assert roles["decode"]["generation_tokens_per_second"] == 40.0 and roles["decode"]["running"] == 4
    assert tracker.summary()["kv_transfer_gbps"] == pytest.approx(1.0)  # decode's kv_transfer_bytes, as before
    # a restarted worker (counters back to 0) starts its series again; a removed one leaves the figures
    clock.t = 20.0
    tracker.record_worker("http://p1", "prefill", info(50, 0, 0, 0, 0.0))
    tracker.forget_worker("http://p2")
    roles = tracker.summary()["roles"]
    assert roles["prefill"]["workers"] == 1 and roles["prefill"]["prompt_tokens_per_second"] is None
    tracker.record_worker("http://p1", "prefill", {"prompt_tokens": "x", "running": True, "token_usage": -1})
    assert tracker.summary()["roles"]["prefill"]["running"] is None  # junk is no figure


# --- a real router and worker under a load generator ------------------------------------------------------

MAX_TOKENS = 12
REQUESTS = 24
# More clients than the worker runs at once: requests queue, so TTFT is mostly waiting in the worker (as under
# real load) and not the few ms from the client to the router's handler, which the router cannot see and
# which a busy 2-core CI box stretches to ~10 ms now and then.
CONCURRENCY = 3


async def _one(c: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[float, list[float], float, float]:
    """One streamed completion: (TTFT, inter-token gaps, end-to-end, end time), timed by the client."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    stamps = []
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if any(ch.get("text") for ch in json.loads(line[6:]).get("choices", [])):
                    stamps.append(time.perf_counter())
    end = time.perf_counter()
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], end - t0, end


@pytest.fixture(scope="module")
def small_llama_dir(tmp_path_factory) -> str:
    """A random llama big enough that a decode step takes milliseconds on CPU: with the tiny test model a
    step is so short that the worker's HTTP thread, sharing the GIL with its model loop, sends tokens in
    bursts and inter-token gaps are mostly ~0 for anyone who measures them.  (The worker also runs one torch
    thread, leaving CPU to the router and the load generator, which otherwise read events late.)"""
    from conftest import build_tiny_model

    out = str(tmp_path_factory.mktemp("small_llama"))
    return build_tiny_model(
        out,
        "llama",
        seed=7,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_slo_figures_agree_with_what_a_load_generator_measures(small_llama_dir):
    args = [
        "--model-path",
        small_llama_dir,
        "--served-model-name",
        "tiny",
        "--max-running-requests",
        "1",
        "--num-threads",
        "1",
    ]
    with server_fixtures.start_server(args + ["--max-total-tokens", "4096"]) as worker:
        # the router in its own process, as deployed: a load generator sharing its event loop would
        # see every event late by whatever the router does meanwhile
        with router_process(["--worker-urls", worker.url, "--log-level", "warning"]) as (url, _):
            async with httpx.AsyncClient(timeout=120) as c:
                await _one(c, url, [5, 6, 7])  # warm-up, outside the measured window below
                await asyncio.sleep(1.0)
                queue = [[(i * 7 + k) % 300 + 3 for k in range(40 + i % 5 * 20)] for i in range(REQUESTS)]
                results = []

                async def client() -> None:
                    while queue:
                        results.append(await _one(c, url, queue.pop()))

                start = time.perf_counter()
                await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
                duration = time.perf_counter() - start
                slo = (await c.get(url + "/slo", params={"window_s": f"{duration:.3f}"})).json()
                metrics_text = (await c.get(url + "/metrics")).text
    assert slo["requests"] == REQUESTS, slo
    ttft = statistics.median(r[0] for r in results) * 1000
    itl = statistics.median(g for r in results for g in r[1]) * 1000
    e2e = statistics.median(r[2] for r in results) * 1000
    rps = REQUESTS / duration
    figures = {"ttft": (slo["ttft_p50_ms"], ttft), "itl": (slo["itl_p50_ms"], itl), "e2e": (slo["e2e_p50_ms"], e2e)}
    figures["rps"] = (slo["requests_per_second"], rps)
    figures["tokens/s"] = (slo["output_tokens_per_second"], rps * MAX_TOKENS)
    print("router vs load generator:", {k: (round(a, 3), round(b, 3)) for k, (a, b) in figures.items()})
    # an inter-token gap is timed in two processes (the router as chunks arrive from the worker, the generator as
    # they arrive from the router) on a box that may have 2 cores for all three: a gap of ~7 ms can shift by a
    # scheduler tick either way (CI once saw 7.71 against 6.95 ms), so ITL also passes within 1 ms
    slack = {"itl": 1.0}
    for name, (router_value, client_value) in figures.items():
        want = pytest.approx(client_value, rel=0.10, abs=slack.get(name, 0.0))
        assert router_value == want, (name, router_value, client_value)
    assert slo["ttft_p50_ms"] <= slo["ttft_p90_ms"] <= slo["ttft_p99_ms"]
    assert slo["kv_transfer_gbps"] is None  # no decode worker: no KV transfer
    assert f'{names.ROUTER_ITL}_count{{route="/v1/completions"}}' in metrics_text
