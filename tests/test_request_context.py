"""One request context per HTTP body: the router's extensions read once, one builder for every route."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from kvship.common import protocol
from kvship.engine.config import ServerArgs
from kvship.engine.disagg.auth import choice_token
from kvship.engine.http_errors import APIError
from kvship.engine.io_struct import SamplingParams
from kvship.engine.openai_protocol import ChatCompletionRequest, CompletionRequest, GenerateReqInput
from kvship.engine.serving_request import RequestContext

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _http(headers: dict[str, str]) -> Request:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


# a unified worker's settings are all ``RequestContext.of`` reads of the engine (it checks room tokens by mode)
ENGINE = SimpleNamespace(server_args=ServerArgs(device="cpu"))
SP = SamplingParams(max_new_tokens=4, seed=10)


def test_the_router_and_the_worker_share_one_definition_of_the_protocol():
    from kvship.engine import serving
    from kvship.router import wire

    assert wire.ROUTER_IDS_HEADER is protocol.ROUTER_IDS_HEADER is serving.ROUTER_IDS_HEADER
    assert wire.PD_FIRST_TOKEN_HEADER is protocol.PD_FIRST_TOKEN_HEADER
    boot = wire.PDBootstrap(host="10.0.0.1", port=8998, room=7, token="t")
    body = json.loads(boot.inject({"prompt": "x"}))
    assert {k: body[k] for k in protocol.BOOTSTRAP_FIELDS} == {
        "bootstrap_host": "10.0.0.1",
        "bootstrap_port": 8998,
        "bootstrap_room": 7,
        "bootstrap_token": "t",
    }
    assert protocol.choice_room(2**63 - 1, 2) == 1 and protocol.choice_room(None, 3) is None


def test_a_body_with_one_room_gives_request_k_room_plus_k_across_prompts_and_choices():
    body = CompletionRequest(
        model="m", prompt=[[1, 2], [3]], n=2, bootstrap_host="h", bootstrap_port=9000, bootstrap_room=100
    )
    ctx = RequestContext.of(ENGINE, _http({}), body)
    ctx.add(0, "cmpl-1", [1, 2], SP, 2, total=4)
    ctx.add(0, "cmpl-1", [3], SP, 2, total=4)
    reqs = ctx.requests
    assert [r.rid for r in reqs] == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2", "cmpl-1-3"]
    assert [r.bootstrap_room for r in reqs] == [100, 101, 102, 103]
    assert [r.sampling_params.seed for r in reqs] == [10, 11, 10, 11]  # choice j of each prompt: seed + j
    assert all(r.bootstrap_host == "h" and r.bootstrap_port == 9000 for r in reqs)
    assert [r.input_ids for r in reqs] == [[1, 2], [1, 2], [3], [3]]


def test_per_item_bootstrap_fields_give_choice_j_of_item_i_its_items_room_plus_j():
    body = GenerateReqInput(
        input_ids=[[1], [2]],
        bootstrap_host=["a", "b"],
        bootstrap_port=[1001, 1002],
        bootstrap_room=[50, 90],
        bootstrap_token="tok",  # one token for the body: request k gets choice_token(tok, k)
        sampling_params={"n": 2},
    )
    ctx = RequestContext.of(ENGINE, _http({}), body, batch=2)
    ctx.add(0, "g0", [1], SP, 2)
    ctx.add(1, "g1", [2], SP, 2)
    reqs = ctx.requests
    assert [r.rid for r in reqs] == ["g0-0", "g0-1", "g1-0", "g1-1"]
    assert [r.bootstrap_room for r in reqs] == [50, 51, 90, 91]
    assert [r.bootstrap_host for r in reqs] == ["a", "a", "b", "b"]
    assert [r.bootstrap_port for r in reqs] == [1001, 1001, 1002, 1002]
    assert [r.bootstrap_token for r in reqs] == [choice_token("tok", k) for k in range(4)]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"bootstrap_port": 70000}, "bootstrap_port"),
        ({"bootstrap_room": -1}, "bootstrap_room"),
        ({"bootstrap_room": [1, 2, 3]}, "bootstrap_room"),  # the batch has 2 items
    ],
)
def test_bad_bootstrap_fields_are_a_400_naming_the_field(fields, param):
    body = GenerateReqInput(input_ids=[[1], [2]], **fields)
    with pytest.raises(APIError) as e:
        RequestContext.of(ENGINE, _http({}), body, batch=2)
    assert e.value.status == 400 and e.value.param == param


def test_router_headers_and_the_trace_context_are_read_once():
    headers = {
        protocol.ROUTER_IDS_HEADER: "1",
        protocol.PD_FIRST_TOKEN_HEADER: "1",
        "traceparent": TP,
        "tracestate": "k=v",
    }
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    streamed = RequestContext.of(ENGINE, _http(headers), ChatCompletionRequest(**chat, stream=True))
    assert streamed.router_ids and streamed.pd_first_token
    assert streamed.trace == protocol.TraceContext.parse(TP, "k=v")
    whole = RequestContext.of(ENGINE, _http(headers), ChatCompletionRequest(**chat))
    assert not whole.router_ids and not whole.pd_first_token  # both are stream features
    plain = RequestContext.of(ENGINE, _http({"traceparent": "garbage"}), ChatCompletionRequest(**chat, stream=True))
    assert plain.trace is None and not plain.router_ids
    traced = RequestContext.of(ENGINE, _http({}), GenerateReqInput(text="x", return_trace=True))
    [greq] = traced.add(0, "r", [1, 2], SP)
    assert greq.trace == {"http_received": traced.created} and greq.created_time == traced.created
