"""The router's HTTP surface (FastAPI on uvicorn).

Public: ``GET /health`` (always 200 while the process serves; JSON counts).
Behind ``--api-key`` when set: ``POST /v1/chat/completions``,
``/v1/completions``, ``/generate`` (proxied), ``GET /v1/models`` (union of the
workers' models), ``GET /readiness`` (503 until some revision has an
available worker of every role), ``GET /metrics``, ``GET /slo[?window_s=S]``
(live SLO figures, ``kvship.router.slo``), and the admin API ``GET /workers``
(workers with revision, state and ``in_rotation``, and the revisions;
docs/router.md), ``POST /workers`` ``{"url": ..., "role":
"unified|prefill|decode"}``, ``DELETE /workers?url=...``.

Checks done here, before any worker is involved: API key (401), rate limit
(429 + ``Retry-After``), body size (413), JSON shape (400), unknown model
(404).  Every response carries ``x-request-id`` (the
client's, or a new one); proxied ones also ``x-kvship-worker``.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvship.router.config import RouterConfig
from kvship.router.core import Router
from kvship.router.proxy import error_response, proxy_request
from kvship.router.ratelimit import RateLimited
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


def create_app(config: RouterConfig, router: Optional[Router] = None) -> FastAPI:
    """The ASGI app of one router; its lifespan starts and stops ``router`` (built from ``config`` if None)."""
    router = router or Router(config)
    auth_value = f"Bearer {config.api_key}".encode() if config.api_key else None

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="kvship router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    def unauthorized(request: Request) -> Optional[Response]:
        if auth_value is None:
            return None
        got = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(got, auth_value):
            return None
        return _error(
            401,
            "missing or wrong API key (send 'Authorization: Bearer <key>')",
            "invalid_api_key",
            {"www-authenticate": "Bearer"},
        )

    def forward_headers(request: Request, request_id: str) -> dict[str, str]:
        h = {"content-type": "application/json", "x-request-id": request_id}
        if router.worker_headers:
            h.update(router.worker_headers)
        elif "authorization" in request.headers:
            h["authorization"] = request.headers["authorization"]
        return h

    async def proxied(request: Request) -> Response:
        request_id = request.headers.get("x-request-id", "")
        if not _REQUEST_ID_OK.fullmatch(request_id):
            request_id = new_request_id()
        route = request.url.path
        ctx = RequestContext(router, request_id, route, {})
        denied = unauthorized(request)
        if denied is not None:
            ctx.finish(401, "")
            denied.headers["x-request-id"] = request_id
            return denied
        try:
            if router.limiter is not None:
                await router.limiter.acquire()
            raw = await read_body_limited(request, config.max_request_bytes)
            req = RoutingRequest.parse(route, raw, request.headers.get("x-session-id"))
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
        ctx.headers = forward_headers(request, request_id)
        return await proxy_request(ctx, req)

    for path in PROXY_ROUTES:
        app.add_route(path, proxied, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        workers = router.registry.all()
        return JSONResponse(
            {"status": "ok", "workers": len(workers), "healthy_workers": sum(1 for w in workers if w.healthy)}
        )

    @app.get("/readiness")
    async def readiness(request: Request) -> Response:
        denied = unauthorized(request)
        if denied is not None:
            return denied
        counts = {role: len(router.registry.available(role)) for role in router.roles}
        ready = router.ready()
        return JSONResponse(
            {"status": "ready" if ready else "not_ready", "available": counts}, status_code=200 if ready else 503
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        denied = unauthorized(request)
        if denied is not None:
            return denied
        router.registry.publish_all()
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    @app.get("/slo")
    async def slo(request: Request) -> Response:
        denied = unauthorized(request)
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
        denied = unauthorized(request)
        if denied is not None:
            return denied
        return JSONResponse(router.workers_report())

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        denied = unauthorized(request)
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
        except (RegistrationError, ValueError) as e:
            return _error(400, str(e), "registration_failed")
        logger.info("worker %s (%s) added through the admin API", worker.url, worker.role)
        return JSONResponse(router.worker_json(worker), status_code=200)

    @app.delete("/workers")
    async def remove_worker(request: Request) -> Response:
        denied = unauthorized(request)
        if denied is not None:
            return denied
        url = request.query_params.get("url")
        if not url:
            return _error(400, "give the worker as ?url=http://host:port", "invalid_request")
        if not router.registry.remove(url):
            return _error(404, f"no worker {url}", "worker_not_found")
        return JSONResponse({"removed": url.rstrip("/")})

    return app
