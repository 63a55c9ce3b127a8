"""Test doubles and harnesses for router tests (test code only; never imported by product code).

* ``start_double(...)``: a context manager running a *fast test-double worker*
  in a subprocess (a real uvicorn HTTP server on loopback) that implements the
  worker HTTP surface: ``GET /health``, ``/get_server_info``,
  ``/get_model_info``, ``/v1/models``; ``POST /generate``,
  ``/v1/completions``, ``/v1/chat/completions`` (JSON or SSE streaming).
  Its reply text is a deterministic function of the prompt (so "through the
  router equals direct" is meaningful) and names the double.  Behaviour is
  set at start (keyword args) or at run time with ``double.control(...)``:
  ``delay`` (s before answering), ``chunk_delay`` (s between SSE chunks),
  ``tokens`` (chunks per reply), ``fail_next`` + ``fail_status`` (answer the
  next N generation requests with that status), ``healthy`` (``/health``
  200/503), ``die_after_chunks`` (exit the process mid-stream).  Asked for
  token ids (``x-kvship-token-ids: 1``), OpenAI stream chunks carry
  ``kvship_token_ids`` (one id per word) and the first ``kvship_prompt_ids``.
  ``double.requests()`` lists what it received (route, body, headers);
  ``double.kill()`` SIGKILLs it, ``double.restart()`` brings it back on the
  same port.
* ``running_router(config)``: an async context manager serving a router
  in-process (uvicorn on a loopback socket bound to port 0); yields its URL.
* ``router_process(args)``: a context manager running ``kvship router`` as a
  subprocess (for SIGTERM / CLI tests); yields its URL.

Run ``python tests/router_fixtures.py --port 0`` to start a double by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Iterator, Optional

from kvship.common.ports import free_port  # below the ephemeral range: no race with bind(0)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PYTHON = sys.executable


# --------------------------------------------------------------------------------------------------
# The double (runs in the child process)
# --------------------------------------------------------------------------------------------------


def reply_words(text: str, n: int) -> list[str]:
    """The deterministic 'greedy' continuation of ``text``: ``n`` words derived from its hash."""
    digest = hashlib.sha256(text.encode()).hexdigest()
    return [f"w{digest[(2 * i) % 60 : (2 * i) % 60 + 4]}" for i in range(n)]


def _prompt_of(route: str, body: dict) -> str:
    if route == "/v1/chat/completions":
        return "".join(f"{m.get('role')}:{m.get('content')}\n" for m in body.get("messages", []))
    if route == "/v1/completions":
        return json.dumps(body.get("prompt"))
    return json.dumps(body.get("text") if body.get("text") is not None else body.get("input_ids"))


def build_double_app(name: str, model: str, mode: str, bootstrap_port: Optional[int], behaviour: dict):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    state = {
        "delay": 0.0,
        "chunk_delay": 0.0,
        "tokens": 4,
        "fail_next": 0,
        "fail_status": 503,
        "fail_code": None,  # the error body's code (``pd_request_failed``: a PD worker reporting its pair's failure)
        "healthy": True,
        "die_after_chunks": -1,
    }
    state.update(behaviour)
    log: list[dict] = []

    async def health(_: Request) -> Response:
        return Response(status_code=200 if state["healthy"] else 503)

    async def server_info(_: Request) -> Response:
        info: dict[str, Any] = {"served_model_name": model, "mode": mode, "name": name}
        if mode == "prefill":
            info["disaggregation_bootstrap_port"] = bootstrap_port
        return JSONResponse(info)

    async def model_info(_: Request) -> Response:
        return JSONResponse({"model_path": f"/models/{model}", "is_generation": True})

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "test"}]})

    async def control(request: Request) -> Response:
        state.update(await request.json())
        return JSONResponse(state)

    async def requests_log(_: Request) -> Response:
        return JSONResponse(log)

    def chunk_json(route: str, rid: str, word: Optional[str], finish: Optional[str]) -> dict:
        if route == "/v1/chat/completions":
            delta = {"content": word} if word is not None else {}
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
        if route == "/v1/completions":
            return {
                "id": rid,
                "object": "text_completion",
                "model": model,
                "choices": [{"index": 0, "text": word or "", "finish_reason": finish}],
            }
        return {"text": word or "", "meta_info": {"id": rid, "finish_reason": finish}}

    async def generate(request: Request) -> Response:
        route = request.url.path
        body = await request.json()
        log.append(
            {
                "route": route,
                "body": body,
                "time": time.time(),
                "headers": {
                    k: v
                    for k, v in request.headers.items()
                    if k in ("x-request-id", "authorization", "x-session-id", "traceparent")
                },
            }
        )
        if state["fail_next"] > 0:
            state["fail_next"] -= 1
            err = {"message": f"{name} told to fail"}
            if state["fail_code"]:
                err["code"] = state["fail_code"]
            return JSONResponse({"error": err}, status_code=state["fail_status"])
        if state["delay"]:
            await asyncio.sleep(state["delay"])
        n = int(
            body.get("max_tokens")
            or body.get("max_new_tokens")
            or (body.get("sampling_params") or {}).get("max_new_tokens")
            or state["tokens"]
        )
        words = reply_words(_prompt_of(route, body), n)
        rid = request.headers.get("x-request-id", "rid")
        if mode == "prefill":
            return JSONResponse({"prefill": name, "room": body.get("bootstrap_room")})
        if body.get("stream"):
            ids_asked = request.headers.get("x-kvship-token-ids") == "1" and route != "/generate"

            async def events():
                for i, w in enumerate(words):
                    if state["die_after_chunks"] == i:
                        os._exit(1)
                    piece = (" " if i else "") + w
                    chunk = chunk_json(route, rid, piece, None)
                    if ids_asked:  # like a real worker: token ids for the router (one id per word here)
                        chunk["kvship_token_ids"] = [100 + i]
                        if i == 0:
                            chunk["kvship_prompt_ids"] = [1, 2, 3]
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    if state["chunk_delay"]:
                        await asyncio.sleep(state["chunk_delay"])
                yield f"data: {json.dumps(chunk_json(route, rid, None, 'length'))}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        text = " ".join(words)
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        if route == "/v1/chat/completions":
            out = {
                "id": rid,
                "object": "chat.completion",
                "model": model,
                "usage": usage,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
            }
        elif route == "/v1/completions":
            out = {
                "id": rid,
                "object": "text_completion",
                "model": model,
                "usage": usage,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            }
        else:
            out = {"text": text, "meta_info": {"id": rid, "finish_reason": {"type": "length"}}}
        out["worker"] = name
        if mode == "decode":
            out["bootstrap"] = {k: body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
        return JSONResponse(out)

    routes = [
        Route("/health", health),
        Route("/get_server_info", server_info),
        Route("/get_model_info", model_info),
        Route("/v1/models", models),
        Route("/_control", control, methods=["POST"]),
        Route("/_requests", requests_log),
    ]
    routes += [Route(p, generate, methods=["POST"]) for p in ("/generate", "/v1/completions", "/v1/chat/completions")]
    return Starlette(routes=routes)


def _double_main(argv: list[str]) -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--name", default="double")
    p.add_argument("--model", default="double-model")
    p.add_argument("--mode", default="unified")
    p.add_argument("--bootstrap-port", type=int, default=None)
    p.add_argument("--behaviour", default="{}")
    a = p.parse_args(argv)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", a.port))
    sock.listen(1024)
    app = build_double_app(a.name, a.model, a.mode, a.bootstrap_port, json.loads(a.behaviour))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])


# --------------------------------------------------------------------------------------------------
# Parent-side handles
# --------------------------------------------------------------------------------------------------


def _read_port(proc: subprocess.Popen, timeout: float, what: str) -> int:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    buf = b""
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 0.1)
        if r:
            line = proc.stdout.readline()
            if not line:
                break
            buf += line
            if line.startswith(b"PORT "):
                return int(line.split()[1])
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{what} did not start: {buf.decode(errors='replace')}")


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy


def _http_json(url: str, body: Any = None, timeout: float = 5.0) -> Any:
    """GET (or POST ``body`` as JSON) with the standard library: no client set-up cost per call."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with _OPENER.open(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with _OPENER.open(url, timeout=1.0) as resp:
                if resp.status < 500:
                    return
        except urllib.error.HTTPError as e:
            if e.code < 500:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


class WorkerDouble:
    """Handle on one test-double worker subprocess."""

    def __init__(self, name: str, model: str, mode: str, bootstrap_port: Optional[int], behaviour: dict):
        self.name, self.model, self.mode, self.bootstrap_port = name, model, mode, bootstrap_port
        self.behaviour = behaviour
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            PYTHON,
            os.path.join(HERE, "router_fixtures.py"),
            "--port",
            str(self.port),
            "--name",
            self.name,
            "--model",
            self.model,
            "--mode",
            self.mode,
            "--behaviour",
            json.dumps(self.behaviour),
        ]
        if self.bootstrap_port is not None:
            cmd += ["--bootstrap-port", str(self.bootstrap_port)]
        return cmd

    def start(self, timeout: float = 30.0) -> "WorkerDouble":
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, cwd=REPO)
        self.port = _read_port(self.proc, timeout, f"double {self.name}")
        _wait_http(self.url + "/health", timeout)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self, timeout: float = 30.0) -> None:
        self.kill()
        self.start(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def control(self, **changes: Any) -> dict:
        return _http_json(self.url + "/_control", changes)

    def requests(self) -> list[dict]:
        return _http_json(self.url + "/_requests")


@contextlib.contextmanager
def start_double(
    name: str = "double",
    model: str = "double-model",
    mode: str = "unified",
    bootstrap_port: Optional[int] = None,
    **behaviour: Any,
) -> Iterator[WorkerDouble]:
    if mode == "prefill" and bootstrap_port is None:
        bootstrap_port = 8998
    d = WorkerDouble(name, model, mode, bootstrap_port, behaviour)
    d.start()
    try:
        yield d
    finally:
        d.kill()


@contextlib.contextmanager
def start_doubles(n: int, **kwargs: Any) -> Iterator[list[WorkerDouble]]:
    """``n`` doubles named w0..w{n-1}, started in parallel."""
    behaviour = {k: v for k, v in kwargs.items() if k not in ("model", "mode", "bootstrap_port")}
    doubles = [
        WorkerDouble(
            f"w{i}",
            kwargs.get("model", "double-model"),
            kwargs.get("mode", "unified"),
            kwargs.get("bootstrap_port"),
            behaviour,
        )
        for i in range(n)
    ]
    try:
        for d in doubles:  # launch all, then read ports (startups overlap)
            d.proc = subprocess.Popen(d.command(), stdout=subprocess.PIPE, cwd=REPO)
        for d in doubles:
            assert d.proc is not None
            d.port = _read_port(d.proc, 30.0, f"double {d.name}")
            _wait_http(d.url + "/health", 30.0)
        yield doubles
    finally:
        for d in doubles:
            d.kill()


# --------------------------------------------------------------------------------------------------
# Routers
# --------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_router(config):
    """Serve ``create_app(config)`` in this event loop on a loopback port; yield ``(url, app)``."""
    import uvicorn

    from kvship.router.app import create_app

    app = create_app(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, log_config=None))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("router did not start")
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


@contextlib.contextmanager
def router_process(
    args: list[str], env: Optional[dict] = None, timeout: float = 30.0
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``kvship router --host 127.0.0.1 --port <free> *args`` as a subprocess; yield ``(url, proc)``."""
    port = free_port()
    cmd = [PYTHON, "-m", "kvship.app.cli", "router", "--host", "127.0.0.1", "--port", str(port), *args]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stderr=log)
    proc.log = log  # type: ignore[attr-defined]  # read with router_log(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/health", timeout)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def router_log(proc: subprocess.Popen) -> str:
    """What a ``router_process`` wrote to stderr so far."""
    log = proc.log  # type: ignore[attr-defined]
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")


if __name__ == "__main__":
    _double_main(sys.argv[1:])
