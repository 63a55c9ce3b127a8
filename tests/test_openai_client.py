"""The official ``openai`` Python client against a real ``kvship serve`` (tiny random Llama)."""

from __future__ import annotations

import openai
import pytest
from server_fixtures import ServerHandle, start_server

MESSAGES = [{"role": "user", "content": "Say something about foxes."}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> ServerHandle:
    with start_server(["--model-path", tiny_llama_dir, "--served-model-name", "tiny"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_models_list_names_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_chat_completion_non_streaming(client):
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and isinstance(out.choices[0].message.content, str)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + 10


def test_chat_completion_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    parts, finish, usage = [], None, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == full
    assert len([p for p in parts if p]) > 1
    assert finish == "length" and usage.completion_tokens == 24


def test_chat_logprobs_and_n(client):
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, n=2, temperature=0.9, seed=11, logprobs=True, top_logprobs=2
    )
    assert len(out.choices) == 2 and {c.index for c in out.choices} == {0, 1}
    for c in out.choices:
        assert 1 <= len(c.logprobs.content) <= 4
        for entry in c.logprobs.content:
            assert len(entry.top_logprobs) == 2 and entry.logprob <= 0


def test_completion_non_streaming_and_streaming(client):
    kw = dict(
        model="tiny", prompt="The capital of France is", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    text = full.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == text


def test_completion_seed_reproduces_sampling(client):
    kw = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=16,
        temperature=1.0,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_client_errors_map_to_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-unknown", messages=MESSAGES)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="tiny", prompt="x", max_tokens="lots")  # type: ignore[arg-type]
