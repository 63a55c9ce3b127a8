"""PD parity as a rule (docs/pd.md): every request parameter a unified worker honours gives the same
answer through the router of a PD deployment, on every transfer backend.

One parametrized table of request variants (OpenAI chat and completions, native /generate) is sent to
a unified ``kvship serve`` worker and to ``kvship local`` (router + prefill + decode processes); the
answers must be equal: text, finish reasons, matched stops, usage, and logprobs within fp tolerance.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from pd_fixtures import start_local
from server_fixtures import start_server

PROMPT = "the quick brown fox jumps over the lazy dog and"
PROMPT_IDS = [5, 17, 42, 99, 7, 23, 61]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0}

# (name, route, body); "{stop}" is replaced by a stop string taken from the unified greedy answer
VARIANTS = [
    ("completions-logprobs", "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 2, **GREEDY}),
    ("completions-echo", "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "echo": True, **GREEDY}),
    ("completions-max-tokens", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, **GREEDY}),
    ("completions-token-prompt", "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 6, **GREEDY}),
    (
        "completions-n-seeded",
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 6, "n": 3, "temperature": 0.9, "top_p": 0.95, "seed": 11},
    ),
    ("completions-stop-string", "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "stop": "{stop}", **GREEDY}),
    (
        "completions-penalties",
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 10,
            "frequency_penalty": 1.0,
            "presence_penalty": 0.5,
            "repetition_penalty": 1.3,
            **GREEDY,
        },
    ),
    (
        "chat-logprobs",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "logprobs": True, "top_logprobs": 3}
        | GREEDY,
    ),
    (
        "chat-seeded",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0.8, "seed": 5},
    ),
    (
        "chat-json-schema",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a person as JSON"}],
            "max_tokens": 60,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}},
        }
        | GREEDY,
    ),
    (
        "chat-json-object",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "JSON"}],
            "max_tokens": 40,
            "response_format": {"type": "json_object"},
        }
        | GREEDY,
    ),
    (
        "generate-logprobs",
        "/generate",
        {
            "input_ids": PROMPT_IDS,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    ),
    (
        "generate-stop-ids",
        "/generate",
        {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": []}},
    ),
    (
        "generate-regex",
        "/generate",
        {"text": "ip:", "sampling_params": {"max_new_tokens": 20, "temperature": 0, "regex": r"10\.[0-9]{1,3}"}},
    ),
    (
        "generate-n-seeded",
        "/generate",
        {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "seed": 3, "min_p": 0.1, "n": 2}},
    ),
]

# fields that differ between any two responses (ids, clocks, where it ran)
VOLATILE = {
    "id",
    "created",
    "system_fingerprint",
    "e2e_latency",
    "kvship_worker",
    "cached_tokens",
    "prompt_tokens_details",
}
MODEL = "tiny"


def _scrub(obj):
    """The answer without volatile fields; floats kept for the tolerance check."""
    if isinstance(obj, dict):
        return {k: _scrub(v) for k, v in obj.items() if k not in VOLATILE and not k.startswith("kvship_")}
    if isinstance(obj, list):
        return [_scrub(v) for v in obj]
    return obj


def _assert_same(got, want, path="$"):
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(got, (int, float)) and isinstance(want, (int, float)), (path, got, want)
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-4), (path, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (path, sorted(got), sorted(want))
        for k in want:
            _assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (path, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, (path, got, want)


def _meta_only_answer(route: str, j):
    """/generate's meta_info holds timings; keep what the answer is made of."""
    if route != "/generate":
        return j
    items = j if isinstance(j, list) else [j]
    keep = ("prompt_tokens", "completion_tokens", "finish_reason", "output_token_logprobs", "output_top_logprobs")
    return [
        {"text": it["text"], "output_ids": it["output_ids"], "meta": {k: it["meta_info"].get(k) for k in keep}}
        for it in items
    ]


def _post(url: str, route: str, body: dict) -> dict:
    r = httpx.post(url + route, json=dict(body, model=MODEL) if route != "/generate" else body, timeout=120)
    assert r.status_code == 200, (route, r.text)
    return _scrub(_meta_only_answer(route, r.json()))


@pytest.fixture(scope="module")
def unified(tiny_llama_dir):
    args = [
        "--model-path",
        tiny_llama_dir,
        "--served-model-name",
        MODEL,
        "--device",
        "cpu",
        "--max-total-tokens",
        "8192",
    ]
    with start_server(args) as handle:
        yield handle.url


@pytest.fixture(scope="module")
def variants(unified):
    """The table with its placeholders filled from the unified worker's greedy answers."""
    base = httpx.post(
        unified + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16, **GREEDY}, timeout=60
    ).json()["choices"][0]["text"]
    stop = base[6:9]
    assert len(stop) == 3 and base.find(stop) >= 1, base
    ids = httpx.post(
        unified + "/generate",
        json={"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
        timeout=60,
    ).json()["output_ids"]
    out = []
    for name, route, body in VARIANTS:
        body = json.loads(json.dumps(body).replace('"{stop}"', json.dumps(stop)))
        if name == "generate-stop-ids":
            body["sampling_params"]["stop_token_ids"] = [ids[5]]
        out.append((name, route, body))
    return out


@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
def test_every_request_parameter_answers_the_same_through_pd_as_unified(tiny_llama_dir, unified, variants, backend):
    args = ["--model-path", tiny_llama_dir, "--served-model-name", MODEL, "--device", "cpu"]
    args += ["--transfer-backend", backend, "--max-total-tokens", "8192"]
    want = {name: _post(unified, route, body) for name, route, body in variants}
    with start_local(args) as cluster:
        for name, route, body in variants:
            got = _post(cluster.url, route, body)
            _assert_same(got, want[name], name)
        cluster.wait_free(cluster.workers("prefill") + cluster.workers("decode"))
    # the variants exercise what they claim
    assert want["generate-stop-ids"][0]["meta"]["finish_reason"]["type"] == "stop"
    assert want["completions-stop-string"]["choices"][0]["finish_reason"] == "stop"
    assert want["completions-echo"]["choices"][0]["text"].startswith(PROMPT)
    assert len({c["text"] for c in want["completions-n-seeded"]["choices"]}) >= 2
    # constrained (validity itself is tests/test_structured_output.py's; a random model may run out of tokens)
    assert want["chat-json-schema"]["choices"][0]["message"]["content"].startswith('{"name"')
    assert want["chat-json-object"]["choices"][0]["message"]["content"].lstrip().startswith("{")
    assert want["completions-logprobs"]["choices"][0]["logprobs"]["top_logprobs"][0]
