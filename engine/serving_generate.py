"""``POST /generate`` (SGLang-compatible native API).

Input: exactly one of ``text`` / ``input_ids``, each single or a batch;
``sampling_params`` one object for all or a list (one per batch item);
``rid``, ``return_logprob`` and the PD fields ``bootstrap_host`` /
``bootstrap_port`` / ``bootstrap_room`` single or per item.  With
``sampling_params.n > 1`` every item runs ``n`` times (outputs item-major).

Output per request: ``{"text", "output_ids", "meta_info": {"id",
"prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
"e2e_latency", ...}}`` (plus ``"spec_accept_length"``, tokens per verify
round, on speculative workers; docs/speculative.md); a single request
returns the object, a batch a list.
``finish_reason`` keeps SGLang's shape: ``{"type": "stop", "matched": id or
str}``, ``{"type": "length", "length": n}``, ``{"type": "abort", "message"}``.
With ``return_logprob``: ``meta_info.output_token_logprobs`` =
``[[logprob, token_id, text or null], ...]`` and, with ``top_logprobs_num``,
``meta_info.output_top_logprobs`` = one such list per token.

Streaming (``stream: true``) sends one event per update with the text and
output ids *so far* (cumulative, as SGLang does), plus ``"index"`` for a
batch, then ``data: [DONE]``.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvship.engine.engine import Engine, RequestHandle, TextDelta
from kvship.engine.http_errors import APIError, bad_request
from kvship.engine.io_struct import FinishReason
from kvship.engine.openai_protocol import GenerateReqInput, GenerateSamplingParams
from kvship.engine.serving import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    build_sampling_params,
    check_grammar,
    check_max_tokens,
    check_n,
    check_prompt_length,
    check_resume,
    check_token_ids,
    collect_until_disconnect,
    encode_text,
    merge_streams,
    new_id,
    normalize_stop,
    pd_abort_error,
    sse,
    stream_response,
)
from kvship.engine.serving_request import RequestContext


def _per_item(value: Any, batch: int, name: str, is_list: bool) -> list[Any]:
    """Broadcast a single value to ``batch`` items, or check a list's length."""
    if is_list:
        if len(value) != batch:
            raise bad_request(f"{name} has {len(value)} entries but the batch has {batch}", name)
        return list(value)
    return [value] * batch


class _Output:
    """Accumulates one request's deltas into SGLang's output object."""

    def __init__(
        self,
        rid: str,
        n_prompt: int,
        created: float,
        want_logprob: bool,
        top_n: int,
        keep_stop: bool,
        text_in_logprobs: bool,
    ):
        self.rid = rid
        self.n_prompt = n_prompt
        self.created = created
        self.want_logprob = want_logprob
        self.top_n = top_n
        self.keep_stop = keep_stop
        self.text_in_logprobs = text_in_logprobs
        self.text = ""
        self.ids: list[int] = []
        self.logprobs: list[list] = []
        self.top: list[list[list]] = []
        self.last: Optional[TextDelta] = None
        self.trace: Optional[dict[str, float]] = None  # the request's trace (``return_trace``), shared with it

    def add(self, engine: Engine, d: TextDelta) -> None:
        self.text += d.text
        if d.finished and d.finish_reason == "stop" and self.keep_stop and isinstance(d.matched_stop, str):
            self.text += d.matched_stop
        self.ids.extend(d.token_ids)
        if self.want_logprob and d.logprobs is not None:
            tok = engine.tokenizer
            txt = (lambda t: tok.token_text(t)) if self.text_in_logprobs else (lambda t: None)
            self.logprobs.extend([lp, t, txt(t)] for t, lp in zip(d.token_ids, d.logprobs))
            if self.top_n:
                tops = d.top_logprobs or [[] for _ in d.token_ids]
                self.top.extend([[v, t, txt(t)] for t, v in top] for top in tops)
        self.last = d

    def finish_reason(self) -> Optional[dict]:
        d = self.last
        if d is None or not d.finished:
            return None
        if d.finish_reason == "length":
            return dict(FinishReason.of_length(d.completion_tokens))
        return dict(FinishReason.from_wire(d.reason))

    def to_dict(self, index: Optional[int] = None) -> dict:
        d = self.last
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.n_prompt,
            "completion_tokens": d.completion_tokens if d else 0,
            "cached_tokens": d.cached_tokens if d else 0,
            **({"spec_accept_length": round(d.spec_accept_length, 4)} if d and d.spec_accept_length else {}),
            "finish_reason": self.finish_reason(),
            "e2e_latency": round(time.time() - self.created, 6),
        }
        if self.want_logprob:
            meta["output_token_logprobs"] = self.logprobs
            if self.top_n:
                meta["output_top_logprobs"] = self.top
        if self.trace is not None:  # the first event (or the body) is when the first token left this worker
            self.trace.setdefault("http_respond", time.time())
            meta["trace"] = dict(self.trace)
        out: dict[str, Any] = {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out


class GenerateServing:
    def __init__(self, engine: Engine):
        self.engine = engine

    async def generate(self, request: Request, body: GenerateReqInput) -> Response:
        engine = self.engine
        if (body.text is None) == (body.input_ids is None):
            raise bad_request("give exactly one of 'text' and 'input_ids'", "text")
        # normalise the prompts to a batch
        if body.text is not None:
            is_batch = isinstance(body.text, list)
            texts = body.text if is_batch else [body.text]
            if not texts:
                raise bad_request("the batch is empty", "text")
            prompts = []
            for i, t in enumerate(texts):
                param = f"text.{i}" if is_batch else "text"
                if t == "":
                    raise bad_request("the prompt is empty", param, code="empty_prompt")
                prompts.append((param, await encode_text(engine, t, param)))
        else:
            ids_in = body.input_ids or []
            is_batch = bool(ids_in) and isinstance(ids_in[0], list)
            batch_ids = ids_in if is_batch else [ids_in]
            prompts = []
            for i, ids in enumerate(batch_ids):
                param = f"input_ids.{i}" if is_batch else "input_ids"
                if not ids:
                    raise bad_request("the prompt is empty", param, code="empty_prompt")
                check_token_ids(engine, ids, param)
                prompts.append((param, list(ids)))
        batch = len(prompts)
        sps = _per_item(
            body.sampling_params if body.sampling_params is not None else GenerateSamplingParams(),
            batch,
            "sampling_params",
            isinstance(body.sampling_params, list),
        )
        rids = _per_item(body.rid, batch, "rid", isinstance(body.rid, list))
        want_lp = _per_item(body.return_logprob, batch, "return_logprob", isinstance(body.return_logprob, list))
        ctx = RequestContext.of(engine, request, body, batch)
        if not 0 <= body.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs_num")
        if body.kvship_resume is not None and body.input_ids is None:
            raise bad_request("kvship_resume needs input_ids", "kvship_resume")
        ctx.resumed = check_resume(body.kvship_resume, [ids for _, ids in prompts], max(sp.n for sp in sps))
        outputs: list[_Output] = []
        for i, ((param, ids), gsp) in enumerate(zip(prompts, sps)):
            prefix = f"sampling_params.{i}." if isinstance(body.sampling_params, list) else "sampling_params."
            check_n(gsp.n, prefix + "n")
            check_max_tokens(gsp.max_new_tokens, prefix + "max_new_tokens", minimum=0)
            explicit = gsp.max_new_tokens if "max_new_tokens" in gsp.model_fields_set else None
            max_new = check_prompt_length(engine, len(ids), explicit, param, prefix + "max_new_tokens")
            if explicit is None and gsp.max_new_tokens is not None:  # the default shrinks to fit the context
                max_new = min(max_new, gsp.max_new_tokens)
            sp = build_sampling_params(
                engine,
                max_new_tokens=max_new,
                temperature=gsp.temperature,
                top_p=gsp.top_p,
                top_k=gsp.top_k,
                min_p=gsp.min_p,
                frequency_penalty=gsp.frequency_penalty,
                presence_penalty=gsp.presence_penalty,
                repetition_penalty=gsp.repetition_penalty,
                stop=normalize_stop(gsp.stop, prefix + "stop"),
                stop_token_ids=gsp.stop_token_ids,
                ignore_eos=gsp.ignore_eos,
                seed=gsp.seed,
                skip_special_tokens=gsp.skip_special_tokens,
                spaces_between_special_tokens=gsp.spaces_between_special_tokens,
                json_schema=gsp.json_schema,
                regex=gsp.regex,
                ebnf=gsp.ebnf,
                param_prefix=prefix,
            )
            if sp.grammar_key is not None:
                await check_grammar(engine, sp, prefix + sp.grammar_key[0])
            added = ctx.add(
                i,
                rids[i] or new_id("gen"),
                ids,
                sp,
                gsp.n,
                return_logprob=want_lp[i],
                top_logprobs_num=body.top_logprobs_num if want_lp[i] else 0,
            )
            for greq in added:
                out = _Output(
                    greq.rid,
                    len(ids),
                    ctx.created,
                    want_lp[i],
                    body.top_logprobs_num,
                    gsp.no_stop_trim,
                    body.return_text_in_logprobs,
                )
                out.trace = greq.trace
                outputs.append(out)
        if len(ctx.requests) > MAX_N:
            raise bad_request(f"a batch may hold at most {MAX_N} requests (items x n)", "text")
        many = is_batch or len(ctx.requests) > 1
        handles = ctx.open()
        if body.stream:
            router_ids = [r.input_ids for r in ctx.requests] if ctx.router_ids else None
            return stream_response(self._stream(handles, outputs, many, router_ids), handles)
        results = await collect_until_disconnect(request, engine, handles)
        if results is None:
            return Response(status_code=499)
        for out, deltas in zip(outputs, results):
            for d in deltas:
                out.add(engine, d)
        if not engine.is_alive() and any(o.last and o.last.finish_reason == "abort" for o in outputs):
            raise APIError(503, engine.failure or "the model loop died", code="engine_dead")
        pd_err = pd_abort_error(engine, [o.last for o in outputs])
        if pd_err is not None:
            raise pd_err
        if many:
            return JSONResponse([o.to_dict() for o in outputs])
        return JSONResponse(outputs[0].to_dict())

    async def _stream(
        self,
        handles: list[RequestHandle],
        outputs: list[_Output],
        many: bool,
        router_ids: Optional[list[list[int]]] = None,
    ) -> AsyncIterator[bytes]:
        """``router_ids`` (each request's prompt ids; the router asked with ``ROUTER_IDS_HEADER``): the
        first event of each request carries them as ``meta_info.kvship_prompt_ids``."""
        engine = self.engine
        stream = merge_streams(engine, handles)
        prompt_sent = [False] * len(handles)
        try:
            async for i, d in stream:
                out = outputs[i]
                out.add(engine, d)
                if not d.text and not d.token_ids and not d.finished:
                    continue
                event = out.to_dict(i if many else None)
                if router_ids is not None and not prompt_sent[i]:
                    event["meta_info"]["kvship_prompt_ids"], prompt_sent[i] = router_ids[i], True
                yield sse(event)
            if not engine.is_alive() and any(o.last and o.last.finish_reason == "abort" for o in outputs):
                yield sse(APIError(503, engine.failure or "the model loop died", code="engine_dead").body())
            elif (pd_err := pd_abort_error(engine, [o.last for o in outputs])) is not None:
                yield sse(pd_err.body())
            yield sse("[DONE]")
        finally:
            await stream.aclose()
