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
stream has started, a worker failure ends it with an SSE ``error`` event.

Accounting: every attempt holds a ``Lease`` on its worker (in-flight count,
circuit-breaker outcome) that is finished exactly once, on every path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import aiohttp
from starlette.responses import Response

from kvship.router.circuit import STATE_CODE
from kvship.router.core import NoWorker, Router
from kvship.router.wire import RoutingRequest, error_body
from kvship.router.worker import Worker

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
_DROP_RESPONSE_HEADERS = frozenset({
    "connection", "keep-alive", "transfer-encoding", "content-length", "proxy-authenticate",
    "proxy-authorization", "te", "trailer", "upgrade", "server", "date"})


class DeadlineExceeded(Exception):
    """The request ran past ``--request-timeout`` (answered 504, never retried)."""


@dataclass
class RequestContext:
    """Per-request bookkeeping: id, route, timing, and what the worker call sends."""

    router: Router
    request_id: str
    route: str
    headers: dict[str, str]
    started: float = field(default_factory=time.perf_counter)
    deadline: float = 0.0  # event-loop time
    attempts: int = 0

    def finish(self, status: int, worker: str) -> None:
        m = self.router.metrics
        elapsed = time.perf_counter() - self.started
        m.requests.labels(self.route, str(status), worker).inc()
        m.latency.labels(self.route).observe(elapsed)
        logger.info("request %s %s -> %s status %d in %.1f ms (%d attempt%s)", self.request_id, self.route,
                    worker or "-", status, elapsed * 1000, self.attempts, "" if self.attempts == 1 else "s")


class Lease:
    """One attempt's hold on a worker: ``finish(ok)`` exactly once (later calls do nothing)."""

    __slots__ = ("router", "worker", "done")

    def __init__(self, router: Router, worker: Worker):
        self.router = router
        self.worker = worker
        self.done = False
        worker.in_flight += 1
        worker.total_requests += 1
        worker.breaker.on_attempt()
        router.metrics.in_flight.labels(worker.url).set(worker.in_flight)

    def finish(self, ok: bool, reason: str = "") -> None:
        if self.done:
            return
        self.done = True
        w, m = self.worker, self.router.metrics
        w.in_flight -= 1
        if ok:
            w.breaker.record_success()
        else:
            w.breaker.record_failure()
            w.total_failures += 1
            w.last_error = reason
            m.worker_failures.labels(w.url, reason.split(":", 1)[0] or "error").inc()
        m.in_flight.labels(w.url).set(w.in_flight)
        m.circuit.labels(w.url).set(STATE_CODE[w.breaker.state])


class AttemptFailed(Exception):
    """An attempt that produced nothing for the client.  ``response`` (if any) is the worker's own reply."""

    def __init__(self, worker: Worker, reason: str, retryable: bool, status: Optional[int] = None,
                 body: bytes = b"", headers: Optional[list[tuple[str, str]]] = None):
        super().__init__(reason)
        self.worker = worker
        self.reason = reason
        self.retryable = retryable
        self.status = status
        self.body = body
        self.headers = headers or []


@dataclass
class Upstream:
    """A successful attempt: a complete body, or an open stream whose first chunk has arrived."""

    worker: Worker
    lease: Lease
    status: int
    headers: list[tuple[str, str]]
    body: Optional[bytes] = None
    response: Optional[aiohttp.ClientResponse] = None
    first: bytes = b""
    extra_headers: dict[str, str] = field(default_factory=dict)


def pass_headers(resp: aiohttp.ClientResponse) -> list[tuple[str, str]]:
    """The worker's response headers the client gets (bodies pass undecoded, so content-encoding stays)."""
    out = []
    for k, v in resp.headers.items():
        lk = k.lower()
        if lk in _DROP_RESPONSE_HEADERS or lk.startswith("x-kvship-") or lk == "x-request-id":
            continue
        out.append((lk, v))
    return out


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def open_upstream(ctx: RequestContext, worker: Worker, lease: Lease, content: bytes) -> Upstream:
    """Send one attempt to ``worker`` and wait until something can be given to the client.

    Finishes ``lease`` on every path except a returned stream (the relay finishes it then).
    Raises ``AttemptFailed`` or ``DeadlineExceeded``.
    """
    client = ctx.router.client
    assert client is not None
    resp: Optional[aiohttp.ClientResponse] = None
    try:
        async with asyncio.timeout_at(ctx.deadline):
            resp = await client.post(worker.url + ctx.route, data=content, headers=ctx.headers)
            status = resp.status
            if status in RETRYABLE_STATUS:
                body = await resp.read()
                raise AttemptFailed(worker, f"http_{status}", True, status, body, pass_headers(resp))
            streaming = status == 200 and resp.headers.get("content-type", "").startswith("text/event-stream")
            if not streaming:
                body = await resp.read()
                resp.release()
                lease.finish(True)
                return Upstream(worker, lease, status, pass_headers(resp), body=body)
            first = await resp.content.readany()
            return Upstream(worker, lease, status, pass_headers(resp), response=resp, first=first)
    except AttemptFailed as e:
        lease.finish(False, e.reason)
        _close(resp)
        raise
    except aiohttp.ClientError as e:  # before TimeoutError: aiohttp's socket timeouts subclass both
        lease.finish(False, _describe(e))
        _close(resp)
        raise AttemptFailed(worker, _describe(e), True) from None
    except TimeoutError:
        lease.finish(False, "timeout")
        _close(resp)
        raise DeadlineExceeded() from None
    except BaseException:
        lease.finish(True)
        _close(resp)
        raise


def _close(resp: Optional[aiohttp.ClientResponse]) -> None:
    """Drop the connection of a response that may not have been read to the end (the worker sees it go)."""
    if resp is not None:
        resp.close()


def _sse_error(message: str, code: str) -> bytes:
    payload = {"error": {"message": message, "type": "server_error", "code": code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


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
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            chunk = up.first
            content = resp.content
            while chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                try:
                    async with asyncio.timeout_at(ctx.deadline):
                        chunk = await content.readany()
                except aiohttp.ClientError as e:
                    if self.client_gone:
                        break
                    ok, reason = False, "stream_broken: " + _describe(e)
                    logger.warning("request %s: stream from %s broke: %s", ctx.request_id, up.worker.url,
                                   _describe(e))
                    chunk = b""
                    await send({"type": "http.response.body", "more_body": True,
                                "body": _sse_error(f"worker failed mid-stream: {_describe(e)}", "worker_failed")})
                except TimeoutError:
                    logger.warning("request %s: stream from %s passed --request-timeout", ctx.request_id,
                                   up.worker.url)
                    chunk = b""
                    await send({"type": "http.response.body", "more_body": True,
                                "body": _sse_error("request timed out (--request-timeout)", "timeout")})
            else:
                clean_end = ok and content.at_eof()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            if clean_end:
                resp.release()   # read to the end: the connection goes back to the pool
            else:
                resp.close()
            up.lease.finish(ok, reason)
            ctx.finish(self.status_code, up.worker.url)


def _response_headers(ctx: RequestContext, up: Upstream) -> dict[str, str]:
    headers = dict(up.headers)
    headers["x-kvship-worker"] = up.worker.url
    headers["x-request-id"] = ctx.request_id
    headers.update(up.extra_headers)
    return headers


def error_response(ctx: RequestContext, status: int, message: str, code: str,
                   headers: Optional[dict[str, str]] = None) -> Response:
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
    for attempt in range(cfg.max_retries + 1):
        if attempt:
            delay = backoff_delay(cfg.retry_backoff_base, cfg.retry_backoff_max, attempt)
            if loop.time() + delay >= ctx.deadline:
                break
            router.metrics.retries.labels(ctx.route).inc()
            logger.info("request %s: attempt %d on %s failed (%s); retrying in %.0f ms", ctx.request_id,
                        attempt, last.worker.url if last else "?", last.reason if last else "?", delay * 1000)
            await asyncio.sleep(delay)
        try:
            sel = router.choose(request, exclude)
        except NoWorker as e:
            if last is None:
                return error_response(ctx, 503, str(e), "no_healthy_worker")
            break
        ctx.attempts += 1
        try:
            if cfg.pd:
                from kvship.router.pd import pd_attempt
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
            return error_response(ctx, 504, f"request did not finish within --request-timeout "
                                            f"({cfg.request_timeout:g} s)", "timeout")
        headers = _response_headers(ctx, up)
        if up.body is not None:
            ctx.finish(up.status, up.worker.url)
            return Response(up.body, status_code=up.status, headers=headers)
        router.metrics.ttft.labels(ctx.route).observe(time.perf_counter() - ctx.started)
        return RelayResponse(ctx, up, headers)
    assert last is not None
    if last.status is not None:
        headers = dict(last.headers)
        headers.update({"x-kvship-worker": last.worker.url, "x-request-id": ctx.request_id})
        logger.warning("request %s failed on %s after %d attempt(s): %s", ctx.request_id, last.worker.url,
                       ctx.attempts, last.reason)
        ctx.finish(last.status, last.worker.url)
        return Response(last.body, status_code=last.status, headers=headers)
    logger.warning("request %s failed after %d attempt(s); last on %s: %s", ctx.request_id, ctx.attempts,
                   last.worker.url, last.reason)
    return error_response(ctx, 502, f"worker {last.worker.url} failed: {last.reason} "
                                    f"(after {ctx.attempts} attempt(s))", "worker_failed",
                          {"x-kvship-worker": last.worker.url})
