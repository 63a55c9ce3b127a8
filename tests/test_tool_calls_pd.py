"""Tool calls and reasoning through PD (docs/api.md, "Reasoning", PD and resumed streams): a ``kvship local``
(1 prefill + 1 decode, tcp, tiny random Llama on CPU) streams the same chat deltas as a unified worker,
event by event, and never takes prefill's first-token event for a parsed stream.
"""

from __future__ import annotations

import json

import httpx
import pytest
from pd_fixtures import start_local
from server_fixtures import start_server
from test_tool_calls_openai import TOOLS

pytestmark = pytest.mark.timeout(400)
pytest.importorskip("xgrammar")

FLAGS = ["--device", "cpu", "--page-size", "16", "--max-total-tokens", "8192", "--served-model-name", "tiny"]
PARSERS = ["--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"]


@pytest.fixture(scope="module")
def pd_and_unified(tiny_llama_dir):
    flags = ["--model-path", tiny_llama_dir, *FLAGS, *PARSERS]
    with start_local(["--transfer-backend", "tcp", *flags]) as cluster, start_server(flags) as unified:
        yield cluster, unified


def _deltas(url: str, body: dict) -> tuple[dict, list]:
    """(headers, per event the choices' deltas and finish) of one streamed chat; call ids made comparable."""
    out = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                e = json.loads(line[6:])
                assert "kvship_token_ids" not in e and "kvship_prompt_ids" not in e
                for c in e["choices"]:
                    for tc in c["delta"].get("tool_calls", []):
                        if "id" in tc:
                            assert tc["id"].startswith("call_")
                            tc["id"] = "call"
                out.append([(c["delta"], c["finish_reason"]) for c in e["choices"]])
        headers = dict(r.headers)
    return headers, out


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": TOOLS, "tool_choice": "required", "max_tokens": 80},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": 40},
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "<think>\nHmm"},
            ],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "ignore_eos": True,
            "max_tokens": 9,
        },
        {"ignore_eos": True, "max_tokens": 9},
    ],
    ids=["required", "named", "thinking", "answer"],
)
def test_parsed_chat_streams_through_pd_equal_the_unified_worker_event_by_event(pd_and_unified, extra):
    cluster, unified = pd_and_unified
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "temperature": 0,
        "stream": True,
        **extra,
    }
    headers, pd = _deltas(cluster.url, body)
    _, uni = _deltas(unified.url, body)
    assert pd == uni
    assert headers.get("x-kvship-first-token") != "prefill"  # parsed streams carry no ids for the router
    kinds = {k for event in uni for delta, _ in event for k in delta}
    assert kinds & {"tool_calls", "reasoning_content", "content"}
    cluster.wait_free(cluster.workers("prefill") + cluster.workers("decode"))
