"""The router's HTTP surface (FastAPI on uvicorn).

Who may call what (docs/router.md, "Authentication"; keys in ``kvship.router.auth``):

* open: ``GET /health`` (always 200 while the process serves; JSON counts).
* a client key (open when the router has none): ``POST /v1/chat/completions``,
  ``/v1/completions``, ``/generate`` (proxied), ``GET /v1/models`` (union of the
  workers' models); ``GET /readiness`` (503 until some revision has an available
  worker of every role) also takes the admin and worker keys.
* the admin or the worker key (open only on a router with no key at all):
  ``GET /workers`` (workers with revision, state and ``in_rotation``, and the
  revisions), ``GET /slo[?window_s=S]`` (live SLO figures,
  ``kvship.router.slo``), ``GET /metrics`` (its labels name worker URLs).
* the admin key only (403 "admin API disabled" without ``--admin-api-key``):
  ``POST /workers`` ``{"url": ..., "role": "unified|prefill|decode"}`` (the URL
  must pass the allow-list, else 403 and nothing is sent to it),
  ``DELETE /workers?url=...``.

A missing or unknown key is a 401; a valid key of the wrong kind a 403.

Checks done here, before any worker is involved: the key (401/403), the
per-key limits (429 + ``Retry-After``), the global rate limit (429), body size
(413), JSON shape (400), unknown model (404).  Every response carries
``x-request-id`` (the client's, or a new one); the ``x-kvship-*`` headers
(worker URLs, traces) only with ``--debug-headers``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvship.common.protocol import REQUEST_ID_HEADER, SESSION_HEADER, TraceContext
from kvship.common.tracing import Tracing
from kvship.router.auth import ADMIN, CLIENT, WORKER, bearer_token, key_id
from kvship.router.config import RouterConfig
from kvship.router.core import Router, WorkerNotAllowed
from kvship.router.proxy import error_response, proxy_request
from kvship.router.ratelimit import RateLimited
from kvship.router.tracing import RequestSpans
from kvship.router.upstream import RequestContext
from kvship.router.wire import PROXY_ROUTES, RequestError, RoutingRequest, error_body, new_request_id
from kvship.router.worker import RegistrationError

logger = logging.getLogger(__name__)

_REQUEST_ID_OK = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")  # anything else is replaced by a fresh id


def _error(status: int, message: str, code: str, headers: Optional[dict[str, str]] = None) -> Response:
    return Response(
        error_body(message, status, code), status_code=status, media_type="application/json", headers=headers
    )


async def read_body_limited(request: Request, limit: int) -> bytes:
    """The request body, or ``RequestError(413)`` as soon as it passes ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            if int(length) > limit:
                raise RequestError(
                    413, f"request body of {length} bytes exceeds --max-request-bytes ({limit})", "request_too_large"
                )
        except ValueError:
            raise RequestError(400, "invalid Content-Length header") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"request body exceeds --max-request-bytes ({limit})", "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


_CLIENT_ONLY = frozenset({CLIENT})
_OPERATOR = frozenset({ADMIN, WORKER})
_ADMIN_ONLY = frozenset({ADMIN})
_ANY_KEY = frozenset({CLIENT, ADMIN, WORKER})


class _Endpoint:
    """A proxied route as a plain ASGI app: ``handler(request, releases)`` builds the response, and every
    callable it put in ``releases`` (the per-key in-flight count) runs once that response has ended, its
    stream included, however it ended."""

    def __init__(self, handler):
        self.handler = handler

    async def __call__(self, scope, receive, send) -> None:
        releases: list = []
        try:
            response = await self.handler(Request(scope, receive, send), releases)
            await response(scope, receive, send)
        finally:
            for release in releases:
                release()


def create_app(config: RouterConfig, router: Optional[Router] = None) -> FastAPI:
    """The ASGI app of one router; its lifespan starts and stops ``router`` (built from ``config`` if None)."""
    router = router or Router(config)
    creds = router.credentials
    # OpenTelemetry (docs/observability.md): off unless --otlp-traces-endpoint; then each request gets spans,
    # recorded raw on the request path and encoded and exported by a child process ("Cost")
    tracing = Tracing.configure(
        config.otlp_traces_endpoint, config.otlp_traces_sample_ratio, "kvship-router", export_process=True
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()
            tracing.shutdown()  # exports the spans still buffered

    app = FastAPI(title="kvship router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    def _denied(request: Request, allowed: frozenset[str], what: str) -> Optional[Response]:
        kind = creds.classify(request.headers.get("authorization")).kind
        if kind in allowed:
            return None
        if kind is None:
            return _error(
                401,
                f"missing or wrong API key: {what} (send 'Authorization: Bearer <key>')",
                "invalid_api_key",
                {"www-authenticate": "Bearer"},
            )
        return _error(403, f"a {kind} key is not accepted here: {what}", "forbidden")

    def unauthorized(request: Request) -> Optional[Response]:
        """The serving routes: a client key, when the router has any."""
        if not creds.has_client_keys:
            return None
        return _denied(request, _CLIENT_ONLY, "this route takes a client key")

    def not_operator(request: Request) -> Optional[Response]:
        """``GET /workers``, ``/slo``, ``/metrics``: the admin or the worker key."""
        if not (creds.has_admin_key or creds.has_worker_key):
            if not creds.any:
                return None  # a router with no key at all is open (docs/router.md, "Authentication")
            return _error(
                403,
                "this route takes the admin or the worker key, and the router has neither "
                "(--admin-api-key / --worker-api-key)",
                "admin_api_disabled",
            )
        return _denied(request, _OPERATOR, "this route takes the admin or the worker key")

    def not_admin(request: Request) -> Optional[Response]:
        """``POST`` / ``DELETE /workers``: the admin key; 403 when the router has none."""
        if not creds.has_admin_key:
            return _error(403, "admin API disabled: start the router with --admin-api-key", "admin_api_disabled")
        return _denied(request, _ADMIN_ONLY, "the admin API takes the admin key (--admin-api-key)")

    def limit_key(request: Request) -> str:
        """Whom the per-key limits count: the client key presented, else the client's address."""
        if creds.has_client_keys:
            return key_id(bearer_token(request.headers.get("authorization")) or "")
        return "addr:" + (request.client.host if request.client else "?")

    def forward_headers(request_id: str) -> dict[str, str]:
        h = {"content-type": "application/json", REQUEST_ID_HEADER: request_id}
        h.update(router.worker_headers)  # the worker key; a client's own Authorization never goes to a worker
        return h

    async def proxied(request: Request, releases: list) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER, "")
        if not _REQUEST_ID_OK.fullmatch(request_id):
            request_id = new_request_id()
        route = request.url.path
        ctx = RequestContext(router, request_id, route, {})
        denied = unauthorized(request)
        if denied is not None:
            ctx.finish(denied.status_code, "")
            denied.headers[REQUEST_ID_HEADER] = request_id
            return denied
        try:
            if router.key_limits is not None:
                releases.append(router.key_limits.admit(limit_key(request)))
            if router.limiter is not None:
                await router.limiter.acquire()
            raw = await read_body_limited(request, config.max_request_bytes)
            req = RoutingRequest.parse(route, raw, request.headers.get(SESSION_HEADER))
            if req.model is not None and not router.registry.knows_model(req.model):
                known = router.registry.models()
                raise RequestError(
                    404,
                    f"model {req.model!r} not found; served models: {', '.join(known) or 'none yet'}",
                    "model_not_found",
                )
        except RateLimited as e:
            router.metrics.rate_limited.inc()
            return error_response(ctx, 429, e.reason, "rate_limited", {"retry-after": e.retry_after_header})
        except RequestError as e:
            return error_response(ctx, e.status, e.message, e.code, e.headers)
        except ClientDisconnect:
            return error_response(ctx, 400, "client disconnected while sending the body", "client_disconnect")
        ctx.headers = forward_headers(request_id)
        trace = TraceContext.from_headers(request.headers)  # a client's W3C trace context is kept
        if tracing.enabled:
            ctx.spans = RequestSpans(tracing, trace, route, request_id, ctx.started_wall)
            ctx.headers.update(ctx.spans.headers())
        elif trace is not None:  # no spans here: the workers continue the client's trace themselves
            ctx.headers.update(trace.headers())
        return await proxy_request(ctx, req)

    for path in PROXY_ROUTES:
        app.add_route(path, _Endpoint(proxied), methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        workers = router.registry.all()
        return JSONResponse(
            {"status": "ok", "workers": len(workers), "healthy_workers": sum(1 for w in workers if w.healthy)}
        )

    @app.get("/readiness")
    async def readiness(request: Request) -> Response:
        denied = _denied(request, _ANY_KEY, "send a client, admin or worker key") if creds.has_client_keys else None
        if denied is not None:
            return denied
        counts = {role: len(router.registry.available(role)) for role in router.roles}
        ready = router.ready()
        return JSONResponse(
            {"status": "ready" if ready else "not_ready", "available": counts}, status_code=200 if ready else 503
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        denied = not_operator(request)
        if denied is not None:
            return denied
        router.registry.publish_all()
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    @app.get("/slo")
    async def slo(request: Request) -> Response:
        denied = not_operator(request)
        if denied is not None:
            return denied
        raw = request.query_params.get("window_s")
        window: Optional[float] = None
        if raw is not None:
            try:
                window = float(raw)
            except ValueError:
                window = -1.0
            if not 0 < window <= config.slo_window:
                return _error(
                    400, f"window_s must be a number in (0, {config.slo_window:g}] (--slo-window)", "invalid_request"
                )
        return JSONResponse(router.slo.summary(window))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        denied = unauthorized(request)
        if denied is not None:
            return denied
        now = int(time.time())
        data = [{"id": m, "object": "model", "created": now, "owned_by": "kvship"} for m in router.registry.models()]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/workers")
    async def list_workers(request: Request) -> Response:
        denied = not_operator(request)
        if denied is not None:
            return denied
        return JSONResponse(router.workers_report())

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        denied = not_admin(request)
        if denied is not None:
            return denied
        try:
            body = json.loads(await read_body_limited(request, 64 * 1024))
        except RequestError as e:
            return _error(e.status, e.message, e.code)
        except (ValueError, RecursionError):
            return _error(400, 'body must be JSON: {"url": ..., "role": ...}', "invalid_json")
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            return _error(400, 'body must be {"url": "http://host:port", "role": ...}', "invalid_request")
        role = body.get("role") or (None if config.pd else "unified")
        if role is None:
            return _error(400, 'PD router: give "role": "prefill" or "decode"', "invalid_request")
        try:
            worker = await router.add_worker(body["url"], role)
        except WorkerNotAllowed as e:
            logger.warning("admin API: registration of %s refused: %s", body["url"][:200], e)
            return _error(403, str(e), "worker_not_allowed")
        except (RegistrationError, ValueError) as e:
            return _error(400, str(e), "registration_failed")
        logger.info("worker %s (%s) added through the admin API", worker.url, worker.role)
        return JSONResponse(router.worker_json(worker), status_code=200)

    @app.delete("/workers")
    async def remove_worker(request: Request) -> Response:
        denied = not_admin(request)
        if denied is not None:
            return denied
        url = request.query_params.get("url")
        if not url:
            return _error(400, "give the worker as ?url=http://host:port", "invalid_request")
        if not router.registry.remove(url):
            return _error(404, f"no worker {url}", "worker_not_found")
        return JSONResponse({"removed": url.rstrip("/")})

    return app
