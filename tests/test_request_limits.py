"""Bounded request pre-processing (issue 30): chat templates and grammars cannot stall or kill a worker.

The HTTP cases run in-process engines on the tiny llama (httpx's ASGI
transport, so ``/health`` shares the event loop with the attack); the
template cases also render directly through ``Tokenizer.apply_chat_template``
with hostile templates, which a client can never send but which show the
sandbox's budget holds whatever the template does.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import pytest

from kvship.engine.config import ServerArgs
from kvship.engine.tokenizer import ChatTemplateError, RenderLimits, load_tokenizer

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Say something."}]
ANSWER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "integer"}},
    "required": ["city", "zip"],
    "additionalProperties": False,
}


def nested_arrays(depth: int) -> dict:
    """A valid JSON schema nested ``depth`` arrays deep (600 deep: the audit's 45 s compile)."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _engine(model_dir: str, **args):
    from kvship.engine.engine import Engine

    return Engine(ServerArgs(model_path=model_dir, served_model_name="tiny", max_total_tokens=4096, **args))


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    e = _engine(tiny_llama_dir, max_chat_template_output_chars=4096)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def bomb_engine(tiny_llama_dir):
    """Deep schemas pass the depth check here, so they reach the compiler and its timeout."""
    e = _engine(tiny_llama_dir, max_schema_depth=2000, grammar_compile_timeout=2.0, grammar_compile_processes=3)
    yield e
    e.shutdown()


async def _timed(c: httpx.AsyncClient, method: str, path: str, body=None, delay: float = 0.0):
    await asyncio.sleep(delay)
    t = time.monotonic()
    r = await (c.get(path) if method == "GET" else c.post(path, json=body))
    return r, time.monotonic() - t, time.monotonic()


def call(engine, *requests: tuple) -> list[tuple[httpx.Response, float, float]]:
    """Run ``(method, path, body[, delay])`` requests concurrently on one in-process app:
    ``(response, seconds it took, monotonic time it ended)`` each."""
    from kvship.engine.http_server import create_app

    async def main():
        app = create_app(engine, engine.server_args)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return await asyncio.gather(*(_timed(c, *r) for r in requests))

    return asyncio.run(main())


def chat(max_tokens: int = 4, **extra) -> tuple:
    return ("POST", CHAT, {"messages": USER, "max_tokens": max_tokens, "temperature": 0, **extra})


# ------------------------------------------------------------------------------- chat_template_kwargs


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"chat_template": "{% for i in range(10**9) %}{{ 'x' * 10**10 }}{% endfor %}"}, "chat_template"),
        ({"tokenize": True}, "tokenize"),
        ({"tokenizer": "x"}, "tokenizer"),
        ({"return_dict": True}, "return_dict"),
        ({"return_assistant_tokens_mask": True}, "return_assistant_tokens_mask"),
        ({"padding": True}, "padding"),
        ({"truncation": True, "max_length": 3}, "truncation"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"enable_thinking": True, "made_up_switch": 1}, "made_up_switch"),
        ({"enable_thinking": "yes"}, "enable_thinking"),
        ({"enable_thinking": 1}, "enable_thinking"),
        ({"reasoning_effort": "x" * 300}, "reasoning_effort"),
        ({"reasoning_effort": ["low"]}, "reasoning_effort"),
        ({"thinking_budget": 10**12}, "thinking_budget"),
    ],
)
def test_chat_template_kwargs_outside_the_allow_list_are_a_400_naming_the_key(engine, kwargs, key):
    ((r, took, _),) = call(engine, chat(chat_template_kwargs=kwargs))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == f"chat_template_kwargs.{key}" and key in err["message"], err
    assert took < 1.0


def test_documented_template_switches_render_and_reach_the_template(engine):
    ((r, _, _),) = call(
        engine, chat(chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low", "thinking_budget": 64})
    )
    assert r.status_code == 200, r.text
    tok = engine.tokenizer
    tok_template = tok.hf.chat_template
    try:  # a switch reaches the template as a variable
        tok.hf.chat_template = "{% if enable_thinking is false %}no-think {% endif %}{{ messages[0]['content'] }}"
        assert tok.apply_chat_template(USER, template_kwargs={"enable_thinking": False}) == "no-think Say something."
    finally:
        tok.hf.chat_template = tok_template


def test_template_bomb_is_refused_within_a_second_while_health_and_a_normal_chat_stay_fast(engine):
    bomb = chat(chat_template_kwargs={"chat_template": "{% for i in range(10**9) %}{{ 'x' * 10**10 }}{% endfor %}"})
    (b, b_took, _), (h, h_took, _), (n, n_took, _) = call(engine, bomb, ("GET", "/health", None), chat())
    assert b.status_code == 400 and b_took < 1.0, (b.text, b_took)
    assert h.status_code == 200 and h_took < 1.0, h_took
    assert n.status_code == 200 and n_took < 10.0, (n.text, n_took)


def test_a_render_past_the_output_cap_is_a_413_and_the_worker_keeps_serving(engine):
    long = [{"role": "user", "content": "word " * 1000}]  # 5000 characters, the cap is 4096
    (r, took, _), (h, _, _) = call(
        engine, ("POST", CHAT, {"messages": long, "max_tokens": 2}), ("GET", "/health", None)
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "chat_template_limit" and "4096" in r.json()["error"]["message"]
    assert took < 1.0 and h.status_code == 200
    ((ok, _, _),) = call(engine, chat())
    assert ok.status_code == 200, ok.text


def test_completions_and_generate_never_take_a_template_from_the_body(engine):
    bomb = "{{ 'x' * 10**10 }}"
    (c, _, _), (g, _, _) = call(
        engine,
        ("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 2, "chat_template": bomb}),
        ("POST", "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2}, "chat_template": bomb}),
    )
    assert c.status_code == 200 and g.status_code == 200, (c.text, g.text)
    n = len(engine.tokenizer.encode("hello"))
    assert c.json()["usage"]["prompt_tokens"] == n and g.json()["meta_info"]["prompt_tokens"] == n


# ------------------------------------------------------------------------------- the render budget


@pytest.fixture()
def tok(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


@pytest.mark.parametrize(
    "template, status",
    [
        ("{{ 'x' * 10**10 }}", 413),  # refused before the string is allocated
        ("{{ messages[0]['content'] * 10**9 }}", 413),
        ("{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", 413),
        ("{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", 413),
        ("{% for i in range(100000) %}{% for m in messages %}{{ m['content'] }}{% endfor %}{% endfor %}", 413),
        ("{{ 7 ** (10 ** 9) }}", 400),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", 400),  # the clock
        ("{% for i in range(10**9) %}{% endfor %}", 400),  # more than the sandbox's 100000
    ],
)
def test_hostile_templates_stop_at_the_output_cap_or_the_time_limit(tok, template, status):
    tok.hf.chat_template = template
    t = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        tok.apply_chat_template(USER, limits=RenderLimits(max_output_chars=1 << 20, timeout_s=0.3))
    assert time.monotonic() - t < 1.0
    assert getattr(e.value, "status", 400) == status, e.value


def test_the_bounded_renderer_gives_transformers_text_for_the_model_templates(tok, smollm2_path):
    convs = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "naïve café 日本語 " * 50},
        ],
    ]
    for t in (tok, load_tokenizer(smollm2_path)):
        for c in convs:
            for gen in (True, False):
                want = t.hf.apply_chat_template(c, tokenize=False, add_generation_prompt=gen)
                assert t.apply_chat_template(c, add_generation_prompt=gen) == want
        want = t.hf.apply_chat_template(convs[1][:3], tokenize=False, continue_final_message=True)
        assert t.apply_chat_template(convs[1][:3], continue_final_message=True) == want


# ------------------------------------------------------------------------------- grammars


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, {**chat()[2], "response_format": schema_format(nested_arrays(600))}, "response_format"),
        ("/generate", {"text": "x", "sampling_params": {"regex": "a" * 40000}}, "sampling_params.regex"),
    ],
)
def test_a_600_deep_or_oversized_grammar_is_a_400_within_a_second_while_health_and_a_normal_request_stay_fast(
    engine, path, body, param
):
    misses = engine.grammar.misses
    (b, b_took, _), (h, h_took, _), (n, n_took, _) = call(
        engine,
        ("POST", path, body),
        ("GET", "/health", None),
        chat(response_format=schema_format(ANSWER), max_tokens=40),
    )
    assert b.status_code == 400 and b_took < 1.0, (b.text, b_took)
    err = b.json()["error"]
    assert err["param"] == param and ("--max-schema-depth" in err["message"] or "--max-grammar-bytes" in err["message"])
    assert h.status_code == 200 and h_took < 1.0, h_took
    assert n.status_code == 200, n.text
    assert engine.grammar.misses <= misses + 1  # only the normal schema reached the compiler


def test_schema_depth_counts_nested_objects_and_arrays_but_not_brackets_inside_strings():
    from kvship.engine.grammar import GrammarError, GrammarLimits
    from kvship.engine.grammar.backend import json_depth

    assert json_depth(json.dumps(nested_arrays(600))) == 601
    assert json_depth(json.dumps({"pattern": '^[[{{\\"]]$', "enum": ["[", "{"]})) == 2
    limits = GrammarLimits(max_bytes=200, max_schema_depth=3)
    limits.check("json_schema", json.dumps({"type": "array", "items": {"type": "array"}}))  # depth 2
    with pytest.raises(GrammarError, match="--max-schema-depth"):
        limits.check("json_schema", json.dumps(nested_arrays(3)))
    with pytest.raises(GrammarError, match="--max-grammar-bytes"):
        limits.check("regex", "é" * 101)  # 202 bytes in UTF-8


def _warm_compile_processes(engine, n: int) -> None:
    """``n`` distinct grammars compiled at once: that many compile processes have started and answered."""
    reqs = [
        ("POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1, "regex": f"w{i}[0-9]+"}})
        for i in range(n)
    ]
    assert all(r.status_code == 200 for r, _, _ in call(engine, *reqs))


def test_a_compile_past_the_timeout_is_a_400_and_never_cached(bomb_engine):
    bomb = chat(response_format=schema_format(nested_arrays(600)))
    key = ("json_schema", json.dumps(nested_arrays(600)))
    timeouts = bomb_engine.grammar.timeouts
    for attempt in range(2):
        ((r, took, _),) = call(bomb_engine, bomb)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "grammar_compile_timeout" and "timed out" in err["message"], err
        assert took < 30.0  # 2 s of compile (+ a compile process starting on a busy machine)
        assert key not in bomb_engine.grammar._cache
        assert bomb_engine.grammar.timeouts == timeouts + attempt + 1  # compiled (and killed) again
    ((ok, _, _),) = call(bomb_engine, chat(response_format=schema_format(ANSWER), max_tokens=40))
    assert ok.status_code == 200, ok.text


def test_a_normal_structured_request_completes_while_two_compile_bombs_are_in_flight(bomb_engine):
    _warm_compile_processes(bomb_engine, 3)
    bombs = [chat(response_format=schema_format(nested_arrays(600 - i))) for i in range(2)]
    normal = ("POST", CHAT, {**chat(max_tokens=40)[2], "response_format": schema_format(ANSWER)}, 0.3)
    (b1, _, b1_end), (b2, _, b2_end), (n, n_took, n_end), (h, h_took, _) = call(
        bomb_engine, *bombs, normal, ("GET", "/health", None, 0.3)
    )
    assert n.status_code == 200, n.text
    jsonschema.validate(json.loads(n.json()["choices"][0]["message"]["content"]), ANSWER)
    assert n_end < min(b1_end, b2_end), (n_took, n_end, b1_end, b2_end)  # done while both still compiled
    assert b1.status_code == b2.status_code == 400, (b1.text, b2.text)
    assert h.status_code == 200 and h_took < 1.0, h_took
