"""OpenTelemetry tracing: W3C trace context, OTLP export, one trace from the router through prefill to decode.

The end-to-end test runs ``kvship local`` (router + 1 prefill + 1 decode, tcp transfer, a tiny model) with
``--otlp-traces-endpoint`` pointing at a real OTLP/HTTP receiver in this process: an HTTP server that decodes
``ExportTraceServiceRequest`` protobufs with the official ``opentelemetry-proto`` package.  The gRPC test
runs a real OTLP/gRPC receiver (a ``grpcio`` server implementing ``opentelemetry-proto``'s ``TraceService``)
behind a router and a unified worker exporting to ``grpc://``.
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
from kvship.common.tracing import Tracing, otlp_target, traces_url

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


def test_otlp_endpoint_scheme_picks_http_or_grpc_and_bad_ones_are_refused():
    assert otlp_target("http://collector:4318") == ("http/protobuf", "http://collector:4318/v1/traces")
    assert otlp_target("grpc://collector:4317") == ("grpc", "collector:4317")
    assert otlp_target("grpcs://collector.example:443") == ("grpc", "collector.example:443")
    for bad in ("collector:4317", "grpc://collector:4317/v1/traces", "ftp://x", "grpc://"):
        with pytest.raises(ValueError, match="otlp-traces-endpoint"):
            otlp_target(bad)
    from kvship.router.config import RouterConfig

    with pytest.raises(ValueError, match="otlp-traces-endpoint"):
        RouterConfig(otlp_traces_endpoint="collector:4317").validate()


# --------------------------------------------------------------------------- router spans (no SDK on the path)


def _router_spans(ratio: float, parent):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvship.router.tracing import RequestSpans

    exporter = InMemorySpanExporter()
    tracing = Tracing.configure(None, ratio, "kvship-router", exporter=exporter)
    spans = RequestSpans(tracing, parent, "/generate", "req-1", time.time())
    pick = spans.start("router.pick", attempt=1, note=None)
    spans.end(pick, worker="http://w")
    call = spans.start("router.decode", room="7")
    sent = spans.headers(call)
    spans.finish(502, "http://w")
    tracing.flush()
    out = {s.name: s for s in exporter.get_finished_spans()}
    tracing.shutdown()
    return sent, out


def test_router_spans_are_recorded_raw_and_exported_with_the_same_tree_and_attributes():
    sent, out = _router_spans(1.0, TraceContext(TRACE_ID, CLIENT_SPAN, True, "vendor=abc"))
    assert set(out) == {"router.request", "router.pick", "router.decode"}
    root, pick, call = out["router.request"], out["router.pick"], out["router.decode"]
    assert {s.context.trace_id for s in out.values()} == {int(TRACE_ID, 16)}  # the client's trace
    assert root.parent.span_id == int(CLIENT_SPAN, 16) and root.parent.is_remote
    assert pick.parent.span_id == call.parent.span_id == root.context.span_id
    assert root.kind.name == "SERVER" and call.kind.name == "CLIENT"
    assert dict(root.attributes) == {
        "http.route": "/generate",
        "kvship.request_id": "req-1",
        "http.status_code": 502,
        "kvship.worker": "http://w",
    }
    assert dict(pick.attributes) == {"kvship.attempt": 1, "kvship.worker": "http://w"}  # None values dropped
    assert not root.status.is_ok and root.status.description == "http 502"  # the open call ended with it
    assert not call.status.is_ok and pick.status.status_code.name == "UNSET"
    assert root.start_time <= pick.start_time <= pick.end_time <= root.end_time == call.end_time
    assert root.context.trace_state.to_header() == "vendor=abc"
    # the worker call names the span that made it
    assert sent == {"traceparent": f"00-{TRACE_ID}-{call.context.span_id:016x}-01", "tracestate": "vendor=abc"}


def test_router_spans_follow_the_parents_sampling_and_the_ratio_for_new_traces():
    sent, out = _router_spans(1.0, TraceContext(TRACE_ID, CLIENT_SPAN, False))
    assert out == {} and sent["traceparent"].startswith(f"00-{TRACE_ID}-") and sent["traceparent"].endswith("-00")
    assert CLIENT_SPAN not in sent["traceparent"]  # a span of the router's, not sampled, is the parent
    sent, out = _router_spans(0.0, None)
    assert out == {} and sent["traceparent"].endswith("-00")
    sent, out = _router_spans(1.0, None)
    assert len(out) == 3 and out["router.request"].parent is None and sent["traceparent"].endswith("-01")


# --------------------------------------------------------------------------- OTLP receiver


def _decoded(req: ExportTraceServiceRequest) -> list[dict]:
    """The spans of one OTLP export, as dicts."""
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
    return out


class _Received:
    """Every span a receiver got, with a wait for some names."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def add_export(self, req: ExportTraceServiceRequest) -> None:
        out = _decoded(req)
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


class OTLPReceiver(_Received):
    """An OTLP/HTTP trace receiver on loopback: every exported span, decoded with ``opentelemetry-proto``."""

    def __init__(self) -> None:
        super().__init__()
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
        self.add_export(req)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GrpcOTLPReceiver(_Received):
    """An OTLP/gRPC trace receiver on loopback: a ``grpcio`` server implementing ``opentelemetry-proto``'s
    ``TraceService``; its URL is ``grpc://127.0.0.1:<port>``."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        super().__init__()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the generated service's name
                receiver.add_export(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.url = f"grpc://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.stop(grace=None)


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


@pytest.mark.timeout(180)
async def test_router_and_worker_export_over_otlp_grpc_to_a_grpc_receiver(tiny_llama_dir):
    from router_fixtures import running_router
    from server_fixtures import start_server

    from kvship.router.config import RouterConfig

    trace_id = "7c2f9a1e5d3b4c6a8e0f1a2b3c4d5e6f"
    grpc_receiver = GrpcOTLPReceiver()
    try:
        flags = ["--model-path", tiny_llama_dir, *FLAGS, "--otlp-traces-endpoint", grpc_receiver.url]
        with start_server(flags) as server:
            cfg = RouterConfig(
                worker_urls=[server.url], health_check_interval=60, otlp_traces_endpoint=grpc_receiver.url
            )
            async with running_router(cfg) as (url, _):
                async with httpx.AsyncClient(timeout=60) as c:
                    body = {"input_ids": list(range(5, 25)), "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
                    r = await c.post(
                        url + "/generate", json=body, headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}
                    )
                    assert r.status_code == 200, r.text
            # the router's lifespan flushed its spans when it stopped; the worker exports within 0.5 s
            spans = grpc_receiver.wait_for({"router.request", "unified.request", "decode"})
    finally:
        grpc_receiver.close()
    by_name = {s["name"]: s for s in spans if s["trace_id"] == trace_id}
    assert by_name["router.request"]["service"] == "kvship-router"
    assert by_name["router.request"]["parent"] == CLIENT_SPAN
    # behind a router without --pd the unified worker's span is a child of router.request
    assert by_name["unified.request"]["service"] == "kvship-unified"
    assert by_name["unified.request"]["parent"] == by_name["router.request"]["span_id"]
    assert by_name["decode"]["parent"] == by_name["unified.request"]["span_id"]
    assert by_name["unified.request"]["attrs"]["kvship.completion_tokens"] == 3


def test_router_spans_exported_by_a_child_process_reach_the_receiver_and_a_dead_child_drops_them(receiver):
    from kvship.router.tracing import RequestSpans

    trace_id = "1f2e3d4c5b6a79881f2e3d4c5b6a7988"
    tracing = Tracing.configure(receiver.url, 1.0, "kvship-router", export_process=True)
    spans = RequestSpans(tracing, TraceContext(trace_id, CLIENT_SPAN), "/generate", "req-child", time.time())
    spans.end(spans.start("router.pick", attempt=1))
    spans.finish(200, "http://w")
    tracing.shutdown()  # hands the spans over; the child exports them and exits
    got = [s for s in receiver.wait_for({"router.pick"}) if s["trace_id"] == trace_id]
    assert {s["name"] for s in got} == {"router.request", "router.pick"}
    assert all(s["service"] == "kvship-router" for s in got)
    assert tracing.export_process.proc.returncode == 0
    # a child that died: the spans are dropped, the request path and the flush never fail
    lost = Tracing.configure(receiver.url, 1.0, "kvship-router", export_process=True)
    lost.export_process.proc.kill()
    lost.export_process.proc.wait()
    for _ in range(2):
        spans = RequestSpans(lost, None, "/generate", "req-lost", time.time())
        spans.finish(200)
        lost.flush()
    lost.shutdown()
