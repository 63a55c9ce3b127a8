"""Workers the router knows and the registry that owns them.

A ``Worker`` is one worker process reachable at ``url`` with a ``role``
(``unified``, ``prefill`` or ``decode``).  It is *available* for new requests
when it has passed registration (its info endpoints answered), its health
checks pass, and its circuit breaker lets a request through.

Life cycle: ``register`` (static flag, admin API or discovery) -> info read
(``/get_model_info``, ``/get_server_info``, ``/v1/models``, with the worker
key) -> healthy ->
health checks flip ``healthy`` by the failure/success thresholds ->
``remove``.  A worker whose info could not be read yet stays registered but
unavailable; the health checker keeps trying.  A worker that comes back
healthy has its info read again (a restarted worker may serve another
revision).

Each worker has a *revision* (``kvship.router.revisions``): its pod's
``kvship.io/revision`` label when discovered, else what its
``/get_server_info`` reports.  The registry keeps ``revisions`` (when each
revision was first seen) in step with its workers.

The worker key goes to a URL only once it is accepted: static and discovered
workers are accepted by where they came from (flags, the Kubernetes API); a URL
given to the admin API is accepted once it passed the allow-list
(``Router.add_worker``) and answered the open ``GET /health`` with 200, asked
without any key (docs/router.md, "Authentication").  A URL that fails either
never receives the key.

All state changes happen on the event loop thread (no locks).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import aiohttp

from kvship.router.circuit import STATE_CODE, CircuitBreaker
from kvship.router.config import RouterConfig
from kvship.router.metrics import RouterMetrics
from kvship.router.revisions import RevisionOrder
from kvship.router.wire import WorkerInfo

logger = logging.getLogger(__name__)

ROLES = ("unified", "prefill", "decode")


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"worker URL must start with http:// or https://, got {url!r}")
    return url


@dataclass(eq=False)
class Worker:
    url: str
    role: str
    breaker: CircuitBreaker
    source: str = "static"
    info: Optional[WorkerInfo] = None
    healthy: bool = False
    health_failures: int = 0
    health_successes: int = 0
    last_error: Optional[str] = None
    in_flight: int = 0
    total_requests: int = 0
    total_failures: int = 0
    added_at: float = field(default_factory=time.time)
    label_revision: Optional[str] = None  # discovery: the pod's kvship.io/revision label
    pod: Optional[str] = None  # discovery: the pod's name
    namespace: Optional[str] = None

    @property
    def models(self) -> tuple[str, ...]:
        return self.info.models if self.info else ()

    @property
    def revision(self) -> Optional[str]:
        """The pod label when discovered with one, else the worker's own report (None if neither)."""
        if self.label_revision:
            return self.label_revision
        return self.info.revision if self.info else None

    @property
    def revision_known(self) -> bool:
        """Whether ``revision`` is final (a label, or the worker's info has been read)."""
        return bool(self.label_revision) or self.info is not None

    @property
    def bootstrap_port(self) -> Optional[int]:
        return self.info.bootstrap_port if self.info else None

    def available(self) -> bool:
        return self.healthy and self.info is not None and self.breaker.can_attempt()

    def serves(self, model: Optional[str]) -> bool:
        return model is None or model in self.models

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "source": self.source,
            "healthy": self.healthy,
            "available": self.available(),
            "circuit": self.breaker.state,
            "in_flight": self.in_flight,
            "total_requests": self.total_requests,
            "total_failures": self.total_failures,
            "models": list(self.models),
            "model": self.models[0] if self.models else None,
            "bootstrap_port": self.bootstrap_port,
            "last_error": self.last_error,
            "revision": self.revision,
            "fingerprint": self.info.fingerprint if self.info else None,
            "pod": self.pod,
            "namespace": self.namespace,
        }

    def state(self, in_rotation: bool) -> str:
        """``registering`` (info not read yet), ``unhealthy``, ``circuit_open``, ``serving`` (gets new
        requests) or ``draining`` (available, but its revision is not the serving one)."""
        if self.info is None:
            return "registering"
        if not self.healthy:
            return "unhealthy"
        if not self.breaker.can_attempt():
            return "circuit_open"
        return "serving" if in_rotation else "draining"


class RegistrationError(Exception):
    """A worker could not be registered (unreachable, wrong role, missing bootstrap port)."""


class WorkerRegistry:
    """The set of workers, keyed by URL.  ``client`` must be set (``attach``) before info reads."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics):
        self.config = config
        self.metrics = metrics
        self.client: Optional[aiohttp.ClientSession] = None
        self._workers: dict[str, Worker] = {}
        self.revisions = RevisionOrder()
        self._removed_listeners: list[Callable[[Worker], None]] = []
        self._worker_headers: dict[str, str] = {}
        key = config.resolved_worker_api_key
        if key:
            self._worker_headers["authorization"] = f"Bearer {key}"

    def attach(self, client: aiohttp.ClientSession) -> None:
        self.client = client

    def on_removed(self, listener: Callable[[Worker], None]) -> None:
        """Call ``listener(worker)`` after a worker leaves (policies drop their per-worker state)."""
        self._removed_listeners.append(listener)

    # -- queries ---------------------------------------------------------
    def get(self, url: str) -> Optional[Worker]:
        return self._workers.get(url.rstrip("/"))

    def all(self, role: Optional[str] = None) -> list[Worker]:
        return [w for w in self._workers.values() if role is None or w.role == role]

    def available(self, role: str, model: Optional[str] = None) -> list[Worker]:
        return [w for w in self._workers.values() if w.role == role and w.serves(model) and w.available()]

    def models(self) -> list[str]:
        """Union of the model ids of every registered worker whose info is known."""
        seen: dict[str, None] = {}
        for w in self._workers.values():
            for m in w.models:
                seen[m] = None
        return list(seen)

    def knows_model(self, model: str) -> bool:
        return any(model in w.models for w in self._workers.values())

    # -- membership ------------------------------------------------------
    async def register(
        self,
        url: str,
        role: str = "unified",
        source: str = "static",
        require_reachable: bool = False,
        revision: Optional[str] = None,
        pod: Optional[str] = None,
        namespace: Optional[str] = None,
    ) -> Worker:
        """Add a worker (idempotent per URL) and try to read its info.

        With ``require_reachable`` the worker is only kept when its info could be
        read; otherwise ``RegistrationError`` is raised.  Without it, an
        unreachable worker stays registered and unavailable until a health
        check reads its info.  ``revision`` / ``pod`` / ``namespace`` come from
        discovery (the pod's label and name).
        """
        url = normalize_url(url)
        if role not in ROLES:
            raise RegistrationError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        existing = self._workers.get(url)
        if existing is None and require_reachable:
            await self._open_probe(url)
            existing = self._workers.get(url)  # (registered by someone else meanwhile)
        if existing is not None:
            if existing.role != role:
                raise RegistrationError(f"{url} is already registered as a {existing.role} worker")
            if revision is not None and revision != existing.label_revision:
                self.set_label_revision(existing, revision)
            return existing
        worker = Worker(
            url=url,
            role=role,
            source=source,
            breaker=CircuitBreaker(self.config.circuit_failure_threshold, self.config.circuit_cooldown),
            label_revision=revision or None,
            pod=pod,
            namespace=namespace,
        )
        self._workers[url] = worker
        self._publish(worker)
        self.revisions.sync(self._workers.values())
        ok = await self.load_info(worker)
        if self._workers.get(url) is not worker:  # removed while we read its info
            return worker
        self.revisions.sync(self._workers.values())
        if ok:
            self._mark_healthy(worker, "registered")
        elif require_reachable:
            self.remove(url)
            raise RegistrationError(f"could not register {url}: {worker.last_error}")
        else:
            logger.warning("worker %s registered but not reachable yet: %s", url, worker.last_error)
        return worker

    def set_label_revision(self, worker: Worker, revision: Optional[str]) -> None:
        """Discovery saw the pod's revision label change."""
        logger.info("worker %s: revision label %s -> %s", worker.url, worker.label_revision, revision)
        worker.label_revision = revision or None
        self.revisions.sync(self._workers.values())

    def remove(self, url: str) -> bool:
        worker = self._workers.pop(url.rstrip("/"), None)
        if worker is None:
            return False
        self.revisions.sync(self._workers.values())
        self.metrics.forget_worker(worker.url)
        for listener in self._removed_listeners:
            listener(worker)
        logger.info("worker %s (%s) removed", worker.url, worker.role)
        return True

    # -- info and health -------------------------------------------------
    async def _open_probe(self, url: str) -> None:
        """``GET url/health`` without any credential; ``RegistrationError`` unless it answers 200."""
        assert self.client is not None, "WorkerRegistry.attach(client) first"
        try:
            async with self.client.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=self.config.health_check_timeout)
            ) as resp:
                await resp.content.read(64 * 1024)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise RegistrationError(f"could not register {url}: GET /health failed: {why}") from None
        if status != 200:
            raise RegistrationError(f"could not register {url}: GET /health answered {status}")

    async def _get_json(self, worker: Worker, path: str, optional: bool = False) -> Optional[dict]:
        assert self.client is not None, "WorkerRegistry.attach(client) first"
        async with self.client.get(
            worker.url + path,
            headers=self._worker_headers,
            timeout=aiohttp.ClientTimeout(total=self.config.health_check_timeout),
        ) as resp:
            if optional and resp.status == 404:
                return None
            if resp.status != 200:
                raise RegistrationError(f"GET {path} answered {resp.status}")
            data = json.loads(await resp.read())
        if not isinstance(data, dict):
            raise RegistrationError(f"GET {path} did not return a JSON object")
        return data

    async def load_info(self, worker: Worker) -> bool:
        """Read the worker's info endpoints; on failure keep the reason in ``last_error``."""
        try:
            model_info, server_info, models = await asyncio.gather(
                self._get_json(worker, "/get_model_info"),
                self._get_json(worker, "/get_server_info"),
                self._get_json(worker, "/v1/models", optional=True),
            )
            info = WorkerInfo.parse(model_info or {}, server_info or {}, models)
        except (aiohttp.ClientError, TimeoutError, RegistrationError, ValueError) as e:
            worker.last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return False
        if info.mode in ROLES and info.mode != worker.role:
            worker.last_error = f"worker runs --mode {info.mode} but was registered as {worker.role}"
            return False
        if worker.role == "prefill" and info.bootstrap_port is None:
            worker.last_error = "prefill worker's /get_server_info has no disaggregation_bootstrap_port"
            return False
        worker.info = info
        worker.last_error = None
        return True

    async def check(self, worker: Worker) -> None:
        """One health check: ``GET /health`` (or the info read for a worker without info)."""
        if worker.info is None:
            ok = await self.load_info(worker)
            if ok and worker.url in self._workers:
                self.revisions.sync(self._workers.values())
        else:
            try:
                assert self.client is not None
                async with self.client.get(
                    worker.url + "/health", timeout=aiohttp.ClientTimeout(total=self.config.health_check_timeout)
                ) as r:
                    await r.read()
                    ok = r.status == 200
                if not ok:
                    worker.last_error = f"GET /health answered {r.status}"
            except (aiohttp.ClientError, TimeoutError) as e:
                ok = False
                worker.last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if worker.url not in self._workers:
            return
        if ok:
            worker.health_failures = 0
            worker.health_successes += 1
            if not worker.healthy and worker.health_successes >= self.config.health_success_threshold:
                # a worker coming back may have been restarted with another model or revision
                if not await self.load_info(worker) or worker.url not in self._workers:
                    self._publish(worker)
                    return
                self.revisions.sync(self._workers.values())
                self._mark_healthy(worker, "passed health checks")
        else:
            worker.health_successes = 0
            worker.health_failures += 1
            if worker.healthy and worker.health_failures >= self.config.health_failure_threshold:
                worker.healthy = False
                logger.warning(
                    "worker %s unhealthy after %d failed checks: %s",
                    worker.url,
                    worker.health_failures,
                    worker.last_error,
                )
        self._publish(worker)

    def _mark_healthy(self, worker: Worker, why: str) -> None:
        was = worker.healthy
        worker.healthy = True
        worker.health_failures = 0
        if not was:
            worker.breaker.reset()
            logger.info(
                "worker %s (%s) healthy: %s; models %s", worker.url, worker.role, why, ", ".join(worker.models) or "?"
            )
        self._publish(worker)

    def _publish(self, worker: Worker) -> None:
        self.metrics.healthy.labels(worker.url).set(1 if worker.healthy else 0)
        self.metrics.circuit.labels(worker.url).set(STATE_CODE[worker.breaker.state])
        self.metrics.in_flight.labels(worker.url).set(worker.in_flight)

    def publish_all(self) -> None:
        for w in self._workers.values():
            self._publish(w)
