"""OTLP export without the request path: the ``--otlp-traces-endpoint`` helpers, ``RawSpan`` (a span
recorded as plain data), its SDK spans, and the child process that exports them (docs/observability.md,
"Cost").  No OpenTelemetry import at module level.

The router records its spans raw (``RawSpan``) and hands the finished ones of sampled
requests to ``Tracing.export_raw``; with ``Tracing.configure(..., export_process=True)`` a background thread
pickles them to a ``SpanExportProcess`` (``python -m kvship.common.trace_export``), which builds the SDK's
``ReadableSpan``s and exports them with the official OTLP exporter: the span encoding, the costly part,
never runs in the router's process.
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

OTLP_TRACES_PATH = "/v1/traces"
_GRPC_SCHEMES = ("grpc", "grpcs")


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP traces URL from ``--otlp-traces-endpoint``: a bare ``http://host:4318`` gets
    ``/v1/traces``; a URL with a path is used as given.  ValueError for anything but http(s)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL (OTLP/HTTP), got {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + OTLP_TRACES_PATH


def otlp_target(endpoint: str) -> tuple[str, str]:
    """``(protocol, target)`` of ``--otlp-traces-endpoint``: ``("http/protobuf", url)`` for an http(s) URL
    (see ``traces_url``), ``("grpc", "host:port")`` for ``grpc://host:port`` (plaintext) or
    ``grpcs://host:port`` (TLS).  ValueError for anything else."""
    parts = urlsplit(endpoint or "")
    if parts.scheme in _GRPC_SCHEMES:
        if not parts.netloc or parts.path not in ("", "/") or parts.query:
            raise ValueError(f"--otlp-traces-endpoint: a gRPC endpoint is grpc://host:port (no path), got {endpoint!r}")
        return "grpc", parts.netloc
    if parts.scheme not in ("http", "https"):
        raise ValueError(
            "--otlp-traces-endpoint must be http(s)://host:port (OTLP/HTTP) or grpc(s)://host:port (OTLP/gRPC), "
            f"got {endpoint!r}"
        )
    return "http/protobuf", traces_url(endpoint)


def otlp_exporter(endpoint: str) -> Any:
    """The official OTLP span exporter for ``endpoint`` (see ``otlp_target``)."""
    protocol, target = otlp_target(endpoint)
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError as e:
            raise RuntimeError(
                f"--otlp-traces-endpoint {endpoint!r} is OTLP/gRPC, which needs the package "
                "opentelemetry-exporter-otlp-proto-grpc (pip install 'opentelemetry-exporter-otlp-proto-grpc')"
            ) from e
        return GrpcExporter(endpoint=target, insecure=urlsplit(endpoint).scheme == "grpc", timeout=10)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=target, timeout=10)


@dataclass(eq=False, slots=True)
class RawSpan:
    """A span recorded without the SDK (ids, wall-clock seconds, attributes), exported by ``export_raw``.

    ``parent_id`` 0 starts a trace; ``remote_parent``: the parent span is in another process (a client's or a
    router's ``traceparent``).  ``end`` None when the span is still open; ``events``: ``(name, at)`` span
    events (wall-clock seconds)."""

    name: str
    span_id: int
    parent_id: int
    start: float
    kind: str = "internal"  # internal | server | client
    attrs: dict[str, Any] = field(default_factory=dict)
    remote_parent: bool = False
    end: Optional[float] = None
    error: Optional[str] = None
    events: list[tuple[str, float]] = field(default_factory=list)


_ATTR_TYPES = (str, bool, int, float)  # what an OTLP attribute holds as is (anything else: its str)


def _ns(at: float) -> int:
    return int(at * 1e9)


EXPORT_CHUNK = 512  # spans per OTLP export request of the export process (the SDK batch processor's default)


def readable_spans(items: Sequence[tuple[int, Optional[str], Sequence[RawSpan]]], resource: Any) -> list[Any]:
    """The SDK's ``ReadableSpan``s of raw spans (``(trace_id, tracestate, spans)`` per request), all sampled;
    a span that cannot be built is logged and skipped."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Status, StatusCode

    kinds = {"server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT}
    flags = trace.TraceFlags(trace.TraceFlags.SAMPLED)
    scope = InstrumentationScope("kvship")
    unset = Status(StatusCode.UNSET)
    out = []
    for trace_id, tracestate, spans in items:
        state = trace.TraceState.from_header([tracestate]) if tracestate else None
        for raw in spans:
            try:
                context = trace.SpanContext(trace_id, raw.span_id, False, flags, state)
                parent = (
                    trace.SpanContext(trace_id, raw.parent_id, raw.remote_parent, flags, state)
                    if raw.parent_id
                    else None
                )
                attrs = {
                    k: (v if isinstance(v, _ATTR_TYPES) else str(v)) for k, v in raw.attrs.items() if v is not None
                }
                end = raw.end if raw.end is not None else time.time()
                out.append(
                    ReadableSpan(
                        raw.name,
                        context,
                        parent,
                        resource,
                        attrs,
                        tuple(Event(name, timestamp=_ns(at)) for name, at in raw.events),
                        kind=kinds.get(raw.kind, trace.SpanKind.INTERNAL),
                        status=Status(StatusCode.ERROR, raw.error) if raw.error else unset,
                        start_time=_ns(raw.start),
                        end_time=_ns(max(raw.start, end)),
                        instrumentation_scope=scope,
                    )
                )
            except Exception:  # noqa: BLE001 - a span that cannot be built must not stop the others
                logger.exception("could not export span %s", raw.name)
    return out


class SpanExportProcess:
    """A child process (``python -m kvship.common.trace_export``) that builds and exports the raw spans it is sent.

    The parent writes pickled batches of ``(trace_id, tracestate, [span fields...])`` to the child's stdin
    (``send``: one background thread); the child builds ``ReadableSpan``s and exports them with the OTLP
    exporter of the endpoint, a batch at a time.  The child ends when its stdin closes: ``close`` (after it
    exported what it holds), or the parent's death (no orphan).  A child that died costs its spans (logged
    once), never a request.  ``proc`` is the child (``subprocess.Popen``)."""

    def __init__(self, endpoint: str, service: str):
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvship.common.trace_export", endpoint, service],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
        self._lost = False

    def send(self, items: list[tuple[int, Optional[str], Sequence[RawSpan]]]) -> None:
        import pickle

        if self._lost:
            return
        wire = [
            (
                t,
                state,
                [
                    (
                        r.name,
                        r.span_id,
                        r.parent_id,
                        r.start,
                        r.kind,
                        r.attrs,
                        r.remote_parent,
                        r.end,
                        r.error,
                        r.events,
                    )
                    for r in spans
                ],
            )
            for t, state, spans in items
        ]
        try:
            pickle.dump(wire, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:  # the child is gone
            self._lost = True
            logger.warning("the trace export process ended (%s, exit %s): spans are dropped", e, self.proc.poll())

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the pipe and wait up to ``timeout_s`` for the child to export what it holds and exit; kill it
        after that (``timeout_s`` 0: at once)."""
        if timeout_s > 0:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
                return
            except subprocess.TimeoutExpired:
                logger.warning("the trace export process did not finish in %.0f s: killed", timeout_s)
        self.proc.kill()
        self.proc.wait()


def _export_main(argv: list[str]) -> int:
    """The export process (``SpanExportProcess``): ``python -m kvship.common.trace_export ENDPOINT SERVICE``.

    Exports each batch it reads before reading the next (in chunks of ``EXPORT_CHUNK`` spans), so a slow
    collector slows the pipe, and the parent's bounded queue, not this process's memory."""
    import pickle
    import sys

    from opentelemetry.sdk.resources import Resource

    endpoint, service = argv
    logging.basicConfig(level=logging.WARNING)
    exporter = otlp_exporter(endpoint)
    resource = Resource.create({"service.name": service})
    stdin = sys.stdin.buffer
    while True:
        try:
            batch = pickle.load(stdin)
        except EOFError:
            break
        spans = readable_spans([(t, state, [RawSpan(*f) for f in raw]) for t, state, raw in batch], resource)
        for i in range(0, len(spans), EXPORT_CHUNK):
            exporter.export(spans[i : i + EXPORT_CHUNK])  # the exporter retries and logs its own failures
    exporter.shutdown()
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_export_main(sys.argv[1:]))
