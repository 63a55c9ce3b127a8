"""Bad input gets a 4xx with an OpenAI-style error body, and the server keeps answering.

Most cases run against one real ``kvship serve`` process (tiny Llama, context
256, 64 KiB body limit); API keys, a full queue and a dead model loop use an
in-process app (``create_app`` + httpx's ASGI transport).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from server_fixtures import ServerHandle, start_server

from kvship.engine.config import ServerArgs

CONTEXT = 256
MAX_BODY = 65536
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
GEN = "/generate"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> ServerHandle:
    with start_server(
        [
            "--model-path",
            tiny_llama_dir,
            "--served-model-name",
            "tiny",
            "--context-length",
            str(CONTEXT),
            "--max-request-bytes",
            str(MAX_BODY),
            "--max-total-tokens",
            "4096",
        ]
    ) as srv:
        yield srv
        # after all the bad input, SIGTERM still shuts the server down cleanly
        assert srv.stop() in (0, -signal.SIGTERM), srv.log_tail()  # uvicorn re-raises SIGTERM after shutdown
        log = open(srv.log_path).read()
        assert "model loop stopped" in log and "Traceback" not in log, log[-3000:]


def chat(**kw):
    return {"model": "tiny", "messages": MSG, "max_tokens": 4, **kw}


def comp(**kw):
    return {"model": "tiny", "prompt": "hello", "max_tokens": 4, **kw}


def gen(**sp):
    return {"text": "hello", "sampling_params": {"max_new_tokens": 4, **sp}}


# (id, method, path, json body or raw bytes, expected status, expected param or None)
CASES = [
    ("malformed_json", "POST", CHAT, b'{"model": "tiny", "messages": [', 400, None),
    ("empty_body", "POST", CHAT, b"", 400, None),
    ("deeply_nested_json", "POST", COMP, b"[" * 20000 + b"]" * 20000, 400, None),
    ("json_array_body", "POST", CHAT, b"[1, 2]", 400, None),
    ("invalid_utf8_body", "POST", COMP, b'{"prompt": "\xff\xfe"}', 400, None),
    ("missing_messages", "POST", CHAT, {"model": "tiny"}, 422, "messages"),
    ("messages_not_a_list", "POST", CHAT, chat(messages="hi"), 422, "messages"),
    ("unknown_role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 422, "messages.0.role"),
    ("content_is_a_number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 422, None),
    (
        "image_content_part",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        422,
        None,
    ),
    ("empty_messages", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("unknown_model", "POST", CHAT, chat(model="gpt-9"), 404, "model"),
    ("unknown_model_completions", "POST", COMP, comp(model="nope"), 404, "model"),
    ("negative_max_tokens", "POST", CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    ("zero_max_completion_tokens", "POST", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("max_tokens_over_context", "POST", COMP, comp(max_tokens=CONTEXT + 1), 400, "max_tokens"),
    ("prompt_plus_max_tokens_over_context", "POST", COMP, comp(prompt=[5] * 200, max_tokens=100), 400, "max_tokens"),
    ("prompt_longer_than_context", "POST", COMP, comp(prompt=[5] * CONTEXT), 400, "prompt"),
    ("text_prompt_longer_than_context", "POST", COMP, comp(prompt="fox " * 300), 400, "prompt"),
    ("huge_text_prompt_refused_untokenized", "POST", GEN, {"text": "x" * 60000}, 400, "text"),
    (
        "chat_longer_than_context",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "fox " * 300}]),
        400,
        "messages",
    ),
    ("max_tokens_wrong_type", "POST", COMP, comp(max_tokens="many"), 422, "max_tokens"),
    ("negative_temperature", "POST", CHAT, chat(temperature=-0.5), 400, "temperature"),
    ("temperature_not_a_number", "POST", CHAT, chat(temperature="hot"), 422, "temperature"),
    (
        "nan_temperature",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        "temperature",
    ),
    ("top_p_zero", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_p_above_one", "POST", COMP, comp(top_p=1.5), 400, "top_p"),
    ("top_k_below_minus_one", "POST", COMP, comp(top_k=-5), 400, "top_k"),
    ("min_p_above_one", "POST", COMP, comp(min_p=2.0), 400, "min_p"),
    ("frequency_penalty_too_high", "POST", CHAT, chat(frequency_penalty=3), 400, "frequency_penalty"),
    ("presence_penalty_too_low", "POST", CHAT, chat(presence_penalty=-3), 400, "presence_penalty"),
    ("repetition_penalty_zero", "POST", COMP, comp(repetition_penalty=0), 400, "repetition_penalty"),
    ("n_zero", "POST", CHAT, chat(n=0), 400, "n"),
    ("n_too_large", "POST", COMP, comp(n=1000), 400, "n"),
    ("top_logprobs_without_logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("top_logprobs_too_many", "POST", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("logprobs_not_bool", "POST", CHAT, chat(logprobs="yes"), 422, "logprobs"),
    ("completion_logprobs_too_many", "POST", COMP, comp(logprobs=100), 400, "logprobs"),
    ("empty_string_prompt", "POST", COMP, comp(prompt=""), 400, "prompt"),
    ("empty_list_prompt", "POST", COMP, comp(prompt=[]), 400, "prompt"),
    ("mixed_prompt_list", "POST", COMP, comp(prompt=["a", 1]), 422, "prompt.1"),
    ("token_id_out_of_vocab", "POST", COMP, comp(prompt=[1, 2, 999999]), 400, "prompt"),
    ("negative_token_id", "POST", COMP, comp(prompt=[-3]), 400, "prompt"),
    ("stream_not_bool", "POST", COMP, comp(stream="yes"), 422, "stream"),
    ("empty_stop_string", "POST", COMP, comp(stop=["ok", ""]), 400, "stop"),
    ("too_many_stop_strings", "POST", COMP, comp(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("stop_string_too_long", "POST", COMP, comp(stop="x" * 1000), 400, "stop"),
    ("stop_token_id_out_of_vocab", "POST", COMP, comp(stop_token_ids=[100000]), 400, "stop_token_ids"),
    ("seed_not_int", "POST", COMP, comp(seed="abc"), 422, "seed"),
    ("logit_bias_unsupported", "POST", CHAT, chat(logit_bias={"5": 10}), 400, "logit_bias"),
    (
        "response_format_type_unsupported",
        "POST",
        CHAT,
        chat(response_format={"type": "xml"}),
        400,
        "response_format",
    ),
    (
        "response_format_schema_invalid",
        "POST",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        400,
        "response_format",
    ),
    (
        "generate_regex_invalid",
        "POST",
        GEN,
        {"text": "a", "sampling_params": {"regex": "(a"}},
        400,
        "sampling_params.regex",
    ),
    ("suffix_unsupported", "POST", COMP, comp(suffix="end"), 400, "suffix"),
    ("echo_with_logprobs", "POST", COMP, comp(echo=True, logprobs=1), 400, "echo"),
    ("best_of_not_n", "POST", COMP, comp(best_of=3), 400, "best_of"),
    ("generate_text_and_ids", "POST", GEN, {"text": "a", "input_ids": [1, 2]}, 400, "text"),
    ("generate_without_prompt", "POST", GEN, {"sampling_params": {"max_new_tokens": 2}}, 400, "text"),
    ("generate_unknown_sampling_key", "POST", GEN, gen(bogus=1), 422, "sampling_params.bogus"),
    ("generate_negative_max_new_tokens", "POST", GEN, gen(max_new_tokens=-1), 400, "sampling_params.max_new_tokens"),
    (
        "generate_sampling_list_length",
        "POST",
        GEN,
        {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]},
        400,
        "sampling_params",
    ),
    ("generate_empty_input_ids", "POST", GEN, {"input_ids": []}, 400, "input_ids"),
    ("generate_ids_out_of_vocab", "POST", GEN, {"input_ids": [1, 384]}, 400, "input_ids"),
    ("generate_bad_top_p", "POST", GEN, gen(top_p=0), 400, "sampling_params.top_p"),
    ("generate_bad_bootstrap_port", "POST", GEN, {**gen(), "bootstrap_port": 70000}, 400, "bootstrap_port"),
    ("generate_negative_bootstrap_room", "POST", GEN, {**gen(), "bootstrap_room": -1}, 400, "bootstrap_room"),
    ("abort_without_rid", "POST", "/abort_request", {}, 422, "rid"),
    ("unknown_route", "POST", "/v1/nothing", {}, 404, None),
    ("unknown_model_card", "GET", "/v1/models/other", None, 404, "model"),
    ("wrong_method", "GET", CHAT, None, 405, None),
    ("wrong_method_generate", "PUT", GEN, gen(), 405, None),
    ("oversize_body", "POST", COMP, comp(prompt="x" * (MAX_BODY + 10)), 413, None),
]


def _send(server: ServerHandle, method: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.request(
            method, server.url + path, content=body, timeout=30, headers={"content-type": "application/json"}
        )
    if body is None:
        return httpx.request(method, server.url + path, timeout=30)
    return httpx.request(method, server.url + path, json=body, timeout=30)


def assert_error_body(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_there_are_at_least_thirty_distinct_bad_input_cases():
    assert len({c[0] for c in CASES}) == len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_4xx_error_body_and_server_keeps_answering(server, case):
    _, method, path, body, status, param = case
    r = _send(server, method, path, body)
    assert 400 <= r.status_code < 500
    assert_error_body(r, status, param)
    ok = server.post(COMP, json=comp(max_tokens=1))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def test_extreme_but_valid_numbers_are_served(server):
    r = server.post(COMP, json=comp(top_k=10**30, seed=-(10**30), max_tokens=2))
    assert r.status_code == 200, r.text
    r = server.post(COMP, json=comp(top_k=10**30, max_tokens=2, temperature=0))
    g = server.post(COMP, json=comp(max_tokens=2, temperature=0))
    assert r.json()["choices"][0]["text"] == g.json()["choices"][0]["text"]


def test_oversize_chunked_body_without_content_length_is_rejected(server):
    def body():
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"x" * 1024

    r = httpx.post(server.url + COMP, content=body(), headers={"content-type": "application/json"}, timeout=30)
    assert_error_body(r, 413)


def test_garbage_bytes_on_the_socket_do_not_hurt_the_server(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"\x00\x01NOT HTTP AT ALL\r\n\r\n")
        try:
            s.recv(1024)
        except OSError:
            pass
    assert server.get("/health").status_code == 200


def test_errors_leave_no_request_or_slot_behind(server):
    info = server.get("/get_server_info").json()
    assert info["running"] == 0 and info["waiting"] == 0 and info["active_requests"] == 0
    assert info["free_slots"] == info["total_slots"]
    assert server.alive()


def test_invalid_settings_exit_with_code_2():
    out = subprocess.run(
        [sys.executable, "-m", "kvship.app.cli", "serve", "--page-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--page-size must be >= 1" in out.stderr


def test_missing_model_exits_with_code_1_and_says_why(tmp_path):
    missing = str(tmp_path / "no-such-model")
    out = subprocess.run(
        [sys.executable, "-m", "kvship.app.cli", "serve", "--model-path", missing],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    assert "cannot start the server" in out.stderr and missing in out.stderr
    assert "Traceback" not in out.stderr


# ------------------------------------------------------------------ in-process app


@pytest.fixture(scope="module")
def engine_factory(tiny_llama_dir):
    from kvship.engine.engine import Engine

    engines = []

    def make(**kw):
        sa = ServerArgs(model_path=tiny_llama_dir, served_model_name="tiny", max_total_tokens=4096, **kw)
        e = Engine(sa)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.shutdown()


def _client(engine) -> httpx.AsyncClient:
    from kvship.engine.http_server import create_app

    app = create_app(engine, engine.server_args)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def test_api_key_is_required_on_every_route_but_health(engine_factory):
    engine = engine_factory(api_key="s3cret")

    async def main():
        async with _client(engine) as c:
            assert (await c.get("/health")).status_code == 200
            for method, path in [
                ("GET", "/v1/models"),
                ("POST", COMP),
                ("POST", CHAT),
                ("POST", GEN),
                ("GET", "/get_server_info"),
                ("GET", "/metrics"),
                ("POST", "/abort_request"),
            ]:
                r = await c.request(method, path, json={})
                assert_error_body(r, 401)
                r = await c.request(method, path, json={}, headers={"Authorization": "Bearer wrong"})
                assert_error_body(r, 401)
            good = {"Authorization": "Bearer s3cret"}
            assert (await c.get("/v1/models", headers=good)).status_code == 200
            r = await c.post(COMP, json=comp(max_tokens=2), headers=good)
            assert r.status_code == 200, r.text

    asyncio.run(main())


def test_full_waiting_queue_answers_503_then_recovers(engine_factory):
    engine = engine_factory(max_running_requests=1, max_queued_requests=1)

    async def wait_for(pred):
        for _ in range(600):
            if pred(engine.get_stats()):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(engine.get_stats())

    async def main():
        async with _client(engine) as c:
            long = {"text": "x", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
            a = asyncio.create_task(c.post(GEN, json={**long, "rid": "a"}))
            await wait_for(lambda s: s["running"] == 1)
            b = asyncio.create_task(c.post(GEN, json={**long, "rid": "b"}))
            await wait_for(lambda s: s["waiting"] == 1)
            r = await c.post(COMP, json=comp())
            err = assert_error_body(r, 503)
            assert "overloaded" in err["message"]
            for rid in ("a", "b"):
                await c.post("/abort_request", json={"rid": rid})
            ra, rb = await a, await b
            assert ra.json()["meta_info"]["finish_reason"]["type"] == "abort"
            assert rb.json()["meta_info"]["finish_reason"]["type"] == "abort"
            r = await c.post(COMP, json=comp(max_tokens=2))
            assert r.status_code == 200, r.text
        await wait_for(lambda s: s["running"] == 0 and s["free_slots"] == s["total_slots"])

    asyncio.run(main())


def test_duplicate_running_rid_is_rejected(engine_factory):
    engine = engine_factory()

    async def main():
        async with _client(engine) as c:
            long = {"text": "x", "rid": "dup", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
            first = asyncio.create_task(c.post(GEN, json=long))
            while not engine.has_request("dup"):
                await asyncio.sleep(0.01)
            r = await c.post(GEN, json=long)
            assert_error_body(r, 400, "rid")
            await c.post("/abort_request", json={"rid": "dup"})
            assert (await first).status_code == 200

    asyncio.run(main())


def test_dead_model_loop_gives_503_on_health_and_generation(engine_factory):
    engine = engine_factory()

    async def main():
        async with _client(engine) as c:
            assert (await c.get("/health")).status_code == 200
            pending = asyncio.create_task(c.post(COMP, json=comp(max_tokens=1500, ignore_eos=True)))
            while engine.num_active() == 0:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(engine.shutdown)
            assert_error_body(await pending, 503)
            assert_error_body(await c.get("/health"), 503)
            assert_error_body(await c.post(CHAT, json=chat()), 503)
            assert_error_body(await c.post(GEN, json=gen()), 503)
            info = (await c.get("/get_server_info")).json()
            assert info["alive"] is False

    asyncio.run(main())


def test_body_parser_fast_path_gives_the_models_json_loads_gives():
    """``_parse`` tries pydantic's JSON parser first; where it accepts a body the result equals json.loads +
    validation (the path every error still takes), and bodies only json.loads reads (UTF-16, NaN) still parse."""
    import json

    from starlette.requests import Request

    from kvship.engine.http_server import _parse
    from kvship.engine.openai_protocol import ChatCompletionRequest, CompletionRequest, GenerateReqInput

    def request(raw: bytes) -> Request:
        async def receive():
            return {"type": "http.request", "body": raw, "more_body": False}

        return Request({"type": "http", "method": "POST", "headers": []}, receive)

    cases = [
        (GenerateReqInput, {"input_ids": list(range(3, 4099)), "sampling_params": {"max_new_tokens": 1}}),
        (GenerateReqInput, {"text": ["a", "caf\u00e9"], "sampling_params": [{"temperature": 0.5}, {"top_k": 3}]}),
        (GenerateReqInput, {"input_ids": [[1, 2], [3]], "bootstrap_room": 2**62, "stream": True, "rid": "x"}),
        (CompletionRequest, {"model": "m", "prompt": [5, 6], "logprobs": 2, "stop": ["\n"], "logit_bias": {"7": -1}}),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 1e308}),
    ]
    for model, body in cases:
        raw = json.dumps(body).encode()
        got = asyncio.run(_parse(request(raw), model))
        assert got == model.model_validate(json.loads(raw)), body
    # only json.loads reads these: the slow path parses them as before
    utf16 = json.dumps(cases[1][1]).encode("utf-16")
    assert asyncio.run(_parse(request(utf16), GenerateReqInput)) == GenerateReqInput.model_validate(cases[1][1])
    nan = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    got = asyncio.run(_parse(request(nan), ChatCompletionRequest))  # the handler's own checks see it, as before
    assert got.temperature != got.temperature and got.messages[0].content == "x"
