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
"""

from __future__ import annotations

import time
from typing import Any, Optional

from kvship.common.protocol import TraceContext
from kvship.common.tracing import Tracing


def _named(attributes: dict[str, Any]) -> dict[str, Any]:
    """Span attributes under the ``kvship.`` namespace (``worker`` -> ``kvship.worker``)."""
    return {key if "." in key else f"kvship.{key}": value for key, value in attributes.items()}


class RequestSpans:
    """The spans of one routed request; every span still open ends with ``finish``."""

    def __init__(self, tracing: Tracing, parent: Optional[TraceContext], route: str, request_id: str, start: float):
        self.tracing = tracing
        self.root = tracing.start_span(
            "router.request",
            parent,
            {"http.route": route, "kvship.request_id": request_id},
            start=start,
            kind="server",
        )
        self._open: list[Any] = []
        self.done = False

    def start(self, name: str, parent: Any = None, **attributes: Any) -> Any:
        """A child span of ``parent`` (default the request's span), started now."""
        span = self.tracing.start_span(name, parent or self.root, _named(attributes), kind="client")
        self._open.append(span)
        return span

    def end(self, span: Any, error: Optional[str] = None, **attributes: Any) -> None:
        if span in self._open:
            self._open.remove(span)
            for key, value in _named(attributes).items():
                span.set_attribute(key, value)
            self.tracing.end_span(span, error=error)

    def headers(self, span: Any = None) -> dict[str, str]:
        """The trace headers a worker call made inside ``span`` (default the request's span) carries."""
        return Tracing.context_of(span or self.root).headers()

    def finish(self, status: int, worker: str = "") -> None:
        if self.done:
            return
        self.done = True
        end = time.time()
        error = f"http {status}" if status >= 500 else None
        for span in list(self._open):
            self._open.remove(span)
            self.tracing.end_span(span, end=end, error=error)
        self.root.set_attribute("http.status_code", status)
        if worker:
            self.root.set_attribute("kvship.worker", worker)
        self.tracing.end_span(self.root, end=end, error=error)
