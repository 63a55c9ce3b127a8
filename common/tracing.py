"""OpenTelemetry tracing of a request from the router through prefill to decode (docs/observability.md).

``Tracing.configure(endpoint, ratio, service)`` exports spans over OTLP/HTTP
(protobuf) with the official ``opentelemetry-sdk`` and
``opentelemetry-exporter-otlp-proto-http``; without an endpoint it returns
``Tracing.OFF``, whose ``enabled`` is False: callers check it and build no
span at all (the SDK is not even imported).

Propagation is W3C trace context (``kvship.common.protocol.TraceContext``):
the router continues a client's ``traceparent`` (or starts a trace), and
sends each worker a ``traceparent`` naming the router span that called it,
so a worker's spans are children of the router's upstream span.  Sampling is
parent-based: a sampled parent is always kept, a new trace with probability
``ratio``.

``WorkerTracer`` turns the engine's request events (``kvship.common.events``)
into a worker's spans.  The scheduler thread only records timestamps; spans
are built on a background thread once the request finished, with the
recorded times, so tracing adds no span work to a scheduler step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from kvship.common.events import (
    Event,
    EventBus,
    FirstToken,
    ForwardFinished,
    ForwardStarted,
    KVTransferFinished,
    KVTransferStarted,
    PDStage,
    RequestAdmitted,
    RequestFinished,
    RequestQueued,
)
from kvship.common.protocol import TraceContext

logger = logging.getLogger(__name__)

OTLP_TRACES_PATH = "/v1/traces"


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP traces URL from ``--otlp-traces-endpoint``: a bare ``http://host:4318`` gets
    ``/v1/traces``; a URL with a path is used as given.  ValueError for anything but http(s)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL (OTLP/HTTP), got {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + OTLP_TRACES_PATH


def _ns(at: float) -> int:
    return int(at * 1e9)


class Tracing:
    """One process's tracer (router or worker); ``Tracing.OFF`` when no endpoint is configured."""

    OFF: "Tracing"

    def __init__(self, provider: Any = None, tracer: Any = None):
        self._provider = provider
        self._tracer = tracer
        self.enabled = tracer is not None

    @classmethod
    def configure(
        cls, endpoint: Optional[str], ratio: float = 1.0, service: str = "kvship", exporter: Any = None
    ) -> "Tracing":
        """Export to ``endpoint`` (OTLP/HTTP), keeping new traces with probability ``ratio``; ``exporter``
        replaces the OTLP exporter (any ``SpanExporter``).  ``Tracing.OFF`` when ``endpoint`` is empty."""
        if not endpoint and exporter is None:
            return cls.OFF
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"--otlp-traces-sample-ratio must be in [0, 1], got {ratio}")
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=traces_url(endpoint or ""), timeout=10)
        provider = TracerProvider(
            resource=Resource.create({"service.name": service}), sampler=ParentBased(TraceIdRatioBased(ratio))
        )
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        return cls(provider, provider.get_tracer("kvship"))

    def start_span(
        self,
        name: str,
        parent: Any = None,
        attributes: Optional[Mapping[str, Any]] = None,
        start: Optional[float] = None,
        kind: str = "internal",
    ) -> Any:
        """A started span, child of ``parent`` (a span, a ``TraceContext`` from another process, or None for a
        new trace); ``start``: wall-clock seconds (default now).  End it with ``end_span``."""
        from opentelemetry import trace

        ctx = None
        if isinstance(parent, TraceContext):
            flags = trace.TraceFlags(trace.TraceFlags.SAMPLED if parent.sampled else trace.TraceFlags.DEFAULT)
            state = trace.TraceState.from_header([parent.tracestate]) if parent.tracestate else None
            remote = trace.SpanContext(
                int(parent.trace_id, 16), int(parent.span_id, 16), is_remote=True, trace_flags=flags, trace_state=state
            )
            ctx = trace.set_span_in_context(trace.NonRecordingSpan(remote))
        elif parent is not None:
            ctx = trace.set_span_in_context(parent)
        kinds = {"server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT}
        return self._tracer.start_span(
            name,
            context=ctx,
            kind=kinds.get(kind, trace.SpanKind.INTERNAL),
            attributes=dict(attributes or {}),
            start_time=None if start is None else _ns(start),
        )

    @staticmethod
    def end_span(span: Any, end: Optional[float] = None, error: Optional[str] = None) -> None:
        if error:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=None if end is None else _ns(end))

    @staticmethod
    def context_of(span: Any) -> TraceContext:
        """The ``TraceContext`` that makes ``span`` the parent in the next process."""
        sc = span.get_span_context()
        state = sc.trace_state.to_header() if sc.trace_state else None
        return TraceContext(f"{sc.trace_id:032x}", f"{sc.span_id:016x}", bool(sc.trace_flags.sampled), state or None)

    def flush(self, timeout_s: float = 5.0) -> None:
        if self._provider is not None:
            self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


Tracing.OFF = Tracing()


# --------------------------------------------------------------------------- worker spans


@dataclass
class _Record:
    """What the scheduler thread records of one traced request (wall-clock seconds)."""

    parent: Optional[TraceContext]
    prompt_tokens: int
    received: float
    stamps: dict[str, float] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    stages: list[tuple[str, float]] = field(default_factory=list)  # PD stages (``PDStage``), as they came


class WorkerTracer:
    """A worker's spans, built from its engine events (see the module docstring).

    Spans per request, all children of ``<role>.request`` (itself a child of the router's span that called
    this worker, when a ``traceparent`` came with the request):

    * every role: ``queue`` (accepted -> admitted);
    * unified and prefill: ``prefill.forward`` (first extend forward -> first token);
    * prefill: ``kv.send`` (the KV transfer; bytes, seconds, GB/s, backend);
    * decode: ``kv.wait`` (accepted -> KV arrived: pre-allocation, registration, transfer), ``kv.receive``
      (the transfer itself; bytes, seconds, GB/s), ``admit`` (KV arrived -> in the running batch);
    * unified and decode: ``decode`` (first token -> finished).

    PD workers add their stages (``PDStage``: room registered, KV sent / arrived / verified, ...) as events
    ``pd.<stage>`` of the request's span.

    ``request_started`` must be called (HTTP thread) before the request is submitted; events of requests
    never started are ignored.
    """

    def __init__(self, tracing: Tracing, bus: EventBus, role: str):
        self.tracing = tracing
        self.role = role
        self._open: dict[str, _Record] = {}
        self._lock = threading.Lock()
        self._done: "queue.SimpleQueue[Optional[tuple[str, _Record]]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._unsubscribe = bus.subscribe(self._on_event) if tracing.enabled else None

    @property
    def enabled(self) -> bool:
        return self.tracing.enabled

    def request_started(
        self, rid: str, parent: Optional[TraceContext], prompt_tokens: int, received: Optional[float] = None
    ) -> bool:
        """Trace ``rid``; False (nothing recorded) when a request of that id is already traced here."""
        with self._lock:
            if rid in self._open:
                return False
            self._open[rid] = _Record(parent, prompt_tokens, time.time() if received is None else received)
            return True

    def request_dropped(self, rid: str) -> None:
        """A request ``request_started`` took never reached the scheduler (its submit failed): forget it."""
        with self._lock:
            self._open.pop(rid, None)

    # scheduler thread: record only
    def _on_event(self, ev: Event) -> None:
        if isinstance(ev, (ForwardStarted, ForwardFinished)):
            key = "forward_start" if isinstance(ev, ForwardStarted) else "forward_end"
            if ev.mode != "extend":
                return
            for rid in ev.rids:
                rec = self._open.get(rid)
                if rec is not None:
                    if key == "forward_start":
                        rec.stamps.setdefault(key, ev.at)
                    else:
                        rec.stamps[key] = ev.at
            return
        rid = getattr(ev, "rid", None)
        rec = self._open.get(rid) if rid is not None else None
        if rec is None:
            return
        if isinstance(ev, RequestQueued):
            rec.stamps["queued"] = ev.at
        elif isinstance(ev, RequestAdmitted):
            rec.stamps.setdefault("admitted", ev.at)
            rec.attrs["kvship.cached_tokens"] = ev.cached_tokens
        elif isinstance(ev, FirstToken):
            rec.stamps.setdefault("first_token", ev.at)
        elif isinstance(ev, PDStage):
            rec.stages.append((ev.stage, ev.at))
        elif isinstance(ev, KVTransferStarted):
            rec.stamps["kv_start"] = ev.at
        elif isinstance(ev, KVTransferFinished):
            rec.stamps["kv_end"] = ev.at
            rec.attrs.update(kv_attributes(ev))
        elif isinstance(ev, RequestFinished):
            rec.stamps["finished"] = ev.at
            rec.attrs["kvship.finish_reason"] = ev.reason
            rec.attrs["kvship.completion_tokens"] = ev.completion_tokens
            if ev.reason == "abort":
                rec.attrs["error"] = ev.message or "aborted"
            with self._lock:
                self._open.pop(ev.rid, None)
            self._done.put((ev.rid, rec))
            self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._build_loop, name="kvship-trace", daemon=True)
            self._thread.start()

    def _build_loop(self) -> None:
        while True:
            item = self._done.get()
            if item is None:
                return
            try:
                self._build(*item)
            except Exception:  # noqa: BLE001 - a span that cannot be built must not stop the others
                logger.exception("could not build the spans of request %s", item[0])

    def _build(self, rid: str, rec: _Record) -> None:
        t, s = self.tracing, rec.stamps
        end = s.get("finished", time.time())
        root = t.start_span(
            f"{self.role}.request",
            rec.parent,
            {"kvship.rid": rid, "kvship.role": self.role, "kvship.prompt_tokens": rec.prompt_tokens},
            start=rec.received,
            kind="server",
        )
        for key, value in rec.attrs.items():
            if key != "error":
                root.set_attribute(key, value)

        def child(name: str, a: Optional[float], b: Optional[float], attrs: Optional[dict] = None) -> None:
            if a is None or b is None:
                return
            t.end_span(t.start_span(name, root, attrs, start=a), end=max(a, b))

        queued = s.get("queued", rec.received)
        admitted = s.get("admitted")
        child("queue", queued, admitted or s.get("forward_start"))
        kv = {k: v for k, v in rec.attrs.items() if k.startswith("kvship.kv.")}
        if self.role in ("unified", "prefill"):
            child("prefill.forward", s.get("forward_start") or admitted, s.get("first_token") or s.get("forward_end"))
        if self.role == "prefill":
            child("kv.send", s.get("kv_start"), s.get("kv_end"), kv)
        if self.role == "decode":
            child("kv.wait", queued, s.get("kv_end"))
            child("kv.receive", s.get("kv_start"), s.get("kv_end"), kv)
            child("admit", s.get("kv_end"), admitted)
        if self.role in ("unified", "decode"):
            child("decode", s.get("first_token"), end)
        if "first_token" in s:
            root.add_event("first_token", timestamp=_ns(s["first_token"]))
        for stage, at in sorted(rec.stages, key=lambda x: x[1]):  # PD: docs/pd.md, "Reading a request's trace"
            root.add_event(f"pd.{stage}", timestamp=_ns(at))
        t.end_span(root, end=end, error=rec.attrs.get("error"))

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._thread is not None:
            self._done.put(None)
            self._thread.join(timeout=5.0)
        self.tracing.flush()


def kv_attributes(ev: KVTransferFinished) -> dict[str, Any]:
    """The span attributes of a KV transfer (``kvship.kv.*``)."""
    out: dict[str, Any] = {
        "kvship.kv.backend": ev.backend,
        "kvship.kv.role": ev.role,
        "kvship.kv.ok": ev.ok,
        "kvship.kv.bytes": ev.bytes,
        "kvship.kv.seconds": ev.seconds,
    }
    if ev.ok and ev.seconds > 0:
        out["kvship.kv.gbps"] = ev.bytes / ev.seconds / 1e9
    if not ev.ok:
        out["kvship.kv.failure"] = ev.reason
    return out
