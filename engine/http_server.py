"""The worker's HTTP server (FastAPI + uvicorn).

``create_app(engine, server_args)`` builds the app around a running
``Engine``; ``serve_engine(engine, server_args)`` serves it until
SIGINT/SIGTERM, then stops the engine.  The caller builds the engine (the app
shell, ``kvship.app.serve``, picks the role's scheduler), so the model is
loaded before the port opens.

Routes (docs/api.md has the full reference and curl examples):

=====================  =====================================================
POST /v1/chat/completions  OpenAI chat (streaming and not)
POST /v1/completions       OpenAI completions (string, list, token ids)
GET  /v1/models            the served model
POST /generate             SGLang-style native generation
POST /abort_request        abort a request by ``rid``
GET  /health               200 while the model loop runs, else 503
GET  /get_server_info      config, KV slots, running/waiting counts
GET  /get_model_info       model path, name, architectures, context, vocab
GET  /metrics              Prometheus text format
=====================  =====================================================

With ``--api-key`` (env ``KVSHIP_API_KEY``; in a deployment the *worker key*,
docs/router.md "Authentication") every route but ``GET /health`` requires
``Authorization: Bearer <key>`` (``BodyGuardMiddleware``): ``/abort_request``
and the info routes included.  A prefill or decode worker without one logs a
warning at startup: anyone who reaches it could then steer its KV transfers.

The event loop never waits on the model: handlers only enqueue requests and
await their chunk queues (``kvship.engine.engine``).  Request bodies are
parsed by hand so malformed JSON (400) and schema errors (422) get
OpenAI-style bodies; see ``kvship.engine.http_errors`` for statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from kvship.engine.config import ServerArgs
from kvship.engine.engine import Engine
from kvship.engine.http_errors import (
    APIError,
    BodyGuardMiddleware,
    bad_request,
    error_body,
    install_exception_handlers,
    parse_json_body,
)
from kvship.engine.metrics import CONTENT_TYPE
from kvship.engine.openai_protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateReqInput,
    ModelCard,
    ModelList,
)
from kvship.engine.serving import MAX_N
from kvship.engine.serving_generate import GenerateServing
from kvship.engine.serving_openai import OpenAIServing

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


async def _parse(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:  # pydantic's own JSON parser: a 4096-id /generate body in ~0.25 ms, against ~0.6 ms via json.loads
        return model.model_validate_json(raw)
    except ValidationError:
        pass  # the path below gives the error its message: 400 for the JSON, 422 naming the field
    data = parse_json_body(raw)
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    return model.model_validate(data)


def create_app(engine: Engine, server_args: Optional[ServerArgs] = None, *, own_engine: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine``.

    The caller owns the engine's lifetime unless ``own_engine`` is set: then
    the app's lifespan shutdown (SIGINT/SIGTERM under uvicorn, after open
    connections drain) stops the engine's scheduler thread.
    """
    sa = server_args or engine.server_args

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if own_engine:
                await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="kvship worker", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine = engine
    install_exception_handlers(app)
    app.add_middleware(BodyGuardMiddleware, max_bytes=sa.max_request_bytes, api_key=sa.api_key)
    if sa.mode in ("prefill", "decode") and not sa.api_key:
        logger.warning(
            "this %s worker has no --api-key (env KVSHIP_API_KEY): any caller that reaches its port can send it "
            "requests, abort others' and point its KV transfers anywhere. Run PD workers behind the worker key "
            '(docs/router.md, "Authentication"); the operator and `kvship local` always set one.',
            sa.mode,
        )
    openai = OpenAIServing(engine)
    native = GenerateServing(engine)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai.chat(request, await _parse(request, ChatCompletionRequest))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai.completions(request, await _parse(request, CompletionRequest))

    @app.get("/v1/models")
    async def list_models() -> dict:
        return ModelList(data=[_model_card(engine)]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if model_id not in (engine.served_model_name, engine.model_path):
            raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return _model_card(engine).model_dump()

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await native.generate(request, await _parse(request, GenerateReqInput))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict:
        body = await _parse(request, AbortRequest)
        aborted = [r for r in _rid_family(engine, body.rid) if engine.abort(r)]
        return {"rid": body.rid, "aborted": len(aborted)}

    @app.get("/health")
    async def health() -> Response:
        if engine.is_alive():
            return JSONResponse({"status": "ok"})
        return JSONResponse(
            error_body(503, f"the model loop is not running: {engine.failure or 'stopped'}", code="engine_dead"),
            status_code=503,
        )

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        return engine.server_info()

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return engine.model_info()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    # KV events (--enable-kv-events; docs/cache.md): the prefix cache's pages, behind the worker key like the rest
    @app.get("/kv_events/snapshot")
    async def kv_events_snapshot() -> dict:
        return _kv_event_log(engine).snapshot()

    @app.get("/kv_events")
    async def kv_events(after: int = 0, idle_timeout_s: float = 0.0) -> Response:
        log = _kv_event_log(engine)
        return StreamingResponse(_kv_event_stream(log, after, idle_timeout_s), media_type="application/x-ndjson")

    return app


def _kv_event_log(engine: Engine) -> Any:
    log = engine.scheduler.kv_events
    if log is None:
        raise APIError(404, "KV events are off on this worker (start it with --enable-kv-events)", code="not_found")
    return log


async def _kv_event_stream(log: Any, after: int, idle_timeout_s: float) -> AsyncIterator[bytes]:
    """One JSON event per line from ``after`` on; a ``{"gap": true, "seq": N}`` line (and the end of the
    stream) when the log no longer holds the next event: resync from /kv_events/snapshot.  With
    ``idle_timeout_s`` > 0 the stream ends after that long without an event (the client reconnects)."""
    seq = after
    idle_since = time.monotonic()
    while True:
        events = await asyncio.to_thread(log.wait_since, seq, 0.5)
        if events is None:
            yield (json.dumps({"gap": True, "seq": log.seq}) + "\n").encode()
            return
        for e in events:
            yield (json.dumps(e.to_json()) + "\n").encode()
            seq = e.seq
        if events:
            idle_since = time.monotonic()
        elif idle_timeout_s > 0 and time.monotonic() - idle_since >= idle_timeout_s:
            return


def _model_card(engine: Engine) -> ModelCard:
    return ModelCard(
        id=engine.served_model_name,
        created=int(engine.start_time),
        root=engine.model_path,
        max_model_len=engine.context_len,
    )


def _rid_family(engine: Engine, rid: str) -> list[str]:
    """``rid`` itself, or the per-choice ids ``rid-0``, ``rid-1``, ... of an n > 1 request."""
    if engine.has_request(rid):
        return [rid]
    return [f"{rid}-{i}" for i in range(MAX_N) if engine.has_request(f"{rid}-{i}")]


# after a fatal failure (``monitor``), the most seconds the graceful shutdown may take before a hard exit
FATAL_EXIT_GRACE_S = 30.0


def bind_http_socket(server_args: ServerArgs) -> socket.socket:
    """The worker's HTTP socket, bound and listening on ``--host``/``--port`` before the engine is built:
    the port is the worker's from its first moment (a transfer engine starting later picks its own ports
    among the free ones) and a port in use fails at once, not after the model loaded.  Connections made
    before serving starts wait in the backlog.  OSError when the address cannot be bound."""
    family = socket.AF_INET6 if ":" in server_args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((server_args.host, server_args.port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def serve_engine(
    engine: Engine,
    server_args: ServerArgs,
    monitor: Optional[Callable[[], Optional[str]]] = None,
    sock: Optional[socket.socket] = None,
) -> int:
    """Serve ``engine`` over HTTP until interrupted, then shut it down (always). Returns an exit code.

    ``sock`` is the socket ``bind_http_socket`` bound (else uvicorn binds
    ``--host``/``--port`` itself).  ``monitor`` (a tensor-parallel worker's
    rank watch) is polled while serving; when it returns a message the worker
    logs it, shuts down and exits 1 (hard, after ``FATAL_EXIT_GRACE_S``, if the
    shutdown hangs).
    """
    import uvicorn

    try:
        app = create_app(engine, server_args, own_engine=True)
        config = uvicorn.Config(
            app,
            host=server_args.host,
            port=server_args.port,
            log_level=server_args.log_level,
            access_log=server_args.log_level == "debug",
            timeout_keep_alive=30,
            timeout_graceful_shutdown=server_args.shutdown_timeout,
        )
        server = uvicorn.Server(config)
        failures: list[str] = []
        if monitor is not None:
            threading.Thread(target=_watch, args=(server, monitor, failures), name="kvship-watch", daemon=True).start()
        logger.info("serving %s on http://%s:%d", engine.served_model_name, server_args.host, server_args.port)
        server.run(sockets=[sock] if sock is not None else None)  # re-raises SIGTERM/SIGINT after shutting down
        return 0 if server.started and not failures else 1
    finally:
        engine.shutdown()
        if sock is not None:
            sock.close()


def _watch(server: Any, monitor: Callable[[], Optional[str]], failures: list[str], every_s: float = 0.2) -> None:
    """Stop ``server`` when ``monitor`` reports a fatal failure (see ``serve_engine``)."""
    while not server.should_exit:
        message = monitor()
        if message is not None:
            logger.error("%s: shutting the worker down", message)
            failures.append(message)
            server.should_exit = True
            timer = threading.Timer(FATAL_EXIT_GRACE_S, os._exit, (1,))
            timer.daemon = True
            timer.start()
            return
        time.sleep(every_s)
