"""The router's separate credentials, registration allow-list, header stripping and per-key limits
(docs/router.md, "Authentication", "Response headers", "Per-key limits"), over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.server
import json
import logging
import socket
import threading

import httpx
import pytest
from router_fixtures import running_router, start_double, start_doubles

from kvship.router.auth import WorkerAllowList
from kvship.router.config import RouterConfig
from kvship.router.ratelimit import KeyLimits

pytestmark = pytest.mark.timeout(120)

CHAT = {"model": "double-model", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
CLIENT, ADMIN, WORKER = "client-key", "admin-key", "worker-key"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def doubles():
    with start_doubles(2) as ds:
        yield ds


@contextlib.contextmanager
def recorder(health_status: int = 200):
    """A tiny HTTP server on loopback that answers every GET with ``health_status`` (JSON) and records each
    request's path and headers; yields ``(url, requests)``."""
    seen: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            seen.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}})
            body = json.dumps({"status": "ok"}).encode()
            self.send_response(health_status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------------------------ admin API


async def test_client_key_cannot_register_or_delete_workers_and_the_admin_key_can(doubles):
    config = RouterConfig(
        worker_urls=[doubles[0].url],
        api_key=CLIENT,
        admin_api_key=ADMIN,
        worker_api_key=WORKER,
        health_check_interval=60,
    )
    new = {"url": doubles[1].url}
    async with running_router(config) as (url, _):
        async with httpx.AsyncClient(timeout=30) as c:
            as_client = await c.post(url + "/workers", json=new, headers=bearer(CLIENT))
            as_worker = await c.post(url + "/workers", json=new, headers=bearer(WORKER))
            anonymous = await c.post(url + "/workers", json=new)
            wrong = await c.post(url + "/workers", json=new, headers=bearer("guess"))
            delete_as_client = await c.delete(url + "/workers", params={"url": doubles[0].url}, headers=bearer(CLIENT))
            read_as_client = await c.get(url + "/workers", headers=bearer(CLIENT))
            listed = (await c.get(url + "/workers", headers=bearer(WORKER))).json()
            added = await c.post(url + "/workers", json=new, headers=bearer(ADMIN))
            removed = await c.delete(url + "/workers", params={"url": doubles[0].url}, headers=bearer(ADMIN))
            after = (await c.get(url + "/workers", headers=bearer(ADMIN))).json()
    assert as_client.status_code == 403 and as_client.json()["error"]["code"] == "forbidden"
    assert as_worker.status_code == 403
    assert anonymous.status_code == 401 and wrong.status_code == 401
    assert delete_as_client.status_code == 403 and read_as_client.status_code == 403
    assert [w["url"] for w in listed["workers"]] == [doubles[0].url]  # nothing changed by the refused calls
    assert added.status_code == 200 and removed.status_code == 200
    assert [w["url"] for w in after["workers"]] == [doubles[1].url]


async def test_admin_api_answers_403_when_no_admin_key_is_configured(doubles):
    config = RouterConfig(worker_urls=[doubles[0].url], api_key=CLIENT, worker_api_key=WORKER, health_check_interval=60)
    async with running_router(config) as (url, _):
        async with httpx.AsyncClient(timeout=30) as c:
            rs = [
                await c.post(url + "/workers", json={"url": doubles[1].url}, headers=h)
                for h in (bearer(CLIENT), bearer(WORKER), {})
            ]
            gone = await c.delete(url + "/workers", params={"url": doubles[0].url}, headers=bearer(WORKER))
            listed = (await c.get(url + "/workers", headers=bearer(WORKER))).json()
    for r in [*rs, gone]:
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "admin_api_disabled" and "--admin-api-key" in r.json()["error"]["message"]
    assert [w["url"] for w in listed["workers"]] == [doubles[0].url]


async def test_registration_outside_the_allow_list_is_refused_and_no_request_reaches_it():
    with recorder() as (target, seen):
        config = RouterConfig(admin_api_key=ADMIN, worker_allow_cidrs="10.0.0.0/8", worker_allow_hosts="*.ns.svc")
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30, headers=bearer(ADMIN)) as c:
                by_ip = await c.post(url + "/workers", json={"url": target})
                by_name = await c.post(url + "/workers", json={"url": "http://evil.example.com:30000"})
                suffix_trick = await c.post(url + "/workers", json={"url": "http://x.ns.svc.evil.com:1"})
                listed = (await c.get(url + "/workers")).json()
    for r in (by_ip, by_name, suffix_trick):
        assert r.status_code == 403 and r.json()["error"]["code"] == "worker_not_allowed", r.text
    assert "--worker-allow-cidrs" in by_ip.json()["error"]["message"]
    assert "--worker-allow-hosts" in by_name.json()["error"]["message"]
    assert seen == [] and listed["workers"] == []


def test_allow_list_matches_cidrs_and_host_patterns_and_defaults_to_loopback():
    default = WorkerAllowList.from_flags("", "")
    assert default.refusal("http://127.0.0.1:30000") is None and default.refusal("http://[::1]:1") is None
    assert default.refusal("http://localhost:1") is None
    assert default.refusal("http://10.1.2.3:1") is not None
    ns = WorkerAllowList.from_flags("10.0.0.0/8,fd00::/8", "*.ns.svc,*.ns.svc.cluster.local,router-host")
    assert ns.refusal("http://10.244.0.5:30000") is None and ns.refusal("http://[fd00::5]:1") is None
    assert ns.refusal("http://p-0.kv-prefill.ns.svc:30000") is None and ns.refusal("http://router-host:1") is None
    for bad in ("http://ns.svc:1", "http://a.other.svc:1", "http://127.0.0.1:1", "http://192.168.0.1:1"):
        assert ns.refusal(bad) is not None, bad
    with pytest.raises(ValueError, match="--worker-allow-cidrs"):
        WorkerAllowList.from_flags("10.0.0.0/33", "")
    with pytest.raises(ValueError, match="--worker-allow-hosts"):
        WorkerAllowList.from_flags("", "a.*.svc")


async def test_worker_key_is_never_sent_to_a_url_that_failed_registration(doubles):
    with recorder(health_status=404) as (target, seen):
        config = RouterConfig(admin_api_key=ADMIN, worker_api_key=WORKER, health_check_interval=60)
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30, headers=bearer(ADMIN)) as c:
                failed = await c.post(url + "/workers", json={"url": target})
                accepted = await c.post(url + "/workers", json={"url": doubles[0].url})
    assert failed.status_code == 400 and "GET /health answered 404" in failed.json()["error"]["message"]
    assert [r["path"] for r in seen] == ["/health"]
    assert all("authorization" not in r["headers"] for r in seen)
    assert accepted.status_code == 200  # an accepted worker's info is read with the worker key


# ------------------------------------------------------------------------------------------ workers


@pytest.fixture(scope="module")
def worker_engine(tiny_llama_dir):
    from kvship.engine.config import ServerArgs
    from kvship.engine.engine import Engine

    engine = Engine(
        ServerArgs(model_path=tiny_llama_dir, served_model_name="tiny", max_total_tokens=2048, api_key=WORKER)
    )
    yield engine
    engine.shutdown()


@contextlib.asynccontextmanager
async def serving(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, log_config=None))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


async def test_worker_rejects_the_client_key_and_accepts_the_worker_key(worker_engine):
    from kvship.engine.http_server import create_app

    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    async with serving(create_app(worker_engine)) as worker:
        config = RouterConfig(worker_urls=[worker], api_key=CLIENT, worker_api_key=WORKER, health_check_interval=60)
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=60) as c:
                routed = await c.post(url + "/generate", json=body, headers=bearer(CLIENT))
                direct = {
                    path: await c.request(method, worker + path, json=payload, headers=bearer(CLIENT))
                    for method, path, payload in (
                        ("POST", "/generate", body),
                        ("POST", "/abort_request", {"rid": "someone-elses"}),
                        ("GET", "/get_server_info", None),
                        ("GET", "/metrics", None),
                    )
                }
                abort = await c.post(worker + "/abort_request", json={"rid": "x"}, headers=bearer(WORKER))
                health = await c.get(worker + "/health")
    assert routed.status_code == 200 and routed.json()["text"] is not None
    for path, r in direct.items():
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert abort.status_code == 200 and health.status_code == 200


def test_pd_worker_without_an_api_key_warns_at_startup(worker_engine, caplog):
    from kvship.engine.http_server import create_app

    with caplog.at_level(logging.WARNING, logger="kvship.engine.http_server"):
        create_app(worker_engine, dataclasses.replace(worker_engine.server_args, mode="decode", api_key=None))
        create_app(worker_engine, dataclasses.replace(worker_engine.server_args, mode="unified", api_key=None))
        create_app(worker_engine, dataclasses.replace(worker_engine.server_args, mode="prefill"))
    warnings = [r.getMessage() for r in caplog.records if "no --api-key" in r.getMessage()]
    assert len(warnings) == 1 and "decode worker" in warnings[0]


# ------------------------------------------------------------------------------------------ headers


def kvship_headers(r: httpx.Response) -> list[str]:
    return [k for k in r.headers if k.lower().startswith("x-kvship-")]


async def _replies(url: str, streamed_and_not: list[tuple[str, dict]]) -> list[httpx.Response]:
    out = []
    async with httpx.AsyncClient(timeout=30) as c:
        for route, body in streamed_and_not:
            for stream in (False, True):
                r = await c.post(url + route, json={**body, "stream": stream})
                await r.aread()
                assert r.status_code == 200, r.text
                out.append(r)
    return out


async def test_no_x_kvship_header_reaches_the_client_without_debug_headers(doubles):
    bodies = [("/v1/chat/completions", CHAT), ("/generate", {"text": "x", "return_trace": True})]
    async with running_router(RouterConfig(worker_urls=[d.url for d in doubles])) as (url, _):
        plain = await _replies(url, bodies)
    async with running_router(RouterConfig(worker_urls=[d.url for d in doubles], debug_headers=True)) as (url, _):
        debug = await _replies(url, bodies)
    assert all(kvship_headers(r) == [] and r.headers["x-request-id"] for r in plain)
    assert all("x-kvship-worker" in r.headers for r in debug)


async def test_no_x_kvship_header_reaches_the_client_in_pd_mode_without_debug_headers():
    with start_double(name="p0", mode="prefill", bootstrap_port=8998) as p, start_double(name="d0", mode="decode") as d:
        bodies = [
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", {"model": "double-model", "prompt": "a", "max_tokens": 3}),
            ("/generate", {"text": "x", "return_trace": True}),
        ]
        for debug in (False, True):
            config = RouterConfig(pd=True, prefill=[p.url], decode=[d.url], debug_headers=debug)
            async with running_router(config) as (url, _):
                rs = await _replies(url, bodies)
            if debug:
                assert all(r.headers["x-kvship-decode"] == d.url for r in rs)
                assert any("x-kvship-trace" in r.headers for r in rs)
            else:
                assert all(kvship_headers(r) == [] for r in rs), [kvship_headers(r) for r in rs]


async def test_a_failed_request_names_no_worker_address_without_debug_headers():
    with start_double(name="doomed") as doomed:
        config = RouterConfig(worker_urls=[doomed.url], health_check_interval=60, max_retries=0)
        async with running_router(config) as (url, _):
            doomed.kill()  # registered and healthy for the router, but gone: the attempt fails on connect
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.post(url + "/generate", json={"text": "x"})
    assert r.status_code == 502 and kvship_headers(r) == []
    assert f":{doomed.port}" not in r.text and "127.0.0.1" not in r.text, r.text


# ------------------------------------------------------------------------------------------ per-key limits


async def test_per_key_token_bucket_answers_429_with_retry_after_for_one_key_while_another_is_served(doubles):
    config = RouterConfig(
        worker_urls=[d.url for d in doubles],
        api_key=f"{CLIENT}-a,{CLIENT}-b",
        rate_limit_per_key=0.2,
        rate_limit_burst=2,
    )
    async with running_router(config) as (url, _):
        async with httpx.AsyncClient(timeout=30) as c:
            a = [await c.post(url + "/v1/chat/completions", json=CHAT, headers=bearer(f"{CLIENT}-a")) for _ in range(3)]
            b = [await c.post(url + "/v1/chat/completions", json=CHAT, headers=bearer(f"{CLIENT}-b")) for _ in range(2)]
    assert [r.status_code for r in a] == [200, 200, 429]
    limited = a[2]
    assert int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["code"] == "rate_limited" and "per-key" in limited.json()["error"]["message"]
    assert [r.status_code for r in b] == [200, 200]


async def test_max_in_flight_per_key_is_enforced_until_the_stream_ends():
    with start_double(name="slow", chunk_delay=0.3, tokens=4) as slow:
        config = RouterConfig(worker_urls=[slow.url], api_key="ka,kb", max_in_flight_per_key=1)
        async with running_router(config) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                streamed = {**CHAT, "stream": True}
                async with c.stream("POST", url + "/v1/chat/completions", json=streamed, headers=bearer("ka")) as s:
                    assert s.status_code == 200
                    chunks = s.aiter_bytes()
                    first = await chunks.__anext__()
                    second_a = await c.post(url + "/v1/chat/completions", json=CHAT, headers=bearer("ka"))
                    other_b = await c.post(url + "/v1/chat/completions", json=CHAT, headers=bearer("kb"))
                    async for _ in chunks:
                        pass
                again_a = await c.post(url + "/v1/chat/completions", json=CHAT, headers=bearer("ka"))
    assert first
    assert second_a.status_code == 429 and second_a.headers["retry-after"] == "1"
    assert "--max-in-flight-per-key" in second_a.json()["error"]["message"]
    assert other_b.status_code == 200 and again_a.status_code == 200


async def test_per_key_limits_count_client_addresses_when_the_router_has_no_client_key(doubles):
    config = RouterConfig(worker_urls=[d.url for d in doubles], rate_limit_per_key=0.2, rate_limit_burst=1)
    async with running_router(config) as (url, _):
        async with httpx.AsyncClient(timeout=30) as c:
            rs = [await c.post(url + "/v1/chat/completions", json=CHAT, headers=bearer(f"any-{i}")) for i in range(2)]
    assert [r.status_code for r in rs] == [200, 429]  # a made-up key is no escape: the address is counted


def test_key_limits_track_a_bounded_number_of_keys():
    now = [0.0]
    limits = KeyLimits(rate=1.0, burst=1, max_in_flight=0, max_keys=50, clock=lambda: now[0])
    for i in range(10_000):
        limits.admit(f"addr:{i}")()
    assert limits.tracked_keys == 50 and limits.in_flight("addr:9999") == 0


# ------------------------------------------------------------------------------------------ config


def test_client_keys_come_from_the_flag_list_and_the_keys_file_and_never_double_as_other_keys(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# rotated 2026-11\nfile-one\n\nfile-two\n")
    cfg = RouterConfig(api_key="flag-one, flag-two", api_keys_file=str(keys), worker_api_key="w")
    assert cfg.client_keys() == ["flag-one", "flag-two", "file-one", "file-two"]
    creds = cfg.credentials()
    assert creds.classify("Bearer file-two").kind == "client" and creds.classify("Bearer w").kind == "worker"
    assert creds.classify("Bearer nope").kind is None and creds.classify("Basic file-two").kind is None
    assert RouterConfig(api_key="k").resolved_worker_api_key is None  # no fallback to the client key
    with pytest.raises(ValueError, match="--worker-api-key must differ"):
        RouterConfig(api_key="same", worker_api_key="same").validate()
    with pytest.raises(ValueError, match="--api-keys-file"):
        RouterConfig(api_keys_file=str(tmp_path / "missing")).validate()


def test_kvship_local_gives_workers_a_generated_worker_key_and_the_client_key_only_to_the_router(monkeypatch):
    from kvship.app.local import LocalConfig, LocalDeployment

    for name in ("KVSHIP_API_KEY", "KVSHIP_WORKER_API_KEY", "KVSHIP_ADMIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    dep = LocalDeployment(LocalConfig(api_key=CLIENT), [], "tcp", "/tmp")
    worker_keys = {w.env["KVSHIP_API_KEY"] for w in dep.workers}
    assert worker_keys == {dep.worker_key} and len(dep.worker_key) >= 32 and dep.worker_key != CLIENT
    assert all(w.health_key == dep.worker_key for w in dep.workers)
    assert dep.router.env["KVSHIP_API_KEY"] == CLIENT
    assert dep.router.env["KVSHIP_WORKER_API_KEY"] == dep.worker_key
    assert dep.router.env["KVSHIP_ADMIN_API_KEY"] == ""  # admin API off unless --admin-api-key
    assert LocalDeployment(LocalConfig(), [], "tcp", "/tmp").worker_key != dep.worker_key
    with_admin = LocalDeployment(LocalConfig(admin_api_key=ADMIN), [], "tcp", "/tmp")
    assert with_admin.router.env["KVSHIP_ADMIN_API_KEY"] == ADMIN
