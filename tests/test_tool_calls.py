"""Tool-call parsers (engine/tool_parsers): each family's documented markup, streamed at every split."""

from __future__ import annotations

import json
from typing import Optional

import pytest

from kvship.engine.http_errors import APIError
from kvship.engine.reasoning import ReasoningSplitter
from kvship.engine.tool_parsers import PARSERS, ChoiceOutput, detect_family, plan_tools
from kvship.engine.tool_parsers.forced import NamedParser, RequiredParser

WEATHER = '{"city": "Paris"}'
TIME = '{"tz": "CET"}'

QWEN_TWO_CALLS = (
    "Let me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
LLAMA3_JSON = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA3_TAGGED = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"tz": "CET"}}'
)
MISTRAL_ARRAY = (
    'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"tz": "CET"}}]'
)
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'
DEEPSEEK_V3 = (
    "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
    '{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DEEPSEEK_V31 = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
    '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
BOTH = [("get_weather", WEATHER), ("get_time", TIME)]

CASES = [
    ("qwen25", QWEN_TWO_CALLS, "Let me check both.\n", BOTH),
    ("hermes", QWEN_TWO_CALLS, "Let me check both.\n", BOTH),
    ("llama3", LLAMA3_JSON, None, BOTH[:1]),
    ("llama3", LLAMA3_TAGGED, None, BOTH),
    ("mistral", MISTRAL_ARRAY, "Sure. ", BOTH),
    ("mistral", MISTRAL_V11, None, BOTH),
    ("deepseekv3", DEEPSEEK_V3, "Checking.", BOTH),
    ("deepseekv3", DEEPSEEK_V31, None, BOTH),
]


def _message(parser, text: str, reasoning: Optional[ReasoningSplitter] = None) -> tuple[dict, str]:
    out = ChoiceOutput(parser, reasoning)
    out.feed(text, final=True)
    return out.message_fields(), out.finish_reason("stop")


def _calls(msg: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]


def accumulate(deltas: list[dict]) -> dict:
    """What a client builds from chat deltas (as the openai client's stream helpers do)."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for d in deltas:
        msg["content"] += d.get("content", "")
        msg["reasoning_content"] += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            slot = msg["tool_calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert slot["id"] is None, "a call's id is sent once, in its first delta"
                slot["id"], slot["name"] = tc["id"], tc["function"]["name"]
            assert slot["id"] is not None, "argument fragments follow the delta that names the call"
            slot["arguments"] += tc["function"].get("arguments", "")
    return msg


def _stream(make, pieces: list[str], reasoning=None) -> tuple[list[dict], ChoiceOutput]:
    out = ChoiceOutput(make(), reasoning() if reasoning else None)
    deltas = [out.feed(p) for p in pieces] + [out.feed("", final=True)]
    return [d for d in deltas if d], out


def assert_stream_matches(make, text: str, reasoning=None) -> None:
    """Split ``text`` at every boundary (and char by char): the accumulated stream equals the message."""
    whole, _ = _message(make(), text, reasoning() if reasoning else None)
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        deltas, _ = _stream(make, pieces, reasoning)
        got = accumulate(deltas)
        assert got["content"] == (whole["content"] or ""), pieces
        assert got["reasoning_content"] == (whole.get("reasoning_content") or ""), pieces
        calls = [got["tool_calls"][i] for i in sorted(got["tool_calls"])]
        assert [(c["name"], c["arguments"]) for c in calls] == _calls(whole), pieces
        for marker in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<｜tool", "<think>", "</think>"):
            if marker not in (whole["content"] or ""):  # markup of a call that parsed never shows as content
                assert not any(marker in d.get("content", "") for d in deltas), (marker, pieces)


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_each_family_parses_its_documented_call_markup(family, text, content, calls):
    msg, finish = _message(PARSERS[family](), text)
    assert msg["content"] == content
    assert _calls(msg) == calls
    assert finish == "tool_calls"
    ids = [c["id"] for c in msg["tool_calls"]]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    for c in msg["tool_calls"]:
        assert c["type"] == "function" and isinstance(json.loads(c["function"]["arguments"]), dict)


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_streamed_calls_split_at_every_boundary_equal_the_message(family, text, content, calls):
    assert_stream_matches(PARSERS[family], text)


@pytest.mark.parametrize(
    "family,text",
    [
        ("qwen25", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
        ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'),
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}} and some words'),
        ("llama3", '{"city": "Paris"}'),
        ("mistral", "[TOOL_CALLS] [{oops"),
        ("deepseekv3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>garbage<｜tool▁call▁end｜>"),
    ],
)
def test_malformed_calls_stay_text(family, text):
    msg, finish = _message(PARSERS[family](), text)
    assert msg["content"] == text and "tool_calls" not in msg and finish == "stop"
    assert_stream_matches(PARSERS[family], text)


BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
GOOD_TIME = '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


def _streamed_calls(pieces: list[str]) -> tuple[dict, list[tuple[int, str, str]]]:
    got = accumulate(_stream(PARSERS["qwen25"], pieces)[0])
    return got, [(i, c["name"], c["arguments"]) for i, c in sorted(got["tool_calls"].items())]


def test_auto_call_arguments_stream_in_fragments_once_the_name_is_known():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    deltas, _ = _stream(PARSERS["qwen25"], list(text))
    frags = [tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", [])]
    assert len(frags) > 10 and frags[0] == "{"  # the first delta names the call as soon as its arguments begin
    assert "".join(frags) == '{"city": "Paris", "days": 2}' == _calls(_message(PARSERS["qwen25"](), text)[0])[0][1]
    assert_stream_matches(PARSERS["qwen25"], text)
    spaced = '<tool_call>\n{"name": "f", "arguments": {"a" : [1,2], "b": "}\\""}}\n</tool_call>'
    assert _calls(_message(PARSERS["qwen25"](), spaced)[0]) == [("f", '{"a" : [1,2], "b": "}\\""}')]  # as written
    assert_stream_matches(PARSERS["qwen25"], spaced)


@pytest.mark.parametrize("after", ["", " done", GOOD_TIME])
def test_a_streamed_call_that_turns_out_malformed_stays_sent_and_its_markup_becomes_content(after):
    """docs/api.md, "Tool calling", Streaming: the message has the broken markup as content; the stream has
    sent the call's name and the arguments written until then, then sends the same content, and later calls
    take the next indices."""
    text = "Here: " + BROKEN + after
    msg, finish = _message(PARSERS["qwen25"](), text)
    good = [("get_time", '{"tz": "CET"}')] if after == GOOD_TIME else []
    assert _calls(msg) == good and finish == ("tool_calls" if good else "stop")
    assert BROKEN in msg["content"]
    got, calls = _streamed_calls(list(text))
    assert got["content"] == msg["content"]
    assert calls[0] == (0, "get_weather", '{"city": \n')  # never a piece of the closing tag
    assert [(n, a) for _, n, a in calls[1:]] == good and [i for i, *_ in calls] == list(range(len(calls)))
    for k in range(len(text) + 1):  # any split: content equal; streamed calls the broken one's prefix and the good
        got, calls = _streamed_calls([text[:k], text[k:]])
        assert got["content"] == msg["content"]
        assert [(n, a) for _, n, a in calls if n == "get_time"] == good
        assert all('{"city": \n'.startswith(a) for _, n, a in calls if n == "get_weather")


def test_text_without_calls_is_content_unchanged():
    text = "Paris is sunny today. Use <b>bold</b> and [brackets] freely."
    for make in PARSERS.values():
        msg, finish = _message(make(), text)
        assert msg["content"] == text and finish == "stop"


def test_malformed_block_between_valid_calls_stays_in_content():
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        "<tool_call>not json</tool_call>"
        '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    )
    msg, _ = _message(PARSERS["qwen25"](), text)
    assert _calls(msg) == BOTH and msg["content"] == "<tool_call>not json</tool_call>"
    assert_stream_matches(PARSERS["qwen25"], text)


def test_unclosed_last_block_is_a_call_when_its_json_is_complete():
    msg, _ = _message(PARSERS["qwen25"](), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n')
    assert _calls(msg) == BOTH[:1] and msg["content"] is None


def test_text_before_a_call_streams_before_the_call_closes():
    out = ChoiceOutput(PARSERS["qwen25"](), None)
    assert out.feed("Checking the weather. <tool") == {"content": "Checking the weather."}
    assert out.feed('_call>{"name": "get_weather", "arguments": ') == {}
    d = out.feed('{"city": "Paris"}}</tool_call>')
    assert d["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": WEATHER}
    assert d["tool_calls"][0]["index"] == 0 and d["tool_calls"][0]["type"] == "function"


def test_named_tool_choice_streams_arguments_as_written():
    out = ChoiceOutput(NamedParser("get_weather"), None)
    first = out.feed('{"city": ')
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":'}
    assert "id" in first["tool_calls"][0]
    rest = out.feed('"Paris"}')
    assert rest["tool_calls"] == [{"index": 0, "function": {"arguments": ' "Paris"}'}}]
    out.feed("", final=True)
    assert _calls(out.message_fields()) == [("get_weather", WEATHER)]
    assert_stream_matches(lambda: NamedParser("get_weather"), '{"city": "Paris"}')


def test_required_tool_choice_reads_the_json_array():
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]'
    msg, finish = _message(RequiredParser(), text)
    assert _calls(msg) == BOTH and finish == "tool_calls"
    assert_stream_matches(RequiredParser, text)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def test_tool_choice_plans():
    assert plan_tools(TOOLS, "none", None, "qwen25", False).template_tools is None
    auto = plan_tools(TOOLS, None, None, "qwen25", False)
    assert auto.template_tools == TOOLS and auto.parser is not None and auto.json_schema is None
    assert plan_tools(TOOLS, "auto", None, None, False).parser is None  # no --tool-call-parser: text
    req = json.loads(plan_tools(TOOLS, "required", False, None, False).json_schema)
    assert req["minItems"] == 1 and req["maxItems"] == 1
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, None, False)
    assert json.loads(named.json_schema) == {"type": "object"}


@pytest.mark.parametrize(
    "tools,choice,rf,param",
    [
        (None, "required", False, "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, False, "tool_choice"),
        (TOOLS, "sometimes", False, "tool_choice"),
        (TOOLS, "required", True, "response_format"),
        ([{"type": "function"}], "auto", False, "tools.0"),
        ([{"type": "function", "function": {"name": ""}}], "auto", False, "tools.0.function.name"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(tools, choice, rf, param):
    with pytest.raises(APIError) as e:
        plan_tools(tools, choice, None, "qwen25", rf)
    assert e.value.status == 400 and e.value.param == param


def test_parallel_tool_calls_false_keeps_the_first_call():
    plan = plan_tools(TOOLS, "auto", False, "qwen25", False)
    msg, _ = _message(plan.parser(), QWEN_TWO_CALLS)
    assert _calls(msg) == BOTH[:1]
    assert_stream_matches(plan.parser, QWEN_TWO_CALLS)


def test_auto_parser_follows_the_markup_the_chat_template_names():
    qwen = '{%- if tools %}...<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
    llama = "{%- if builtin_tools is defined or tool_call.name == 'x' %}{{- '<|python_tag|>' -}}"
    assert detect_family(qwen) == "qwen25"
    assert detect_family(llama) == "llama3"
    assert detect_family("[TOOL_CALLS]" + llama) is None  # two families named: ambiguous
    assert detect_family("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") is None
    assert detect_family(None) is None


def test_last_delta_and_final_flush_merge_into_one_entry_per_call():
    from kvship.engine.serving_openai import _merge_deltas

    first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":'}}
    merged = _merge_deltas(
        {"content": "x", "tool_calls": [first]},
        {"content": "y", "tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
    )
    assert merged["content"] == "xy"
    assert merged["tool_calls"] == [{**first, "function": {"name": "f", "arguments": '{"a": 1}'}}]


def test_assistant_tool_call_arguments_reach_the_template_as_objects():
    from kvship.engine.tool_parsers import template_messages

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER}}
    odd = {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call, odd]}]
    out = template_messages(msgs)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out[1]["tool_calls"][1] == odd and out[0] == msgs[0]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == WEATHER  # the request is not changed
