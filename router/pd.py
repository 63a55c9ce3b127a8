"""PD (prefill/decode) dispatch: one attempt on a (prefill, decode) pair.

Protocol (docs/architecture.md, "PD protocol"): the router draws a random 63-bit
``bootstrap_room`` and sends the *same* body, carrying the prefill worker's
``bootstrap_host`` (its URL's host) / ``bootstrap_port`` (its
``/get_server_info`` ``disaggregation_bootstrap_port``) / ``bootstrap_room``,
to both workers at once.  The decode worker's reply is what the client gets
(streamed chunk by chunk); the prefill worker's reply is read to the end and
only checked for errors.

Failure handling before the client saw a byte: if the prefill call fails
first (transport error or error status), the decode call is cancelled (its
connection closed, so the decode worker aborts the room) and the attempt fails
blaming the prefill worker; if the decode call fails, the prefill call is
cancelled and the decode worker is blamed.  5xx / transport errors are
retried on another pair by ``proxy_request``; 4xx replies go to the client.
After the decode stream has started, the prefill call finishes in the
background and only its outcome is recorded.

The first token from prefill (docs/pd.md): for a streamed ``/generate``,
``/v1/completions`` or ``/v1/chat/completions`` request the router can resume (``ResumeState``: the
token-ids header is on),
without stop strings and not itself a resume's continuation, the prefill call
is a stream too, asked (``PD_FIRST_TOKEN_HEADER``) for the first token as
soon as it is sampled.  If that event comes before decode's first chunk, the
attempt returns at once: the client's stream is that event, then decode's
stream without what repeats the first token, in the first event's id
(``_DecodeAfterFirstToken``).  From then on a failure of the
pair (prefill's transfer, decode's open or stream) is a broken stream that
``ResumingRelay`` continues elsewhere; before it, retries work as above.
While the router waits for that event after decode's chat role chunk, it
reads decode's stream too: more from decode ends the wait (decode's stream
goes to the client), its end fails the attempt on decode (prefill would wait
for the room's registration until its bootstrap timeout).

On a router started with ``--debug-headers``, a body with ``"return_trace": true``
also gets the ``x-kvship-trace`` response header: the router's own stamps and the
prefill worker's ``meta_info.trace``, wall clock (docs/pd.md, "Reading a request's
trace").  The router then waits for the prefill reply before it answers (the
trace is a debugging aid; its ``router.prefill_reply`` stamp shows that wait).
Without the flag no ``x-kvship-*`` header reaches the client (``proxy._debug_headers``)
and the router does not wait.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Optional

import aiohttp

from kvship.common import fastjson
from kvship.common.protocol import RESUME_FIELD, RETURN_TRACE_FIELD
from kvship.router.core import Selection
from kvship.router.resume import SSEParser
from kvship.router.upstream import (
    RETRYABLE_STATUS,
    AttemptFailed,
    DeadlineExceeded,
    Lease,
    RequestContext,
    Upstream,
    describe_error,
    is_pair_error,
    open_upstream,
    pair_failure,
    pass_headers,
)
from kvship.router.wire import (
    PD_FIRST_TOKEN_HEADER,
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_GENERATE,
    ROUTER_IDS_HEADER,
    PDBootstrap,
    RoutingRequest,
)
from kvship.router.worker import Worker

logger = logging.getLogger(__name__)


async def _prefill_call(
    ctx: RequestContext, worker: Worker, lease: Lease, content: bytes, path: str, headers: dict[str, str]
) -> bytes:
    """Send to the prefill worker, read its reply to the end and return it; raise ``AttemptFailed`` on error.

    Finishes ``lease`` on every path.
    """
    client = ctx.router.client
    assert client is not None
    try:
        async with asyncio.timeout_at(ctx.deadline):
            async with client.post(worker.url + path, data=content, headers=headers) as resp:
                body = await resp.read()
    except aiohttp.ClientError as e:
        lease.finish(False, describe_error(e))
        raise AttemptFailed(worker, describe_error(e), True) from None
    except TimeoutError:
        lease.finish(False, "timeout")
        raise DeadlineExceeded() from None
    except BaseException:
        lease.finish(True)
        raise
    if resp.status >= 400:
        retryable = resp.status in RETRYABLE_STATUS
        lease.finish(not retryable, f"http_{resp.status}", blame=not pair_failure(body))
        raise AttemptFailed(worker, f"prefill http_{resp.status}", retryable, resp.status, body, pass_headers(resp))
    lease.finish(True)
    return body


def _event_obj(event: bytes) -> Any:
    """The JSON object of one SSE event's ``data:`` payload, or None."""
    lines = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return None
    try:
        return fastjson.loads(b"\n".join(lines))
    except ValueError:
        return None


def _one_choice(obj: Any) -> Optional[dict]:
    """The single choice of an OpenAI stream event (not an error), or None."""
    if not isinstance(obj, dict) or "error" in obj:
        return None
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    return choices[0]


def _choice_text(choice: dict) -> Any:
    """A completion choice's ``text`` or a chat choice's ``delta.content``."""
    delta = choice.get("delta")
    return delta.get("content") if isinstance(delta, dict) else choice.get("text")


def _is_role_chunk(obj: Any) -> bool:
    """Whether an event is a chat stream's role chunk (the role, no content yet, not finished)."""
    c = _one_choice(obj)
    delta = c.get("delta") if c is not None else None
    return isinstance(delta, dict) and "role" in delta and not delta.get("content") and c.get("finish_reason") is None


def _is_first_token(obj: Any) -> bool:
    """Whether a /generate, /v1/completions or chat event is an unfinished one with output (prefill's first
    token)."""
    if isinstance(obj, dict) and "error" not in obj and isinstance(obj.get("meta_info"), dict):  # /generate
        return bool(obj.get("output_ids")) and obj["meta_info"].get("finish_reason") is None
    c = _one_choice(obj)
    return (
        c is not None and bool(obj.get("kvship_token_ids")) and bool(_choice_text(c)) and c.get("finish_reason") is None
    )


async def _prefill_stream(
    ctx: RequestContext,
    worker: Worker,
    lease: Lease,
    content: bytes,
    path: str,
    first: asyncio.Future,
    headers: dict[str, str],
) -> bytes:
    """Stream from the prefill worker, asked for the first token: resolve ``first`` with (that event's bytes,
    a chat stream's role chunk before it, the response headers), or None when the first event is something
    else; then read to the end.  Raise
    ``AttemptFailed`` on an error status, a transport error or an error event.  Finishes ``lease``."""
    client = ctx.router.client
    assert client is not None
    headers = {**headers, PD_FIRST_TOKEN_HEADER: "1"}
    failure: Optional[AttemptFailed] = None
    blame = True  # False when the failure is its pair's (``pair_failure``)
    try:
        async with asyncio.timeout_at(ctx.deadline):
            async with client.post(worker.url + path, data=content, headers=headers) as resp:
                if resp.status != 200:
                    body = await resp.read()
                    retryable = resp.status in RETRYABLE_STATUS
                    failure = AttemptFailed(
                        worker, f"prefill http_{resp.status}", retryable, resp.status, body, pass_headers(resp)
                    )
                    blame = not pair_failure(body)
                else:
                    parser = SSEParser()
                    before = b""  # a chat stream's role chunk, which goes out with the first token
                    async for data in resp.content.iter_any():
                        for event in parser.feed(data):
                            obj = _event_obj(event)
                            if not first.done():
                                if path == ROUTE_CHAT and not before and _is_role_chunk(obj):
                                    before = event + b"\n\n"
                                else:
                                    first.set_result(
                                        (before + event + b"\n\n", pass_headers(resp)) if _is_first_token(obj) else None
                                    )
                            err = obj.get("error") if isinstance(obj, dict) else None
                            if isinstance(err, dict) and failure is None:
                                failure = AttemptFailed(worker, f"prefill error: {err.get('message', err)}", True)
                                blame = not is_pair_error(err)
    except aiohttp.ClientError as e:
        failure = AttemptFailed(worker, describe_error(e), True)
    except TimeoutError:
        lease.finish(False, "timeout")
        raise DeadlineExceeded() from None
    except BaseException:
        lease.finish(True)
        raise
    finally:
        if not first.done():
            first.set_result(None)
    if failure is not None:
        lease.finish(not failure.retryable, failure.reason, blame=blame)
        raise failure
    lease.finish(True)
    return b""


class _DecodeAfterFirstToken:
    """What the client gets after prefill's first-token event ``first``: decode's stream without what repeats
    that token, in ``first``'s id.

    * ``/generate`` (cumulative text): decode's unfinished events with ``completion_tokens`` <= 1 are
      dropped; the others get ``meta_info.id`` of ``first``.
    * ``/v1/completions`` (text deltas, token ids per event under the router's ids header): the first
      ``len(first's ids)`` ids and ``len(first's text)`` characters of decode's stream are cut (the same
      detokenizer made both, so decode's text starts with ``first``'s); an event left with nothing and
      no finish is dropped; ``id`` / ``created`` / ``model`` become ``first``'s.
    * ``/v1/chat/completions``: the same cut on ``delta.content``; decode's role chunk is dropped (prefill's
      went out before ``first``).

    Quacks like the ``aiohttp.ClientResponse`` the relays read (``content.readany`` / ``at_eof``,
    ``release``, ``close``).  Decode's attempt (``open_upstream``) is awaited on the first read; its
    failure reads as a broken stream (``aiohttp.ClientPayloadError``), which ``ResumingRelay`` resumes,
    and its deadline as a read timeout.
    """

    def __init__(self, d_task: asyncio.Task, first: dict):
        self.content = self
        self._task = d_task
        self._first = first
        self._up: Optional[Upstream] = None
        self._parser = SSEParser()
        if isinstance(first.get("meta_info"), dict):
            self._generate = True
        else:
            self._generate = False
            self._skip_ids = len(first.get("kvship_token_ids") or [])
            self._skip_chars = len(_choice_text(first["choices"][0]) or "")

    async def readany(self) -> bytes:
        while True:
            if self._up is None:
                try:
                    self._up = await asyncio.shield(self._task)
                except AttemptFailed as e:
                    raise aiohttp.ClientPayloadError(f"decode failed: {e.reason}") from None
                except DeadlineExceeded:
                    raise TimeoutError() from None  # what a read past the deadline raises
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if self._task.cancelled() and not (task is not None and task.cancelling()):
                        return b""  # close() gave up on decode's attempt (the client left): the stream ends
                    raise
                data = self._up.first
            elif self._up.response is None:  # decode answered with a whole body (a 4xx): nothing to stream
                return b""
            else:
                data = await self._up.response.content.readany()
            if not data:
                return b""
            out = b"".join(self._keep(event) for event in self._parser.feed(data))
            if out:
                return out

    def _keep(self, event: bytes) -> bytes:
        obj = _event_obj(event)
        if not isinstance(obj, dict) or "error" in obj:
            return event + b"\n\n"
        if self._generate:
            meta = obj.get("meta_info")
            if not isinstance(meta, dict):
                return event + b"\n\n"
            if meta.get("finish_reason") is None and int(meta.get("completion_tokens") or 0) <= 1:
                return b""  # the first token again
            meta["id"] = self._first["meta_info"].get("id")
        else:
            if _is_role_chunk(obj):
                return b""  # prefill's role chunk went out with the first token
            choices = obj.get("choices") or []
            ids = obj.get("kvship_token_ids")
            if isinstance(ids, list) and self._skip_ids:
                cut = min(len(ids), self._skip_ids)
                obj["kvship_token_ids"], self._skip_ids = ids[cut:], self._skip_ids - cut
            for c in choices:
                text = _choice_text(c) if isinstance(c, dict) else None
                if isinstance(text, str) and self._skip_chars:
                    cut = min(len(text), self._skip_chars)
                    rest, self._skip_chars = text[cut:], self._skip_chars - cut
                    if isinstance(c.get("delta"), dict):
                        c["delta"]["content"] = rest
                    else:
                        c["text"] = rest
            if (
                choices
                and all(isinstance(c, dict) and not _choice_text(c) and c.get("finish_reason") is None for c in choices)
                and not obj.get("kvship_token_ids")
                and "usage" not in obj
            ):
                return b""  # the first token again
            obj.update({k: self._first.get(k) for k in ("id", "created", "model")})
        return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    def at_eof(self) -> bool:
        return self._up is not None and self._up.response is not None and self._up.response.content.at_eof()

    def release(self) -> None:
        if self._up is not None and self._up.response is not None:
            self._up.response.release()

    def close(self) -> None:
        if self._up is not None and self._up.response is not None:
            self._up.response.close()
        elif not self._task.done():
            self._task.cancel()  # open_upstream closes the connection and finishes its lease


def first_token_from_prefill(ctx: RequestContext, request: RoutingRequest, path: str) -> bool:
    """Whether this attempt asks the prefill worker for the first token (see the module docstring)."""
    body = request.body
    sp = body.get("sampling_params")
    return (
        ctx.router.config.pd_first_token
        and path in (ROUTE_GENERATE, ROUTE_COMPLETIONS, ROUTE_CHAT)
        and request.stream
        and not body.get("stop")
        and ctx.headers.get(ROUTER_IDS_HEADER) == "1"
        and RESUME_FIELD not in body
        and not body.get(RETURN_TRACE_FIELD)
        and not (isinstance(sp, dict) and sp.get("stop"))
    )


def _decode_sent_only_its_role(d_task: asyncio.Task) -> bool:
    """Whether decode's stream opened with nothing but a chat role chunk: it answers that at once, before the
    KV arrives, so the first token from prefill is still awaited (and decode's role chunk is dropped)."""
    if not d_task.done() or d_task.cancelled() or d_task.exception() is not None:
        return False
    events = SSEParser().feed(d_task.result().first or b"")
    return bool(events) and all(_is_role_chunk(_event_obj(e)) for e in events)


async def _cancel(task: asyncio.Task) -> None:
    if not task.done():
        task.cancel()
    try:
        result = await task
    except BaseException:  # noqa: BLE001 - we only want it gone
        return
    if isinstance(result, Upstream):  # the decode stream had opened: close it and release the worker
        if result.response is not None:
            result.response.close()
        result.lease.finish(True)


async def _more_from_decode(up: Upstream) -> Optional[str]:
    """Read decode's open stream once more, appending what came to ``up.first`` (its readers start there);
    None when bytes came, else how the stream ended."""
    assert up.response is not None
    try:
        data = await up.response.content.readany()
    except aiohttp.ClientError as e:
        return describe_error(e)
    if not data:
        return "connection closed"
    up.first += data
    return None


def _finish_background_prefill(ctx: RequestContext, task: asyncio.Task) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.warning(
            "request %s: prefill call failed after decode started: %s",
            ctx.request_id,
            getattr(exc, "reason", repr(exc)),
        )


def _end_span(spans: Any, span: Any, task: asyncio.Task) -> None:
    """End the span of a worker call when its task ends (an error status when it failed)."""
    if task.cancelled():
        spans.end(span, error="cancelled")
    elif task.exception() is not None:
        exc = task.exception()
        spans.end(span, error=getattr(exc, "reason", None) or type(exc).__name__)
    else:
        spans.end(span)


def _meta_trace(body: bytes) -> Any:
    """``meta_info.trace`` of a worker's /generate body (a list of them for a batch), or None."""
    try:
        out = json.loads(body)
    except ValueError:
        return None
    pick = lambda o: (o.get("meta_info") or {}).get("trace") if isinstance(o, dict) else None  # noqa: E731
    return [pick(o) for o in out] if isinstance(out, list) else pick(out)


async def _trace_header(ctx: RequestContext, stamps: dict[str, float], p_task: asyncio.Task) -> str:
    """The ``x-kvship-trace`` header: router stamps + the prefill's trace (waits for its reply)."""
    prefill = None
    try:
        prefill = _meta_trace(await asyncio.shield(p_task))
    except Exception:  # noqa: BLE001 - a failed prefill call is reported by _finish_background_prefill
        pass
    stamps["prefill_reply"] = time.time()
    return json.dumps({"clock": "time.time", "router": stamps, "prefill": prefill}, separators=(",", ":"))


async def pd_attempt(
    ctx: RequestContext, request: RoutingRequest, sel: Selection, path: Optional[str] = None
) -> Upstream:
    """One attempt on ``sel.prefill`` + ``sel.decode`` (``path``, default the client's route); returns
    the decode worker's ``Upstream``."""
    p, d = sel.prefill, sel.decode
    assert p is not None and d is not None
    assert p.bootstrap_port is not None  # registry refuses prefill workers without one
    boot = PDBootstrap.for_prefill(p.url, p.bootstrap_port)
    content = boot.inject(request.body, request.raw)
    router = ctx.router
    path = path or ctx.route
    traced = request.body.get(RETURN_TRACE_FIELD) is True and router.config.debug_headers
    stamps = {"received": ctx.started_wall, "sent": time.time()} if traced else None
    p_headers = ctx.headers
    spans, p_span, d_span = ctx.spans, None, None
    if spans is not None:  # each worker's spans are children of the router span that called it
        p_span = spans.start("router.prefill", worker=p.url, room=str(boot.room))
        d_span = spans.start("router.decode", worker=d.url, room=str(boot.room))
        p_headers = {**ctx.headers, **spans.headers(p_span)}
        ctx.headers.update(spans.headers(d_span))
    first: Optional[asyncio.Future] = None
    if first_token_from_prefill(ctx, request, path):
        first = asyncio.get_running_loop().create_future()
        p_task = asyncio.create_task(_prefill_stream(ctx, p, Lease(router, p), content, path, first, p_headers))
    else:
        p_task = asyncio.create_task(_prefill_call(ctx, p, Lease(router, p), content, path, p_headers))
    if spans is not None:
        p_task.add_done_callback(lambda t: _end_span(spans, p_span, t))
    d_lease = Lease(router, d)
    d_task = asyncio.create_task(open_upstream(ctx, d, d_lease, content, path))
    early: Optional[tuple[bytes, list[tuple[str, str]]]] = None
    watch: Optional[asyncio.Task] = None  # decode's stream past its role chunk (see below)
    try:
        pending: set[asyncio.Future] = {p_task, d_task} | ({first} if first is not None else set())
        while d_task in pending or (first in pending and _decode_sent_only_its_role(d_task)):
            if d_task not in pending and watch is None:
                # Decode answered a chat stream's role chunk at once, before its room reached prefill.  If it
                # dies now, prefill waits for that registration until its bootstrap timeout (minutes), and
                # its first token may never come as an event of its own (text the detokenizer holds back):
                # so read decode's stream beside prefill's, and let its end fail the attempt.
                watch = asyncio.create_task(_more_from_decode(d_task.result()))
                pending.add(watch)
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and p_task.exception() is not None:
                await _cancel(d_task)
                raise p_task.exception()  # type: ignore[misc]
            if first is not None and first in done and first.result() is not None:
                if d_task not in done or _decode_sent_only_its_role(d_task):
                    early = first.result()
                    break
            if watch is not None and watch in done:
                ended, watch = watch.result(), None
                if ended is not None:  # decode's stream ended with its role chunk alone
                    reason = f"decode stream ended before its first token: {ended}"
                    d_up = d_task.result()
                    d_up.lease.finish(False, reason)
                    raise AttemptFailed(d, reason, True)
        if early is not None:
            up = Upstream(
                d,
                d_lease,
                200,
                early[1],
                response=_DecodeAfterFirstToken(d_task, _event_obj(SSEParser().feed(early[0])[-1])),  # type: ignore[arg-type]
                first=early[0],
            )
        else:
            up = d_task.result()  # raises the decode failure
        if stamps is not None:
            stamps["decode_first_byte"] = time.time()
            trace = await _trace_header(ctx, stamps, p_task)
    except BaseException as e:
        if watch is not None:
            await _cancel(watch)
        await _cancel(p_task)
        await _cancel(d_task)
        if spans is not None:
            spans.end(d_span, error=getattr(e, "reason", None) or type(e).__name__)
        raise
    if watch is not None:  # a read not begun leaves decode's bytes in its stream; one that ended kept them
        await _cancel(watch)
    if p_task.done():
        _finish_background_prefill(ctx, p_task)
    else:
        router.background.add(p_task)
        p_task.add_done_callback(router.background.discard)
        p_task.add_done_callback(lambda t: _finish_background_prefill(ctx, t))
        up.prefill_task = p_task
    up.extra_headers = {"x-kvship-prefill": p.url, "x-kvship-decode": d.url}
    if early is not None:  # the client's first token came from prefill (docs/pd.md, "The first token from prefill")
        up.extra_headers["x-kvship-first-token"] = "prefill"
    if stamps is not None:
        up.extra_headers["x-kvship-trace"] = trace
    logger.debug("request %s: PD pair %s -> %s room %d", ctx.request_id, p.url, d.url, boot.room)
    return up
