"""The router's spans of one request (docs/observability.md, "Tracing").

``RequestSpans`` is made per request only when tracing is on
(``RequestContext.spans`` is None otherwise, and no span is built):

* ``router.request``: receive -> the response's last byte (a child of the
  client's ``traceparent`` when it sent one, so the client's trace id is kept);
* ``router.pick``: the policy choosing the worker(s);
* ``router.prefill``: the upstream call to the prefill worker (PD);
* ``router.decode``: the decode worker's call and the relay of its stream, to
  the end of the request (PD; a unified worker is called in ``router.request``);
* ``router.resume``: a broken stream continued on another worker.

Each worker call carries a ``traceparent`` naming the span that made it, so
the worker's spans are its children.

The request path builds no SDK span: each span is a ``RawSpan`` (random ids,
``time.time()`` stamps, attributes); ``finish`` hands a sampled request's
spans to ``Tracing.export_raw`` and a background thread builds and exports
them in batches (docs/observability.md, "Cost").  An unsampled request still
gets span ids, so the ``traceparent`` it sends on says "not sampled".
"""

from __future__ import annotations

import time
from typing import Any, Optional

from kvship.common.protocol import TRACEPARENT_HEADER, TRACESTATE_HEADER, TraceContext
from kvship.common.trace_export import RawSpan
from kvship.common.tracing import Tracing, new_span_id, new_trace_id


def _named(attributes: dict[str, Any]) -> dict[str, Any]:
    """Span attributes under the ``kvship.`` namespace (``worker`` -> ``kvship.worker``)."""
    return {key if "." in key else f"kvship.{key}": value for key, value in attributes.items()}


class RequestSpans:
    """The spans of one routed request; every span still open ends with ``finish``."""

    def __init__(self, tracing: Tracing, parent: Optional[TraceContext], route: str, request_id: str, start: float):
        self.tracing = tracing
        self.trace_id = int(parent.trace_id, 16) if parent is not None else new_trace_id()
        self._trace_hex = parent.trace_id if parent is not None else f"{self.trace_id:032x}"
        self.sampled = tracing.sampled(parent, self.trace_id)
        self._state = parent.tracestate if parent is not None else None
        self._flags = "01" if self.sampled else "00"
        self.root = RawSpan(
            "router.request",
            new_span_id(),
            int(parent.span_id, 16) if parent is not None else 0,
            start,
            "server",
            {"http.route": route, "kvship.request_id": request_id},
            remote_parent=parent is not None,
        )
        self._spans: list[RawSpan] = [self.root]
        self._open: list[RawSpan] = []
        self.done = False

    def start(self, name: str, parent: Optional[RawSpan] = None, **attributes: Any) -> RawSpan:
        """A child span of ``parent`` (default the request's span), started now."""
        span = RawSpan(name, new_span_id(), (parent or self.root).span_id, time.time(), "client", _named(attributes))
        self._open.append(span)
        self._spans.append(span)
        return span

    def end(self, span: RawSpan, error: Optional[str] = None, **attributes: Any) -> None:
        if span in self._open:
            self._open.remove(span)
            span.attrs.update(_named(attributes))
            span.end = time.time()
            span.error = error

    def headers(self, span: Optional[RawSpan] = None) -> dict[str, str]:
        """The trace headers a worker call made inside ``span`` (default the request's span) carries."""
        out = {TRACEPARENT_HEADER: f"00-{self._trace_hex}-{(span or self.root).span_id:016x}-{self._flags}"}
        if self._state:
            out[TRACESTATE_HEADER] = self._state
        return out  # what ``TraceContext.headers`` gives, without building one per call

    def finish(self, status: int, worker: str = "") -> None:
        if self.done:
            return
        self.done = True
        end = time.time()
        error = f"http {status}" if status >= 500 else None
        for span in self._open:
            span.end, span.error = end, error
        self._open.clear()
        self.root.attrs["http.status_code"] = status
        if worker:
            self.root.attrs["kvship.worker"] = worker
        self.root.end, self.root.error = end, error
        if self.sampled:
            self.tracing.export_raw(self.trace_id, self._state, self._spans)
