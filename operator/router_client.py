"""What the operator reads from an InferenceService's router: ``GET /workers`` and ``GET /slo``.

The router documents both (docs/router.md); the operator uses

* ``/workers`` -> ``workers[]`` (``url``, ``role``, ``revision``, ``in_rotation``, ``in_flight``, ``pod``)
  and ``revisions[]`` (``revision``, ``serving``): the in-rotation readiness gate of each worker pod and
  when an old revision has drained (kvship.operator.rollout);
* ``/slo`` -> the figures of ``status.slo``, and for the SLO planner (kvship.operator.planner) its ``roles``:
  per worker role the prompt tokens/s, queue depth, running requests and KV usage the router scraped from
  the workers.

Both are read with ``Authorization: Bearer <worker key>`` (the service's ``<name>-worker-key`` Secret; the
router accepts it on these two routes only, docs/router.md).  A body is read as a stream and dropped past
:data:`MAX_BODY_BYTES` (whatever ``Content-Length`` claims), and each request has one deadline for the whole
exchange, so a router that answers endlessly or a byte at a time costs the operator at most that.

A router that cannot be reached (or answers garbage, or too much) gives a :class:`RouterView` with
``reachable`` False and the reason in ``error``; nothing here raises.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

log = logging.getLogger(__name__)
# GET /workers of a router with a few thousand workers is well under 1 MiB.
MAX_BODY_BYTES = 4 * 1024 * 1024


class BodyTooLarge(Exception):
    pass


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


async def _get(
    http: httpx.AsyncClient, url: str, timeout: float, headers: dict[str, str], limit: int
) -> tuple[int, bytes]:
    """``(status, body)`` of ``GET url``; :class:`BodyTooLarge` past ``limit`` bytes (decoded)."""

    async def exchange() -> tuple[int, bytes]:
        async with http.stream("GET", url, timeout=timeout, headers=headers) as r:
            declared = r.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise BodyTooLarge(f"Content-Length {declared}")
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    raise BodyTooLarge(f"more than {limit} bytes")
            return r.status_code, bytes(body)

    return await asyncio.wait_for(exchange(), timeout)


async def read_router(
    url: str,
    timeout: float,
    client: Optional[httpx.AsyncClient] = None,
    api_key: Optional[str] = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> RouterView:
    """``GET url/workers`` and ``GET url/slo`` with ``api_key`` as Bearer (see the module docstring)."""
    own = client is None
    http = client or httpx.AsyncClient(timeout=timeout)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        try:
            status, body = await _get(http, url + "/workers", timeout, headers, max_body_bytes)
            if status != 200:
                text = body[:200].decode("utf-8", "replace")
                return RouterView(url, False, f"GET /workers answered {status}: {text}")
            data = json.loads(body)
            if not isinstance(data, dict) or not isinstance(data.get("workers"), list):
                return RouterView(url, False, "GET /workers did not answer {workers: [...]}")
        except BodyTooLarge as e:
            return RouterView(url, False, f"GET {url}/workers: body too large ({e}); not read")
        except asyncio.TimeoutError:
            return RouterView(url, False, f"GET {url}/workers: no whole answer within {timeout:g} s")
        except (httpx.HTTPError, ValueError) as e:
            return RouterView(url, False, f"GET {url}/workers failed: {type(e).__name__}: {e}")
        slo: Optional[dict[str, Any]] = None
        try:
            status, body = await _get(http, url + "/slo", timeout, headers, max_body_bytes)
            parsed = json.loads(body) if status == 200 else None
            if isinstance(parsed, dict):
                slo = parsed
            else:
                log.debug("router %s: GET /slo answered %d", url, status)
        except (BodyTooLarge, asyncio.TimeoutError, httpx.HTTPError, ValueError) as e:
            log.debug("router %s: GET /slo failed: %s", url, e)
        workers = [w for w in data["workers"] if isinstance(w, dict)]
        revisions = [r for r in data.get("revisions") or [] if isinstance(r, dict)]
        return RouterView(url, True, "", workers, revisions, slo)
    finally:
        if own:
            await http.aclose()
