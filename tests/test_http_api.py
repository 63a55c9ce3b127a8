"""The worker HTTP API against a real ``kvship serve`` process (tiny random Llama on CPU)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from server_fixtures import ServerHandle, start_server

PROMPT = "The quick brown fox jumps over the lazy dog. What is the capital of France?"


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> ServerHandle:
    with start_server(
        [
            "--model-path",
            tiny_llama_dir,
            "--served-model-name",
            "tiny",
            "--max-total-tokens",
            "16384",
            "--max-running-requests",
            "16",
        ]
    ) as srv:
        yield srv


def sse_events(response: httpx.Response) -> list:
    """Parse an SSE body into decoded JSON payloads ('[DONE]' kept as a string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def complete(server, **body) -> dict:
    body.setdefault("model", "tiny")
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(server, timeout: float = 30.0) -> dict:
    """Server info once nothing runs or waits (the scheduler finishes aborts asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        info = server.get("/get_server_info").json()
        if info["running"] == 0 and info["waiting"] == 0 and info["active_requests"] == 0:
            return info
        assert time.monotonic() < deadline, f"server never went idle: {info}"
        time.sleep(0.05)


def assert_all_slots_free(server) -> None:
    info = wait_idle(server)
    assert info["free_slots"] == info["total_slots"], info


# ------------------------------------------------------------------ info routes


def test_health_models_and_info_routes_describe_the_server(server, tiny_llama_dir):
    assert server.get("/health").json() == {"status": "ok"}
    models = server.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 2048
    assert server.get("/v1/models/tiny").json()["id"] == "tiny"
    info = server.get("/get_model_info").json()
    assert info["model_path"] == tiny_llama_dir and info["served_model_name"] == "tiny"
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert info["context_len"] == 2048 and info["vocab_size"] == 384 and info["is_generation"] is True
    sinfo = server.get("/get_server_info").json()
    assert sinfo["total_slots"] == 16384 and sinfo["free_slots"] == 16384
    assert sinfo["server_args"]["max_running_requests"] == 16
    for key in ("running", "waiting", "cache_hit_rate", "token_usage"):
        assert key in sinfo


# ------------------------------------------------------------------ completions and chat


def test_greedy_completion_is_deterministic_and_counts_usage(server):
    a = complete(server, prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    b = complete(server, prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    assert a["object"] == "text_completion" and a["id"].startswith("cmpl-")
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["choices"][0]["text"]
    assert a["choices"][0]["finish_reason"] == "length"
    u = a["usage"]
    assert u["completion_tokens"] == 12 and u["total_tokens"] == u["prompt_tokens"] + 12
    # the identical second prompt is served from the prefix cache
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_token_id_prompt_equals_text_prompt(server, tiny_llama_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_llama_dir).encode(PROMPT)
    by_text = complete(server, prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    by_ids = complete(server, prompt=ids, max_tokens=8, temperature=0, ignore_eos=True)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


def test_batch_prompts_with_n_give_indexed_choices(server):
    out = complete(
        server, prompt=["Hello", "Large language models"], n=2, max_tokens=5, temperature=0.8, seed=3, ignore_eos=True
    )
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["completion_tokens"] == 20
    single = complete(server, prompt="Hello", max_tokens=5, temperature=0.8, seed=3, ignore_eos=True)
    assert out["choices"][0]["text"] == single["choices"][0]["text"]  # choice 0 uses the request's seed


def test_same_seed_gives_same_sample_and_other_seed_differs(server):
    texts = [
        complete(server, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=s, ignore_eos=True)["choices"][0]["text"]
        for s in (7, 7, 8)
    ]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_chat_completion_answers_with_assistant_message(server):
    r = server.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_completion_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 6


def test_streamed_chat_arrives_incrementally_and_matches_non_streamed(server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = server.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    arrivals, events = [], []
    start = time.monotonic()
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        timeout=60,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert len([c for c in content if c]) >= 10, "tokens must arrive in many chunks"
    assert "".join(content) == full
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 300
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
    first_content = next(t for t, c in zip(arrivals, content) if c)
    # the first tokens arrive while the other ~300 are still being generated
    assert first_content - start < 0.5 * (arrivals[-1] - start)


def test_streamed_completion_with_n_streams_every_choice(server):
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": "Hello",
            "n": 3,
            "max_tokens": 7,
            "temperature": 0.7,
            "seed": 1,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: "", 2: ""}
    finish = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    assert finish == {0: "length", 1: "length", 2: "length"}
    ref = complete(server, prompt="Hello", n=3, max_tokens=7, temperature=0.7, seed=1, ignore_eos=True)
    assert [texts[i] for i in range(3)] == [c["text"] for c in ref["choices"]]


# ------------------------------------------------------------------ stop conditions


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_trimmed_from_the_output(server, stream):
    base = complete(server, prompt=PROMPT, max_tokens=40, temperature=0, ignore_eos=True)["choices"][0]["text"]
    stop = next(
        base[i : i + 2] for i in range(6, len(base) - 2) if base[i : i + 2].strip() and base.find(base[i : i + 2]) == i
    )
    expected = base[: base.find(stop)]
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "stop": [stop, "\x00never"],
    }
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            events = sse_events(r)[:-1]
        text = "".join(c["text"] for e in events for c in e["choices"])
        last = events[-1]["choices"][0]
    else:
        out = complete(server, **body)
        text, last = out["choices"][0]["text"], out["choices"][0]
    assert text == expected
    assert last["finish_reason"] == "stop" and last["matched_stop"] == stop


def test_stop_token_id_ends_generation_and_is_not_in_text(server):
    r = server.post(
        "/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}},
    ).json()
    ids = r["output_ids"]
    stop_id = ids[5]
    first = ids.index(stop_id)
    out = server.post(
        "/generate",
        json={
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": 20,
                "temperature": 0,
                "ignore_eos": True,
                "stop_token_ids": [stop_id],
            },
        },
    ).json()
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    prefix = server.post("/generate", json={"input_ids": ids[:first], "sampling_params": {"max_new_tokens": 1}})
    assert prefix.status_code == 200
    ref_text = server.post(
        "/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": first, "temperature": 0, "ignore_eos": True}},
    ).json()["text"]
    assert out["text"] == ref_text


# ------------------------------------------------------------------ logprobs


def test_chat_logprobs_have_top_alternatives_and_greedy_picks_the_best(server):
    out = server.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 3,
        },
    ).json()
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert len(entry["top_logprobs"]) == 3 and isinstance(entry["bytes"], list)
        assert entry["logprob"] == pytest.approx(max(t["logprob"] for t in entry["top_logprobs"]), abs=1e-5)
        assert entry["logprob"] <= 0


def test_completion_logprobs_shape(server):
    out = complete(server, prompt="Hello", max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0


# ------------------------------------------------------------------ /generate


def test_native_generate_single_batch_and_logprobs(server):
    one = server.post(
        "/generate",
        json={
            "text": "Hello",
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "rid": "native-1",
        },
    ).json()
    meta = one["meta_info"]
    assert meta["id"] == "native-1" and meta["completion_tokens"] == 6 and len(one["output_ids"]) == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0 and "cached_tokens" in meta
    assert [x[1] for x in meta["output_token_logprobs"]] == one["output_ids"]
    assert all(len(t) == 2 for t in meta["output_top_logprobs"])
    batch = server.post(
        "/generate",
        json={
            "text": ["Hello", "World"],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        },
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == one["output_ids"]
    by_ids = server.post(
        "/generate",
        json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}]},
    ).json()
    assert [len(b["output_ids"]) for b in by_ids] == [2, 3]


def test_native_generate_streams_cumulative_text(server):
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    full = server.post("/generate", json=body).json()
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and len(events) > 3
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full["text"] and events[-2]["output_ids"] == full["output_ids"]
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"


def test_pd_bootstrap_fields_are_accepted(server):
    r = server.post(
        "/generate",
        json={
            "text": "Hi",
            "sampling_params": {"max_new_tokens": 1},
            "bootstrap_host": "10.0.0.1",
            "bootstrap_port": 8998,
            "bootstrap_room": 12345,
        },
    )
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ aborts, disconnects, slots


def test_abort_request_ends_a_running_stream(server):
    rid = "abort-me-1"
    body = {
        "text": "Hello",
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
    }
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
        assert server.post("/abort_request", json={"rid": rid}).json()["aborted"] == 1
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    last = events[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "abort" and last["completion_tokens"] < 1500
    assert server.post("/abort_request", json={"rid": rid}).json()["aborted"] == 0
    assert_all_slots_free(server)


def test_client_disconnect_mid_stream_frees_slots(server):
    before = server.get("/get_server_info").json()["num_aborted"]
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}], "stream": True}),
        ("/v1/completions", {"prompt": "go", "stream": True}),
        ("/generate", {"text": "go", "stream": True}),
    ]:
        body = (
            {**body, "max_tokens": 1500, "ignore_eos": True}
            if path != "/generate"
            else {**body, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
        )
        with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got >= 3:
                    break  # leave mid-stream: closing the response drops the connection
    info = wait_idle(server)
    assert info["num_aborted"] - before == 3
    assert info["free_slots"] == info["total_slots"]


def test_client_disconnect_before_a_non_streamed_answer_aborts_it(server):
    before = server.get("/get_server_info").json()
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", json={"prompt": "go", "max_tokens": 1800, "ignore_eos": True}, timeout=1.0)
    info = wait_idle(server)
    assert info["num_aborted"] == before["num_aborted"] + 1
    assert info["generation_tokens"] - before["generation_tokens"] < 1800
    assert info["free_slots"] == info["total_slots"]


async def _one_soak_request(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    kind = ["plain", "stream_stop", "abort", "disconnect", "chat", "n"][i % 6]
    if kind == "plain":
        r = await client.post(
            "/v1/completions",
            json={"prompt": f"req {i}", "max_tokens": rng.randint(1, 12), "temperature": 0.9, "seed": i},
        )
        assert r.status_code == 200, r.text
    elif kind == "stream_stop":
        async with client.stream(
            "POST",
            "/v1/completions",
            json={
                "prompt": f"stop {i}",
                "max_tokens": 30,
                "stop": ["e", "a", "o"],
                "stream": True,
                "temperature": 1.0,
                "seed": i,
            },
        ) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                pass
    elif kind == "abort":
        rid = f"soak-abort-{i}"
        task = asyncio.create_task(
            client.post(
                "/generate",
                json={"text": f"abort {i}", "rid": rid, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}},
            )
        )
        await asyncio.sleep(rng.uniform(0.0, 0.2))
        await client.post("/abort_request", json={"rid": rid})
        r = await task
        assert r.status_code == 200
    elif kind == "disconnect":
        async with client.stream(
            "POST",
            "/generate",
            json={"text": f"disc {i}", "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}},
        ) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n >= rng.randint(1, 4):
                    break
    elif kind == "chat":
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": f"chat {i}"}], "max_tokens": 8, "stop": "\n"},
        )
        assert r.status_code == 200, r.text
    else:
        r = await client.post("/v1/completions", json={"prompt": f"n {i}", "n": 3, "max_tokens": 4})
        assert r.status_code == 200, r.text
    return kind


def test_two_hundred_mixed_requests_leave_every_slot_free(server):
    async def main():
        rng = random.Random(1234)
        sem = asyncio.Semaphore(12)
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

            async def guarded(i):
                async with sem:
                    return await _one_soak_request(client, i, rng)

            return await asyncio.gather(*(guarded(i) for i in range(200)))

    kinds = asyncio.run(main())
    assert len(kinds) == 200
    assert_all_slots_free(server)
    assert server.get("/health").status_code == 200
    assert complete(server, prompt="still alive?", max_tokens=3)["usage"]["completion_tokens"] >= 1


# ------------------------------------------------------------------ metrics


def test_metrics_expose_token_counters_latency_histograms_and_gauges(server):
    complete(server, prompt="metrics", max_tokens=4, ignore_eos=True)
    text = server.get("/metrics").text
    for series in (
        "kvship:prompt_tokens_total",
        "kvship:generation_tokens_total",
        "kvship:cached_tokens_total",
        "kvship:time_to_first_token_seconds_bucket",
        "kvship:inter_token_latency_seconds_bucket",
        "kvship:e2e_request_latency_seconds_count",
        "kvship:num_running_reqs",
        "kvship:num_queue_reqs",
        "kvship:token_usage",
        "kvship:cache_hit_rate",
        "kvship:kv_total_slots",
        "kvship:kv_free_slots",
        "kvship:requests_total",
    ):
        assert series in text, series
    values = {
        line.split(" ")[0]: float(line.split(" ")[-1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values['kvship:generation_tokens_total{model_name="tiny"}'] >= 4
    assert values['kvship:prompt_tokens_total{model_name="tiny"}'] > 0
    assert values['kvship:kv_total_slots{model_name="tiny"}'] == 16384
