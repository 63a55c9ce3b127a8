"""Tool calling and reasoning through the official ``openai`` client against a real ``kvship serve``.

The tiny random model (ChatML template, Qwen2.5-style) writes noise, so every valid call below is the
grammar's doing (tool_choice required / named); greedy sampling makes streamed and non-streamed answers
comparable token for token.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from server_fixtures import ServerHandle, start_server

pytest.importorskip("xgrammar")

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["CET", "UTC"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> ServerHandle:
    args = ["--model-path", tiny_llama_dir, "--served-model-name", "tiny"]
    with start_server(args + ["--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _create(client, **kw):
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, **kw)


def _streamed(client, **kw):
    state = ChatCompletionStreamState()
    for chunk in _create(client, stream=True, **kw):
        state.handle_chunk(chunk)
    return state.get_final_completion().choices[0]


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _assert_valid_calls(choice, names):
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [None, False])
def test_required_tool_choice_returns_a_call_whose_arguments_validate(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    choice = _create(client, tools=TOOLS, tool_choice="required", **extra).choices[0]
    _assert_valid_calls(choice, SCHEMAS)
    if parallel is False:
        assert len(choice.message.tool_calls) == 1
    streamed = _streamed(client, tools=TOOLS, tool_choice="required", **extra)
    assert _calls(streamed.message) == _calls(choice.message)
    assert streamed.finish_reason == "tool_calls"


def test_named_tool_choice_calls_that_function_and_streams_the_same_call(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = _create(client, tools=TOOLS, tool_choice=named).choices[0]
    _assert_valid_calls(choice, ["get_time"])
    assert len(choice.message.tool_calls) == 1
    streamed = _streamed(client, tools=TOOLS, tool_choice=named)
    assert _calls(streamed.message) == _calls(choice.message)


def test_bad_tool_choice_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        _create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError):
        _create(client, tool_choice="required")
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    with pytest.raises(openai.BadRequestError) as e:  # the schema does not compile: the compiler's message
        _create(client, tools=bad, tool_choice="required")
    assert e.value.body["param"] == "tools" and "nonsense" in e.value.body["message"]
    assert _create(client, tools=bad, max_tokens=2).choices[0].finish_reason  # auto: the schema is not compiled


def test_thinking_opened_in_the_prompt_comes_back_as_reasoning_content(client):
    # the prompt ends inside <think> (as thinking templates leave it): the answer so far is thinking
    kw = dict(
        messages=MESSAGES + [{"role": "assistant", "content": "<think>\nLet me see"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True},
        max_tokens=12,
    )
    out = client.chat.completions.create(model="tiny", temperature=0, **kw).choices[0]
    reasoning = out.message.model_extra["reasoning_content"]
    assert reasoning and out.message.content == ""
    streamed = _streamed_raw(client, **kw)
    assert streamed == (reasoning, "")


def _streamed_raw(client, **kw) -> tuple[str, str]:
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="tiny", temperature=0, stream=True, **kw):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    return reasoning, content


def test_auto_tool_choice_without_a_call_streams_the_same_content(client):
    kw = dict(tools=TOOLS, max_tokens=16, extra_body={"ignore_eos": True})
    out = _create(client, **kw).choices[0]
    assert out.finish_reason == "length" and out.message.tool_calls is None and out.message.content
    assert _streamed_raw(client, messages=MESSAGES, **kw) == ("", out.message.content)


def test_a_call_and_its_result_go_back_to_the_model_in_the_next_turn(client):
    choice = _create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0]
    call = choice.message.tool_calls[0]
    messages = MESSAGES + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


# A Llama 3.1-style tool template (header ids, "Environment: ipython", the tools as JSON in the system turn,
# calls written back as {"name": ..., "parameters": ...}, results in an ipython turn), written for this test.
LLAMA31_TEMPLATE = (
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}"
    '{{- \'Respond with JSON {"name": function name, "parameters": arguments}. <|python_tag|> marks calls.\\n\' }}'
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{%- if m.tool_calls is defined %}"
    "{%- for c in m.tool_calls %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    '{{- \'{"name": "\' + c.function.name + \'", "parameters": \' }}{{- c.function.arguments | tojson }}'
    "{{- '}<|eot_id|>' }}{%- endfor %}"
    "{%- elif m.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def llama31_client(tiny_llama_dir, tmp_path_factory):
    import shutil

    model = str(tmp_path_factory.mktemp("tiny_llama31") / "m")
    shutil.copytree(tiny_llama_dir, model)
    with open(f"{model}/chat_template.jinja", "w") as f:  # (where transformers keeps the template)
        f.write(LLAMA31_TEMPLATE)
    args = ["--model-path", model, "--served-model-name", "tiny", "--tool-call-parser", "auto"]
    with start_server(args) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_llama31_template_required_and_named_calls_validate_and_go_back_to_the_model(llama31_client):
    client = llama31_client
    plain = _create(client, max_tokens=1).usage.prompt_tokens
    assert _create(client, tools=TOOLS, max_tokens=1).usage.prompt_tokens > plain + 50  # the tools are rendered
    for choice_arg in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        kw = dict(tools=TOOLS, tool_choice=choice_arg, parallel_tool_calls=False)
        choice = _create(client, **kw).choices[0]
        _assert_valid_calls(choice, SCHEMAS)
        assert _calls(_streamed(client, **kw).message) == _calls(choice.message)
    call = choice.message.tool_calls[0]
    messages = MESSAGES + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length")
