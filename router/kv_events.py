"""``--policy kv_events``: a global prefix index fed by every worker's KV events (docs/cache.md, "Routing on KV events").

Data flow::

    worker /kv_events (NDJSON) ──> WorkerFeed (one task per worker) ──> PrefixIndex ──> KVEventsPolicy.select
    worker /kv_events/snapshot ──> WorkerFeed.resync (first sync, a gap, a lost line, a reconnect failure)

* ``PrefixIndex`` holds page hash -> {worker URL: tiers} for the workers it follows (a page may be on both
  tiers of a worker: ``--hicache-write-policy write_through``; it counts as a gpu page), at most
  ``--kv-index-max-pages`` hashes (least recently stored or matched dropped first), and per worker the
  sequence number of the last event applied, its page size and whether it is *synced* (its events since the
  last snapshot were all applied in order).  Event-loop thread only.
* ``WorkerFeed`` keeps one worker's part of the index in step: snapshot, then the event stream from the
  snapshot's ``seq``; a stream that ends idle is reopened from the last ``seq`` (the worker replays what was
  missed, or answers a gap line); any gap or failure marks the worker unsynced until the next snapshot.
* ``KVEventSubscriber`` runs one feed per registered worker of the roles that route with ``kv_events`` and
  drops a worker's pages when it leaves the registry.
* ``KVEventsPolicy`` routes a token-id prompt by the rule of ``cache_aware`` with the index in place of the
  approximate tree: when in-flight counts are imbalanced (``--balance-abs-threshold`` and
  ``--balance-rel-threshold``) the least loaded worker wins; otherwise the worker with the best score::

      score = gpu_tokens + host_weight * host_tokens - load_tokens * in_flight

  where ``gpu_tokens`` / ``host_tokens`` are the tokens of the prompt's longest leading run of pages the
  worker holds on that tier (``page_hashes`` of the prompt at the worker's page size); ``load_tokens``
  (``--kv-events-load-tokens``) is 0 by default, so the longest cached prefix wins and load only breaks ties.
  Ties: the worker sent the fewest distinct prompt tokens (``cache_aware``'s tree size: its KV demand),
  then the least loaded, then the fewest pages held (most free KV), then at random.  When no worker holds
  any page of the prompt the same tie rule picks, except for a *returning* prompt (``cache_aware``'s tree
  would route it by affinity) that every worker holds at most ``--cache-threshold`` of: with
  ``--kv-events-contain-thrash`` it goes to the worker whose ``removed`` events lost the most pages lately
  (thrash containment: docs/cache.md).  With ``--kv-events-pending`` the pages of each prompt routed count as
  its worker's (gpu tier) until that worker's events report them, its reply ends (+1 s) or 10 s pass
  (``PrefixIndex.expect``: docs/cache.md, "Pages on their way").  A worker whose feed is not synced is scored from the
  approximate tree of ``cache_aware`` (what the router sent it) instead.  The router has no tokenizer: text
  prompts (chat, text completions and ``/generate`` text, batches) are routed by the ``cache_aware`` rule on
  the approximate tree.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import aiohttp

from kvship.common.kv_events import TIER_BIT, KVEvent, fastest_tier, page_hashes
from kvship.router.config import RouterConfig
from kvship.router.metrics import RouterMetrics
from kvship.router.policies import CacheAwarePolicy, Policy, register_policy
from kvship.router.wire import ROUTE_CHAT, ROUTE_GENERATE, RoutingRequest
from kvship.router.worker import Worker, WorkerRegistry

# bounds on what a worker's event stream may send (docs/security.md): one event line, one snapshot (a page is
# ~25 bytes of JSON: 64 MiB holds millions of pages, above any --kv-index-max-pages the index keeps)
MAX_EVENT_LINE_BYTES = 1 << 20
MAX_SNAPSHOT_BYTES = 64 << 20

logger = logging.getLogger(__name__)

STREAM_IDLE_S = 10.0  # a stream with no event for this long ends and is reopened (a dead connection shows)
RETRY_S = (0.2, 5.0)  # reconnect backoff: first delay, largest delay
EVENTS_OFF_RETRY_S = 30.0  # a worker answering 404 (started without --enable-kv-events) is asked again after this
SUPERVISE_S = 0.5  # how often the subscriber compares its feeds with the registry
# thrash containment: a worker's recent page losses decay by 1/LOSS_WINDOW per token-id prompt routed, so they
# count roughly the losses of the last LOSS_WINDOW routings
LOSS_WINDOW = 64
# pages on their way (``PrefixIndex.expect``): how long a routed prompt's pages count as its worker's before that
# worker's events report them, how long after its reply ended, and at most how many per worker
PENDING_S = 10.0
PENDING_AFTER_REPLY_S = 1.0
MAX_PENDING_PAGES = 1 << 15


@dataclass
class FeedState:
    """One worker's place in the index: ``seq`` of the last applied event, ``page_size``, ``synced``."""

    seq: int = 0
    page_size: int = 0
    synced: bool = False
    resyncs: int = 0


class PrefixIndex:
    """page hash -> {worker URL: tiers (a ``TIER_BIT`` mask)}, bounded; see the module docstring.  Event-loop
    thread only."""

    def __init__(self, max_pages: int):
        if max_pages < 1:
            raise ValueError("--kv-index-max-pages must be >= 1")
        self.max_pages = max_pages
        self._pages: OrderedDict[int, dict[str, int]] = OrderedDict()
        self._held: dict[str, set[int]] = {}
        self.state: dict[str, FeedState] = {}
        self.evicted_pages = 0
        # per worker: pages its ``removed`` events took off every tier (not a demotion to host), since it joined
        self.lost: dict[str, int] = {}
        # per worker: pages on their way (``expect``): hash -> deadline (``time.monotonic``), oldest first
        self.pending: dict[str, OrderedDict[int, float]] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def synced(self, url: str) -> bool:
        s = self.state.get(url)
        return s is not None and s.synced

    def page_size(self, url: str) -> int:
        return self.state[url].page_size

    def held(self, url: str) -> int:
        """How many pages the index holds for ``url``."""
        return len(self._held.get(url, ()))

    def pages(self, url: str) -> dict[int, str]:
        """The pages the index holds for ``url`` (a copy): hash -> its fastest tier there."""
        return {h: fastest_tier(self._pages[h][url]) for h in self._held.get(url, ())}

    # -- updates -----------------------------------------------------------
    def reset(self, url: str, snapshot: dict) -> None:
        """Replace ``url``'s pages with a ``/kv_events/snapshot`` reply; the worker is synced at its ``seq``."""
        seq, page_size = int(snapshot["seq"]), int(snapshot["page_size"])
        if page_size < 1:
            raise ValueError(f"snapshot of {url} has page_size {page_size}")
        pages = [(int(h), str(t)) for h, t in snapshot["pages"]]
        self._drop_worker_pages(url)
        state = self.state.setdefault(url, FeedState())
        state.seq, state.page_size, state.synced = seq, page_size, True
        state.resyncs += 1
        for h, tier in pages:
            self._store(h, url, tier)

    def apply(self, url: str, events: Sequence[KVEvent]) -> bool:
        """Apply ``events`` in order; False (nothing applied, the worker unsynced) when the first new event is
        not the next sequence number.  Replays of applied events are skipped."""
        state = self.state.get(url)
        if state is None or not state.synced:
            return False
        fresh = [e for e in events if e.seq > state.seq]
        if fresh and fresh[0].seq != state.seq + 1:
            state.synced = False
            return False
        for e in fresh:
            if e.seq != state.seq + 1:
                state.synced = False
                return False
            waiting = self.pending.get(url)
            if waiting:  # the worker told: its own word replaces the expectation, either way
                for h in e.hashes:
                    waiting.pop(h, None)
            if e.kind == "stored":
                for h in e.hashes:
                    self._store(h, url, e.tier)  # type: ignore[arg-type]
            else:
                gone = sum(self._remove(h, url, e.tier) for h in e.hashes)
                if gone:
                    self.lost[url] = self.lost.get(url, 0) + gone
            state.seq = e.seq
        return True

    def mark_unsynced(self, url: str) -> None:
        state = self.state.get(url)
        if state is not None:
            state.synced = False

    def forget(self, url: str) -> None:
        """Drop a worker that left: its pages and its state."""
        self._drop_worker_pages(url)
        self._held.pop(url, None)
        self.state.pop(url, None)
        self.lost.pop(url, None)
        self.pending.pop(url, None)

    def expect(self, url: str, hashes: Sequence[int], now: Optional[float] = None) -> None:
        """A prompt of ``hashes`` was just routed to ``url``: until its events report those pages (stored or
        removed) or ``PENDING_S`` pass, ``prefix`` counts the ones ``url`` does not hold yet as held on its gpu
        tier (the request is computing them there).  At most ``MAX_PENDING_PAGES`` per worker, oldest dropped."""
        deadline = (time.monotonic() if now is None else now) + PENDING_S
        waiting = self.pending.setdefault(url, OrderedDict())
        held = self._held.get(url, ())
        for h in hashes:
            if h in held:
                continue
            waiting[h] = deadline
            waiting.move_to_end(h)
        while len(waiting) > MAX_PENDING_PAGES:
            waiting.popitem(last=False)

    def settle(self, url: str, hashes: Sequence[int], now: Optional[float] = None) -> None:
        """The reply of a request routed with ``expect(url, hashes)`` ended: its pages stop counting
        ``PENDING_AFTER_REPLY_S`` from now unless the events report them sooner (they are on their way)."""
        waiting = self.pending.get(url)
        if not waiting:
            return
        deadline = (time.monotonic() if now is None else now) + PENDING_AFTER_REPLY_S
        for h in hashes:
            if h in waiting and waiting[h] > deadline:
                waiting[h] = deadline

    def _store(self, h: int, url: str, tier: str) -> None:
        entry = self._pages.get(h)
        if entry is None:
            entry = self._pages[h] = {}
        else:
            self._pages.move_to_end(h)
        entry[url] = entry.get(url, 0) | TIER_BIT[tier]
        self._held.setdefault(url, set()).add(h)
        while len(self._pages) > self.max_pages:
            old, holders = self._pages.popitem(last=False)
            for u in holders:
                self._held[u].discard(old)
            self.evicted_pages += 1

    def _remove(self, h: int, url: str, tier: Optional[str] = None) -> bool:
        """``url`` no longer holds page ``h`` on ``tier`` (None: on any tier); True when it now holds it on none."""
        entry = self._pages.get(h)
        if entry is None or url not in entry:
            return False
        if tier is not None:
            left = entry[url] & ~TIER_BIT[tier]
            if left:
                entry[url] = left
                return False
        del entry[url]
        self._held[url].discard(h)
        if not entry:
            del self._pages[h]
        return True

    def _drop_worker_pages(self, url: str) -> None:
        for h in list(self._held.get(url, ())):
            self._remove(h, url)

    # -- lookups -------------------------------------------------------------
    def prefix(self, url: str, hashes: Sequence[int], now: Optional[float] = None) -> tuple[int, int]:
        """(gpu pages, host pages) of the longest leading run of ``hashes`` that ``url`` holds, pages on their
        way there (``expect``) counted on its gpu tier; the matched pages become the most recently used."""
        gpu = host = 0
        waiting = self.pending.get(url)
        t = (time.monotonic() if now is None else now) if waiting else 0.0
        for h in hashes:
            entry = self._pages.get(h)
            tiers = entry.get(url) if entry is not None else None
            if tiers is None:
                deadline = waiting.get(h) if waiting else None
                if deadline is None:
                    break
                if deadline < t:
                    del waiting[h]  # type: ignore[union-attr]
                    break
                gpu += 1
                continue
            self._pages.move_to_end(h)
            if tiers & TIER_BIT["gpu"]:
                gpu += 1
            else:
                host += 1
        return gpu, host


class WorkerFeed:
    """Keeps one worker's pages in a ``PrefixIndex`` (module docstring); ``run`` until cancelled."""

    def __init__(
        self,
        url: str,
        index: PrefixIndex,
        client: Callable[[], Optional[aiohttp.ClientSession]],
        headers: dict[str, str],
        metrics: Optional[RouterMetrics] = None,
        idle_s: float = STREAM_IDLE_S,
    ):
        self.url = url
        self.index = index
        self._client = client
        self.headers = headers
        self.metrics = metrics
        self.idle_s = idle_s
        self.events_off = False  # the worker answered 404: started without --enable-kv-events

    def session(self) -> aiohttp.ClientSession:
        client = self._client()
        if client is None:
            raise RuntimeError("the router's HTTP client is not started")
        return client

    async def resync(self) -> None:
        """Load the worker's snapshot into the index (the worker is synced at its ``seq`` afterwards)."""
        async with self.session().get(
            self.url + "/kv_events/snapshot", headers=self.headers, timeout=aiohttp.ClientTimeout(total=30)
        ) as r:
            if r.status == 404:
                self.events_off = True
            r.raise_for_status()
            body = await r.content.read(MAX_SNAPSHOT_BYTES + 1)
            if len(body) > MAX_SNAPSHOT_BYTES:
                raise ValueError(f"KV event snapshot of {self.url} exceeds {MAX_SNAPSHOT_BYTES} bytes")
            snapshot = json.loads(body)
        self.events_off = False
        self.index.reset(self.url, snapshot)
        if self.metrics is not None:
            self.metrics.kv_index_resyncs.labels(self.url).inc()

    def feed_line(self, line: bytes) -> bool:
        """Apply one NDJSON line of the stream; False when the index lost step (a gap line, a skipped seq)."""
        if len(line) > MAX_EVENT_LINE_BYTES:  # (aiohttp also refuses a line past its own buffer limit)
            raise ValueError(f"a KV event line of {len(line)} bytes (limit {MAX_EVENT_LINE_BYTES})")
        obj = json.loads(line)
        if obj.get("gap"):
            self.index.mark_unsynced(self.url)
            return False
        return self.index.apply(self.url, [KVEvent.from_json(obj)])

    async def follow(self) -> None:
        """One stream from the last applied ``seq``, until it ends (idle) or the index loses step."""
        seq = self.index.state[self.url].seq
        params = {"after": str(seq), "idle_timeout_s": str(self.idle_s)}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.idle_s + 10)
        async with self.session().get(
            self.url + "/kv_events", params=params, headers=self.headers, timeout=timeout
        ) as r:
            r.raise_for_status()
            async for line in r.content:
                if line.strip() and not self.feed_line(line):
                    return

    async def run(self) -> None:
        delay = RETRY_S[0]
        while True:
            try:
                if not self.index.synced(self.url):
                    await self.resync()
                await self.follow()
                delay = RETRY_S[0]
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError, OSError) as e:
                self.index.mark_unsynced(self.url)
                if self.events_off:
                    await asyncio.sleep(EVENTS_OFF_RETRY_S)
                    continue
                logger.debug("KV events of %s: %s (reconnecting in %.1f s)", self.url, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_S[1])


class KVEventSubscriber:
    """One ``WorkerFeed`` per registered worker of the roles in ``indexes`` (role -> that role's index)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        indexes: dict[str, PrefixIndex],
        client: Callable[[], Optional[aiohttp.ClientSession]],
        headers: dict[str, str],
        metrics: Optional[RouterMetrics] = None,
    ):
        self.registry = registry
        self.indexes = indexes
        self.client = client
        self.headers = headers
        self.metrics = metrics
        self.feeds: dict[str, tuple[WorkerFeed, asyncio.Task]] = {}
        self._task: Optional[asyncio.Task] = None
        registry.on_removed(self.on_worker_removed)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._supervise())

    async def stop(self) -> None:
        tasks = [t for _, t in self.feeds.values()] + ([self._task] if self._task else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.feeds.clear()

    def sync_feeds(self) -> None:
        """Start a feed for each new worker of a followed role, stop those of workers gone."""
        wanted = {w.url: role for role in self.indexes for w in self.registry.all(role)}
        for url in [u for u in self.feeds if u not in wanted]:
            self._stop_feed(url)
        for url, role in wanted.items():
            if url not in self.feeds:
                feed = WorkerFeed(url, self.indexes[role], self.client, self.headers, self.metrics)
                self.feeds[url] = (feed, asyncio.get_running_loop().create_task(feed.run()))
        if self.metrics is not None:
            self.metrics.kv_index_pages.set(sum(len(i) for i in set(self.indexes.values())))

    async def _supervise(self) -> None:
        while True:
            self.sync_feeds()
            await asyncio.sleep(SUPERVISE_S)

    def _stop_feed(self, url: str) -> None:
        feed, task = self.feeds.pop(url)
        task.cancel()
        feed.index.forget(url)

    def on_worker_removed(self, worker: Worker) -> None:
        if worker.url in self.feeds:
            self._stop_feed(worker.url)
        for index in self.indexes.values():
            index.forget(worker.url)


MAX_REPLY_LINE_BYTES = 1 << 20  # a reply line longer than this is not searched for cached_tokens


def reply_cached_tokens(obj: Any) -> Optional[int]:
    """The worker's count of cached prompt tokens in one reply object (``/generate``: ``meta_info.cached_tokens``;
    OpenAI routes: ``usage.prompt_tokens_details.cached_tokens``), else None."""
    if not isinstance(obj, dict):
        return None
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("cached_tokens"), int):
        return meta["cached_tokens"]
    usage = obj.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    return None


@dataclass
class KVPrediction:
    """What ``kv_events`` expected of the worker it chose for one token-id request, and what the worker said.

    The proxy feeds it the reply (``feed`` per stream chunk, ``feed_body`` for a whole reply) and calls
    ``finish`` once the reply ended well: the metrics then compare ``tokens`` (predicted) with the worker's own
    ``cached_tokens`` (docs/cache.md, "Routing on KV events", Metrics).
    """

    worker: str
    tokens: int
    source: str  # "index" (the worker's KV events) or "tree" (the approximate tree: its feed was behind)
    actual: Optional[int] = None
    _tail: bytes = field(default=b"", repr=False)
    # called when the reply ended well: the prompt's pages on their way stop counting soon (``PrefixIndex.settle``)
    on_end: Optional[Callable[[], None]] = field(default=None, repr=False)

    def feed(self, chunk: bytes) -> None:
        """One piece of an SSE reply; the last ``cached_tokens`` of its ``data:`` events is kept."""
        data = self._tail + chunk if self._tail else chunk
        lines = data.split(b"\n")
        tail = lines.pop()
        self._tail = tail if len(tail) <= MAX_REPLY_LINE_BYTES else b""
        for line in lines:
            if b"cached_tokens" in line and line.startswith(b"data:"):
                try:
                    found = reply_cached_tokens(json.loads(line[5:]))
                except ValueError:
                    continue
                if found is not None:
                    self.actual = found

    def feed_body(self, body: bytes) -> None:
        """A whole (non-streamed) JSON reply."""
        if b"cached_tokens" not in body:
            return
        try:
            found = reply_cached_tokens(json.loads(body))
        except ValueError:
            return
        if found is not None:
            self.actual = found

    def finish(self, metrics: Optional[RouterMetrics], worker_url: str) -> None:
        """Record predicted against actual (a reply from another worker, resumed or retried, is not counted)."""
        if self.on_end is not None:
            self.on_end()
            self.on_end = None
        if metrics is None or self.actual is None or worker_url != self.worker:
            return
        diff = self.actual - self.tokens
        outcome = "exact" if diff == 0 else ("under" if diff > 0 else "over")
        metrics.kv_actual_cached_tokens.labels(self.source).observe(self.actual)
        metrics.kv_prediction_error_tokens.labels(self.source).observe(abs(diff))
        metrics.kv_predictions.labels(self.source, outcome).inc()


def prompt_ids(request: RoutingRequest) -> Optional[list[int]]:
    """The token ids of a single token-id prompt (``/generate`` ``input_ids``, a completions id list), else None."""
    if not request.text_is_ids or request.batch_size != 1 or request.route == ROUTE_CHAT:
        return None
    value = request.body.get("input_ids") if request.route == ROUTE_GENERATE else request.body.get("prompt")
    if isinstance(value, list) and value and isinstance(value[0], list):
        value = value[0]
    return value if isinstance(value, list) else None


@register_policy("kv_events")
class KVEventsPolicy(Policy):
    """The rule of the module docstring.  ``index`` is fed by a ``KVEventSubscriber`` the router runs."""

    def __init__(self, config: RouterConfig, metrics: Optional[RouterMetrics] = None):
        super().__init__(config, metrics)
        self.index = PrefixIndex(config.kv_index_max_pages)
        self.fallback = CacheAwarePolicy(config, metrics)
        self._last: Optional[tuple[int, KVPrediction]] = None  # (id of the request, its prediction)
        self.recent_losses: dict[str, float] = {}  # worker URL -> pages lost lately (decayed; ``_age_losses``)
        self._losses_seen: dict[str, int] = {}  # worker URL -> ``index.lost`` when last aged

    def predict(
        self, worker: Worker, ids: list[int], text: str, hashes: dict[int, list[int]]
    ) -> tuple[float, int, bool]:
        """(score before load, predicted cached tokens, from the index) of ``worker`` for a prompt."""
        if self.index.synced(worker.url):
            ps = self.index.page_size(worker.url)
            if ps not in hashes:
                hashes[ps] = page_hashes(ids, ps)
            gpu, host = self.index.prefix(worker.url, hashes[ps])
            return (gpu + self.config.kv_events_host_weight * host) * ps, (gpu + host) * ps, True
        matched = self.fallback.tree(worker).match(text)
        return float(matched), matched, False

    def held_pages(self, worker: Worker) -> int:
        """Pages the index holds for ``worker`` (its used KV as far as the router knows; 0 when unsynced)."""
        return self.index.held(worker.url) if self.index.synced(worker.url) else 0

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        self._last = None
        ids = prompt_ids(request)
        if ids is None:
            return self.fallback.select(workers, request)
        text = request.text
        loads = [w.in_flight for w in workers]
        max_load, min_load = max(loads), min(loads)
        imbalanced = (
            max_load - min_load > self.config.balance_abs_threshold
            and max_load > self.config.balance_rel_threshold * min_load
        )
        hashes: dict[int, list[int]] = {}
        self._age_losses(workers)
        if imbalanced:
            least = min(loads)
            pool = [w for w in workers if w.in_flight == least]
            chosen = self._tie_break([(0.0, 0, False, w) for w in pool])[3]
            _, cached, from_index = self.predict(chosen, ids, text, hashes)
        else:
            scored = []
            for w in workers:
                score, cached, from_index = self.predict(w, ids, text, hashes)
                scored.append((score - self.config.kv_events_load_tokens * w.in_flight, cached, from_index, w))
            best = max(s[0] for s in scored)
            _, cached, from_index, chosen = self._tie_break([s for s in scored if s[0] == best])
            if self._lost(scored, len(ids)) and self._returning(workers, text):
                _, cached, from_index, chosen = self._contain(scored, (best, cached, from_index, chosen))
        self.fallback.tree(chosen).insert(text)
        source = "index" if from_index else "tree"
        if self.metrics is not None:
            self.metrics.kv_predicted_cached_tokens.labels(source).observe(cached)
        prediction = KVPrediction(chosen.url, cached, source)
        if self.config.kv_events_pending and self.index.synced(chosen.url):
            ps = self.index.page_size(chosen.url)
            if ps not in hashes:
                hashes[ps] = page_hashes(ids, ps)
            url, pages = chosen.url, hashes[ps]
            self.index.expect(url, pages)
            prediction.on_end = lambda: self.index.settle(url, pages)
        self._last = (id(request), prediction)
        return chosen

    def take_prediction(self, request: RoutingRequest) -> Optional[KVPrediction]:
        """The prediction of the ``select`` that just routed ``request`` (once; None for a text prompt)."""
        last, self._last = self._last, None
        return last[1] if last is not None and last[0] == id(request) else None

    def _age_losses(self, workers: Sequence[Worker]) -> None:
        """Decay every worker's recent page losses by one routing and add those its events reported since."""
        keep = 1.0 - 1.0 / LOSS_WINDOW
        for w in workers:
            lost = self.index.lost.get(w.url, 0)
            seen = self._losses_seen.get(w.url, 0)
            fresh = lost - seen if lost >= seen else lost  # the counter restarted: the worker rejoined
            self._losses_seen[w.url] = lost
            self.recent_losses[w.url] = self.recent_losses.get(w.url, 0.0) * keep + fresh

    def _lost(self, scored: list[tuple[float, int, bool, Worker]], prompt_len: int) -> bool:
        """Whether every worker (all followed by the index) holds at most ``--cache-threshold`` of the prompt:
        none would be chosen for its cache by ``cache_aware``'s rule."""
        return all(s[2] for s in scored) and max(s[1] for s in scored) <= self.config.cache_threshold * prompt_len

    def _returning(self, workers: Sequence[Worker], text: str) -> bool:
        """Whether ``cache_aware``'s tree of what was sent would route ``text`` by affinity: a prompt that came
        back (a conversation's next turn, a shared prefix) rather than a new one."""
        if not text:
            return False
        matched = max(self.fallback.tree(w).match(text) for w in workers)
        return matched > 0 and matched / len(text) > self.config.cache_threshold

    def _contain(
        self, scored: list[tuple[float, int, bool, Worker]], chosen: tuple[float, int, bool, Worker]
    ) -> tuple[float, int, bool, Worker]:
        """Where a returning prompt goes that every worker has (mostly) lost: with ``--kv-events-contain-thrash``,
        the worker that lost the most pages lately (its pool is the one thrashing: the prompt's pages push out
        what is going anyway there, not the conversations the other pools still hold), else ``chosen``."""
        most = max(self.recent_losses.get(s[3].url, 0.0) for s in scored)
        contained = self.config.kv_events_contain_thrash and most > 0
        if contained:
            chosen = self._tie_break([s for s in scored if self.recent_losses.get(s[3].url, 0.0) == most])
        if self.metrics is not None:
            self.metrics.kv_lost_prompts.labels("contained" if contained else "spread").inc()
        return chosen

    def _tie_break(self, tied: list[tuple[float, int, bool, Worker]]) -> tuple[float, int, bool, Worker]:
        """Among equal scores (and for a prompt no worker holds): the worker sent the fewest distinct prompt
        tokens (the size of ``cache_aware``'s approximate tree of what it was sent: its KV demand, counted at
        the choice, where the index hears of pages only once they are cached), then the least loaded, then
        the fewest pages held in the index, then at random.  Demand before load: a new conversation goes
        where its KV is least likely to push others out (load has the balance thresholds)."""
        for key in (
            lambda w: self.fallback.tree(w).size,
            lambda w: w.in_flight,
            self.held_pages,
        ):
            if len(tied) > 1:
                least = min(key(s[3]) for s in tied)
                tied = [s for s in tied if key(s[3]) == least]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)

    def on_worker_removed(self, worker: Worker) -> None:
        self.fallback.on_worker_removed(worker)
        self.index.forget(worker.url)
        self.recent_losses.pop(worker.url, None)
        self._losses_seen.pop(worker.url, None)
