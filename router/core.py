"""``Router``: the state one router process owns and the choice of worker(s) for a request.

Owns the pooled ``aiohttp.ClientSession`` (keep-alive to every worker;
``docs/router.md`` says why not httpx), the ``WorkerRegistry``, one policy per role (unified, or prefill + decode in PD
mode), the session-affinity table, the rate limiter, the health checker and
Kubernetes discovery.  ``start()`` / ``stop()`` run in the app's lifespan.

Choosing (``choose``): first the *serving revision* for the request's model
(``kvship.router.revisions``: the newest revision with an available worker of
every role; a PD pair never mixes revisions); candidates are then the
available workers of that revision and the role that serve the request's
model, minus the ones that already failed this request (unless that leaves
none).  With ``--session-affinity`` (on by default) a request with a session
key (``RoutingRequest.session_id``: body ``session_id``, header
``x-session-id``, else the OpenAI ``user`` field) goes to the worker its
session last used while that worker is in rotation; otherwise the policy picks
and the session follows: a move off a worker that failed this request, is
unavailable (unhealthy, circuit open, removed) or drains (its revision no
longer serves) is logged and counted (``kvship_router_session_moves`` by
reason), and the new worker prefills the session's next prompt from scratch.
In PD mode the session pins the prefill worker (where the prefix cache lives);
the decode worker is always the decode policy's choice.  With
``--pd-selective`` the decode worker is chosen first and
``kvship.router.selective`` decides whether it serves the request alone
(``Selection.worker`` is then that decode worker and ``Selection.selective``
the reason).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import aiohttp

from kvship.router.config import RouterConfig
from kvship.router.health import HealthChecker
from kvship.router.kv_events import KVEventsPolicy, KVEventSubscriber
from kvship.router.metrics import RouterMetrics
from kvship.router.policies import Policy, create_policy
from kvship.router.ratelimit import KeyLimits, TokenBucket, key_limits_or_none
from kvship.router.revisions import describe_revisions
from kvship.router.selective import SelectiveDisagg
from kvship.router.slo import SLOTracker, WorkerStatsScraper
from kvship.router.wire import RoutingRequest
from kvship.router.worker import RegistrationError, Worker, WorkerRegistry

logger = logging.getLogger(__name__)

SESSION_TABLE_SIZE = 100_000


class NoWorker(Exception):
    """No available worker for this request (answered 503)."""


class WorkerNotAllowed(Exception):
    """``POST /workers`` named a URL outside the allow-list (answered 403; nothing was sent to it)."""


@dataclass
class Selection:
    """The worker(s) chosen for one attempt: ``worker`` (unified, or a PD decode worker serving alone), or
    ``prefill`` + ``decode``; ``selective`` is the ``--pd-selective`` reason (None without the flag)."""

    worker: Optional[Worker] = None
    prefill: Optional[Worker] = None
    decode: Optional[Worker] = None
    selective: Optional[str] = None

    @property
    def is_pair(self) -> bool:
        return self.prefill is not None

    @property
    def workers(self) -> list[Worker]:
        return [w for w in (self.worker, self.prefill, self.decode) if w is not None]


def session_tag(session: str) -> str:
    """A session key as logs show it: a short hash (the key may be a user's name: never logged whole)."""
    return hashlib.sha256(session.encode()).hexdigest()[:12]


class SessionTable:
    """session id -> worker URL, least recently used entries dropped past ``capacity``."""

    def __init__(self, capacity: int = SESSION_TABLE_SIZE):
        self.capacity = capacity
        self._map: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str) -> Optional[str]:
        url = self._map.get(session)
        if url is not None:
            self._map.move_to_end(session)
        return url

    def set(self, session: str, url: str) -> None:
        self._map[session] = url
        self._map.move_to_end(session)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)


class Router:
    def __init__(self, config: RouterConfig):
        config.validate()
        self.config = config
        self.metrics = RouterMetrics()
        self.registry = WorkerRegistry(config, self.metrics)
        roles = ("prefill", "decode") if config.pd else ("unified",)
        names = {
            "unified": config.policy,
            "prefill": config.resolved_prefill_policy,
            "decode": config.resolved_decode_policy,
        }
        self.policies: dict[str, Policy] = {r: create_policy(names[r], config, self.metrics) for r in roles}
        for policy in self.policies.values():
            self.registry.on_removed(policy.on_worker_removed)
        self.sessions = SessionTable()
        self.selective: Optional[SelectiveDisagg] = None
        if config.pd and config.pd_selective:
            self.selective = SelectiveDisagg(config)
            self.registry.on_removed(self.selective.on_worker_removed)
        self.limiter: Optional[TokenBucket] = None
        if config.rate_limit_rps > 0:
            self.limiter = TokenBucket(
                config.rate_limit_rps,
                config.resolved_rate_limit_burst,
                config.rate_limit_queue_size,
                config.rate_limit_queue_timeout,
            )
        self.key_limits: Optional[KeyLimits] = key_limits_or_none(
            config.rate_limit_per_key,
            config.resolved_per_key_burst,
            config.max_in_flight_per_key,
            config.rate_limit_tracked_keys,
        )
        self.credentials = config.credentials()
        self.allow_list = config.worker_allow_list()
        self.health = HealthChecker(self.registry, config.health_check_interval)
        self.slo = SLOTracker(self.metrics, config.slo_window)
        self.client: Optional[aiohttp.ClientSession] = None
        self.discovery = None
        self.background: set[asyncio.Task] = set()
        self.worker_headers: dict[str, str] = {}
        if config.resolved_worker_api_key:
            self.worker_headers["authorization"] = f"Bearer {config.resolved_worker_api_key}"
        # --policy kv_events (any role): one subscriber feeds each such policy's index from its workers' events
        kv_indexes = {r: p.index for r, p in self.policies.items() if isinstance(p, KVEventsPolicy)}
        self.kv_events: Optional[KVEventSubscriber] = None
        if kv_indexes:
            self.kv_events = KVEventSubscriber(
                self.registry, kv_indexes, lambda: self.client, self.worker_headers, self.metrics
            )
        self.stats_scraper = WorkerStatsScraper(
            self.registry,
            self.slo,
            config.slo_scrape_interval,
            lambda: self.client,
            self.worker_headers,
            config.health_check_timeout,
        )

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.policies)

    # -- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, self.config.request_timeout)),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            trust_env=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self.registry.attach(self.client)
        static = [(u, "unified") for u in self.config.worker_urls]
        static += [(u, "prefill") for u in self.config.prefill] + [(u, "decode") for u in self.config.decode]
        results = await asyncio.gather(*(self.registry.register(u, role) for u, role in static), return_exceptions=True)
        for (url, _), r in zip(static, results):
            if isinstance(r, Exception):
                logger.error("could not register %s: %s", url, r)
        if self.config.service_discovery:
            from kvship.router.discovery import PodDiscovery

            self.discovery = PodDiscovery(self.config, self.registry)
            await self.discovery.start()
        self.health.start()
        if self.kv_events is not None:
            self.kv_events.start()
        self.stats_scraper.start()
        logger.info(
            "router ready: %d worker(s), policy %s",
            len(self.registry.all()),
            ", ".join(f"{r}={p.name}" for r, p in self.policies.items()),
        )

    async def stop(self) -> None:
        await self.health.stop()
        await self.stats_scraper.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.background:
            await asyncio.wait(self.background, timeout=self.config.shutdown_timeout)
        if self.client is not None:
            await self.client.close()

    # -- membership (admin API) -----------------------------------------
    async def add_worker(self, url: str, role: str) -> Worker:
        """The admin API's registration: the allow-list first (``WorkerNotAllowed``: no request is made), then
        ``register`` with an open probe before the worker key is sent (``WorkerRegistry.register``)."""
        if role not in self.roles:
            raise RegistrationError(f"this router takes {' and '.join(self.roles)} workers, not {role!r}")
        refusal = self.allow_list.refusal(url)
        if refusal is not None:
            raise WorkerNotAllowed(refusal)
        return await self.registry.register(url, role, source="admin", require_reachable=True)

    # -- revisions ---------------------------------------------------------
    def serving_revision(self, model: Optional[str] = None) -> Optional[str]:
        """The revision that takes new requests for ``model``; raises ``NoWorker`` when none is ready."""
        self.registry.revisions.sync(self.registry.all())  # (cheap; also covers workers added behind its back)
        available = {role: self.registry.available(role, model) for role in self.roles}
        ready = self.registry.revisions.ready_revisions(available)
        if ready:
            return ready[-1]
        about = f" serving model {model!r}" if model else ""
        if all(available.values()):  # every role has workers, but no revision has all roles
            raise NoWorker(
                f"no revision has a healthy {' and a healthy '.join(self.roles)} worker{about} "
                f"({describe_revisions(available)}): a PD pair never mixes revisions"
            )
        missing = next((role for role in self.roles if not available[role]), self.roles[0])
        total = len(self.registry.all(missing))
        raise NoWorker(f"no healthy {missing} worker available{about} ({total} registered)")

    def serving_revisions(self) -> set[Optional[str]]:
        """Every revision that serves some model (or requests naming none)."""
        out = set()
        for model in [None, *self.registry.models()]:
            try:
                out.add(self.serving_revision(model))
            except NoWorker:
                pass
        return out

    def in_rotation(self, worker: Worker) -> bool:
        """Whether new requests may go to ``worker``: it is available and of the serving revision of a
        model it serves (docs/router.md, "Revisions")."""
        if not worker.available() or worker.role not in self.roles:
            return False
        for model in worker.models or (None,):
            try:
                if self.serving_revision(model) == worker.revision:
                    return True
            except NoWorker:
                pass
        return False

    # -- selection -------------------------------------------------------
    def _pick(
        self, role: str, request: RoutingRequest, exclude: set[str], sticky: bool, revision: Optional[str]
    ) -> Worker:
        available = [w for w in self.registry.available(role, request.model) if w.revision == revision]
        if not available:  # (serving_revision found one of each role)
            raise NoWorker(f"no healthy {role} worker of revision {revision} available")
        candidates = [w for w in available if w.url not in exclude] or available
        session = request.session_id if sticky and self.config.session_affinity else None
        moved_from: Optional[str] = None
        if session is not None:
            moved_from = self.sessions.get(session)
            if moved_from is not None:
                for w in candidates:
                    if w.url == moved_from:
                        return w
        worker = self.policies[role].select(candidates, request)
        if session is not None:
            self.sessions.set(session, worker.url)
            if moved_from is not None and moved_from != worker.url:
                reason = self._move_reason(moved_from, exclude)
                logger.info(
                    "session moved from %s to %s (%s; session %s)", moved_from, worker.url, reason, session_tag(session)
                )
                self.metrics.session_moves.labels(reason).inc()
        return worker

    def _move_reason(self, url: str, exclude: set[str]) -> str:
        """Why a session left ``url``: ``failed`` (this request failed there), ``draining`` (available, but its
        revision no longer serves) or ``unavailable`` (unhealthy, circuit open, or gone from the registry)."""
        if url in exclude:
            return "failed"
        worker = self.registry.get(url)
        if worker is not None and worker.available():
            return "draining"
        return "unavailable"

    def choose(self, request: RoutingRequest, exclude: set[str], prefer_revision: Optional[str] = None) -> Selection:
        """Worker(s) for one attempt, all of one revision: ``prefer_revision`` while it is ready (a resumed
        stream goes on with the model it began with), else the serving one; raises ``NoWorker``."""
        revision = self.serving_revision(request.model)
        if prefer_revision is not None and prefer_revision != revision:
            available = {role: self.registry.available(role, request.model) for role in self.roles}
            if prefer_revision in self.registry.revisions.ready_revisions(available):
                revision = prefer_revision
        if self.config.pd:
            decode = self._pick("decode", request, exclude, False, revision)
            reason = None
            if self.selective is not None:
                decision = self.selective.decide(decode, request)
                reason = decision.reason
                if decision.local:
                    self.metrics.pd_selective.labels("decode", reason).inc()
                    return Selection(worker=decode, selective=reason)
                self.metrics.pd_selective.labels("pd", reason).inc()
            prefill = self._pick("prefill", request, exclude, True, revision)
            return Selection(prefill=prefill, decode=decode, selective=reason)
        return Selection(worker=self._pick("unified", request, exclude, True, revision))

    def ready(self) -> bool:
        """Some revision has an available worker of every role (a request can be served)."""
        try:
            self.serving_revision()
        except NoWorker:
            return False
        return True

    def worker_json(self, worker: Worker) -> dict:
        """One worker as ``/workers`` lists it: its fields plus ``state`` and ``in_rotation``."""
        rotating = self.in_rotation(worker)
        return {**worker.to_json(), "state": worker.state(rotating), "in_rotation": rotating}

    def workers_report(self) -> dict:
        """``GET /workers``: every worker with its revision, state and ``in_rotation``, and the revisions."""
        serving = self.serving_revisions()
        workers = [self.worker_json(w) for w in self.registry.all()]
        revisions = []
        for rev in self.registry.revisions.ordered():
            ready = {role: 0 for role in ("prefill", "decode", "unified")}
            count = 0
            for w in self.registry.all():
                if w.revision == rev and w.revision_known:
                    count += 1
                    if w.available():
                        ready[w.role] += 1
            seen = self.registry.revisions.seen(rev)
            revisions.append(
                {
                    "revision": rev,
                    "prefill_ready": ready["prefill"],
                    "decode_ready": ready["decode"],
                    "unified_ready": ready["unified"],
                    "workers": count,
                    "serving": rev in serving,
                    "first_seen": seen.at if seen else None,
                }
            )
        return {"pd": self.config.pd, "workers": workers, "revisions": revisions}
