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

A body with ``"return_trace": true`` also gets the ``x-kvship-trace``
response header: the router's own stamps and the prefill worker's
``meta_info.trace``, wall clock (docs/pd.md, "Reading a request's trace").
The router then waits for the prefill reply before it answers (the trace is
a debugging aid; its ``router.prefill_reply`` stamp shows that wait).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Optional

import aiohttp

from kvship.router.core import Selection
from kvship.router.upstream import (
    RETRYABLE_STATUS,
    AttemptFailed,
    DeadlineExceeded,
    Lease,
    RequestContext,
    Upstream,
    describe_error,
    open_upstream,
    pass_headers,
)
from kvship.router.wire import PDBootstrap, RoutingRequest
from kvship.router.worker import Worker

logger = logging.getLogger(__name__)


async def _prefill_call(ctx: RequestContext, worker: Worker, lease: Lease, content: bytes, path: str) -> bytes:
    """Send to the prefill worker, read its reply to the end and return it; raise ``AttemptFailed`` on error.

    Finishes ``lease`` on every path.
    """
    client = ctx.router.client
    assert client is not None
    try:
        async with asyncio.timeout_at(ctx.deadline):
            async with client.post(worker.url + path, data=content, headers=ctx.headers) as resp:
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
        lease.finish(not retryable, f"http_{resp.status}")
        raise AttemptFailed(worker, f"prefill http_{resp.status}", retryable, resp.status, body, pass_headers(resp))
    lease.finish(True)
    return body


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
    content = boot.inject(request.body)
    router = ctx.router
    path = path or ctx.route
    stamps = {"received": ctx.started_wall, "sent": time.time()} if request.body.get("return_trace") is True else None
    p_task = asyncio.create_task(_prefill_call(ctx, p, Lease(router, p), content, path))
    d_task = asyncio.create_task(open_upstream(ctx, d, Lease(router, d), content, path))
    try:
        pending = {p_task, d_task}
        while d_task in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and p_task.exception() is not None:
                await _cancel(d_task)
                raise p_task.exception()  # type: ignore[misc]
        up = d_task.result()  # raises the decode failure
        if stamps is not None:
            stamps["decode_first_byte"] = time.time()
            trace = await _trace_header(ctx, stamps, p_task)
    except BaseException:
        await _cancel(p_task)
        await _cancel(d_task)
        raise
    if p_task.done():
        _finish_background_prefill(ctx, p_task)
    else:
        router.background.add(p_task)
        p_task.add_done_callback(router.background.discard)
        p_task.add_done_callback(lambda t: _finish_background_prefill(ctx, t))
        up.prefill_task = p_task
    up.extra_headers = {"x-kvship-prefill": p.url, "x-kvship-decode": d.url}
    if stamps is not None:
        up.extra_headers["x-kvship-trace"] = trace
    logger.debug("request %s: PD pair %s -> %s room %d", ctx.request_id, p.url, d.url, boot.room)
    return up
