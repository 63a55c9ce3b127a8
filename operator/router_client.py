"""What the operator reads from an InferenceService's router: ``GET /workers`` and ``GET /slo``.

The router documents both (docs/router.md); the operator uses

* ``/workers`` -> ``workers[]`` (``url``, ``role``, ``revision``, ``in_rotation``, ``in_flight``, ``pod``)
  and ``revisions[]`` (``revision``, ``serving``): the in-rotation readiness gate of each worker pod and
  when an old revision has drained (kvship.operator.rollout);
* ``/slo`` -> the figures of ``status.slo``.

A router that cannot be reached (or answers garbage) gives a :class:`RouterView` with ``reachable``
False and the reason in ``error``; nothing here raises.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterView:
    """One read of a router.  ``slo`` is ``None`` when ``/slo`` failed while ``/workers`` answered."""

    url: str
    reachable: bool
    error: str = ""
    workers: list[dict[str, Any]] = field(default_factory=list)
    revisions: list[dict[str, Any]] = field(default_factory=list)
    slo: Optional[dict[str, Any]] = None

    def serving(self) -> set[str]:
        """Revisions the router sends new requests to."""
        return {str(r.get("revision")) for r in self.revisions if r.get("serving")}

    def in_flight(self, revision: str) -> int:
        """Requests the router's workers of ``revision`` are running."""
        return sum(int(w.get("in_flight") or 0) for w in self.workers if _rev(w) == revision)

    def knows(self, revision: str) -> bool:
        return any(_rev(w) == revision for w in self.workers) or any(
            str(r.get("revision")) == revision for r in self.revisions
        )

    def in_rotation(self, pod_name: str, pod_url: Optional[str]) -> Optional[dict[str, Any]]:
        """The router's entry for a pod (matched by pod name, or by ``http://podIP:port``) if it is in rotation."""
        for w in self.workers:
            pod = w.get("pod")
            named = isinstance(pod, str) and (pod == pod_name or pod.rsplit("/", 1)[-1] == pod_name)
            if (named or (pod_url is not None and w.get("url") == pod_url)) and w.get("in_rotation"):
                return w
        return None


def _rev(worker: dict[str, Any]) -> str:
    return str(worker.get("revision") or "")


async def read_router(url: str, timeout: float, client: Optional[httpx.AsyncClient] = None) -> RouterView:
    """``GET url/workers`` and ``GET url/slo`` (see the module docstring)."""
    own = client is None
    http = client or httpx.AsyncClient(timeout=timeout)
    try:
        try:
            r = await http.get(url + "/workers", timeout=timeout)
            if r.status_code != 200:
                return RouterView(url, False, f"GET /workers answered {r.status_code}: {r.text[:200]}")
            data = r.json()
            if not isinstance(data, dict) or not isinstance(data.get("workers"), list):
                return RouterView(url, False, "GET /workers did not answer {workers: [...]}")
        except (httpx.HTTPError, ValueError) as e:
            return RouterView(url, False, f"GET {url}/workers failed: {type(e).__name__}: {e}")
        slo: Optional[dict[str, Any]] = None
        try:
            s = await http.get(url + "/slo", timeout=timeout)
            if s.status_code == 200 and isinstance(s.json(), dict):
                slo = s.json()
            else:
                log.debug("router %s: GET /slo answered %d", url, s.status_code)
        except (httpx.HTTPError, ValueError) as e:
            log.debug("router %s: GET /slo failed: %s", url, e)
        workers = [w for w in data["workers"] if isinstance(w, dict)]
        revisions = [r for r in data.get("revisions") or [] if isinstance(r, dict)]
        return RouterView(url, True, "", workers, revisions, slo)
    finally:
        if own:
            await http.aclose()
