"""OpenTelemetry tracing: W3C trace context, OTLP export, one trace from the router through prefill to decode.

The end-to-end test runs ``kvship local`` (router + 1 prefill + 1 decode, tcp transfer, a tiny model) with
``--otlp-traces-endpoint`` pointing at a real OTLP/HTTP receiver in this process: an HTTP server that decodes
``ExportTraceServiceRequest`` protobufs with the official ``opentelemetry-proto`` package.
"""

from __future__ import annotations

import http.server
import threading
import time
from typing import Iterator

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from pd_fixtures import start_local

from kvship.common.protocol import TraceContext
from kvship.common.tracing import traces_url

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


# --------------------------------------------------------------------------- trace context


def test_traceparent_parses_w3c_headers_and_refuses_malformed_ones():
    tc = TraceContext.parse(f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "vendor=abc")
    assert tc == TraceContext(TRACE_ID, CLIENT_SPAN, True, "vendor=abc")
    assert tc.headers() == {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "tracestate": "vendor=abc"}
    assert TraceContext.parse(f"00-{TRACE_ID}-{CLIENT_SPAN}-00").sampled is False
    # a later version's first four fields are read (W3C: forward compatible)
    assert TraceContext.parse(f"01-{TRACE_ID}-{CLIENT_SPAN}-01-extra").trace_id == TRACE_ID
    for bad in (
        None,
        "",
        f"ff-{TRACE_ID}-{CLIENT_SPAN}-01",  # version ff is invalid
        f"00-{'0' * 32}-{CLIENT_SPAN}-01",  # all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero span id
        f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-01",  # upper case
        f"00-{TRACE_ID}-{CLIENT_SPAN}-01-extra",  # version 00 has exactly four fields
        "not a traceparent",
    ):
        assert TraceContext.parse(bad) is None, bad
    assert TraceContext.parse(f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "x" * 600).tracestate is None  # too long: dropped


def test_otlp_endpoint_gets_the_traces_path_unless_it_names_one():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"
    with pytest.raises(ValueError, match="http"):
        traces_url("collector:4317")


# --------------------------------------------------------------------------- OTLP receiver


class OTLPReceiver:
    """An OTLP/HTTP trace receiver on loopback: every exported span, decoded with ``opentelemetry-proto``."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver.add(req, self.path, self.headers.get("content-type"))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, req: ExportTraceServiceRequest, path: str, content_type: str) -> None:
        assert path == "/v1/traces" and content_type == "application/x-protobuf"
        out = []
        for rs in req.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {}
                    for a in s.attributes:
                        v = a.value
                        attrs[a.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
                    out.append(
                        {
                            "service": service,
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(),
                            "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                            "attrs": attrs,
                            "events": [e.name for e in s.events],
                        }
                    )
        with self.lock:
            self.spans.extend(out)

    def wait_for(self, names: set[str], timeout: float = 60.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                spans = list(self.spans)
            if names <= {s["name"] for s in spans}:
                return spans
            time.sleep(0.2)
        raise AssertionError(f"spans {sorted(names - {s['name'] for s in spans})} never arrived; got {spans}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    r = OTLPReceiver()
    yield r
    r.close()


FLAGS = ["--device", "cpu", "--page-size", "16", "--max-total-tokens", "4096", "--served-model-name", "tiny"]


@pytest.mark.timeout(300)
def test_one_pd_request_is_one_trace_from_router_through_prefill_to_decode(tiny_llama_dir, receiver):
    flags = ["--model-path", tiny_llama_dir, *FLAGS, "--otlp-traces-endpoint", receiver.url]
    with start_local(["--transfer-backend", "tcp", *flags]) as cluster:
        r = httpx.post(
            cluster.url + "/generate",
            json={"input_ids": list(range(5, 45)), "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
            headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        names = {
            "router.request",
            "router.pick",
            "router.prefill",
            "router.decode",
            "prefill.request",
            "prefill.forward",
            "kv.send",
            "decode.request",
            "kv.wait",
            "kv.receive",
            "decode",
        }
        spans = receiver.wait_for(names)
    by_name = {s["name"]: s for s in spans if s["trace_id"] == TRACE_ID}
    assert names <= set(by_name), sorted(by_name)  # one trace: the client's trace id everywhere
    assert by_name["router.request"]["parent"] == CLIENT_SPAN
    root = by_name["router.request"]["span_id"]
    for name in ("router.pick", "router.prefill", "router.decode"):
        assert by_name[name]["parent"] == root, name
        assert by_name[name]["service"] == "kvship-router"
    # each worker's request span is a child of the router span that called it
    assert by_name["prefill.request"]["parent"] == by_name["router.prefill"]["span_id"]
    assert by_name["decode.request"]["parent"] == by_name["router.decode"]["span_id"]
    assert by_name["prefill.request"]["service"] == "kvship-prefill"
    assert by_name["decode.request"]["service"] == "kvship-decode"
    for name in ("prefill.forward", "kv.send"):
        assert by_name[name]["parent"] == by_name["prefill.request"]["span_id"], name
    for name in ("kv.wait", "kv.receive", "decode"):
        assert by_name[name]["parent"] == by_name["decode.request"]["span_id"], name
    # the KV transfer spans carry what moved: 40 tokens = 3 pages of 16, every layer's K and V
    for name in ("kv.send", "kv.receive"):
        attrs = by_name[name]["attrs"]
        assert attrs["kvship.kv.backend"] == "tcp" and attrs["kvship.kv.ok"] is True, attrs
        assert attrs["kvship.kv.bytes"] > 0 and attrs["kvship.kv.seconds"] >= 0, attrs
    assert by_name["kv.send"]["attrs"]["kvship.kv.bytes"] == by_name["kv.receive"]["attrs"]["kvship.kv.bytes"]
    assert "first_token" in by_name["decode.request"]["events"]
    # the PD stages (docs/pd.md, "Reading a request's trace") are events of the worker's request span
    assert {"pd.scheduled", "pd.room_registered", "pd.kv_send_end"} <= set(by_name["prefill.request"]["events"])
    assert {"pd.kv_arrived", "pd.admitted"} <= set(by_name["decode.request"]["events"])
    assert by_name["decode.request"]["attrs"]["kvship.completion_tokens"] == 6
    # the worker spans sit inside the router's request span
    assert by_name["router.request"]["start"] <= by_name["prefill.request"]["start"]
    assert by_name["decode"]["end"] <= by_name["router.request"]["end"]


async def test_a_resumed_stream_shows_the_resume_span_in_the_clients_trace(receiver):
    from router_fixtures import running_router, start_doubles

    from kvship.router.config import RouterConfig

    trace_id = "0af7651916cd43dd8448eb211c80319c"
    with start_doubles(1, die_after_chunks=2) as [dying], start_doubles(1) as [fine]:
        cfg = RouterConfig(
            debug_headers=True,
            worker_urls=[dying.url, fine.url],
            policy="round_robin",
            health_check_interval=60,
            otlp_traces_endpoint=receiver.url,
        )
        async with running_router(cfg) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                body = {"model": "double-model", "prompt": "hi", "max_tokens": 6, "stream": True}
                for _ in range(2):  # round robin: one of the two starts on the dying worker
                    headers = {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}
                    async with c.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
                        events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                        assert events[-1] == "data: [DONE]"
                        if r.headers["x-kvship-worker"] == dying.url:
                            break
        # the router's spans are exported when it stops (its lifespan flushes them)
        spans = [s for s in receiver.wait_for({"router.resume"}) if s["trace_id"] == trace_id]
        sent = [r["headers"].get("traceparent", "") for r in fine.requests() if r["route"] == "/v1/completions"]
    resume = [s for s in spans if s["name"] == "router.resume"]
    roots = {s["span_id"]: s for s in spans if s["name"] == "router.request" and s["parent"] == CLIENT_SPAN}
    assert len(resume) == 1 and resume[0]["parent"] in roots, spans
    assert resume[0]["attrs"]["kvship.worker"] == fine.url and resume[0]["attrs"]["kvship.resume"] == 1
    # every worker call carries the client's trace id, a router span as its parent
    assert sent and all(tp.startswith(f"00-{trace_id}-") and CLIENT_SPAN not in tp for tp in sent), sent


@pytest.mark.timeout(180)
def test_a_unified_worker_continues_the_clients_trace_for_a_chat_request(tiny_llama_dir, receiver):
    from server_fixtures import start_server

    trace_id = "5b8efff798038103d269b633813fc60c"
    flags = ["--model-path", tiny_llama_dir, *FLAGS, "--otlp-traces-endpoint", receiver.url]
    with start_server(flags) as server:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json=chat,
            headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        spans = [s for s in receiver.wait_for({"unified.request"}) if s["trace_id"] == trace_id]
    by_name = {s["name"]: s for s in spans}
    assert (
        by_name["unified.request"]["parent"] == CLIENT_SPAN
        and by_name["unified.request"]["service"] == "kvship-unified"
    )
    for name in ("queue", "prefill.forward", "decode"):
        assert by_name[name]["parent"] == by_name["unified.request"]["span_id"], name
    assert by_name["unified.request"]["attrs"]["kvship.completion_tokens"] == 3
    assert not any(n.startswith("kv.") for n in by_name)  # no transfer in unified mode


async def test_a_router_without_tracing_passes_the_clients_trace_context_on_and_builds_no_span():
    from router_fixtures import running_router, start_doubles

    from kvship.router.config import RouterConfig

    with start_doubles(1) as [worker]:
        cfg = RouterConfig(worker_urls=[worker.url], health_check_interval=60)
        async with running_router(cfg) as (url, _):
            async with httpx.AsyncClient(timeout=30) as c:
                body = {"model": "double-model", "prompt": "hi", "max_tokens": 2}
                r = await c.post(
                    url + "/v1/completions", json=body, headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
                )
                assert r.status_code == 200, r.text
                r = await c.post(url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
        sent = [req["headers"].get("traceparent") for req in worker.requests() if req["route"] == "/v1/completions"]
    assert sent == [f"00-{TRACE_ID}-{CLIENT_SPAN}-01", None]  # as the client sent it: the router made no span
