"""One attempt on one worker, up to the first byte the client may see.

The pieces the unified path (``kvship.router.proxy``) and the PD path
(``kvship.router.pd``) share: the per-request context, the ``Lease`` an
attempt holds on its worker, ``open_upstream`` and the two ways an attempt
ends without output (``AttemptFailed``, ``DeadlineExceeded``).

Contract: ``open_upstream`` returns only once something can be given to the
client (a whole body, or a stream's first chunk), so a caller that gets
``AttemptFailed`` may retry on another worker without duplicating output.
Every ``Lease`` is finished exactly once on every path; a returned stream's
lease is finished by whoever relays it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

from kvship.router.circuit import STATE_CODE
from kvship.router.core import Router
from kvship.router.worker import Worker

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
_DROP_RESPONSE_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "upgrade",
        "server",
        "date",
    }
)


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
    started_wall: float = field(default_factory=time.time)  # the same moment on the wall clock (PD traces)
    deadline: float = 0.0  # event-loop time
    attempts: int = 0
    spans: Optional[Any] = None  # the request's ``kvship.router.tracing.RequestSpans`` when tracing is on
    kv_prediction: Optional[Any] = None  # a ``kv_events`` choice's ``KVPrediction``, completed by the reply

    def finish(self, status: int, worker: str) -> None:
        if self.spans is not None:
            self.spans.finish(status, worker)
        m = self.router.metrics
        elapsed = time.perf_counter() - self.started
        m.requests.labels(self.route, str(status), worker).inc()
        m.latency.labels(self.route).observe(elapsed)
        logger.info(
            "request %s %s -> %s status %d in %.1f ms (%d attempt%s)",
            self.request_id,
            self.route,
            worker or "-",
            status,
            elapsed * 1000,
            self.attempts,
            "" if self.attempts == 1 else "s",
        )


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

    def finish(self, ok: bool, reason: str = "", blame: bool = True) -> None:
        """``blame=False``: a failed attempt that says nothing of this worker's own health (its PD peer
        failed, see ``pair_failure``): counted and reported, but the circuit breaker only frees its trial."""
        if self.done:
            return
        self.done = True
        w, m = self.worker, self.router.metrics
        w.in_flight -= 1
        if ok:
            w.breaker.record_success()
        else:
            if blame:
                w.breaker.record_failure()
            else:
                w.breaker.release_trial()
            w.total_failures += 1
            w.last_error = reason
            m.worker_failures.labels(w.url, reason.split(":", 1)[0] or "error").inc()
        m.in_flight.labels(w.url).set(w.in_flight)
        m.circuit.labels(w.url).set(STATE_CODE[w.breaker.state])


class AttemptFailed(Exception):
    """An attempt that produced nothing for the client.  ``response`` (if any) is the worker's own reply."""

    def __init__(
        self,
        worker: Worker,
        reason: str,
        retryable: bool,
        status: Optional[int] = None,
        body: bytes = b"",
        headers: Optional[list[tuple[str, str]]] = None,
    ):
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
    # PD: the prefill call still running beside this decode stream (cancel it when the stream breaks)
    prefill_task: Optional[asyncio.Task] = None

    def cancel_prefill(self) -> None:
        """Close the paired prefill call, if it still runs (the prefill worker sees it go and aborts)."""
        if self.prefill_task is not None and not self.prefill_task.done():
            self.prefill_task.cancel()


def pass_headers(resp: aiohttp.ClientResponse) -> list[tuple[str, str]]:
    """The worker's response headers the client gets (bodies pass undecoded, so content-encoding stays)."""
    out = []
    for k, v in resp.headers.items():
        lk = k.lower()
        if lk in _DROP_RESPONSE_HEADERS or lk.startswith("x-kvship-") or lk == "x-request-id":
            continue
        out.append((lk, v))
    return out


PAIR_FAILED_CODE = "pd_request_failed"


def is_pair_error(err: object) -> bool:
    """Whether a PD worker's error object (``{"message": ..., "code": ...}``) says the attempt failed on its
    pair (``pd_request_failed``: the KV transfer failed or timed out, the peer went away).  A live worker
    answers this when its peer died, so it is not counted against the worker that answered: the dead one
    is caught by its own connection errors and health checks (docs/router.md, "Reliability")."""
    return isinstance(err, dict) and err.get("code") == PAIR_FAILED_CODE


def pair_failure(body: bytes) -> bool:
    """``is_pair_error`` of an error reply's body."""
    try:
        return is_pair_error(json.loads(body).get("error"))
    except (ValueError, AttributeError):
        return False


def describe_error(e: BaseException) -> str:
    """``Type: message`` (or just ``Type``) of an attempt's exception, for logs, metrics and errors."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def open_upstream(
    ctx: RequestContext, worker: Worker, lease: Lease, content: bytes, path: Optional[str] = None
) -> Upstream:
    """Send one attempt to ``worker`` (``path``, default the client's route) and wait until something
    can be given to the client.

    Finishes ``lease`` on every path except a returned stream (the relay finishes it then).
    Raises ``AttemptFailed`` or ``DeadlineExceeded``.
    """
    client = ctx.router.client
    assert client is not None
    resp: Optional[aiohttp.ClientResponse] = None
    try:
        async with asyncio.timeout_at(ctx.deadline):
            resp = await client.post(worker.url + (path or ctx.route), data=content, headers=ctx.headers)
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
        lease.finish(False, e.reason, blame=not pair_failure(e.body))
        close_response(resp)
        raise
    except aiohttp.ClientError as e:  # before TimeoutError: aiohttp's socket timeouts subclass both
        lease.finish(False, describe_error(e))
        close_response(resp)
        raise AttemptFailed(worker, describe_error(e), True) from None
    except TimeoutError:
        lease.finish(False, "timeout")
        close_response(resp)
        raise DeadlineExceeded() from None
    except BaseException:
        lease.finish(True)
        close_response(resp)
        raise


def close_response(resp: Optional[aiohttp.ClientResponse]) -> None:
    """Drop the connection of a response that may not have been read to the end (the worker sees it go)."""
    if resp is not None:
        resp.close()
