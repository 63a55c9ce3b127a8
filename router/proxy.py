"""Forwarding one request to a worker: attempts, retries, and the chunk-by-chunk stream relay.

Data flow of a proxied request::

    app handler -> proxy_request -> [choose worker(s) -> attempt] x (1 + --max-retries) -> response
                                      unified: open_upstream(worker)
                                      PD:      pd.pd_attempt(prefill, decode)

An attempt ends *before anything is sent to the client*: for a non-streaming
reply the whole body has been read; for a stream (``text/event-stream``) the
first chunk has arrived.  Only then is a response started, so a retry can
never duplicate output the client already saw.  Transport errors and 5xx
replies before that point are retried on another worker (exponential backoff
with jitter); 4xx replies are the client's and are passed through.  Once a
stream has started, a worker failure resumes it on another worker when it is
resumable (``ResumingRelay``, ``kvship.router.resume``), else ends it with an
SSE ``error`` event (``RelayResponse``).

Accounting: every attempt holds a ``Lease`` on its worker (in-flight count,
circuit-breaker outcome) that is finished exactly once, on every path.  A
request that ends well is measured for the live SLO figures
(``kvship.router.slo``): the relays feed what they send to a ``RequestMeter``.  The
attempt itself (``open_upstream``, ``Lease``, ``RequestContext``) lives in
``kvship.router.upstream``, shared with the PD path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from typing import Optional

import aiohttp
from starlette.responses import Response

from kvship.router.core import NoWorker
from kvship.router.pd import pd_attempt
from kvship.router.resume import ResumeState, SSEParser
from kvship.router.slo import RequestMeter
from kvship.router.upstream import (
    PAIR_FAILED_CODE,
    AttemptFailed,
    DeadlineExceeded,
    Lease,
    RequestContext,
    Upstream,
    describe_error,
    open_upstream,
)
from kvship.router.wire import ROUTER_IDS_HEADER, RoutingRequest, error_body

logger = logging.getLogger(__name__)

__all__ = ["RelayResponse", "ResumingRelay", "WholeResponse", "backoff_delay", "error_response", "proxy_request"]


def _sse_error(message: str, code: str) -> bytes:
    payload = {"error": {"message": message, "type": "server_error", "code": code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class WholeResponse(Response):
    """A worker's whole (non-streamed) reply.  Its accounting (the SLO sample, the request's metrics and
    log line: ~0.1-0.3 ms) runs once the bytes went out, off the client's latency; a send that fails
    is still accounted."""

    def __init__(self, ctx: RequestContext, up: Upstream, headers: dict[str, str]):
        assert up.body is not None
        super().__init__(up.body, status_code=up.status, headers=headers)
        self.ctx = ctx
        self.up = up

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            ctx, up = self.ctx, self.up
            if up.status == 200:
                assert up.body is not None
                ctx.router.slo.record(ctx.route, RequestMeter.body_sample(ctx.started, up.body))
                if ctx.kv_prediction is not None:
                    ctx.kv_prediction.feed_body(up.body)
                    ctx.kv_prediction.finish(ctx.router.metrics, up.worker.url)
            ctx.finish(up.status, up.worker.url)


class RelayResponse(Response):
    """Streams an ``Upstream`` to the client chunk by chunk; releases the worker however it ends.

    A plain ASGI loop (read a chunk from the worker, send it) plus one small task
    watching for the client's ``http.disconnect``: when the client goes, the worker
    connection is closed at once, which ends the loop and tells the worker.
    """

    def __init__(self, ctx: RequestContext, up: Upstream, headers: dict[str, str]):
        super().__init__(status_code=up.status, headers=headers)
        del self.headers["content-length"]  # set by Response for its empty body; streams are chunked
        self.ctx = ctx
        self.up = up
        self.client_gone = False

    async def _watch_disconnect(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.client_gone = True
                if self.up.response is not None:
                    self.up.response.close()
                return

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        up, ctx = self.up, self.ctx
        resp = up.response
        assert resp is not None
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive))
        ok, reason, clean_end = True, "", False
        meter = RequestMeter(ctx.started)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            chunk = up.first
            content = resp.content
            while chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                meter.feed(chunk)
                if ctx.kv_prediction is not None:
                    ctx.kv_prediction.feed(chunk)
                try:
                    async with asyncio.timeout_at(ctx.deadline):
                        chunk = await content.readany()
                except aiohttp.ClientError as e:
                    if self.client_gone:
                        break
                    ok, reason = False, "stream_broken: " + describe_error(e)
                    logger.warning(
                        "request %s: stream from %s broke: %s", ctx.request_id, up.worker.url, describe_error(e)
                    )
                    chunk = b""
                    await send(
                        {
                            "type": "http.response.body",
                            "more_body": True,
                            "body": _sse_error(
                                f"worker failed mid-stream: {client_reason(ctx, describe_error(e))}", "worker_failed"
                            ),
                        }
                    )
                except TimeoutError:
                    logger.warning("request %s: stream from %s passed --request-timeout", ctx.request_id, up.worker.url)
                    chunk = b""
                    await send(
                        {
                            "type": "http.response.body",
                            "more_body": True,
                            "body": _sse_error("request timed out (--request-timeout)", "timeout"),
                        }
                    )
            else:
                clean_end = ok and content.at_eof()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if clean_end and self.status_code == 200 and not self.client_gone:
                ctx.router.slo.record(ctx.route, meter.stream_sample())
                if ctx.kv_prediction is not None:
                    ctx.kv_prediction.finish(ctx.router.metrics, up.worker.url)
        finally:
            watcher.cancel()
            if clean_end:
                resp.release()  # read to the end: the connection goes back to the pool
            else:
                resp.close()
                up.cancel_prefill()
            up.lease.finish(ok, reason)
            ctx.finish(self.status_code, up.worker.url)


class ResumingRelay(Response):
    """Streams a resumable request (``kvship.router.resume``) event by event; when its worker fails
    mid-stream, continues it on another worker (at most ``--max-resumes`` times) into the same response.

    Only whole events reach the client; the events of each upstream go through
    ``ResumeState.process`` (token ids stripped, continuations rewritten).  A
    break is: a transport error, the end of the stream before ``[DONE]``, an
    error event of a failed worker, or silence while the health checks have
    marked the worker unhealthy.  Past ``--max-resumes`` (or when no worker is
    left) the client gets the SSE error event as a non-resumable stream would;
    the deadline ends it with the ``timeout`` event.  Every upstream's lease is
    finished once: failed on a break, ok otherwise.
    """

    def __init__(
        self, ctx: RequestContext, up: Upstream, headers: dict[str, str], request: RoutingRequest, state: ResumeState
    ):
        super().__init__(status_code=up.status, headers=headers)
        del self.headers["content-length"]
        self.ctx = ctx
        self.up = up
        self.request = request
        self.state = state
        self.client_gone = False

    async def _watch_disconnect(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.client_gone = True
                if self.up.response is not None:
                    self.up.response.close()
                return

    async def _next_bytes(self) -> tuple[bytes, str]:
        """The next bytes of the current upstream, or (b"", why it broke / "timeout").

        While no bytes come, the worker's health is looked at every ``_HEALTH_POLL_S``: a worker the
        health checks marked unhealthy (hung, unreachable) breaks the stream.
        """
        resp = self.up.response
        assert resp is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout_at(min(self.ctx.deadline, loop.time() + _HEALTH_POLL_S)):
                    data = await resp.content.readany()  # (a cancelled read loses no data)
            except aiohttp.ClientError as e:
                return b"", "reset: " + describe_error(e)
            except TimeoutError:
                if loop.time() >= self.ctx.deadline:
                    return b"", "timeout"
                if not self.up.worker.healthy:
                    return b"", "unhealthy: the worker failed its health checks mid-stream"
                continue
            return data, ("" if data else "eof: the stream ended before its finish")

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        ctx, state = self.ctx, self.state
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive))
        exclude: set[str] = set()
        broke_at: Optional[float] = None
        meter = RequestMeter(ctx.started)
        completed = False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while True:
                up, parser, data, why = self.up, SSEParser(), self.up.first, ""
                outcome: Optional[str] = None
                while outcome is None:
                    for event in parser.feed(data):
                        out, outcome = state.process(event)
                        if out:
                            await send({"type": "http.response.body", "body": out, "more_body": True})
                            meter.feed(out)
                            if ctx.kv_prediction is not None:
                                ctx.kv_prediction.feed(out)
                            if broke_at is not None:
                                logger.info(
                                    "request %s: resumed on %s, %.1f ms from the break to the next event relayed",
                                    ctx.request_id,
                                    up.worker.url,
                                    (time.perf_counter() - broke_at) * 1000,
                                )
                                broke_at = None
                        if outcome is not None:
                            break
                    if outcome is None:
                        data, why = await self._next_bytes()
                        if self.client_gone:
                            outcome = "gone"
                        elif why:
                            outcome = "failed"
                    elif outcome == "failed":
                        why = "worker_error: the worker reported its failure mid-stream"
                if outcome in ("done", "gone"):
                    resp = up.response
                    assert resp is not None
                    if outcome == "done" and resp.content.at_eof():
                        resp.release()
                    else:
                        resp.close()
                    if outcome == "gone":
                        up.cancel_prefill()
                    up.lease.finish(True)
                    completed = outcome == "done"
                    break
                # the stream broke before its finish
                broken_at = time.perf_counter()
                assert up.response is not None
                up.response.close()
                up.cancel_prefill()
                paired = why.startswith("worker_error") and state.failed_code == PAIR_FAILED_CODE  # its peer's failure
                up.lease.finish(why == "timeout", why, blame=not paired)
                exclude.add(up.worker.url)
                logger.warning(
                    "request %s: stream from %s broke after %d token(s): %s",
                    ctx.request_id,
                    up.worker.url,
                    len(state.out_ids),
                    why,
                )
                if why == "timeout":
                    await send(_body(_sse_error("request timed out (--request-timeout)", "timeout")))
                    break
                broke_at = broken_at
                if not await self._resume(why, exclude, send):
                    break
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if completed and self.status_code == 200:
                ctx.router.slo.record(ctx.route, meter.stream_sample(len(state.out_ids)))
                if ctx.kv_prediction is not None:
                    ctx.kv_prediction.finish(ctx.router.metrics, self.up.worker.url)
        finally:
            watcher.cancel()
            if not self.up.lease.done:
                if self.up.response is not None:
                    self.up.response.close()
                self.up.lease.finish(True)
            ctx.finish(self.status_code, self.up.worker.url)

    async def _resume(self, why: str, exclude: set[str], send) -> bool:
        """Open the continuation on another worker into ``self.up``; False (error event sent) if it cannot."""
        ctx, state = self.ctx, self.state
        router = ctx.router
        if state.finished:  # the finish had arrived; only [DONE] was missing
            await send(_body(b"data: [DONE]\n\n"))
            return False
        if state.resumes >= router.config.max_resumes or not state.can_resume():
            await send(
                _body(
                    _sse_error(
                        f"worker failed mid-stream: {client_reason(ctx, why)} (resumed {state.resumes} time(s))",
                        "worker_failed",
                    )
                )
            )
            return False
        state.resumes += 1
        router.metrics.resumes.labels(why.split(":", 1)[0]).inc()
        remaining = state.remaining_tokens()
        if state.prompt_ids is not None and remaining is not None and remaining <= 0:
            await send(_body(state.finish_events()))
            return False
        path, body = state.continuation()
        cont = dataclasses.replace(self.request, route=path, body=body, raw=json.dumps(body).encode())
        span = None
        if ctx.spans is not None:  # docs/observability.md: the resume and its new attempt, under one span
            span = ctx.spans.start("router.resume", reason=why.split(":", 1)[0], resume=state.resumes)
        try:
            self.up = await open_attempts(ctx, cont, exclude, path, self.up.worker.revision)
            if span is not None:
                ctx.spans.end(span, worker=self.up.worker.url)
        except (AttemptFailed, NoWorker, DeadlineExceeded) as e:
            reason = e.reason if isinstance(e, AttemptFailed) else (str(e) or "deadline passed")
            if span is not None:
                ctx.spans.end(span, error=reason)
            logger.warning("request %s: could not resume: %s", ctx.request_id, reason)
            await send(
                _body(
                    _sse_error(
                        f"worker failed mid-stream ({client_reason(ctx, why)}); resuming failed: "
                        f"{client_reason(ctx, reason)}",
                        "worker_failed",
                    )
                )
            )
            return False
        if self.up.body is not None:  # the worker refused the continuation (a 4xx)
            await send(_body(_sse_error(f"resuming failed: worker answered {self.up.status}", "worker_failed")))
            return False
        state.begin_continuation()
        logger.info(
            "request %s: resuming on %s after %d token(s) (resume %d)",
            ctx.request_id,
            self.up.worker.url,
            len(state.out_ids),
            state.resumes,
        )
        return True


_HEALTH_POLL_S = 1.0  # how often a silent stream looks at its worker's health


def _body(data: bytes) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": True}


async def open_attempts(
    ctx: RequestContext, request: RoutingRequest, exclude: set[str], path: str, revision: Optional[str] = None
) -> Upstream:
    """A resume's continuation: up to 1 + ``--max-retries`` attempts on workers not in ``exclude``, of
    ``revision`` (the broken stream's) while that revision is ready (docs/router.md, "Revisions").

    Raises the last ``AttemptFailed``, ``NoWorker`` or ``DeadlineExceeded``.
    """
    router = ctx.router
    cfg = router.config
    loop = asyncio.get_running_loop()
    last: Optional[AttemptFailed] = None
    for attempt in range(cfg.max_retries + 1):
        if attempt:
            delay = backoff_delay(cfg.retry_backoff_base, cfg.retry_backoff_max, attempt)
            if loop.time() + delay >= ctx.deadline:
                break
            await asyncio.sleep(delay)
        sel = router.choose(request, exclude, revision)
        ctx.attempts += 1
        try:
            if sel.is_pair:
                up = await pd_attempt(ctx, request, sel, path)
            else:
                assert sel.worker is not None
                up = await open_upstream(ctx, sel.worker, Lease(router, sel.worker), request.raw, path)
        except AttemptFailed as f:
            last = f
            exclude.add(f.worker.url)
            if not f.retryable:
                break
            continue
        if up.response is not None or up.status < 500:
            return up
    if last is None:
        raise DeadlineExceeded()
    raise last


def _debug_headers(ctx: RequestContext, headers: dict[str, str]) -> dict[str, str]:
    """``headers`` (``x-kvship-*``: worker URLs, traces) when the router runs with ``--debug-headers``, else
    nothing: clients never learn the workers' addresses (docs/router.md, "Response headers")."""
    return headers if ctx.router.config.debug_headers else {}


def client_reason(ctx: RequestContext, reason: str) -> str:
    """A failure's reason as a client may read it: whole with ``--debug-headers``, else only its kind
    (``ClientConnectorError``, ``http_503``, ``reset``...): a transport error's text names the worker's address."""
    return reason if ctx.router.config.debug_headers else reason.split(":", 1)[0]


def _worker_name(ctx: RequestContext, worker) -> str:
    return f"worker {worker.url}" if ctx.router.config.debug_headers else f"the {worker.role} worker"


def _response_headers(ctx: RequestContext, up: Upstream) -> dict[str, str]:
    headers = dict(up.headers)  # (pass_headers already dropped the workers' own x-kvship-* headers)
    headers.update(_debug_headers(ctx, {"x-kvship-worker": up.worker.url, **up.extra_headers}))
    headers["x-request-id"] = ctx.request_id
    return headers


def error_response(
    ctx: RequestContext, status: int, message: str, code: str, headers: Optional[dict[str, str]] = None
) -> Response:
    h = {"x-request-id": ctx.request_id}
    h.update(headers or {})
    ctx.finish(status, "")
    return Response(error_body(message, status, code), status_code=status, media_type="application/json", headers=h)


def backoff_delay(cfg_base: float, cfg_max: float, retry: int) -> float:
    """Delay before retry number ``retry`` (1-based): exponential, capped, with 'equal jitter'."""
    cap = min(cfg_max, cfg_base * (2 ** (retry - 1)))
    return cap / 2 + random.uniform(0, cap / 2)


async def proxy_request(ctx: RequestContext, request: RoutingRequest) -> Response:
    """Route ``request``, retrying before the first byte, and build the client's response."""
    router = ctx.router
    cfg = router.config
    loop = asyncio.get_running_loop()
    ctx.deadline = loop.time() + cfg.request_timeout
    exclude: set[str] = set()
    last: Optional[AttemptFailed] = None
    state = ResumeState.for_request(request) if cfg.max_resumes > 0 else None
    if state is not None:
        ctx.headers[ROUTER_IDS_HEADER] = "1"
    for attempt in range(cfg.max_retries + 1):
        if attempt:
            delay = backoff_delay(cfg.retry_backoff_base, cfg.retry_backoff_max, attempt)
            if loop.time() + delay >= ctx.deadline:
                break
            router.metrics.retries.labels(ctx.route).inc()
            logger.info(
                "request %s: attempt %d on %s failed (%s); retrying in %.0f ms",
                ctx.request_id,
                attempt,
                last.worker.url if last else "?",
                last.reason if last else "?",
                delay * 1000,
            )
            await asyncio.sleep(delay)
        pick = ctx.spans.start("router.pick", attempt=attempt) if ctx.spans is not None else None
        try:
            sel = router.choose(request, exclude)
        except NoWorker as e:
            if pick is not None:
                ctx.spans.end(pick, error=str(e))
            if last is None:
                return error_response(ctx, 503, str(e), "no_healthy_worker")
            break
        policy = router.policies.get(sel.worker.role) if sel.worker is not None else None
        if policy is not None:  # (a PD pair's reply counts the decode worker's cache: not compared)
            ctx.kv_prediction = policy.take_prediction(request)
        if pick is not None:
            if sel.selective is not None:  # docs/observability.md: the --pd-selective decision on the pick span
                ctx.spans.end(pick, pd_selective=sel.selective, pd_route="pd" if sel.is_pair else "decode")
            else:
                ctx.spans.end(pick)
        ctx.attempts += 1
        try:
            if sel.is_pair:
                up = await pd_attempt(ctx, request, sel)
            else:
                assert sel.worker is not None
                up = await open_upstream(ctx, sel.worker, Lease(router, sel.worker), request.raw)
        except AttemptFailed as f:
            last = f
            exclude.add(f.worker.url)
            if not f.retryable:
                break
            continue
        except DeadlineExceeded:
            return error_response(
                ctx, 504, f"request did not finish within --request-timeout ({cfg.request_timeout:g} s)", "timeout"
            )
        headers = _response_headers(ctx, up)
        if up.body is not None:
            return WholeResponse(ctx, up, headers)
        router.metrics.ttft.labels(ctx.route).observe(time.perf_counter() - ctx.started)
        if state is not None:
            return ResumingRelay(ctx, up, headers, request, state)
        return RelayResponse(ctx, up, headers)
    assert last is not None
    if last.status is not None:
        headers = dict(last.headers)
        headers.update(_debug_headers(ctx, {"x-kvship-worker": last.worker.url}))
        headers["x-request-id"] = ctx.request_id
        logger.warning(
            "request %s failed on %s after %d attempt(s): %s",
            ctx.request_id,
            last.worker.url,
            ctx.attempts,
            last.reason,
        )
        ctx.finish(last.status, last.worker.url)
        return Response(last.body, status_code=last.status, headers=headers)
    logger.warning(
        "request %s failed after %d attempt(s); last on %s: %s",
        ctx.request_id,
        ctx.attempts,
        last.worker.url,
        last.reason,
    )
    return error_response(
        ctx,
        502,
        f"{_worker_name(ctx, last.worker)} failed: {client_reason(ctx, last.reason)} (after {ctx.attempts} attempt(s))",
        "worker_failed",
        _debug_headers(ctx, {"x-kvship-worker": last.worker.url}),
    )
