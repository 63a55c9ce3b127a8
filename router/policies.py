"""Routing policies: ``select(workers, request) -> worker`` behind one ABC and a name registry.

Contract for every policy: ``workers`` is a non-empty sequence of workers that
are all available right now and serve the request's model; ``select`` returns
one of them, synchronously and without I/O (it runs on the event loop for
every request).  Load is the router's own count of in-flight requests per
worker (``Worker.in_flight``).  A policy may keep per-worker state; it is told
when a worker leaves through ``on_worker_removed``.

Add a policy with ``@register_policy("name")`` on a ``Policy`` subclass whose
constructor takes ``(config, metrics=None)``.
"""

from __future__ import annotations

import collections
import importlib
import itertools
import random
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Optional, Sequence

from kvship.router.config import RouterConfig
from kvship.router.metrics import RouterMetrics
from kvship.router.radix_tree import ApproxRadixTree
from kvship.router.wire import RoutingRequest
from kvship.router.worker import Worker

POLICIES: dict[str, type["Policy"]] = {}


def register_policy(name: str) -> Callable[[type["Policy"]], type["Policy"]]:
    def deco(cls: type["Policy"]) -> type["Policy"]:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        POLICIES[name] = cls
        cls.name = name
        return cls

    return deco


# policies registered in their own module (kv_events runs a subscriber beside the policy), imported on first use
_LAZY_MODULES = {"kv_events": "kvship.router.kv_events"}


def create_policy(name: str, config: RouterConfig, metrics: Optional[RouterMetrics] = None) -> "Policy":
    if name not in POLICIES and name in _LAZY_MODULES:
        importlib.import_module(_LAZY_MODULES[name])
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}") from None
    return cls(config, metrics)


class Policy(ABC):
    name = "?"

    def __init__(self, config: RouterConfig, metrics: Optional[RouterMetrics] = None):
        self.config = config
        self.metrics = metrics
        self.rng = random.Random()

    @abstractmethod
    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        """Pick one of ``workers`` (non-empty, all available) for ``request``."""

    def take_prediction(self, request: RoutingRequest) -> Optional[Any]:
        """What this policy expected of the worker its last ``select`` chose for ``request``, handed over once,
        right after that ``select``; None for policies that predict nothing (``kv_events`` returns a
        ``KVPrediction`` the proxy completes with the reply)."""
        return None

    def on_worker_removed(self, worker: Worker) -> None:
        """Forget per-worker state of a worker that left the registry."""

    def least_loaded(self, workers: Sequence[Worker], key: Optional[Callable[[Worker], object]] = None) -> Worker:
        """The worker with the fewest in-flight requests (then smallest ``key``), ties broken at random."""
        best_load = min(w.in_flight for w in workers)
        tied = [w for w in workers if w.in_flight == best_load]
        if key is not None and len(tied) > 1:
            best_key = min(key(w) for w in tied)  # type: ignore[type-var]
            tied = [w for w in tied if key(w) == best_key]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)


@register_policy("round_robin")
class RoundRobinPolicy(Policy):
    """Each worker in turn (in URL order, so adding a worker does not reshuffle the rest)."""

    def __init__(self, config: RouterConfig, metrics: Optional[RouterMetrics] = None):
        super().__init__(config, metrics)
        self._counter = itertools.count()

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        ordered = sorted(workers, key=lambda w: w.url)
        return ordered[next(self._counter) % len(ordered)]


@register_policy("random")
class RandomPolicy(Policy):
    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return self.rng.choice(list(workers))


@register_policy("shortest_queue")
class ShortestQueuePolicy(Policy):
    """The worker with the fewest in-flight requests."""

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return self.least_loaded(workers)


@register_policy("power_of_two")
class PowerOfTwoPolicy(Policy):
    """Two workers drawn at random; the less loaded of the two."""

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = self.rng.sample(list(workers), 2)
        if a.in_flight == b.in_flight:
            return a if self.rng.random() < 0.5 else b
        return a if a.in_flight < b.in_flight else b


@register_policy("cache_aware")
class CacheAwarePolicy(Policy):
    """Prefix-cache affinity with a load-balance escape hatch.

    Per worker, an ``ApproxRadixTree`` of the texts sent to it.  When loads
    are balanced, the request goes to the worker whose tree matches the longest
    prefix if ``matched / len(text) > --cache-threshold``; otherwise to the
    least loaded worker (ties: smallest tree, i.e. most free cache).  When
    ``max_load - min_load > --balance-abs-threshold`` and
    ``max_load > --balance-rel-threshold * min_load`` the least loaded worker
    wins regardless of prefixes.  The chosen worker's tree records the text.
    """

    def __init__(self, config: RouterConfig, metrics: Optional[RouterMetrics] = None):
        super().__init__(config, metrics)
        self.trees: dict[str, ApproxRadixTree] = {}

    def tree(self, worker: Worker) -> ApproxRadixTree:
        t = self.trees.get(worker.url)
        if t is None:
            t = self.trees[worker.url] = ApproxRadixTree(self.config.max_tree_size)
        return t

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        text = request.text
        loads = [w.in_flight for w in workers]
        max_load, min_load = max(loads), min(loads)
        imbalanced = (
            max_load - min_load > self.config.balance_abs_threshold
            and max_load > self.config.balance_rel_threshold * min_load
        )
        if imbalanced or not text:
            chosen = self.least_loaded(workers, key=lambda w: self.tree(w).size)
            ratio = self.tree(chosen).match(text) / len(text) if text else 0.0
        else:
            best, best_len = None, -1
            for w in workers:
                m = self.tree(w).match(text)
                if m > best_len or (m == best_len and best is not None and w.in_flight < best.in_flight):
                    best, best_len = w, m
            assert best is not None
            ratio = best_len / len(text)
            if ratio > self.config.cache_threshold:
                chosen = best
            else:
                chosen = self.least_loaded(workers, key=lambda w: self.tree(w).size)
                ratio = self.tree(chosen).match(text) / len(text)
        if text:
            self.tree(chosen).insert(text)
        if self.metrics is not None:
            self.metrics.cache_match.observe(ratio)
        return chosen

    def on_worker_removed(self, worker: Worker) -> None:
        self.trees.pop(worker.url, None)


@register_policy("bucket")
class BucketPolicy(Policy):
    """Length buckets (SGLang's bucket policy): each worker serves one range of prompt lengths.

    The rule, exactly:

    * Workers are ordered by URL; worker ``i`` of ``n`` owns the bucket of prompt lengths (characters of the
      request text) ``[bounds[i-1], bounds[i])`` with ``bounds[-1] = 0`` and the last bucket open-ended.
    * Until requests were seen, the ``n - 1`` bounds split ``--bucket-initial-span`` characters evenly
      (``span * k / n`` for ``k = 1..n-1``).
    * The policy keeps the requests of the last ``--bucket-adjust-interval`` seconds (length, time).  At most
      once per interval the bounds are refitted to them: with the window's lengths sorted and ``total`` their
      sum, bound ``k`` is one more than the first length at which the running sum reaches ``total * k / n``,
      so each bucket holds about an equal share of the recent prompt characters (bounds never decrease from
      ``k`` to ``k+1``; many prompts of one length all land in one bucket, which the load escape offsets).
      An empty window brings back the even split.
      A change of the worker set (a worker added or gone) refits at once.
    * Load escape: when the in-flight counts are imbalanced by the cache_aware rule
      (``max - min > --balance-abs-threshold`` and ``max > --balance-rel-threshold * min``) the least loaded
      worker wins regardless of the bucket.

    So a deployment sends prompts of similar length to the same worker (its batches mix fewer very short and
    very long prompts), with an equal share of the prompt work each.
    """

    def __init__(
        self,
        config: RouterConfig,
        metrics: Optional[RouterMetrics] = None,
        clock: Optional[Callable[[], float]] = None,
    ):
        super().__init__(config, metrics)
        self._clock: Callable[[], float] = clock or time.monotonic
        self._window: collections.deque[tuple[float, int]] = collections.deque()  # (time, length)
        self._urls: tuple[str, ...] = ()
        self.bounds: list[int] = []
        self._fitted_at = float("-inf")

    def _initial_bounds(self, n: int) -> list[int]:
        span = self.config.bucket_initial_span
        return [span * k // n for k in range(1, n)]

    def _fit(self, n: int) -> list[int]:
        lengths = sorted(length for _, length in self._window)
        total = sum(lengths)
        if not lengths or total == 0:
            return self._initial_bounds(n)
        bounds, running, k = [], 0, 1
        for length in lengths:
            running += length
            while k < n and running * n >= total * k:
                bounds.append(length + 1)  # (``length`` itself stays in the lower bucket)
                k += 1
        while len(bounds) < n - 1:  # (fewer distinct lengths than buckets)
            bounds.append(bounds[-1] if bounds else 0)
        return bounds

    def bucket_of(self, length: int) -> int:
        """Index of the bucket (into the URL-ordered workers) that takes a prompt of ``length`` characters."""
        for i, bound in enumerate(self.bounds):
            if length < bound:
                return i
        return len(self.bounds)

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        now = self._clock()
        interval = self.config.bucket_adjust_interval
        while self._window and self._window[0][0] < now - interval:
            self._window.popleft()
        ordered = sorted(workers, key=lambda w: w.url)
        urls = tuple(w.url for w in ordered)
        if urls != self._urls or now - self._fitted_at >= interval:
            self._urls = urls
            self.bounds = self._fit(len(ordered))
            self._fitted_at = now
        length = len(request.text)
        self._window.append((now, length))
        loads = [w.in_flight for w in ordered]
        max_load, min_load = max(loads), min(loads)
        if (
            max_load - min_load > self.config.balance_abs_threshold
            and max_load > self.config.balance_rel_threshold * min_load
        ):
            return self.least_loaded(ordered)
        return ordered[self.bucket_of(length)]
