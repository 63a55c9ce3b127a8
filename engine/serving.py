"""Pieces shared by the OpenAI and SGLang-style handlers.

* request checks that need the model or the server (model name, prompt and
  context length, vocabulary, sampling ranges, ``n``): each raises an
  ``APIError`` naming the offending ``param``;
* ``merge_streams``: run several requests' ``TextDelta`` streams at once
  (``n > 1``, batches) and cancel them all if the consumer goes away;
* ``run_until_disconnect`` / ``EventStreamResponse``: abort work when the
  HTTP client disconnects, streaming or not;
* ``choice_rid`` / ``choice_params``: the id and seed of choice ``i`` of ``n``
  (its PD room: ``kvship.common.protocol.choice_room``); ``collect_until_disconnect`` /
  ``stream_response``: the non-streaming and streaming ends of a handler;
* logprob formatting in the OpenAI chat and completions shapes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Optional, Sequence, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from kvship.common.protocol import ROUTER_IDS_HEADER  # noqa: F401 - the worker's name for it, kept importable
from kvship.engine.engine import Engine, EngineDead, EngineOverloaded, RequestHandle, TextDelta
from kvship.engine.grammar.backend import GrammarError
from kvship.engine.http_errors import APIError, bad_request
from kvship.engine.io_struct import GenerateRequest, Resumed, SamplingParams
from kvship.engine.openai_protocol import PromptTokensDetails, ResponseFormat, ResumeInfo, UsageInfo
from kvship.engine.scheduler.admission import check_prompt, ids_in_vocab

logger = logging.getLogger(__name__)

MAX_N = 128  # most choices per request (n, batch x n)
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string (stop strings are searched on every step)
_SEED_MOD = 2**63
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object

T = TypeVar("T")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- checks


def check_model(engine: Engine, model: Optional[str]) -> None:
    """404 unless ``model`` is omitted or names the served model (its name or path)."""
    if model is None or model in (engine.served_model_name, engine.model_path, engine.server_args.model_path):
        return
    raise APIError(
        404,
        f"the model '{model}' does not exist; this server serves '{engine.served_model_name}'",
        param="model",
        code="model_not_found",
    )


def normalize_stop(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", param)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"a stop string may have at most {MAX_STOP_CHARS} characters", param)
    return stops


def check_resume(info: Optional[ResumeInfo], prompts: Sequence[Sequence[int]], n: int) -> Optional[Resumed]:
    """``kvship_resume`` (router-internal) as ``Resumed``: one token-id prompt, n == 1, in range."""
    if info is None:
        return None
    if len(prompts) != 1 or n != 1:
        raise bad_request("kvship_resume needs a single token-id prompt and n == 1", "kvship_resume")
    if not 0 <= info.output_tokens < len(prompts[0]) or info.relayed_chars < 0:
        raise bad_request(
            "kvship_resume.output_tokens must be in [0, prompt length) and relayed_chars >= 0", "kvship_resume"
        )
    return Resumed(output_len=info.output_tokens, relayed_chars=info.relayed_chars)


def check_n(n: int, param: str = "n") -> None:
    if n < 1:
        raise bad_request("n must be at least 1", param)
    if n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}", param)


async def encode_text(engine: Engine, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Tokenize off the event loop; a text that cannot fit the context is refused without tokenizing."""
    if engine.tokenizer.surely_longer_than(text, engine.context_len):
        raise bad_request(
            f"the prompt is longer than this model's maximum context length of {engine.context_len} tokens",
            param,
            code="context_length_exceeded",
        )
    return await asyncio.to_thread(engine.tokenizer.encode, text, add_special_tokens)


def check_token_ids(engine: Engine, ids: Sequence[int], param: str) -> None:
    vocab = engine.vocab_size
    if ids_in_vocab(ids, vocab):  # the per-id loop below only names the first bad id
        return
    for t in ids:
        if not 0 <= t < vocab:
            raise bad_request(f"token id {t} is outside the vocabulary [0, {vocab})", param)


def check_prompt_length(
    engine: Engine, n_prompt: int, max_new_tokens: Optional[int], param: str, max_tokens_param: str = "max_tokens"
) -> int:
    """Validate prompt + completion against the context; return the resolved ``max_new_tokens``."""
    ctx = engine.context_len
    problem = check_prompt(n_prompt, ctx, engine.max_total_tokens)
    if problem is not None:
        raise bad_request(problem.message, param, code=problem.code)
    if max_new_tokens is None:
        return ctx - n_prompt
    if max_new_tokens > ctx:
        raise bad_request(
            f"{max_tokens_param} is {max_new_tokens}, more than this model's maximum context length of {ctx} tokens",
            max_tokens_param,
        )
    if n_prompt + max_new_tokens > ctx:
        raise bad_request(
            f"this model's maximum context length is {ctx} tokens, but {n_prompt + max_new_tokens} "
            f"were requested ({n_prompt} in the prompt, {max_new_tokens} for the completion); "
            f"reduce the prompt or {max_tokens_param}",
            max_tokens_param,
            code="context_length_exceeded",
        )
    return max_new_tokens


def check_max_tokens(value: Optional[int], param: str, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise bad_request(f"{param} must be at least {minimum}", param)


def build_sampling_params(
    engine: Engine,
    *,
    max_new_tokens: int,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    repetition_penalty: Optional[float] = None,
    stop: Sequence[str] = (),
    stop_token_ids: Optional[Sequence[int]] = None,
    ignore_eos: bool = False,
    seed: Optional[int] = None,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    json_schema: Optional[str] = None,
    regex: Optional[str] = None,
    ebnf: Optional[str] = None,
    param_prefix: str = "",
) -> SamplingParams:
    """A verified ``SamplingParams``; out-of-range values become a 400 naming the field."""
    sp = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        # a top_k at least the vocabulary size keeps every token: the same as no top-k
        top_k=-1 if top_k is None or top_k >= engine.vocab_size else int(top_k),
        min_p=0.0 if min_p is None else float(min_p),
        frequency_penalty=0.0 if frequency_penalty is None else float(frequency_penalty),
        presence_penalty=0.0 if presence_penalty is None else float(presence_penalty),
        repetition_penalty=1.0 if repetition_penalty is None else float(repetition_penalty),
        stop=list(stop),
        stop_token_ids=list(stop_token_ids or []),
        ignore_eos=ignore_eos,
        seed=None if seed is None else int(seed) % _SEED_MOD,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        json_schema=json_schema,
        regex=regex,
        ebnf=ebnf,
    )
    if sum(x is not None for x in (json_schema, regex, ebnf)) > 1:
        raise bad_request("give at most one of json_schema, regex and ebnf", param_prefix + "json_schema")
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        v = getattr(sp, name)
        if v != v or v in (float("inf"), float("-inf")):
            raise bad_request(f"{name} must be a finite number", param_prefix + name)
    try:
        sp.verify(engine.vocab_size)
    except ValueError as e:
        msg = str(e)
        raise bad_request(msg, param_prefix + msg.split()[0]) from None
    return sp


# --------------------------------------------------------------------------- structured output


def response_format_schema(rf: Optional[ResponseFormat]) -> Optional[str]:
    """The JSON schema (text) that an OpenAI ``response_format`` constrains the output to, or None for text."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return JSON_OBJECT_SCHEMA
    if rf.type == "json_schema":
        if rf.json_schema is None:
            raise bad_request("response_format 'json_schema' needs a 'json_schema' object", "response_format")
        schema = rf.json_schema.schema_
        return JSON_OBJECT_SCHEMA if schema is None else json.dumps(schema)
    raise bad_request(
        f"response_format '{rf.type}' is not supported (text, json_object or json_schema)", "response_format"
    )


async def check_grammar(engine: Engine, sp: SamplingParams, param: Optional[str] = None) -> None:
    """400 when ``sp``'s output constraint does not compile (the compiler's message) or xgrammar is missing.

    The compile is cached, so the scheduler's compile of the same grammar is a look-up."""
    key = sp.grammar_key
    if key is None:
        return
    try:
        await engine.grammar.compile_async(key)
    except GrammarError as e:
        raise bad_request(str(e), param or key[0], code=e.code) from None  # invalid, over a limit or timed out


# --------------------------------------------------------------------------- PD roles


def check_bootstrap_token(engine: Engine, token: Any, param: str = "bootstrap_token") -> None:
    """400 unless ``token`` may open a room here: a prefill / decode worker with KV-plane authentication on needs
    the router's ``bootstrap_token`` (docs/pd.md, "KV plane authentication"); a unified worker ignores it."""
    from kvship.engine.disagg.auth import room_token_problem

    args = engine.server_args
    if args.mode in ("prefill", "decode"):
        problem = room_token_problem(token, args.kv_transfer_insecure)
        if problem is not None:
            raise bad_request(problem, param)


def choice_params(sp: SamplingParams, i: int, n: int) -> SamplingParams:
    """Sampling parameters of choice ``i`` of ``n``: with a seed, choice ``i`` uses ``seed + i``
    (choices differ but repeat across calls); otherwise ``sp`` itself."""
    if n == 1 or sp.seed is None:
        return sp
    return dataclasses.replace(sp, seed=sp.seed + i)


def choice_rid(base: str, i: int, n: int) -> str:
    """Request id of choice ``i`` of ``n``: ``base`` alone, or ``base-i`` when there are several."""
    return base if n == 1 else f"{base}-{i}"


def pd_abort_error(engine: Engine, deltas: Iterable[Optional[TextDelta]]) -> Optional[APIError]:
    """On a PD worker (``--mode prefill|decode``) an aborted request means the attempt failed (KV
    transfer failure or timeout, peer gone, corrupted KV): a 503 carrying the reason, so the router
    can retry on another pair or tell the client.  None in unified mode or when nothing aborted."""
    if engine.server_args.mode == "unified":
        return None
    for d in deltas:
        if d is not None and d.finished and d.finish_reason == "abort":
            return APIError(503, d.abort_message or "the request was aborted", code="pd_request_failed")
    return None


# --------------------------------------------------------------------------- running


def open_requests(engine: Engine, reqs: list[GenerateRequest]) -> list[RequestHandle]:
    """``engine.open`` with its errors mapped to HTTP (503 / 400)."""
    try:
        return engine.open(reqs)
    except EngineOverloaded as e:
        raise APIError(503, str(e), code="queue_full") from None
    except EngineDead as e:
        raise APIError(503, f"the model loop is not running: {e}", code="engine_dead") from None
    except ValueError as e:
        raise bad_request(str(e), "rid") from None


async def merge_streams(engine: Engine, handles: list[RequestHandle]) -> AsyncIterator[tuple[int, TextDelta]]:
    """Yield ``(index, delta)`` from every handle as they arrive; cancel all on exit."""
    if len(handles) == 1:
        inner = engine.stream_text(handles[0])
        try:
            async for d in inner:
                yield 0, d
        finally:
            await inner.aclose()
            handles[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, h: RequestHandle) -> None:
        try:
            async for d in engine.stream_text(h):
                queue.put_nowait((i, d))
        except Exception as e:  # noqa: BLE001 - surfaced to the consumer below
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(drain(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for h in handles:
            h.close()


async def collect(engine: Engine, handles: list[RequestHandle]) -> list[list[TextDelta]]:
    """Every delta of every handle, grouped by handle."""
    out: list[list[TextDelta]] = [[] for _ in handles]
    stream = merge_streams(engine, handles)
    try:
        async for i, d in stream:
            out[i].append(d)
    finally:
        await stream.aclose()
    return out


async def collect_until_disconnect(
    request: Request, engine: Engine, handles: list[RequestHandle]
) -> Optional[list[list[TextDelta]]]:
    """``collect`` the handles' deltas, or None if the client disconnects first; the handles are closed either way."""
    try:
        return await run_until_disconnect(request, collect(engine, handles))
    finally:
        for h in handles:
            h.close()


async def _wait_disconnect(receive: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> Optional[T]:
    """Await ``work``; if the client disconnects first, cancel it and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        logger.info("client disconnected from %s; aborting its requests", request.url.path)
        return None
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


def sse(payload: Any) -> bytes:
    if isinstance(payload, str):
        return f"data: {payload}\n\n".encode()
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of bytes, aborted when the client leaves.

    The iterator runs next to a watcher of ``http.disconnect``; if the client
    disconnects (or a send fails), the iterator is cancelled and closed, so
    its ``finally`` blocks abort the underlying requests.  ``on_close`` runs
    last on every path (also when the body never started).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[bytes],
        headers: Optional[dict[str, str]] = None,
        on_close: Optional[Callable[[], Any]] = None,
    ):
        self.body_iterator = body
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            try:
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]

        task = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                logger.info("client disconnected mid-stream; aborting its requests")
        finally:
            for t in (task, watcher):
                if not t.done():
                    t.cancel()
            results = await asyncio.gather(task, watcher, return_exceptions=True)
            if self.on_close is not None:
                self.on_close()  # the body may never have started: release its requests here
        err = results[0]
        if isinstance(err, OSError):
            logger.info("stream send failed (%s); client gone", err)
        elif isinstance(err, Exception) and not isinstance(err, asyncio.CancelledError):
            raise err


def stream_response(events: AsyncIterator[bytes], handles: list[RequestHandle]) -> EventStreamResponse:
    """An ``EventStreamResponse`` of ``events`` that closes ``handles`` when the stream ends or the client leaves."""
    return EventStreamResponse(events, on_close=lambda: [h.close() for h in handles])


def error_event(err: APIError) -> bytes:
    return sse(err.body())


# --------------------------------------------------------------------------- logprobs


def chat_logprobs(engine: Engine, d: TextDelta) -> Optional[dict]:
    """OpenAI chat ``logprobs.content`` entries for the tokens of one delta."""
    if d.logprobs is None:
        return None
    tok = engine.tokenizer
    content = []
    tops = d.top_logprobs or [[] for _ in d.token_ids]
    for tid, lp, top in zip(d.token_ids, d.logprobs, tops):
        content.append(
            {
                "token": tok.token_text(tid),
                "logprob": _finite(lp),
                "bytes": tok.token_bytes(tid),
                "top_logprobs": [
                    {"token": tok.token_text(t), "logprob": _finite(v), "bytes": tok.token_bytes(t)}
                    for t, v in (top or [])
                ],
            }
        )
    return {"content": content}


def completion_logprobs(engine: Engine, deltas: Iterable[TextDelta], text_offset: int = 0) -> Optional[dict]:
    """OpenAI completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset)."""
    tok = engine.tokenizer
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    seen = False
    for d in deltas:
        if d.logprobs is None:
            continue
        seen = True
        tops = d.top_logprobs or [None for _ in d.token_ids]
        for tid, lp, top in zip(d.token_ids, d.logprobs, tops):
            text = tok.token_text(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(lp))
            out["top_logprobs"].append({tok.token_text(t): _finite(v) for t, v in top} if top else None)
            out["text_offset"].append(offset)
            offset += len(text)
    return out if seen else None


def _finite(v: float) -> float:
    """JSON has no -inf: clamp impossible tokens to a very small logprob."""
    v = float(v)
    return v if v > -1e30 else -9999.0


def usage_info(prompt: int, completion: int, cached: int, spec_accept: Optional[list] = None) -> UsageInfo:
    """``spec_accept``: the choices' speculative acceptance lengths (None where a choice ran none)."""
    extra = {}
    known = [a for a in spec_accept or () if a is not None]
    if known:  # speculative decoding ran: the kvship usage extension (docs/speculative.md)
        extra["kvship_spec_accept_length"] = round(sum(known) / len(known), 4)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        **extra,
    )


def usage_dict(prompt: int, completion: int, cached: int, spec_accept: Optional[list] = None) -> dict:
    return usage_info(prompt, completion, cached, spec_accept).model_dump()
