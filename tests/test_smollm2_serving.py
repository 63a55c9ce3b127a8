"""The embedded SmolLM2-135M-Instruct (GGUF) served by ``kvship serve`` with no ``--model-path``."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_fixtures import ServerHandle, start_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_path) -> ServerHandle:
    with start_server(["--max-total-tokens", "8192"], timeout=300) as srv:
        yield srv


def test_embedded_model_is_served_by_default(server, smollm2_path):
    info = server.get("/get_model_info").json()
    assert info["served_model_name"] == "SmolLM2-135M-Instruct"
    assert info["model_path"] == smollm2_path
    assert info["vocab_size"] == 49152
    assert [m["id"] for m in server.get("/v1/models").json()["data"]] == ["SmolLM2-135M-Instruct"]


def test_capital_of_france_is_paris_over_http(server):
    r = server.post(
        "/v1/chat/completions",
        json={"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "max_tokens": 24, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer


def test_capital_of_france_is_paris_through_the_openai_client_streaming_and_not(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in out.choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=24, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == out.choices[0].message.content


def test_answer_ends_at_the_chat_eos_token(server):
    r = server.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 200, "temperature": 0}).json()
    assert r["choices"][0]["finish_reason"] == "stop"  # <|im_end|> ends the turn well before 200 tokens
    assert "<|im_end|>" not in r["choices"][0]["message"]["content"]
    assert r["usage"]["completion_tokens"] < 200


def test_second_identical_chat_hits_the_prefix_cache(server):
    body = {"messages": QUESTION, "max_tokens": 4, "temperature": 0}
    server.post("/v1/chat/completions", json=body)
    again = server.post("/v1/chat/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 1


def test_multibyte_prompt_round_trips_with_echo(server):
    prompt = "Café ☕ 日本 🙂:"
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 3, "echo": True, "temperature": 0},
        timeout=60,
    ).json()
    text = r["choices"][0]["text"]
    assert text.startswith(prompt) and "\ufffd" not in text[: len(prompt)]


def test_required_tool_choice_returns_a_valid_call_through_the_openai_client(server):
    import json

    import jsonschema

    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    ).choices[0]
    assert out.finish_reason == "tool_calls", out
    (call,) = out.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params)
