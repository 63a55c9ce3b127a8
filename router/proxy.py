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
circuit-breaker outcome) that is finished exactly once, on every path.  The
attempt itself (``open_upstream``, ``Lease``, ``RequestContext``) lives in
``kvship.router.upstream``, shared with the PD path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from typing import Optional

import aiohttp
from starlette.responses import Response

from kvship.router.core import NoWorker
from kvship.router.pd import pd_attempt
from kvship.router.upstream import (
    AttemptFailed,
    DeadlineExceeded,
    Lease,
    RequestContext,
    Upstream,
    describe_error,
    open_upstream,
)
from kvship.router.wire import RoutingRequest, error_body

logger = logging.getLogger(__name__)

__all__ = ["RelayResponse", "backoff_delay", "error_response", "proxy_request"]


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
                    ok, reason = False, "stream_broken: " + describe_error(e)
                    logger.warning(
                        "request %s: stream from %s broke: %s", ctx.request_id, up.worker.url, describe_error(e)
                    )
                    chunk = b""
                    await send(
                        {
                            "type": "http.response.body",
                            "more_body": True,
                            "body": _sse_error(f"worker failed mid-stream: {describe_error(e)}", "worker_failed"),
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
        finally:
            watcher.cancel()
            if clean_end:
                resp.release()  # read to the end: the connection goes back to the pool
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
        try:
            sel = router.choose(request, exclude)
        except NoWorker as e:
            if last is None:
                return error_response(ctx, 503, str(e), "no_healthy_worker")
            break
        ctx.attempts += 1
        try:
            if cfg.pd:
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
            ctx.finish(up.status, up.worker.url)
            return Response(up.body, status_code=up.status, headers=headers)
        router.metrics.ttft.labels(ctx.route).observe(time.perf_counter() - ctx.started)
        return RelayResponse(ctx, up, headers)
    assert last is not None
    if last.status is not None:
        headers = dict(last.headers)
        headers.update({"x-kvship-worker": last.worker.url, "x-request-id": ctx.request_id})
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
        f"worker {last.worker.url} failed: {last.reason} (after {ctx.attempts} attempt(s))",
        "worker_failed",
        {"x-kvship-worker": last.worker.url},
    )
