"""Structured output (xgrammar): JSON schema, json_object, regex and EBNF constrain what a random model writes.

The tiny random model's unconstrained output is noise, so every valid answer
below is the grammar's doing.  Most cases run on one in-process engine (httpx's
ASGI transport, chunked prefill of 32 tokens, radix cache on); the PD cases run
prefill and decode schedulers in this process over the tcp transfer backend.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import pytest
import torch
from pd_fixtures import Collector, InProcessPD, run_until_idle

from kvship.engine.config import ServerArgs

pytest.importorskip("xgrammar")

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
GEN = "/generate"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
IPV4 = r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
EBNF = 'root ::= answer " " num\nanswer ::= "yes" | "no" | "maybe"\nnum ::= [1-9] [0-9]?'
PROMPTS = [f"Describe person number {i}:" for i in range(50)]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from kvship.engine.engine import Engine

    e = Engine(
        ServerArgs(model_path=tiny_llama_dir, served_model_name="tiny", max_total_tokens=8192, chunked_prefill_size=32)
    )
    yield e
    e.shutdown()


def call(engine, *requests: tuple[str, dict]) -> list[httpx.Response]:
    """POST ``requests`` concurrently to an in-process app (they share batches)."""
    from kvship.engine.http_server import create_app

    async def main():
        app = create_app(engine, engine.server_args)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return await asyncio.gather(*(c.post(path, json=body) for path, body in requests))

    return asyncio.run(main())


def gen(text, **sp) -> tuple[str, dict]:
    return GEN, {"text": text, "sampling_params": {"temperature": 0.0, "max_new_tokens": 64, **sp}}


def test_fifty_json_schema_requests_all_validate(engine):
    body = {
        "prompt": PROMPTS,
        "max_tokens": 160,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    }
    (r,) = call(engine, (COMP, body))
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 50
    texts = set()
    for c in choices:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["text"]), PERSON)
        texts.add(c["text"])
    assert len(texts) > 10  # different prompts, different (valid) objects


def test_chat_json_schema_and_json_object_return_parseable_json(engine):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}
    words = ["answer in JSON", "hi", "json please", "x", "give me an object"]
    rs = call(
        engine,
        *[(CHAT, {"messages": [{"role": "user", "content": w}], "max_tokens": 40, "temperature": 0.0,
                  "response_format": fmt}) for w in words[:2]],
        *[(CHAT, {"messages": [{"role": "user", "content": w}], "max_tokens": 300, "temperature": 0.0,
                  "response_format": {"type": "json_object"}}) for w in words],
    )  # fmt: skip
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    choices = [r.json()["choices"][0] for r in rs]
    for c in choices[:2]:
        jsonschema.validate(json.loads(c["message"]["content"]), schema)
    objects = choices[2:]
    assert all(c["message"]["content"].startswith("{") for c in objects)
    # a random model may fill the whole budget inside one JSON string; what stops is an object
    stopped = [c for c in objects if c["finish_reason"] == "stop"]
    assert stopped and all(isinstance(json.loads(c["message"]["content"]), dict) for c in stopped)


def test_regex_and_ebnf_constrain_generate(engine):
    rs = call(engine, gen("a date:", regex=DATE), gen("an address:", regex=IPV4), gen("well?", ebnf=EBNF))
    for r, pattern in zip(rs, [DATE, IPV4, r"(yes|no|maybe) [1-9][0-9]?"]):
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(pattern, out["text"]), out["text"]


def test_long_prompt_in_chunks_and_from_the_radix_cache_is_constrained_the_same(engine):
    prompt = " ".join(f"word{i}" for i in range(60))  # several 32-token chunks
    first, second = (call(engine, gen(prompt, regex=IPV4))[0].json() for _ in range(2))
    assert re.fullmatch(IPV4, first["text"]), first
    assert second["meta_info"]["cached_tokens"] > 0
    assert second["output_ids"] == first["output_ids"]


def test_unconstrained_greedy_outputs_do_not_change_beside_constrained_requests(engine):
    plain = [gen(f"plain prompt {i}", max_new_tokens=24, ignore_eos=True) for i in range(4)]
    alone = [r.json()["output_ids"] for r in call(engine, *plain)]
    constrained = [gen(f"person {i}", json_schema=json.dumps(PERSON), max_new_tokens=120) for i in range(4)]
    mixed = call(engine, *[x for pair in zip(plain, constrained) for x in pair])
    assert [r.json()["output_ids"] for r in mixed[0::2]] == alone
    for r in mixed[1::2]:
        jsonschema.validate(json.loads(r.json()["text"]), PERSON)


@pytest.mark.parametrize(
    "path,body,param",
    [
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}}, "response_format"),
        (COMP, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"$ref": "#/nowhere"}}}}, "response_format"),
        (COMP, {"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
        (GEN, {"text": "x", "sampling_params": {"regex": "(unclosed"}}, "sampling_params.regex"),
        (GEN, {"text": "x", "sampling_params": {"ebnf": "root ::= "}}, "sampling_params.ebnf"),
        (GEN, {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
        (GEN, {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "sampling_params.json_schema"),
    ],
)  # fmt: skip
def test_invalid_grammar_is_a_400_with_the_compiler_message(engine, path, body, param):
    (r,) = call(engine, (path, body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    assert "/project/" not in err["message"]  # xgrammar's source location is cut off


def test_without_xgrammar_a_constrained_request_is_a_clear_400(engine, monkeypatch):
    import kvship.engine.grammar.backend as backend

    monkeypatch.setattr(backend, "grammar_available", lambda: False)
    (r,) = call(engine, gen("x", regex="a+"))
    assert r.status_code == 400 and "xgrammar" in r.json()["error"]["message"], r.text


def test_device_mask_equals_xgrammar_reference_mask(tiny_llama_dir):
    import xgrammar as xgr

    from kvship.engine.grammar import GrammarBackend, apply_grammar_mask
    from kvship.engine.tokenizer import load_tokenizer

    vocab = 384
    backend = GrammarBackend(load_tokenizer(tiny_llama_dir), vocab, [2])
    compiled = backend.compile(("json_schema", json.dumps(PERSON))).result()

    class R:
        def __init__(self, g):
            self.grammar = g

    reqs = [R(backend.matcher(compiled)), R(None), R(backend.matcher(compiled))]
    reqs[2].grammar.accept(int(backend.tokenizer.encode("{", add_special_tokens=False)[0]))
    logits = torch.randn(3, vocab)
    ours = logits.clone()
    apply_grammar_mask(ours, reqs)
    ref = logits.clone()
    bm = xgr.allocate_token_bitmask(3, vocab)
    for i in (0, 2):
        reqs[i].grammar.fill(bm, i)
    xgr.apply_token_bitmask_inplace(ref, bm, indices=[0, 2])
    assert torch.equal(ours, ref)
    assert torch.equal(ours[1], logits[1])
    backend.close()


# ----------------------------------------------------------------------------------------- PD


def _unified(model_dir, tokenizer, submits, runner=None, **args):
    """Run ``submits`` on a unified scheduler stepped in this thread; its collector (``.sched``: the scheduler)."""
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.scheduler import Scheduler

    sa = ServerArgs(model_path=model_dir, device="cpu", max_total_tokens=8192, **args)
    out = Collector()
    sched = Scheduler(sa, runner or ModelRunner(sa), tokenizer, out)
    for greq in submits:
        sched.submit(greq)
    run_until_idle(sched)
    sched.grammar.close()  # its compile processes end here, not when the scheduler is collected
    out.sched = sched
    return out


def test_overlap_loop_chains_constrained_requests_with_the_same_tokens(tiny_llama_dir, monkeypatch):
    """Constrained decodes are chained (their grammars take step N's tokens while N+1 runs) and give
    the synchronous loop's tokens, alone and beside plain requests."""
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.scheduler.overlap import FORCE_ENV
    from kvship.engine.tokenizer import load_tokenizer

    monkeypatch.setenv(FORCE_ENV, "1")
    tok = load_tokenizer(tiny_llama_dir)
    runner = ModelRunner(ServerArgs(model_path=tiny_llama_dir, device="cpu", max_total_tokens=8192))

    def submits(n_plain=3):
        plain = [
            GenerateRequest(
                f"p{i}", tok.encode(f"plain {i}"), SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
            )
            for i in range(n_plain)
        ]
        grammar = [
            GenerateRequest(
                f"g{i}", tok.encode(f"ip {i}"), SamplingParams(max_new_tokens=30, temperature=0.0, regex=IPV4)
            )
            for i in range(3)
        ]
        return plain + grammar

    # fmt: skip

    outs = {}
    for mode in ("sync", "overlap"):
        outs[mode] = _unified(
            tiny_llama_dir, tok, submits(), runner, disable_overlap_schedule=mode == "sync", disable_radix_cache=True
        )
    sched = outs["overlap"].sched
    assert sched.overlap is not None and sched.overlap.launched > 0
    for rid in [f"p{i}" for i in range(3)] + [f"g{i}" for i in range(3)]:
        assert outs["overlap"].tokens(rid) == outs["sync"].tokens(rid)
    for i in range(3):
        assert re.fullmatch(IPV4, tok.decode(outs["overlap"].tokens(f"g{i}"), skip_special_tokens=True))
    # constrained requests alone: every decode after the first is chained
    alone = _unified(tiny_llama_dir, tok, submits(0), runner, disable_overlap_schedule=False, disable_radix_cache=True)
    steps = max(len(alone.tokens(f"g{i}")) for i in range(3))
    assert alone.sched.overlap.launched >= steps - 3, (alone.sched.overlap.launched, steps)
    for i in range(3):
        assert alone.tokens(f"g{i}") == outs["sync"].tokens(f"g{i}")


def test_a_compiling_grammar_does_not_hold_up_other_requests(tiny_llama_dir):
    import threading

    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama_dir)
    release = threading.Event()
    out = Collector()

    def run():
        from kvship.engine.model_runner import ModelRunner
        from kvship.engine.scheduler import Scheduler

        sa = ServerArgs(model_path=tiny_llama_dir, device="cpu", max_total_tokens=8192)
        sched = Scheduler(sa, ModelRunner(sa), tok, out)
        slow = sched.grammar._compile

        def compile_slowly(key):
            release.wait(30)
            return slow(key)

        sched.grammar._compile = compile_slowly
        sched.submit(
            GenerateRequest("g", tok.encode("ip"), SamplingParams(max_new_tokens=30, temperature=0.0, regex=IPV4))
        )
        sched.submit(GenerateRequest("p", tok.encode("plain"), SamplingParams(max_new_tokens=8, temperature=0.0)))
        deadline = time.monotonic() + 120
        while not sched.idle():
            assert time.monotonic() < deadline, "scheduler not idle after 120 s"
            sched.step(block_s=0.001)
            if out.finished("p") and not release.is_set():
                assert not out.finished("g") and len(sched.grammar_queue) == 1  # still compiling
                release.set()
        sched.grammar.close()

    run()
    assert release.is_set() and out.finished("g")[0].finish_reason["type"] == "stop"
    assert re.fullmatch(IPV4, tok.decode(out.tokens("g"), skip_special_tokens=True))


def _chunks(out, rid):
    return [c for c in out.chunks if c.rid == rid]


def test_pd_constrains_prefill_first_token_and_decode_continues_the_grammar(tiny_llama_dir):
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama_dir)
    prompts = [tok.encode(f"person {i}:") for i in range(3)]
    schema = json.dumps(PERSON)
    with InProcessPD(tiny_llama_dir, tokenizer=tok) as pd:
        for i, ids in enumerate(prompts):
            pd.submit(f"j{i}", ids, max_new=200, sampling={"json_schema": schema})
        pd.submit("ip", prompts[0], max_new=40, sampling={"regex": IPV4})
        pd.wait([f"j{i}" for i in range(3)] + ["ip"])
        pd_out = {r: pd.tokens(r) for r in ["j0", "j1", "j2", "ip"]}
        assert all(pd.finish(r)["type"] == "stop" for r in pd_out), [pd.finish(r) for r in pd_out]
        pd.wait_idle()
    for i in range(3):
        jsonschema.validate(json.loads(tok.decode(pd_out[f"j{i}"], skip_special_tokens=True)), PERSON)
    assert re.fullmatch(IPV4, tok.decode(pd_out["ip"], skip_special_tokens=True))
    # the same requests on a unified worker give the same tokens (greedy)
    submits = [
        GenerateRequest(f"j{i}", ids, SamplingParams(max_new_tokens=200, temperature=0.0, json_schema=schema))
        for i, ids in enumerate(prompts)
    ]
    uni = _unified(tiny_llama_dir, tok, submits)
    assert [uni.tokens(f"j{i}") for i in range(3)] == [pd_out[f"j{i}"] for i in range(3)]


@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
def test_pd_logprobs_and_top_logprobs_equal_unified_first_token_included(tiny_llama_dir, backend):
    from kvship.engine.io_struct import GenerateRequest, SamplingParams

    prompts = [[5, 17, 42, 99, 7], list(range(3, 40))]
    kw = dict(return_logprob=True, top_logprobs_num=3)
    uni = _unified(
        tiny_llama_dir,
        None,
        [
            GenerateRequest(f"l{i}", p, SamplingParams(max_new_tokens=8, temperature=0.0), **kw)
            for i, p in enumerate(prompts)
        ],
    )
    with InProcessPD(tiny_llama_dir, backend=backend) as pd:
        for i, p in enumerate(prompts):
            pd.submit(f"l{i}", p, max_new=8, **kw)
        pd.wait(["l0", "l1"])
        pd_chunks = {r: _chunks(pd.d_out, r) for r in ["l0", "l1"]}
    for rid, chunks in pd_chunks.items():
        ref = _chunks(uni, rid)
        assert [t for c in chunks for t in c.token_ids] == [t for c in ref for t in c.token_ids]
        lps = [v for c in chunks for v in c.logprobs]
        ref_lps = [v for c in ref for v in c.logprobs]
        assert lps == pytest.approx(ref_lps, abs=1e-4)
        tops = [t for c in chunks for t in c.top_logprobs]
        ref_tops = [t for c in ref for t in c.top_logprobs]
        assert len(tops) == len(ref_tops) == 8 and all(len(t) == 3 for t in tops)
        for got, want in zip(tops, ref_tops):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-4)


PARITY = {
    "seeded": dict(temperature=0.8, top_p=0.9, top_k=50, seed=7),
    "penalties": dict(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3),
    "stop_token": dict(temperature=0.0),  # + stop_token_ids: a token greedy decoding emits
    "min_p": dict(temperature=1.0, min_p=0.2, seed=3),
}


def test_pd_sampling_parameters_give_unified_answers(tiny_llama_dir):
    from pd_fixtures import unified_greedy

    from kvship.engine.io_struct import GenerateRequest, SamplingParams

    prompts = [[5, 17, 42, 99, 7], list(range(3, 30))]
    stop = [unified_greedy(tiny_llama_dir, prompts[1:], 12)[0][5]]
    parity = {**PARITY, "stop_token": {**PARITY["stop_token"], "stop_token_ids": stop}}
    cases = [(f"{v}-{i}", p, parity[v]) for v in sorted(parity) for i, p in enumerate(prompts)]
    uni = _unified(
        tiny_llama_dir, None, [GenerateRequest(rid, p, SamplingParams(max_new_tokens=12, **sp)) for rid, p, sp in cases]
    )
    with InProcessPD(tiny_llama_dir) as pd:
        for rid, p, sp in cases:
            pd.submit(rid, p, max_new=12, sampling=sp)
        pd.wait([rid for rid, _, _ in cases])
        for rid, _, _ in cases:
            assert pd.tokens(rid) == uni.tokens(rid), rid
            assert pd.finish(rid) == uni.finished(rid)[0].finish_reason, rid
    assert uni.finished("stop_token-1")[0].finish_reason["type"] == "stop"


def test_tensor_parallel_ranks_admit_a_grammar_at_the_same_step_and_only_rank_0_compiles(tiny_llama_dir):
    """Rank 0 compiles; its ``GrammarReady`` (broadcast by the inbox, handed over by hand here) makes the
    request ready on every rank at the step that carries it; the follower never compiles nor waits."""
    from kvship.engine.grammar import GrammarBackend, LockstepGrammarQueue
    from kvship.engine.io_struct import SamplingParams
    from kvship.engine.schedule_batch import Req
    from kvship.engine.scheduler.inbox import GrammarReady
    from kvship.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama_dir)
    leader_backend, follower_backend = GrammarBackend(tok, 384, [2]), GrammarBackend(tok, 384, [2])
    follower_backend._compile = lambda key: pytest.fail("a follower rank compiled a grammar")
    sent: list[GrammarReady] = []
    leader = LockstepGrammarQueue(leader_backend, leader=True, publish=lambda *a: sent.append(GrammarReady(*a)))
    follower = LockstepGrammarQueue(follower_backend, leader=False, publish=lambda *a: pytest.fail("follower sent"))
    reqs = {}
    for rank, queue in (("leader", leader), ("follower", follower)):
        for rid, sp in (("ok", SamplingParams(regex=DATE)), ("bad", SamplingParams(regex="(unclosed"))):
            reqs[rank, rid] = Req(rid, [1, 2], sp)
            queue.add(reqs[rank, rid], rid)
    deadline = time.monotonic() + 120
    while len(sent) < 2:  # the leader's compiles end in its pool; nobody is admitted meanwhile
        assert leader.poll() == [] and follower.poll() == [] and time.monotonic() < deadline
        time.sleep(0.01)
    for msg in sent:  # the broadcast step: every rank handles the same messages
        leader.resolve(msg.rid, msg.serialized, msg.error)
        follower.resolve(msg.rid, msg.serialized, msg.error)
    got = {"leader": leader.poll(), "follower": follower.poll()}
    for rank in got:
        by_rid = {payload: error for _, payload, error in got[rank]}
        assert by_rid["ok"] is None and "invalid regex" in by_rid["bad"], (rank, by_rid)
        assert len(leader) == len(follower) == 0
    date = tok.encode("2024-02-29", add_special_tokens=False)
    for rank in ("leader", "follower"):  # the follower's deserialized grammar constrains like the leader's
        g = reqs[rank, "ok"].grammar
        assert all(g.accept(t) for t in date) and g.accept(2) and g.terminated, rank
    leader_backend.close()
    follower_backend.close()


def test_masks_filled_aside_give_the_synchronous_loop_tokens_for_a_mixed_batch(tiny_llama_dir, monkeypatch):
    """Chained steps fill their masks on the mask thread while the previous step is processed: JSON-schema,
    regex and EBNF requests beside plain ones, ending by grammar, stop string, length, and EOS, give the
    synchronous loop's tokens and finish reasons, and every KV slot is free afterwards."""
    from kvship.engine.io_struct import GenerateRequest, SamplingParams
    from kvship.engine.model_runner import ModelRunner
    from kvship.engine.scheduler.overlap import FORCE_ENV
    from kvship.engine.tokenizer import load_tokenizer

    monkeypatch.setenv(FORCE_ENV, "1")
    tok = load_tokenizer(tiny_llama_dir)
    runner = ModelRunner(ServerArgs(model_path=tiny_llama_dir, device="cpu", max_total_tokens=8192))
    schema = json.dumps(PERSON)

    def submits():
        sp = lambda **kw: SamplingParams(temperature=0.0, **kw)  # noqa: E731
        return [
            GenerateRequest("json0", tok.encode("person 0:"), sp(max_new_tokens=160, json_schema=schema)),
            GenerateRequest("json1", tok.encode("person 1:"), sp(max_new_tokens=12, json_schema=schema)),  # length
            GenerateRequest("ip", tok.encode("ip:"), sp(max_new_tokens=30, regex=IPV4)),
            GenerateRequest("date", tok.encode("date:"), sp(max_new_tokens=30, regex=DATE, stop=["-"])),  # stop str
            GenerateRequest("ebnf", tok.encode("well?"), sp(max_new_tokens=30, ebnf=EBNF)),
            GenerateRequest("plain0", tok.encode("plain 0"), sp(max_new_tokens=40, ignore_eos=True)),
            GenerateRequest("plain1", tok.encode("plain 1"), sp(max_new_tokens=25)),
        ]

    outs = {
        mode: _unified(
            tiny_llama_dir, tok, submits(), runner, disable_overlap_schedule=mode == "sync", disable_radix_cache=True
        )
        for mode in ("sync", "overlap")
    }
    for greq in submits():
        assert outs["overlap"].tokens(greq.rid) == outs["sync"].tokens(greq.rid), greq.rid
        assert outs["overlap"].finished(greq.rid) == outs["sync"].finished(greq.rid), greq.rid
    reasons = {g.rid: outs["overlap"].finished(g.rid)[0].finish_reason for g in submits()}
    assert reasons["json1"]["type"] == "length" and reasons["date"] == {"type": "stop", "matched": "-"}, reasons
    assert all(reasons[r]["type"] == "stop" for r in ("json0", "ip", "ebnf")), reasons
    jsonschema.validate(json.loads(tok.decode(outs["overlap"].tokens("json0"), skip_special_tokens=True)), PERSON)
    sched = outs["overlap"].sched
    assert sched.launcher.masks.started > 10 and sched.overlap.launched > 10
    assert sched.allocator.available_size() == sched.allocator.total_slots and not sched.reqs


def test_batch_accept_matches_one_by_one_accept_refusals_and_termination(tiny_llama_dir):
    from kvship.engine.grammar import GrammarBackend, GrammarMatcher
    from kvship.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama_dir)
    backend = GrammarBackend(tok, 384, [2])
    compiled = backend.compile(("ebnf", EBNF)).result()
    words = [tok.encode(w, add_special_tokens=False) for w in ("yes 4", "no 12", "maybe", "no 1x")]
    batch = [backend.matcher(compiled) for _ in words]
    single = [backend.matcher(compiled) for _ in words]
    refused = 0
    for k in range(max(len(w) for w in words) + 1):
        idx = [i for i, w in enumerate(words) if k <= len(w)]
        toks = [words[i][k] if k < len(words[i]) else 2 for i in idx]  # 2: the stop token, after the text
        got = GrammarMatcher.accept_many([batch[i] for i in idx], toks)
        want = []
        for i, t in zip(idx, toks):
            accepted = single[i].accept(t)
            want.append((accepted, accepted and single[i].terminated))
        assert got == want, (k, got, want)
        refused += sum(not a for a, _ in got)
    # "maybe" needs a number before the stop token; "no 1x": "x" is refused, the state stays "no 1", which ends
    assert [m.terminated for m in batch] == [m.terminated for m in single] == [True, True, False, True]
    assert refused == 2
    backend.close()
