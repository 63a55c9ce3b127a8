"""Resuming a stream whose worker died: what the router keeps per stream, and the continuation.

The rule (docs/router.md, "Resuming broken streams"): for a resumable request
(``ResumeState.for_request``: a single streamed chat / completion / generate
request with nothing the continuation could not reproduce, such as logprobs,
tools or a grammar) the router asks the worker for token ids
(``ROUTER_IDS_HEADER``) and keeps

* the prompt's token ids (the worker reports them in its first event),
* the output ids whose text the client already has (*aligned* ids: ids are
  reported with the chunk that carries their text; ids whose text the worker
  still held back, e.g. half of a UTF-8 character, are reported later).

When the stream breaks before its finish (connection reset, end of stream
without a finish, or an error event that says the worker or its PD pair
failed), the router sends a *continuation* to another worker: prompt ids +
aligned ids as the input (``/v1/completions`` with a token-id prompt for the
OpenAI routes, ``/generate`` with ``input_ids`` for the native one), the same
sampling parameters and stop conditions, the token budget reduced by the
aligned ids; and it rewrites the continuation's events into the original
stream's shape (id, object, created, model; cumulative text / ids for
``/generate``; usage counting the whole answer).  Everything here is pure
bookkeeping on parsed events: no I/O.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from kvship.common import fastjson
from kvship.common.protocol import RESUME_FIELD
from kvship.router.wire import ROUTE_CHAT, ROUTE_COMPLETIONS, ROUTE_GENERATE, ROUTER_IDS_HEADER, RoutingRequest

__all__ = ["ROUTER_IDS_HEADER", "RESUMABLE_ERROR_CODES", "ResumeState", "SSEParser"]

# Error codes of worker error events that mean "this worker (or its PD peer) failed", not "your request is bad".
RESUMABLE_ERROR_CODES = frozenset({"engine_dead", "pd_request_failed", "worker_failed"})

_SAMPLING_KEYS = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "user",
)
_COMMON_KEYS = frozenset(_SAMPLING_KEYS) | {"stream", "stream_options", "n", "rid", "session_id", "max_tokens"}
# Keys a resumable request may carry (anything else, e.g. a grammar, makes it non-resumable).
_CHAT_KEYS = _COMMON_KEYS | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "add_generation_prompt",
    "chat_template_kwargs",
    "response_format",
    "tool_choice",
    "parallel_tool_calls",
}
_COMPLETION_KEYS = _COMMON_KEYS | {"prompt", "echo", "logprobs", "best_of"}
_GENERATE_KEYS = frozenset({"text", "input_ids", "sampling_params", "stream", "return_logprob", "rid", "session_id"})
_GENERATE_SAMPLING_KEYS = frozenset(_SAMPLING_KEYS) | {"max_new_tokens", "no_stop_trim", "n"}
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # /generate's default max_new_tokens (worker GenerateSamplingParams)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # /v1/completions' default max_tokens (OpenAI)


class SSEParser:
    """Splits a byte stream into whole server-sent events (``data: ...``), however the bytes were cut."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The events completed by ``data`` (each without its blank-line terminator)."""
        self._buf = (self._buf + data).replace(b"\r\n", b"\n")
        *events, self._buf = self._buf.split(b"\n\n")
        return [e for e in events if e.strip()]


def _data(event: bytes) -> Optional[str]:
    """The ``data:`` payload of one event (lines joined), or None for comments / other fields."""
    lines = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines).decode("utf-8", "replace") if lines else None


def _sse(payload: Any) -> bytes:
    if isinstance(payload, str):
        return f"data: {payload}\n\n".encode()
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _aborts(route: str, obj: dict) -> bool:
    """Whether an event finishes its request with ``abort`` (OpenAI ``finish_reason``, SGLang ``type``)."""
    if route == ROUTE_GENERATE:
        fr = obj.get("meta_info", {}).get("finish_reason") if isinstance(obj.get("meta_info"), dict) else None
        return isinstance(fr, dict) and fr.get("type") == "abort"
    return any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in obj.get("choices") or [])


class ResumeState:
    """One resumable stream: the original request, the ids relayed so far, and the rewriting of events.

    Call ``process(event)`` for every event of the current upstream; it returns
    the bytes for the client and an outcome: ``None`` (go on), ``"done"`` (the
    stream finished) or ``"failed"`` (an error event of a failed worker: resume).
    After a break, ``continuation()`` gives the request for the next worker and
    ``begin_continuation()`` switches the rewriting to it.
    """

    def __init__(self, request: RoutingRequest):
        self.route = request.route
        self.body = request.body
        self.prompt_ids: Optional[list[int]] = None
        self.out_ids: list[int] = []  # aligned output ids: their text reached the client
        self.resumes = 0
        self.finished = False
        self.failed_code: Optional[str] = None  # the code of the error event that failed the last stream
        self._held: list[bytes] = []  # an abort finish (and what follows it) waiting for the next event
        self.text_relayed = False  # some output text reached the client
        self.relayed_chars = 0  # characters of output text the client has
        self.phase_original = True  # events come from the original request (not a continuation)
        self._base = 0  # len(out_ids) when the current continuation started
        # what the client's stream looks like (taken from the first event relayed)
        self._id: Optional[str] = None
        self._created: Optional[int] = None
        self._model: Optional[str] = None
        # /generate: cumulative text / ids the client has, at the last aligned event
        self._text = ""
        self._base_text = ""
        self._last_text = ""

    # -- which requests ---------------------------------------------------
    @classmethod
    def for_request(cls, request: RoutingRequest) -> Optional["ResumeState"]:
        """A state for ``request`` when it can be resumed exactly enough, else None."""
        body = request.body
        if not request.stream or request.batch_size != 1:
            return None
        if request.route == ROUTE_CHAT:
            fmt = body.get("response_format")
            ok = (
                set(body) <= _CHAT_KEYS
                and not body.get("logprobs")
                and (fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"))
                and body.get("tool_choice") in (None, "none")
            )
        elif request.route == ROUTE_COMPLETIONS:
            ok = (
                set(body) <= _COMPLETION_KEYS
                and body.get("logprobs") is None
                and not body.get("echo")
                and body.get("best_of") in (None, 1)
            )
        elif request.route == ROUTE_GENERATE:
            sp = body.get("sampling_params")
            ok = (
                set(body) <= _GENERATE_KEYS
                and body.get("return_logprob") in (None, False)
                and (sp is None or (isinstance(sp, dict) and set(sp) <= _GENERATE_SAMPLING_KEYS))
                and (sp or {}).get("n", 1) == 1
            )
        else:
            ok = False
        if not ok or body.get("n", 1) != 1:
            return None
        return cls(request)

    # -- events -------------------------------------------------------------
    def process(self, event: bytes) -> tuple[bytes, Optional[str]]:
        """(bytes for the client, outcome) for one event of the current upstream.

        An event that finishes the request with ``abort`` is held back, with the
        events after it (a usage chunk): when the worker's error event follows
        (its PD pair or its model loop failed), the stream is resumed and none of
        them reaches the client; at ``[DONE]`` or another error they are relayed.
        """
        payload = _data(event)
        obj: Any = None
        if payload is not None and payload.strip() != "[DONE]":
            try:
                obj = fastjson.loads(payload)
            except ValueError:
                obj = None
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("code") in RESUMABLE_ERROR_CODES and not self.finished:
            self.failed_code = err.get("code")
            self._held = []
            return b"", "failed"  # (held events are dropped)
        if isinstance(obj, dict) and err is None and (self._held or _aborts(self.route, obj)):
            self._held.append(event)
            return b"", None
        held, self._held = self._held, []
        out = b"".join(self._relay(h, fastjson.loads(_data(h) or "{}")) for h in held)
        if payload is None:
            return out + event + b"\n\n", None
        if payload.strip() == "[DONE]":
            return out + b"data: [DONE]\n\n", "done"
        if not isinstance(obj, dict):
            return out + event + b"\n\n", None
        if isinstance(err, dict):
            return out + _sse(obj), None
        return out + self._relay(event, obj), None

    def _relay(self, event: bytes, obj: dict) -> bytes:
        if self.route == ROUTE_GENERATE:
            return self._generate_event(obj)
        return self._openai_event(obj, event)

    def _openai_event(self, obj: dict, event: bytes) -> bytes:
        prompt = obj.pop("kvship_prompt_ids", None)
        ids = obj.pop("kvship_token_ids", None)
        if self.prompt_ids is None and _is_token_list(prompt):
            self.prompt_ids = list(prompt)
        if _is_token_list(ids):
            self.out_ids.extend(ids)
        choices = obj.get("choices") or []
        for c in choices:
            text = (c.get("text") or (c.get("delta") or {}).get("content")) if isinstance(c, dict) else None
            if isinstance(text, str) and text:
                self.text_relayed = True
                self.relayed_chars += len(text)
            delta = c.get("delta") if isinstance(c, dict) else None
            if isinstance(delta, dict) and (delta.get("reasoning_content") or delta.get("tool_calls")):
                # parsed output (a worker's --reasoning-parser / tool calls) has no token ids to resume
                # from: once some reached the client the stream cannot start over (docs/api.md, "Reasoning")
                self.text_relayed = True
        if self.phase_original:
            if self._id is None:
                self._id, self._created, self._model = obj.get("id"), obj.get("created"), obj.get("model")
            if any(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices):
                self.finished = True
            return _sse(obj) if prompt is not None or ids is not None else event + b"\n\n"
        # a /v1/completions continuation, rewritten into the client's stream
        out: dict[str, Any] = {
            "id": self._id or obj.get("id"),
            "object": "chat.completion.chunk" if self.route == ROUTE_CHAT else "text_completion",
            "created": self._created if self._created is not None else obj.get("created"),
            "model": self._model or obj.get("model"),
            "choices": [],
        }
        for c in choices:
            if not isinstance(c, dict):
                continue
            fr = c.get("finish_reason")
            text = c.get("text") or ""
            if self.route == ROUTE_CHAT:
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": {"content": text} if text else {},
                    "logprobs": None,
                    "finish_reason": fr,
                }
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fr}
            if fr is not None:
                self.finished = True
                choice["matched_stop"] = c.get("matched_stop")
                out["kvship_resumes"] = self.resumes
            out["choices"].append(choice)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            out["usage"] = self._usage(usage)
        return _sse(out)

    def _usage(self, usage: dict) -> dict:
        """A continuation's usage as the whole answer's: the original prompt, every completion token."""
        prompt = len(self.prompt_ids or []) or int(usage.get("prompt_tokens") or 0)
        completion = self._base + int(usage.get("completion_tokens") or 0)
        out = dict(usage, prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and "cached_tokens" in details:
            out["prompt_tokens_details"] = dict(details, cached_tokens=min(int(details["cached_tokens"] or 0), prompt))
        out["kvship_resumes"] = self.resumes
        return out

    def _generate_event(self, obj: dict) -> bytes:
        meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else {}
        prompt = meta.pop("kvship_prompt_ids", None)
        if self.prompt_ids is None and _is_token_list(prompt):
            self.prompt_ids = list(prompt)
        if not self.phase_original:
            obj["text"] = self._base_text + str(obj.get("text") or "")
            obj["output_ids"] = self.out_ids[: self._base] + list(obj.get("output_ids") or [])
            if self._id is not None:
                meta["id"] = self._id
            if self.prompt_ids is not None:
                meta["prompt_tokens"] = len(self.prompt_ids)
            meta["completion_tokens"] = self._base + int(meta.get("completion_tokens") or 0)
            fr = meta.get("finish_reason")
            if isinstance(fr, dict) and fr.get("type") == "length" and isinstance(fr.get("length"), int):
                fr["length"] += self._base
            meta["kvship_resumes"] = self.resumes
        elif self._id is None:
            self._id = meta.get("id")
        text, ids = obj.get("text"), obj.get("output_ids")
        self.text_relayed = self.text_relayed or bool(text)
        if isinstance(text, str):
            self.relayed_chars = len(text)  # /generate's text is cumulative
        if isinstance(text, str) and _is_token_list(ids) and text != self._last_text:
            self.out_ids, self._text = list(ids), text  # the text grew: every id so far is aligned
        self._last_text = text if isinstance(text, str) else self._last_text
        if meta.get("finish_reason") is not None:
            self.finished = True
        return _sse(obj)

    # -- continuation -------------------------------------------------------
    def can_resume(self) -> bool:
        """Whether a continuation can follow exactly: the worker reported the prompt ids (so the
        output ids too), or no output text reached the client yet (the request starts over)."""
        return self.prompt_ids is not None or not self.text_relayed

    def remaining_tokens(self) -> Optional[int]:
        """Output tokens the continuation may still produce (None: as many as fit the context)."""
        b = self.body
        if self.route == ROUTE_GENERATE:
            sp = b.get("sampling_params") or {}
            limit = sp.get("max_new_tokens", GENERATE_DEFAULT_MAX_NEW_TOKENS)
        elif self.route == ROUTE_CHAT:
            limit = b.get("max_completion_tokens", b.get("max_tokens"))
        else:
            limit = b.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        return None if limit is None else int(limit) - len(self.out_ids)

    def continuation(self) -> tuple[str, dict]:
        """(worker route, body) that continues this stream on another worker.

        Before the prompt ids are known nothing of the answer reached the client,
        so the original request is sent again.
        """
        if self.prompt_ids is None:
            return self.route, dict(self.body)
        ids = self.prompt_ids + self.out_ids
        remaining = self.remaining_tokens()
        # the worker counts the earlier output as output (stop strings across the join, penalties,
        # per-step seeds) and re-emits the part of its text the client has not seen
        resume = {"output_tokens": len(self.out_ids), "relayed_chars": self.relayed_chars} if self.out_ids else None
        if self.route == ROUTE_GENERATE:
            sp = dict(self.body.get("sampling_params") or {})
            if remaining is not None:
                sp["max_new_tokens"] = remaining
            body = {k: v for k, v in self.body.items() if k in ("stream", "session_id")}
            body.update(input_ids=ids, sampling_params=sp, stream=True)
            if resume is not None:
                body[RESUME_FIELD] = resume
            return ROUTE_GENERATE, body
        body = {k: self.body[k] for k in _SAMPLING_KEYS if k in self.body}
        body.update(prompt=ids, stream=True, max_tokens=remaining)
        if resume is not None:
            body[RESUME_FIELD] = resume
        if "stream_options" in self.body:
            body["stream_options"] = self.body["stream_options"]
        return ROUTE_COMPLETIONS, body

    def begin_continuation(self) -> None:
        """The next events come from the continuation just opened."""
        if self.prompt_ids is None:
            return  # the original request again: its events need no rewriting
        self.phase_original = False
        self._base = len(self.out_ids)
        self._base_text = self._text
        self._last_text = self._text

    def finish_events(self) -> bytes:
        """The end of a stream whose token budget ran out exactly at the break (no continuation needed)."""
        self.finished = True
        if self.route == ROUTE_GENERATE:
            meta = {
                "id": self._id,
                "prompt_tokens": len(self.prompt_ids or []),
                "completion_tokens": len(self.out_ids),
                "finish_reason": {"type": "length", "length": len(self.out_ids)},
                "kvship_resumes": self.resumes,
            }
            return _sse({"text": self._text, "output_ids": self.out_ids, "meta_info": meta}) + _sse("[DONE]")
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        choice.update({"delta": {}} if self.route == ROUTE_CHAT else {"text": ""})
        out = {
            "id": self._id,
            "object": "chat.completion.chunk" if self.route == ROUTE_CHAT else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [choice],
            "kvship_resumes": self.resumes,
        }
        events = _sse(out)
        opts = self.body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            prompt, completion = len(self.prompt_ids or []), len(self.out_ids)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "kvship_resumes": self.resumes,
            }
            events += _sse(dict(out, choices=[], usage=usage))
        return events + _sse("[DONE]")
