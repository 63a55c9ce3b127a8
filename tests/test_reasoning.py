"""Reasoning parsers (engine/reasoning.py): <think> blocks -> reasoning_content, streamed at every split."""

from __future__ import annotations

import json

import pytest
from test_tool_calls import QWEN_TWO_CALLS, _calls, _message, assert_stream_matches

from kvship.engine.reasoning import ReasoningSplitter
from kvship.engine.tool_parsers import PARSERS

QWEN3_PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_OPEN_PROMPT = QWEN3_PROMPT + "<think>\n"  # thinking templates that open the block for the model
QWEN3_NO_THINK_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"  # enable_thinking: false
R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris?<｜Assistant｜><think>\n"

CASES = [
    (
        "qwen3",
        QWEN3_PROMPT,
        "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny.",
        "The user asks about Paris.",
        "It is sunny.",
    ),
    (
        "qwen3",
        QWEN3_OPEN_PROMPT,
        "The user asks about Paris.\n</think>\n\nIt is sunny.",
        "The user asks about Paris.",
        "It is sunny.",
    ),
    ("qwen3", QWEN3_NO_THINK_PROMPT, "It is sunny.", None, "It is sunny."),
    ("qwen3", QWEN3_PROMPT, "It is </think> sunny.", None, "It is </think> sunny."),
    ("deepseek-r1", R1_PROMPT, "Okay, Paris.\n</think>\n\nIt is sunny.", "Okay, Paris.", "It is sunny."),
    ("deepseek-r1", R1_PROMPT, "<think>\nOkay, Paris.\n</think>\n\nIt is sunny.", "Okay, Paris.", "It is sunny."),
    ("deepseek-r1", "no open tag", "Okay, Paris. Still thinking", "Okay, Paris. Still thinking", ""),
]


@pytest.mark.parametrize("family,prompt,text,reasoning,content", CASES)
def test_thinking_is_split_from_the_answer(family, prompt, text, reasoning, content):
    msg, finish = _message(None, text, ReasoningSplitter(family, prompt))
    assert msg["reasoning_content"] == reasoning
    assert msg["content"] == content
    assert finish == "stop"


@pytest.mark.parametrize("family,prompt,text,reasoning,content", CASES)
def test_streamed_reasoning_split_at_every_boundary_equals_the_message(family, prompt, text, reasoning, content):
    assert_stream_matches(lambda: None, text, lambda: ReasoningSplitter(family, prompt))


def test_tool_calls_are_read_from_the_answer_after_the_thinking():
    text = "<think>\nI need the weather and the time.\n</think>\n\n" + QWEN_TWO_CALLS
    msg, finish = _message(PARSERS["qwen25"](), text, ReasoningSplitter("qwen3", QWEN3_PROMPT))
    assert msg["reasoning_content"] == "I need the weather and the time."
    assert msg["content"] == "Let me check both.\n"
    assert [name for name, _ in _calls(msg)] == ["get_weather", "get_time"] and finish == "tool_calls"
    assert_stream_matches(PARSERS["qwen25"], text, lambda: ReasoningSplitter("qwen3", QWEN3_PROMPT))


def test_a_tool_call_markup_inside_the_thinking_is_not_a_call():
    text = '<think><tool_call>{"name": "f", "arguments": {}}</tool_call></think>Done.'
    msg, finish = _message(PARSERS["qwen25"](), text, ReasoningSplitter("qwen3", QWEN3_PROMPT))
    assert "tool_calls" not in msg and msg["content"] == "Done." and finish == "stop"


def test_unknown_reasoning_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningSplitter("o1", "")


@pytest.mark.parametrize(
    "delta",
    [
        {"reasoning_content": "Let me think"},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
    ],
)
def test_router_does_not_restart_a_stream_once_parsed_output_reached_the_client(delta):
    from kvship.router.resume import ResumeState
    from kvship.router.wire import ROUTE_CHAT, RoutingRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    st = ResumeState.for_request(RoutingRequest.parse(ROUTE_CHAT, json.dumps(body).encode()))
    assert st.can_resume()  # nothing shown yet: the request may start over
    event = {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    st.process(b"data: " + json.dumps(event).encode())
    assert not st.can_resume()  # a parsed stream has no ids to continue from (docs/api.md, "Reasoning")
