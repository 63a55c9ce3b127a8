"""OpenTelemetry tracing of a request from the router through prefill to decode (docs/observability.md).

``Tracing.configure(endpoint, ratio, service)`` exports spans over OTLP with the
official ``opentelemetry-sdk``: protobuf over HTTP
(``opentelemetry-exporter-otlp-proto-http``) for an ``http(s)://`` endpoint, over
gRPC (``opentelemetry-exporter-otlp-proto-grpc``) for a ``grpc://`` (plaintext) or
``grpcs://`` (TLS) one.  Without an endpoint it returns ``Tracing.OFF``, whose
``enabled`` is False: callers check it and build no span at all (the SDK is not
even imported).

Propagation is W3C trace context (``kvship.common.protocol.TraceContext``):
the router continues a client's ``traceparent`` (or starts a trace), and
sends each worker a ``traceparent`` naming the router span that called it,
so a worker's spans are children of the router's upstream span.  Sampling is
parent-based: a sampled parent is always kept, a new trace with probability
``ratio``.

Nobody builds an SDK span on a request's path:

* the router records each span as a ``RawSpan`` (ids, times, attributes) and
  hands the request's finished spans to ``Tracing.export_raw`` (an append to
  a deque); a background thread hands them in batches to a child process
  that builds and exports them (``kvship.common.trace_export``), or builds
  them here;
* ``WorkerTracer`` turns the engine's request events (``kvship.common.events``)
  into a worker's spans: the scheduler thread only records timestamps; a
  background thread makes the request's ``RawSpan``s once it finished and
  hands them to ``export_raw`` as the router does.
"""

from __future__ import annotations

import collections
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

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
from kvship.common.trace_export import (  # noqa: F401 - the endpoint helpers and RawSpan are imported from here too
    OTLP_TRACES_PATH,
    RawSpan,
    SpanExportProcess,
    otlp_exporter,
    otlp_target,
    readable_spans,
    traces_url,
)

logger = logging.getLogger(__name__)


def _ns(at: float) -> int:
    return int(at * 1e9)


def new_span_id() -> int:
    """A random non-zero 64-bit span id (what the SDK's id generator makes)."""
    return random.getrandbits(64) or 1


def new_trace_id() -> int:
    return random.getrandbits(128) or 1


class Tracing:
    """One process's tracer (router or worker); ``Tracing.OFF`` when no endpoint is configured."""

    OFF: "Tracing"
    RAW_BATCH_S = 0.1  # how often the background thread hands the recorded ``RawSpan``s on

    def __init__(self, provider: Any = None, processor: Any = None, ratio: float = 1.0, export: Any = None):
        self._provider = provider
        self._processor = processor
        self._export = export  # raw spans go to this child process instead of this process's SDK
        self.enabled = provider is not None or export is not None
        self._bound = round(ratio * (1 << 64))  # the SDK's TraceIdRatioBased rule on a trace id's low 64 bits
        # (trace_id, tracestate, spans) of finished requests; past the bound (an export that cannot keep up)
        # the oldest are dropped
        self._raw: collections.deque = collections.deque(maxlen=65536)
        self._raw_lock = threading.Lock()  # held while a batch of raw spans is built
        self._raw_stop = threading.Event()
        self._raw_thread: Optional[threading.Thread] = None

    @classmethod
    def configure(
        cls,
        endpoint: Optional[str],
        ratio: float = 1.0,
        service: str = "kvship",
        exporter: Any = None,
        export_process: bool = False,
    ) -> "Tracing":
        """Export to ``endpoint`` (``otlp_target``), keeping new traces with probability ``ratio``; ``exporter``
        replaces the OTLP exporter (any ``SpanExporter``).  ``Tracing.OFF`` when ``endpoint`` is empty.

        ``export_process``: raw spans (``export_raw``) are built and exported by a child process
        (``SpanExportProcess``), so their encoding never takes this process's CPU or GIL; such a ``Tracing``
        has no SDK here (the router's and the workers' case: their spans are all raw)."""
        if not endpoint and exporter is None:
            return cls.OFF
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"--otlp-traces-sample-ratio must be in [0, 1], got {ratio}")
        if export_process and exporter is None:
            otlp_target(endpoint or "")  # a bad endpoint fails here, not in the child
            return cls(ratio=ratio, export=SpanExportProcess(endpoint or "", service))
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            exporter = otlp_exporter(endpoint or "")
        provider = TracerProvider(resource=Resource.create({"service.name": service}))  # sampled by ``sampled``
        # a deep queue: the router hands its spans over in bursts (export_raw); batches of 512 (the SDK's
        # default) cost least per span: smaller ones measured worse (docs/observability.md, "Cost")
        processor = BatchSpanProcessor(exporter, max_queue_size=16384, schedule_delay_millis=500)
        provider.add_span_processor(processor)
        return cls(provider, processor, ratio)

    # ------------------------------------------------------------------ raw spans

    @property
    def export_process(self) -> Any:
        """The child process exporting the raw spans (``configure(..., export_process=True)``), else None."""
        return self._export

    def sampled(self, parent: Optional[TraceContext], trace_id: int) -> bool:
        """Whether a trace is kept: as its parent was, else with probability ``ratio`` (parent-based sampling,
        the same rule as the SDK's sampler)."""
        if parent is not None:
            return parent.sampled
        return (trace_id & 0xFFFFFFFFFFFFFFFF) < self._bound

    def export_raw(self, trace_id: int, tracestate: Optional[str], spans: Sequence[RawSpan]) -> None:
        """Queue a sampled request's finished spans for export; cheap (an append), safe from any thread."""
        self._raw.append((trace_id, tracestate, spans))
        if self._raw_thread is None:
            with self._raw_lock:
                if self._raw_thread is None:
                    self._raw_thread = threading.Thread(target=self._raw_loop, name="kvship-trace-raw", daemon=True)
                    self._raw_thread.start()

    def _raw_loop(self) -> None:
        while not self._raw_stop.wait(self.RAW_BATCH_S):
            self._drain_raw()

    def _drain_raw(self, timeout_s: float = -1) -> bool:
        """Hand the queued raw spans on; False when the lock was not had within ``timeout_s`` (the background
        thread is stuck writing to an export process that stopped reading)."""
        if not self._raw_lock.acquire(timeout=timeout_s):
            return False
        try:
            items = []
            while self._raw:
                items.append(self._raw.popleft())
            if not items:
                return True
            if self._export is not None:
                self._export.send(items)
            else:
                self._build_raw(items)
            return True
        finally:
            self._raw_lock.release()

    def _build_raw(self, items: list[tuple[int, Optional[str], Sequence[RawSpan]]]) -> None:
        """SDK spans of raw ones, handed to the batch processor (it encodes and exports them)."""
        for span in readable_spans(items, self._provider.resource):
            self._processor.on_end(span)

    def flush(self, timeout_s: float = 5.0) -> None:
        """Export every span recorded so far (raw spans included; with an export process, hand them to it)."""
        self._drain_raw()
        if self._provider is not None:
            self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Export what is buffered and stop (the export process too, once it exported everything)."""
        if not self.enabled:
            return
        self._raw_stop.set()
        if self._raw_thread is not None:
            self._raw_thread.join(timeout=5.0)
        drained = self._drain_raw(timeout_s=5.0)
        if self._export is not None:
            self._export.close(timeout_s if drained else 0.0)  # a stuck one is killed
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
        parent = rec.parent
        trace_id = int(parent.trace_id, 16) if parent is not None else new_trace_id()
        if not t.sampled(parent, trace_id):
            return
        end = s.get("finished", time.time())
        attrs = {"kvship.rid": rid, "kvship.role": self.role, "kvship.prompt_tokens": rec.prompt_tokens}
        attrs.update((k, v) for k, v in rec.attrs.items() if k != "error")
        events = [("first_token", s["first_token"])] if "first_token" in s else []
        # PD: docs/pd.md, "Reading a request's trace"
        events += [(f"pd.{stage}", at) for stage, at in sorted(rec.stages, key=lambda x: x[1])]
        root = RawSpan(
            f"{self.role}.request",
            new_span_id(),
            int(parent.span_id, 16) if parent is not None else 0,
            rec.received,
            "server",
            attrs,
            remote_parent=parent is not None,
            end=end,
            error=rec.attrs.get("error"),
            events=events,
        )
        spans = [root]

        def child(name: str, a: Optional[float], b: Optional[float], attrs: Optional[dict] = None) -> None:
            if a is not None and b is not None:
                spans.append(RawSpan(name, new_span_id(), root.span_id, a, attrs=dict(attrs or {}), end=max(a, b)))

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
        t.export_raw(trace_id, parent.tracestate if parent is not None else None, spans)

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
