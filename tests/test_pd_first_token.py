"""The first token from prefill (docs/pd.md): a streamed ``/generate`` request through ``kvship router --pd``
gets its first token from the prefill worker's stream, then decode's stream without the repeat; what the
client reads must be exactly what a unified worker streams, event by event (text, ids, finish).

One ``kvship local`` (1 prefill + 1 decode, tcp, tiny random Llama on CPU) beside one unified worker.
"""

from __future__ import annotations

import json

import httpx
import pytest
from pd_fixtures import make_prompts, start_local
from server_fixtures import start_server

pytestmark = pytest.mark.timeout(400)

FLAGS = ["--device", "cpu", "--page-size", "16", "--max-total-tokens", "8192", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def pd_and_unified(tiny_llama_dir):
    flags = ["--model-path", tiny_llama_dir, *FLAGS]
    with start_local(["--transfer-backend", "tcp", *flags]) as cluster, start_server(flags) as unified:
        yield cluster, unified


def _stream(url: str, body: dict, route: str = "/generate") -> tuple[dict, list[dict]]:
    """(response headers, the events' objects) of one streamed call; exactly one [DONE] at the end."""
    events = []
    with httpx.stream("POST", url + route, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
        headers = dict(r.headers)
    assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    return headers, [json.loads(e) for e in events[:-1]]


def _shape(events: list[dict]) -> list[tuple]:
    """What must match a unified worker's stream: per event the text, ids, token count and finish."""
    return [
        (e["text"], e["output_ids"], e["meta_info"]["completion_tokens"], e["meta_info"]["finish_reason"])
        for e in events
    ]


def _body(ids: list[int], max_new: int, **sp) -> dict:
    return {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, **sp}}


def test_streamed_generate_gets_its_first_token_from_prefill_and_equals_unified_event_by_event(pd_and_unified):
    cluster, unified = pd_and_unified
    early = 0
    for ids in make_prompts(6, seed=31, lo=20, hi=120):
        body = _body(ids, 10, ignore_eos=True)
        headers, pd_events = _stream(cluster.url, body)
        _, uni_events = _stream(unified.url, body)
        assert _shape(pd_events) == _shape(uni_events)
        assert len({e["meta_info"]["id"] for e in pd_events}) == 1, "the stream's id changed between events"
        assert not any("kvship_prompt_ids" in e["meta_info"] for e in pd_events)
        early += headers.get("x-kvship-first-token") == "prefill"
    # the prefill's event races decode's first chunk (which needs the KV first); on a loaded 2-core box
    # decode may win some: either way the stream equals unified's (the cut itself: the unit tests below)
    assert early >= 1, early
    cluster.wait_free(cluster.workers("prefill") + cluster.workers("decode"))


def _openai_stream_equals_unified(cluster, unified, route: str, body: dict, field: str) -> bool:
    """Stream ``body`` through the PD router and from the unified worker: per event the choices' ``field``
    (``text`` or ``delta``) and finish, and the usage, must match; one id throughout; no router-only fields.
    Returns whether the first token came from prefill."""
    headers, pd_events = _stream(cluster.url, body, route)
    _, uni_events = _stream(unified.url, body, route)

    def shape(events: list[dict]) -> list:
        return [
            ([(c[field], c["finish_reason"]) for c in e["choices"]], (e.get("usage") or {}).get("completion_tokens"))
            for e in events
        ]

    assert shape(pd_events) == shape(uni_events)
    assert len({(e["id"], e["created"]) for e in pd_events}) == 1, "the stream's id changed between events"
    assert not any("kvship_token_ids" in e or "kvship_prompt_ids" in e for e in pd_events)
    return headers.get("x-kvship-first-token") == "prefill"


def test_streamed_completions_get_their_first_token_from_prefill_and_equal_unified_event_by_event(pd_and_unified):
    cluster, unified = pd_and_unified
    early = with_text = 0
    for i, ids in enumerate(make_prompts(8, seed=33, lo=20, hi=120)):
        # a completions stream skips events without text: only a first token with text can come from prefill
        _, gen = _stream(unified.url, _body(ids, 9, ignore_eos=True))
        with_text += bool(gen[0]["text"])
        body = {"model": "tiny", "prompt": ids, "max_tokens": 9, "temperature": 0, "ignore_eos": True, "stream": True}
        if i % 2:
            body["stream_options"] = {"include_usage": True}
        early += _openai_stream_equals_unified(cluster, unified, "/v1/completions", body, "text")
    assert with_text >= 2 and early >= 1, (early, with_text)
    cluster.wait_free(cluster.workers("prefill") + cluster.workers("decode"))


def test_requests_whose_first_token_ends_them_or_with_stop_strings_still_equal_unified(pd_and_unified):
    cluster, unified = pd_and_unified
    ids = make_prompts(1, seed=32, lo=40, hi=40)[0]
    _, ref = _stream(unified.url, _body(ids, 8, ignore_eos=True))
    first_text = ref[0]["text"]
    cases = [_body(ids, 1, ignore_eos=True), _body(ids, 8, stop_token_ids=[ref[0]["output_ids"][0]])]
    if first_text.strip():
        cases.append(_body(ids, 8, ignore_eos=True, stop=[first_text.strip()[:1]]))  # a stop string on token 1
    for body in cases:
        headers, pd_events = _stream(cluster.url, body)
        _, uni_events = _stream(unified.url, body)
        assert _shape(pd_events) == _shape(uni_events), body["sampling_params"]
        assert headers.get("x-kvship-first-token") is None, "prefill sent a token that ends the request"
    cluster.wait_free(cluster.workers("prefill") + cluster.workers("decode"))


class _FakeContent:
    def __init__(self, chunks: list[bytes]):
        self.chunks = list(chunks)

    async def readany(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    def at_eof(self) -> bool:
        return not self.chunks


class _FakeResponse:
    def __init__(self, chunks: list[bytes]):
        self.content = _FakeContent(chunks)
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _ev(text: str, ids: list[int], finish=None, rid: str = "d-id") -> bytes:
    meta = {"id": rid, "completion_tokens": len(ids), "finish_reason": finish}
    return ("data: " + json.dumps({"text": text, "output_ids": ids, "meta_info": meta}) + "\n\n").encode()


async def _read_all(stream) -> bytes:
    out = b""
    while chunk := await stream.content.readany():
        out += chunk
    return out


async def test_decode_stream_after_the_first_token_drops_its_repeat_and_keeps_the_first_id():
    import asyncio

    from kvship.router.pd import _DecodeAfterFirstToken
    from kvship.router.upstream import Upstream

    first = _ev("A", [7])
    rest = _ev("AB", [7, 8]) + b"data: [DONE]\n\n"
    # decode's first chunk (its repeat of token 1) split across reads, as a socket may cut it
    resp = _FakeResponse([first[5:] + rest[:9], rest[9:]])
    up = Upstream(worker=None, lease=None, status=200, headers=[], response=resp, first=first[:5])  # type: ignore[arg-type]

    async def opened():
        return up

    stream = _DecodeAfterFirstToken(asyncio.ensure_future(opened()), json.loads(_ev("A", [7], rid="p-id")[6:]))
    out = await _read_all(stream)
    events = [e for e in out.split(b"\n\n") if e]
    assert len(events) == 2 and events[-1] == b"data: [DONE]"
    obj = json.loads(events[0][6:])
    assert (obj["text"], obj["output_ids"], obj["meta_info"]["id"]) == ("AB", [7, 8], "p-id")
    assert stream.at_eof()


async def test_decode_failing_after_the_first_token_reads_as_a_broken_stream_and_close_ends_a_pending_open():
    import asyncio

    import aiohttp

    from kvship.router.pd import _DecodeAfterFirstToken
    from kvship.router.upstream import AttemptFailed

    async def fails():
        raise AttemptFailed(None, "http_503", True)  # type: ignore[arg-type]

    with pytest.raises(aiohttp.ClientPayloadError, match="decode failed: http_503"):
        await _DecodeAfterFirstToken(asyncio.ensure_future(fails()), {"meta_info": {"id": "p"}}).content.readany()

    async def never():
        await asyncio.sleep(3600)

    stream = _DecodeAfterFirstToken(asyncio.ensure_future(never()), {"meta_info": {"id": "p"}})
    reader = asyncio.ensure_future(stream.content.readany())
    await asyncio.sleep(0.01)
    stream.close()  # the client left before decode answered
    assert await asyncio.wait_for(reader, 5) == b""


async def test_decode_completion_stream_after_the_first_token_cuts_its_ids_and_text():
    import asyncio

    from kvship.router.pd import _DecodeAfterFirstToken
    from kvship.router.upstream import Upstream

    def ev(text, ids, finish=None, cid="d", usage=None):
        obj = {"id": cid, "created": 2, "model": "m", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
        if ids is not None:
            obj["kvship_token_ids"] = ids
        if usage is not None:
            obj = dict(obj, choices=[], usage=usage)
        return ("data: " + json.dumps(obj) + "\n\n").encode()

    first = json.loads(ev("He", [5], cid="p")[6:])
    first["created"] = 1
    # decode's first chunk repeats the first token; another carries the next two tokens, then usage
    data = (
        ev("He", [5]) + ev("llo", [6, 7], "length") + ev("", None, usage={"completion_tokens": 3}) + b"data: [DONE]\n\n"
    )
    up = Upstream(worker=None, lease=None, status=200, headers=[], response=_FakeResponse([data[7:]]), first=data[:7])  # type: ignore[arg-type]

    async def opened():
        return up

    out = await _read_all(_DecodeAfterFirstToken(asyncio.ensure_future(opened()), first))
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert [(e["choices"], e.get("kvship_token_ids")) for e in events] == [
        ([{"index": 0, "text": "llo", "finish_reason": "length"}], [6, 7]),
        ([], None),
    ]
    assert all((e["id"], e["created"]) == ("p", 1) for e in events)


async def test_decode_chat_stream_after_the_first_token_drops_its_role_chunk_and_cuts_the_content():
    import asyncio

    from kvship.router.pd import _DecodeAfterFirstToken, _is_first_token, _is_role_chunk
    from kvship.router.upstream import Upstream

    def ev(delta, ids, finish=None, cid="d", extra=None):
        obj = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": 2,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            "kvship_token_ids": ids,
            **(extra or {}),
        }
        return ("data: " + json.dumps(obj) + "\n\n").encode()

    role = json.loads(ev({"role": "assistant", "content": ""}, [], extra={"kvship_prompt_ids": [1, 2]})[6:])
    first = json.loads(ev({"content": "He"}, [5], cid="p")[6:])
    first["created"] = 1
    assert _is_role_chunk(role) and not _is_first_token(role)
    assert _is_first_token(first) and not _is_role_chunk(first)
    data = (
        ev({"role": "assistant", "content": ""}, [], extra={"kvship_prompt_ids": [1, 2]})
        + ev({"content": "He"}, [5])
        + ev({"content": "llo"}, [6, 7], "length")
        + b"data: [DONE]\n\n"
    )
    up = Upstream(worker=None, lease=None, status=200, headers=[], response=_FakeResponse([data[9:]]), first=data[:9])  # type: ignore[arg-type]

    async def opened():
        return up

    out = await _read_all(_DecodeAfterFirstToken(asyncio.ensure_future(opened()), first))
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert [(e["choices"], e["kvship_token_ids"]) for e in events] == [
        ([{"index": 0, "delta": {"content": "llo"}, "finish_reason": "length"}], [6, 7])
    ]
    assert (events[0]["id"], events[0]["created"]) == ("p", 1)


def test_streamed_chat_gets_its_first_token_from_prefill_and_equals_unified_event_by_event(pd_and_unified):
    cluster, unified = pd_and_unified
    early = 0
    for i in range(6):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"question {i}: what comes after {i * 7}?"}],
            "max_tokens": 9,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        if i % 2:
            body["stream_options"] = {"include_usage": True}
        early += _openai_stream_equals_unified(cluster, unified, "/v1/chat/completions", body, "delta")
    assert early >= 1, early
    cluster.wait_free(cluster.workers("prefill") + cluster.workers("decode"))
