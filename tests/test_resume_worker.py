"""The worker's side of a resumed stream (``kvship_resume``, docs/router.md "Resuming broken streams").

The router continues a broken stream on another worker with the prompt plus
the output ids so far as the input.  These tests play the router by hand
against one real worker: a continuation must give exactly what the unbroken
request gives after the join, counting the earlier output as output for stop
strings (one may span the join), penalties and per-step seeds, and re-emitting
the earlier output's text the client had not been shown.
"""

from __future__ import annotations

import httpx
import pytest
from server_fixtures import ServerHandle, start_server

MAX_NEW = 24


@pytest.fixture(scope="module")
def worker(tiny_llama_dir) -> ServerHandle:
    with start_server(
        ["--model-path", tiny_llama_dir, "--served-model-name", "tiny", "--max-total-tokens", "4096", "--device", "cpu"]
    ) as handle:
        yield handle


def _decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def _generate(url: str, ids: list[int], sp: dict, resume: dict | None = None) -> dict:
    body: dict = {"input_ids": ids, "sampling_params": sp}
    if resume is not None:
        body["kvship_resume"] = resume
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


def _prompt(tok) -> list[int]:
    return tok.encode("the quick brown fox jumps over")


def test_a_seeded_penalised_continuation_draws_exactly_what_the_unbroken_stream_draws(worker, tok):
    prompt = _prompt(tok)
    sp = {
        "max_new_tokens": MAX_NEW,
        "temperature": 0.9,
        "seed": 7,
        "frequency_penalty": 0.6,
        "presence_penalty": 0.3,
        "ignore_eos": True,
    }
    full = _generate(worker.url, prompt, sp)["output_ids"]
    assert len(full) == MAX_NEW
    for k in (5, 13):
        head = full[:k]
        resume = {"output_tokens": k, "relayed_chars": len(_decode(tok, head))}
        cont = _generate(worker.url, prompt + head, dict(sp, max_new_tokens=MAX_NEW - k), resume)
        assert cont["output_ids"] == full[k:], k


def _spanning_stop(tok, text: str, ids: list[int]) -> tuple[int, int, str]:
    """(k, chars of text before the join, stop) with a stop string that starts 2 characters before
    the text of ``ids[:k]`` ends and whose first occurrence in ``text`` is there."""
    for k in range(3, len(ids) - 3):
        joined = len(_decode(tok, ids[:k]))
        if joined < 3 or not text.startswith(_decode(tok, ids[:k])):
            continue
        stop = text[joined - 2 : joined + 2]
        if len(stop) == 4 and text.find(stop) == joined - 2 and stop.strip():
            return k, joined, stop
    pytest.fail(f"no stop string spans a token boundary in {text!r}")


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_a_stop_string_spanning_the_join_ends_the_continuation_and_is_trimmed(worker, tok, route):
    prompt = _prompt(tok)
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    unbroken = _generate(worker.url, prompt, greedy)
    text, ids = unbroken["text"], unbroken["output_ids"]
    k, joined, stop = _spanning_stop(tok, text, ids)
    want = _generate(worker.url, prompt, dict(greedy, stop=stop))
    assert want["text"] == text[: joined - 2] and want["meta_info"]["finish_reason"]["matched"] == stop
    # the first worker held back the stop string's first 2 characters (a possible stop prefix)
    relayed = joined - 2
    resume = {"output_tokens": k, "relayed_chars": relayed}
    if route == "/generate":
        cont = _generate(worker.url, prompt + ids[:k], dict(greedy, max_new_tokens=MAX_NEW - k, stop=stop), resume)
        got, reason = cont["text"], cont["meta_info"]["finish_reason"]
        assert reason["type"] == "stop" and reason["matched"] == stop
    else:
        body = {
            "prompt": prompt + ids[:k],
            "max_tokens": MAX_NEW - k,
            "temperature": 0,
            "ignore_eos": True,
            "stop": stop,
            "kvship_resume": resume,
        }
        r = httpx.post(worker.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        got = choice["text"]
        assert choice["finish_reason"] == "stop"
    assert text[:relayed] + got == want["text"]


def test_held_back_text_of_the_earlier_output_is_re_emitted_by_the_continuation(worker, tok):
    prompt = _prompt(tok)
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    unbroken = _generate(worker.url, prompt, greedy)
    k = 10
    joined = len(_decode(tok, unbroken["output_ids"][:k]))
    relayed = max(0, joined - 3)
    resume = {"output_tokens": k, "relayed_chars": relayed}
    cont = _generate(worker.url, prompt + unbroken["output_ids"][:k], dict(greedy, max_new_tokens=MAX_NEW - k), resume)
    assert unbroken["text"][:relayed] + cont["text"] == unbroken["text"]
    assert cont["output_ids"] == unbroken["output_ids"][k:]


@pytest.mark.parametrize(
    "resume, status",
    [
        ({"output_tokens": -1, "relayed_chars": 0}, 400),
        ({"output_tokens": 10_000, "relayed_chars": 0}, 400),
        ({"output_tokens": 1, "relayed_chars": -5}, 400),
        ({"output_tokens": 1}, 422),
    ],
)
def test_a_malformed_kvship_resume_gets_a_400(worker, resume, status):
    r = httpx.post(
        worker.url + "/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "kvship_resume": resume},
        timeout=30,
    )
    assert r.status_code == status, r.text
    assert "error" in r.json()
    r = httpx.post(
        worker.url + "/v1/completions",
        json={"prompt": "a text prompt", "max_tokens": 2, "kvship_resume": {"output_tokens": 1, "relayed_chars": 0}},
        timeout=30,
    )
    assert r.status_code == 400 and "kvship_resume" in r.text
