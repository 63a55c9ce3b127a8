"""A constrained answer after free thinking (docs/api.md, "Reasoning"): with ``--reasoning-parser``, a forced
``tool_choice`` or ``response_format`` constrains only what follows ``</think>``.

The model is the tiny random llama with a thinking template (the generation prompt opens ``<think>``) and
``<think>`` / ``</think>`` as added tokens; its ``lm_head`` row of ``</think>`` is made to win after a couple of
free tokens, so greedy output thinks (noise the grammar would refuse), closes the thinking, then answers.
"""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest
import torch
from pd_fixtures import start_local
from server_fixtures import start_server
from test_tool_calls_openai import SCHEMAS, TOOLS, WEATHER

from kvship.engine.grammar.deferred import DeferredGrammar
from kvship.engine.reasoning import grammar_start

pytestmark = pytest.mark.timeout(400)
pytest.importorskip("xgrammar")

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
FLAGS = ["--device", "cpu", "--page-size", "16", "--max-total-tokens", "8192", "--served-model-name", "tiny"]
PARSERS = ["--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"]


@pytest.fixture(scope="module")
def thinking_dir(tiny_llama_dir, tmp_path_factory) -> str:
    import transformers

    out = str(tmp_path_factory.mktemp("tiny_thinking") / "m")
    shutil.copytree(tiny_llama_dir, out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    tok.add_tokens(["<think>", "</think>"])  # plain added tokens, as Qwen3's: kept in the text
    tok.chat_template = tok.chat_template.replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}"
    )
    tok.save_pretrained(out)
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    free = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
    with torch.no_grad():  # </think> scores three times a token the free run picks
        model.lm_head.weight[tok.convert_tokens_to_ids("</think>")] = 3 * model.lm_head.weight[free[5]]
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def servers(thinking_dir):
    flags = ["--model-path", thinking_dir, *FLAGS, *PARSERS]
    with start_local(["--transfer-backend", "tcp", *flags]) as cluster, start_server(flags) as unified:
        yield cluster, unified


def _chat(url: str, **extra) -> dict:
    body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 80, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _stream(url: str, **extra) -> list:
    body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 80, "stream": True, **extra}
    out = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    for tc in c["delta"].get("tool_calls", []):
                        tc.pop("id", None)  # random per worker
                    out.append((c["delta"], c["finish_reason"]))
    return out


def test_required_tool_choice_thinks_freely_then_calls(servers):
    _, unified = servers
    choice = _chat(unified.url, tools=TOOLS, tool_choice="required")
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls", choice
    assert msg["reasoning_content"], msg  # free thinking, not JSON: the grammar waited for </think>
    assert not msg["reasoning_content"].lstrip().startswith("[")
    for call in msg["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_response_format_constrains_the_answer_after_the_thinking(servers):
    _, unified = servers
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    msg = _chat(unified.url, response_format=fmt)["message"]
    assert msg["reasoning_content"], msg
    jsonschema.validate(json.loads(msg["content"]), WEATHER)


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    ],
    ids=["required", "named"],
)
def test_thinking_then_forced_call_through_pd_equals_unified(servers, extra):
    cluster, unified = servers
    uni = _stream(unified.url, **extra)
    assert _stream(cluster.url, **extra) == uni
    kinds = {k for delta, _ in uni for k in delta}
    assert {"reasoning_content", "tool_calls"} <= kinds
    cluster.wait_free(cluster.workers("prefill") + cluster.workers("decode"))


def test_a_closed_or_absent_think_block_constrains_from_the_first_token():
    def encode(text: str) -> list[int]:
        return {"<think>": [7], "</think>": [8]}[text]

    assert grammar_start("qwen3", "<|im_start|>assistant\n<think>\n", encode) == ((8,), None)
    assert grammar_start("deepseek-r1", "<|im_start|>assistant\n", encode) == ((8,), None)
    assert grammar_start("qwen3", "<|im_start|>assistant\n", encode) == ((8,), 7)  # the model may open one
    assert grammar_start("qwen3", "assistant\n<think>\n\n</think>\n\n", encode) is None


class _Grammar:
    """A matcher that allows only token 5, then ends."""

    def __init__(self):
        self.seen: list[int] = []

    def accept(self, t: int) -> bool:
        self.seen.append(t)
        return t == 5

    @property
    def terminated(self) -> bool:
        return self.seen == [5]

    def fill(self, mask: torch.Tensor, row: int) -> None:
        mask[row] = 0
        mask[row, 0] = 1 << 5


def test_deferred_grammar_is_free_until_the_marker_and_the_opener_decides():
    g = DeferredGrammar(_Grammar(), (8, 9))
    mask = torch.zeros((1, 2), dtype=torch.int32)
    for t in (3, 8, 4, 8):  # thinking, including a lone first half of the marker
        g.fill(mask, 0)
        assert mask.tolist() == [[-1, -1]] and g.accept(t) and not g.terminated
    assert g.accept(9) and g.inner.seen == []  # the marker closed: the grammar starts at the next token
    g.fill(mask, 0)
    assert mask.tolist() == [[32, 0]]
    assert g.accept(5) and g.terminated

    g = DeferredGrammar(_Grammar(), (8,), opener=63)
    g.fill(mask, 0)  # the first token: the grammar's or the opener (bit 31 of word 1)
    assert mask.tolist() == [[32, -(1 << 31)]]
    assert not g.accept(4)  # not the opener: the answer starts now, and the grammar refuses 4
    g = DeferredGrammar(_Grammar(), (8,), opener=63)
    assert g.accept(63) and g.accept(4) and g.accept(8) and g.inner.seen == []


def test_thinking_then_forced_call_at_tp2_equals_tp1(servers, thinking_dir):
    """Tensor-parallel ranks admit the grammar together (``LockstepGrammarQueue``) and see the same tokens,
    so their deferred grammars start at the same step: the stream equals the one-rank worker's."""
    _, unified = servers
    extra = {"tools": TOOLS, "tool_choice": "required"}
    args = ["--model-path", thinking_dir, *FLAGS, *PARSERS, "--tp-size", "2", "--attention-backend", "torch_native"]
    with start_server(args) as tp2:
        assert _stream(tp2.url, **extra) == _stream(unified.url, **extra)


def test_a_batch_of_matchers_and_deferred_grammars_fills_the_masks_each_would_alone(tiny_llama_dir):
    from kvship.engine.grammar import GrammarBackend
    from kvship.engine.grammar.mask import fill_bitmask
    from kvship.engine.tokenizer import load_tokenizer

    class R:
        def __init__(self, grammar):
            self.grammar = grammar

    tok = load_tokenizer(tiny_llama_dir)
    backend = GrammarBackend(tok, 384, [2])
    compiled = backend.compile(("json_schema", json.dumps(WEATHER))).result()
    started = DeferredGrammar(backend.matcher(compiled), (9,))
    assert started.accept(3) and started.accept(9) and started.started
    opener = DeferredGrammar(backend.matcher(compiled), (9,), opener=300)
    grammars = [backend.matcher(compiled), DeferredGrammar(backend.matcher(compiled), (9,)), started, opener]
    grammars.append(backend.matcher(compiled))
    _, mask = fill_bitmask([R(g) for g in grammars], 384)
    for i, g in enumerate(grammars):
        alone = torch.zeros((1, mask.shape[1]), dtype=torch.int32)
        g.fill(alone, 0)
        assert torch.equal(mask[i], alone[0]), i
    assert (mask[1] == -1).all() and not (mask[0] == -1).all()
    backend.close()
