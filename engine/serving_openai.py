"""``/v1/chat/completions`` and ``/v1/completions`` (OpenAI-compatible).

Each handler checks the request, tokenizes (chat: through the model's chat
template), opens one engine request per choice (``n`` choices per prompt;
with a ``seed``, choice ``i`` uses ``seed + i`` so choices differ but repeat
across calls) and answers either one JSON body or a server-sent event
stream ending in ``data: [DONE]``.

Usage counts each distinct prompt once and every choice's completion;
``prompt_tokens_details.cached_tokens`` is the prefix-cache hit of the prompt.
Finish reasons: ``stop`` (EOS, stop token, stop string), ``length``,
``abort`` (aborted through ``/abort_request``), ``tool_calls`` (chat: the
model stopped after tool calls; ``kvship.engine.tool_parsers``).  If the model loop dies
during a request, a non-streaming call gets a 503 and a stream gets an error
event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvship.engine.chat_template import ChatTemplateError, RenderLimitError, RenderLimits, check_template_kwargs
from kvship.engine.engine import Engine, RequestHandle, TextDelta
from kvship.engine.http_errors import APIError, bad_request
from kvship.engine.io_struct import SamplingParams
from kvship.engine.openai_protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvship.engine.reasoning import ReasoningSplitter, grammar_start
from kvship.engine.serving import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    build_sampling_params,
    chat_logprobs,
    check_grammar,
    check_max_tokens,
    check_model,
    check_n,
    check_prompt_length,
    check_resume,
    check_token_ids,
    collect_until_disconnect,
    completion_logprobs,
    encode_text,
    merge_streams,
    new_id,
    normalize_stop,
    pd_abort_error,
    response_format_schema,
    sse,
    stream_response,
    usage_dict,
    usage_info,
)
from kvship.engine.serving_request import RequestContext
from kvship.engine.tool_parsers import ChoiceOutput, ToolPlan, detect_family, plan_tools, template_messages


def _sampling_params(
    engine: Engine,
    body: ChatCompletionRequest | CompletionRequest,
    max_new: int,
    stops: list[str],
    json_schema: Optional[str] = None,
) -> SamplingParams:
    """The sampling parameters of a chat or completions body (both carry the same sampling fields)."""
    return build_sampling_params(
        engine,
        max_new_tokens=max_new,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        repetition_penalty=body.repetition_penalty,
        stop=stops,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        seed=body.seed,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        json_schema=json_schema,
    )


def _dead_error(engine: Engine, deltas: list[TextDelta]) -> Optional[APIError]:
    """A 503 when a choice was aborted because the model loop died."""
    if any(d.finish_reason == "abort" for d in deltas) and not engine.is_alive():
        msg = next((d.abort_message for d in deltas if d.abort_message), None) or "the model loop died"
        return APIError(503, msg, code="engine_dead")
    return pd_abort_error(engine, deltas)


def _choice_outputs(plan: ToolPlan, reasoning: Optional[str], prompt: str, n: int) -> Optional[list[ChoiceOutput]]:
    """One output parser per choice, or None when the text is sent as it is."""
    if plan.parser is None and reasoning is None:
        return None
    return [
        ChoiceOutput(
            plan.parser() if plan.parser is not None else None,
            ReasoningSplitter(reasoning, prompt) if reasoning is not None else None,
        )
        for _ in range(n)
    ]


def _merge_deltas(a: dict, b: dict) -> dict:
    """Two chat deltas of one choice as one (the last text delta and the final flush)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    if "tool_calls" in a and "tool_calls" in b:  # one entry per call: later fragments join its arguments
        calls: dict[int, dict] = {}
        for tc in out["tool_calls"]:
            if tc["index"] in calls:
                fn = calls[tc["index"]]["function"]
                fn["arguments"] = fn.get("arguments", "") + tc["function"].get("arguments", "")
            else:
                calls[tc["index"]] = {**tc, "function": dict(tc["function"])}
        out["tool_calls"] = list(calls.values())
    return out


class OpenAIServing:
    def __init__(self, engine: Engine):
        self.engine = engine

    async def _collect(self, request: Request, handles: list[RequestHandle]) -> Optional[list[list[TextDelta]]]:
        """Every choice's deltas (None if the client left first); raises the 503 of ``_dead_error``."""
        results = await collect_until_disconnect(request, self.engine, handles)
        if results is not None:
            err = _dead_error(self.engine, [r[-1] for r in results])
            if err:
                raise err
        return results

    # ------------------------------------------------------------------ chat
    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        engine = self.engine
        check_model(engine, body.model)
        check_n(body.n)
        ctx = RequestContext.of(engine, request, body)
        if body.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        schema = response_format_schema(body.response_format)
        args = engine.server_args
        # tools / tool_choice: template tools, forced-call constraint, parser (docs/api.md, "Tool calling")
        family = args.tool_call_parser
        if family == "auto":
            family = detect_family(engine.tokenizer.chat_template)
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, family, schema is not None)
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        if not body.messages:
            raise bad_request("messages must not be empty", "messages")
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        check_max_tokens(max_tokens, max_param)
        stops = normalize_stop(body.stop)
        messages = template_messages([m.model_dump(exclude_none=True) for m in body.messages])
        refused = check_template_kwargs(body.chat_template_kwargs)  # switches only, never template code
        if refused is not None:
            raise bad_request(refused[1], f"chat_template_kwargs.{refused[0]}", code="invalid_chat_template_kwargs")
        try:
            prompt = await asyncio.to_thread(
                engine.tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=body.add_generation_prompt,
                tools=plan.template_tools,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
                limits=RenderLimits(args.max_chat_template_output_chars, args.chat_template_timeout),
            )
        except RenderLimitError as e:  # a bounded render ran out of time or room (docs/api.md, "Chat templates")
            raise APIError(e.status, str(e), param="messages", code="chat_template_limit") from None
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        ids = await encode_text(engine, prompt, "messages", add_special_tokens=False)  # the template holds BOS
        max_new = check_prompt_length(engine, len(ids), max_tokens, "messages", max_param)
        sp = _sampling_params(engine, body, max_new, stops, plan.json_schema or schema)
        if plan.keep_special_tokens:
            sp = dataclasses.replace(sp, skip_special_tokens=False)  # the family's call markers are special tokens
        await check_grammar(engine, sp, "tools" if plan.json_schema else "response_format")
        reasoning = args.reasoning_parser
        if sp.grammar_key is not None and reasoning is not None:
            # a constrained answer (forced call, response_format) starts after the thinking (docs/api.md,
            # "Reasoning"); when there is none to come, at the first token, all of it answer
            start = grammar_start(reasoning, prompt, lambda t: engine.tokenizer.encode(t, add_special_tokens=False))
            if start is None:
                reasoning = None
            else:
                sp = dataclasses.replace(sp, grammar_after=start[0], grammar_opener=start[1])
        outputs = _choice_outputs(plan, reasoning, prompt, body.n)
        cid = body.rid or new_id("chatcmpl")
        ctx.add(0, cid, ids, sp, body.n, return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0)
        handles = ctx.open()
        model = body.model or engine.served_model_name
        if body.stream:
            opts = body.stream_options
            return stream_response(
                self._chat_stream(
                    cid,
                    model,
                    handles,
                    len(ids),
                    bool(opts and opts.include_usage),
                    bool(opts and opts.continuous_usage_stats),
                    # parsed output is not resumable (docs/api.md, "Reasoning"): no ids for the router
                    router_ids=list(ids) if ctx.router_ids and not outputs else None,
                    outputs=outputs,
                ),
                handles,
            )
        results = await self._collect(request, handles)
        if results is None:
            return Response(status_code=499)
        finals = [r[-1] for r in results]
        choices = []
        for i, deltas in enumerate(results):
            last = deltas[-1]
            lp = None
            if body.logprobs:
                lp = ChatLogprobs.model_validate(
                    {"content": [c for d in deltas for c in (chat_logprobs(engine, d) or {}).get("content", [])]}
                )
            text = "".join(d.text for d in deltas)
            message, finish = ChatResponseMessage(content=text), last.finish_reason
            if outputs:
                outputs[i].feed(text, final=True)
                message = ChatResponseMessage.model_validate(outputs[i].message_fields())
                finish = outputs[i].finish_reason(finish)
            choices.append(
                ChatCompletionChoice(
                    index=i,
                    message=message,
                    logprobs=lp,
                    finish_reason=finish,
                    matched_stop=last.matched_stop,
                )
            )
        usage = usage_info(
            len(ids),
            sum(d.completion_tokens for d in finals),
            max(d.cached_tokens for d in finals),
            [d.spec_accept_length for d in finals],
        )
        return JSONResponse(ChatCompletionResponse(id=cid, model=model, choices=choices, usage=usage).model_dump())

    async def _chat_stream(
        self,
        cid: str,
        model: str,
        handles: list[RequestHandle],
        n_prompt: int,
        include_usage: bool,
        continuous_usage: bool,
        router_ids: Optional[list[int]] = None,
        outputs: Optional[list[ChoiceOutput]] = None,
    ) -> AsyncIterator[bytes]:
        """``router_ids`` (the prompt ids; the router asked with ``ROUTER_IDS_HEADER``): every chunk
        also carries ``kvship_token_ids``, the output ids since the previous chunk, and the first
        ``kvship_prompt_ids``, so that the router can resume the stream elsewhere.  ``outputs``
        (one per choice): the text goes through the tool-call / reasoning parsers."""
        engine = self.engine
        created = int(time.time())
        completion = [0] * len(handles)
        accept: list[Optional[float]] = [None] * len(handles)  # speculative acceptance so far, per choice
        cached = 0
        unsent: list[list[int]] = [[] for _ in handles]  # output ids not yet reported to the router

        def chunk(choices: list[dict], usage: Optional[dict] = None) -> bytes:
            payload: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
            }
            if usage is not None or continuous_usage:
                payload["usage"] = usage or usage_dict(n_prompt, sum(completion), cached, accept)
            if router_ids is not None and choices:
                i = choices[0]["index"]
                payload["kvship_token_ids"], unsent[i] = unsent[i], []
                if "role" in choices[0]["delta"]:
                    payload["kvship_prompt_ids"] = router_ids
            return sse(payload)

        stream = merge_streams(engine, handles)
        try:
            for i in range(len(handles)):
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            dead = None
            async for i, d in stream:
                completion[i] = d.completion_tokens
                accept[i] = d.spec_accept_length if d.spec_accept_length is not None else accept[i]
                cached = max(cached, d.cached_tokens)
                unsent[i].extend(d.token_ids)
                lp = chat_logprobs(engine, d) if d.logprobs is not None else None
                if outputs:
                    delta = outputs[i].feed(d.text)
                    if d.finished:
                        delta = _merge_deltas(delta, outputs[i].feed("", final=True))
                    finish = outputs[i].finish_reason(d.finish_reason)
                else:
                    delta, finish = ({"content": d.text} if d.text else {}), d.finish_reason
                if not delta and not d.finished and not (lp and lp["content"]):
                    continue
                choice: dict[str, Any] = {
                    "index": i,
                    "delta": delta,
                    "logprobs": lp,
                    "finish_reason": finish,
                }
                if d.finished:
                    choice["matched_stop"] = d.matched_stop
                    dead = dead or _dead_error(engine, [d])
                yield chunk([choice])
            if include_usage:
                yield chunk([], usage_dict(n_prompt, sum(completion), cached, accept))
            if dead is not None:
                yield sse(dead.body())
            yield sse("[DONE]")
        finally:
            await stream.aclose()

    # ----------------------------------------------------------- completions
    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        engine = self.engine
        check_model(engine, body.model)
        check_n(body.n)
        ctx = RequestContext.of(engine, request, body)
        if body.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if body.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if body.best_of is not None and body.best_of != body.n:
            raise bad_request("best_of must equal n (ranking candidates is not supported)", "best_of")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
        if body.echo and body.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
        check_max_tokens(body.max_tokens, "max_tokens")
        stops = normalize_stop(body.stop)
        schema = response_format_schema(body.response_format)
        prompts = await self._tokenize_prompts(body.prompt)
        if len(prompts) * body.n > MAX_N:
            raise bad_request(f"prompts x n must be at most {MAX_N}", "n")
        if body.kvship_resume is not None:
            if not (isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], int)):
                raise bad_request("kvship_resume needs a token-id prompt", "kvship_resume")
            ctx.resumed = check_resume(body.kvship_resume, [ids for _, ids in prompts], body.n)
        cid = body.rid or new_id("cmpl")
        total = len(prompts) * body.n
        for p, (_, ids) in enumerate(prompts):
            explicit = body.max_tokens if "max_tokens" in body.model_fields_set else None
            max_new = check_prompt_length(engine, len(ids), explicit, "prompt")
            if explicit is None and body.max_tokens is not None:  # the default (16) shrinks to fit the context
                max_new = min(max_new, body.max_tokens)
            sp = _sampling_params(engine, body, max_new, stops, schema)
            if p == 0:
                await check_grammar(engine, sp, "response_format")
            ctx.add(
                0,
                cid,
                ids,
                sp,
                body.n,
                return_logprob=body.logprobs is not None,
                top_logprobs_num=body.logprobs or 0,
                total=total,
            )
        handles = ctx.open()
        model = body.model or engine.served_model_name
        echoes = [text if body.echo else "" for text, _ in prompts for _ in range(body.n)]
        prompt_lens = [len(ids) for _, ids in prompts]
        if body.stream:
            opts = body.stream_options
            return stream_response(
                self._completion_stream(
                    cid,
                    model,
                    handles,
                    echoes,
                    prompt_lens,
                    body.n,
                    bool(opts and opts.include_usage),
                    bool(opts and opts.continuous_usage_stats),
                    router_ids=[ids for _, ids in prompts for _ in range(body.n)] if ctx.router_ids else None,
                ),
                handles,
            )
        results = await self._collect(request, handles)
        if results is None:
            return Response(status_code=499)
        finals = [r[-1] for r in results]
        choices = []
        for k, deltas in enumerate(results):
            last = deltas[-1]
            lp = completion_logprobs(engine, deltas, len(echoes[k])) if body.logprobs is not None else None
            choices.append(
                CompletionChoice(
                    index=k,
                    text=echoes[k] + "".join(d.text for d in deltas),
                    logprobs=CompletionLogprobs.model_validate(lp) if lp is not None else None,
                    finish_reason=last.finish_reason,
                    matched_stop=last.matched_stop,
                )
            )
        cached = [max(finals[p * body.n + j].cached_tokens for j in range(body.n)) for p in range(len(prompts))]
        usage = usage_info(
            sum(prompt_lens),
            sum(d.completion_tokens for d in finals),
            sum(cached),
            [d.spec_accept_length for d in finals],
        )
        return JSONResponse(CompletionResponse(id=cid, model=model, choices=choices, usage=usage).model_dump())

    async def _tokenize_prompts(self, prompt: Any) -> list[tuple[str, list[int]]]:
        """(text, ids) per prompt; token-id prompts are checked against the vocabulary."""
        engine = self.engine
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("the prompt is empty", "prompt", code="empty_prompt")
        if all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        out = []
        for i, p in enumerate(prompt):
            param = "prompt" if len(prompt) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                if p == "":
                    raise bad_request("the prompt is empty", param, code="empty_prompt")
                ids = await encode_text(engine, p, param)
                out.append((p, ids))
            else:
                if not p:
                    raise bad_request("the prompt is empty", param, code="empty_prompt")
                check_token_ids(engine, p, param)
                out.append((engine.tokenizer.decode(p, skip_special_tokens=False), list(p)))
        return out

    async def _completion_stream(
        self,
        cid: str,
        model: str,
        handles: list[RequestHandle],
        echoes: list[str],
        prompt_lens: list[int],
        n: int,
        include_usage: bool,
        continuous_usage: bool,
        router_ids: Optional[list[list[int]]] = None,
    ) -> AsyncIterator[bytes]:
        """``router_ids`` (each choice's prompt ids): as in ``_chat_stream``."""
        engine = self.engine
        created = int(time.time())
        completion = [0] * len(handles)
        accept: list[Optional[float]] = [None] * len(handles)  # speculative acceptance so far, per choice
        cached = [0] * len(handles)
        offsets = [len(e) for e in echoes]
        unsent: list[list[int]] = [[] for _ in handles]
        prompt_sent = [False] * len(handles)

        def usage() -> dict:
            per_prompt = [max(cached[p * n : (p + 1) * n]) for p in range(len(prompt_lens))]
            return usage_dict(sum(prompt_lens), sum(completion), sum(per_prompt), accept)

        def chunk(choices: list[dict], usage_payload: Optional[dict] = None) -> bytes:
            payload: dict[str, Any] = {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
            }
            if usage_payload is not None or continuous_usage:
                payload["usage"] = usage_payload or usage()
            if router_ids is not None and choices:
                k = choices[0]["index"]
                payload["kvship_token_ids"], unsent[k] = unsent[k], []
                if not prompt_sent[k]:
                    payload["kvship_prompt_ids"], prompt_sent[k] = router_ids[k], True
            return sse(payload)

        stream = merge_streams(engine, handles)
        try:
            for k, e in enumerate(echoes):
                if e:
                    yield chunk([{"index": k, "text": e, "logprobs": None, "finish_reason": None}])
            dead = None
            async for k, d in stream:
                completion[k] = d.completion_tokens
                accept[k] = d.spec_accept_length if d.spec_accept_length is not None else accept[k]
                cached[k] = d.cached_tokens
                unsent[k].extend(d.token_ids)
                lp = completion_logprobs(engine, [d], offsets[k]) if d.logprobs is not None else None
                offsets[k] += len(d.text)
                if not d.text and not d.finished and not (lp and lp["tokens"]):
                    continue
                choice: dict[str, Any] = {"index": k, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
                if d.finished:
                    choice["matched_stop"] = d.matched_stop
                    dead = dead or _dead_error(engine, [d])
                yield chunk([choice])
            if include_usage:
                yield chunk([], usage())
            if dead is not None:
                yield sse(dead.body())
            yield sse("[DONE]")
        finally:
            await stream.aclose()
