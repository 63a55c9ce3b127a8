"""Prometheus metrics of one worker (``GET /metrics``).

Series (all labelled ``model_name``):

* counters ``kvship:prompt_tokens_total``, ``kvship:generation_tokens_total``,
  ``kvship:cached_tokens_total``, ``kvship:requests_total{finish_reason}``
* histograms ``kvship:time_to_first_token_seconds``,
  ``kvship:inter_token_latency_seconds``, ``kvship:e2e_request_latency_seconds``,
  ``kvship:spec_accept_length`` (speculative decoding: each finished
  request's tokens per verify round; docs/speculative.md)
* counter ``kvship:scheduler_phase_seconds_total{phase}`` (``--enable-step-timing``: the
  scheduler's host seconds per step phase, read at scrape time)
* gauges read from the scheduler at scrape time:
  ``kvship:num_running_reqs``, ``kvship:num_queue_reqs``,
  ``kvship:kv_total_slots``, ``kvship:kv_free_slots``, ``kvship:token_usage``
  (fraction of KV slots in use), ``kvship:cache_hit_rate``
* PD KV transfers, one observation per request and transfer (labels
  ``backend``, ``role`` = prefill | decode): histograms
  ``kvship:kv_transfer_bytes``, ``kvship:kv_transfer_duration_seconds``,
  ``kvship:kv_transfer_throughput_gbps`` (bytes / seconds / 1e9) and counter
  ``kvship:kv_transfer_failures_total{backend, role, reason}``, from the
  engine's ``KVTransferFinished`` events (docs/observability.md)
* Mixture-of-Experts models (``expert_load_fn``): counter
  ``kvship:moe_expert_tokens_total{layer, expert}`` (tokens routed to each
  expert) and gauge ``kvship:moe_expert_load_imbalance{layer}`` (max / mean of
  a layer's counts), read from the model's device counters at scrape time
  (docs/parallel.md, "Expert load")

Each ``EngineMetrics`` owns its own registry, so several engines (tests) never
collide in the process-global one.  Observations are made on the event loop
thread (the KV-transfer ones on the scheduler thread; prometheus_client's
metrics are thread-safe); the gauge callback runs on the scrape and must be thread-safe
(``Scheduler.get_stats`` is).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvship.common import metrics_names
from kvship.common.events import Event, EventBus, KVTransferFinished

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
_KV_BYTES_BUCKETS = tuple(float(2**k) for k in range(16, 36, 2))  # 64 KiB .. 16 GiB
_KV_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_KV_GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)

# gauge name -> (help, keys of Scheduler.get_stats() to try, in order)
_GAUGES = {
    "kvship:num_running_reqs": ("Requests in the running batch", ("running", "num_running_reqs")),
    "kvship:num_queue_reqs": ("Requests waiting for admission", ("waiting", "num_waiting_reqs")),
    "kvship:kv_total_slots": ("KV cache slots in the pool", ("total_slots",)),
    "kvship:kv_free_slots": ("KV cache slots free (including evictable cache)", ("free_slots",)),
    "kvship:token_usage": ("Fraction of KV cache slots in use", ("token_usage", "kv_usage")),
    "kvship:cache_hit_rate": ("Prefix cache hit rate (cached / prompt tokens)", ("cache_hit_rate",)),
}


class _SchedulerCollector(Collector):
    def __init__(self, stats_fn: Callable[[], dict], model_name: str):
        self._stats_fn = stats_fn
        self._model = model_name

    def collect(self) -> Iterable:
        try:
            stats = self._stats_fn() or {}
        except Exception as e:  # a scrape must never fail because the engine is down
            logger.warning("scheduler stats unavailable for /metrics: %s", e)
            stats = {}
        stats = dict(stats)
        if "token_usage" not in stats and stats.get("total_slots"):
            stats["token_usage"] = 1.0 - float(stats.get("free_slots", 0)) / float(stats["total_slots"])
        for name, (help_text, keys) in _GAUGES.items():
            value = next((stats[k] for k in keys if isinstance(stats.get(k), (int, float))), None)
            g = GaugeMetricFamily(name, help_text, labels=["model_name"])
            if value is not None:
                g.add_metric([self._model], float(value))
            yield g
        phases = stats.get("step_phase_s")
        if isinstance(phases, dict):  # --enable-step-timing
            c = CounterMetricFamily(
                metrics_names.SCHEDULER_PHASE_SECONDS,
                "Host seconds the scheduler spent in each step phase (--enable-step-timing)",
                labels=["model_name", "phase"],
            )
            for phase, seconds in sorted(phases.items()):
                c.add_metric([self._model, phase], float(seconds))
            yield c


def _label_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def expert_load_text(load: dict[int, list[int]], model_name: str) -> str:
    """The two expert-load families in the text exposition format.

    Written directly rather than through ``prometheus_client``'s collectors:
    a Qwen3-30B-A3B-shaped worker has 48 x 128 = 6144 series, too many for its
    generic per-sample formatting on the event loop (figures: docs/parallel.md,
    "Expert load").  Label values other than the model name are numbers.
    """
    if not load:
        return ""
    model = _label_value(model_name)
    tokens = [
        "# HELP kvship:moe_expert_tokens_total Tokens routed to each expert",
        "# TYPE kvship:moe_expert_tokens_total counter",
    ]
    imbalance = [
        "# HELP kvship:moe_expert_load_imbalance Max / mean of the tokens routed to a layer's experts (1 = balanced)",
        "# TYPE kvship:moe_expert_load_imbalance gauge",
    ]
    for layer, counts in sorted(load.items()):
        head = f'kvship:moe_expert_tokens_total{{model_name="{model}",layer="{layer}",expert="'
        tokens.extend(f'{head}{e}"}} {float(n)}' for e, n in enumerate(counts))
        mean = sum(counts) / max(len(counts), 1)
        ratio = max(counts) / mean if mean > 0 else 1.0
        imbalance.append(f'kvship:moe_expert_load_imbalance{{model_name="{model}",layer="{layer}"}} {ratio}')
    return "\n".join(tokens + imbalance) + "\n"


class EngineMetrics:
    """Token counters and latency histograms; observe from the event loop thread."""

    def __init__(
        self,
        model_name: str,
        stats_fn: Callable[[], dict],
        expert_load_fn: Optional[Callable[[], dict[int, list[int]]]] = None,
    ):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter(
            "kvship:prompt_tokens", "Prompt tokens of finished requests", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter("kvship:generation_tokens", "Generated tokens", labels, registry=r).labels(
            model_name
        )
        self.cached_tokens = Counter(
            "kvship:cached_tokens", "Prompt tokens served from the prefix cache", labels, registry=r
        ).labels(model_name)
        self._requests = Counter(
            "kvship:requests", "Finished requests by finish reason", labels + ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "kvship:time_to_first_token_seconds", "Time to first token", labels, buckets=_LATENCY_BUCKETS, registry=r
        ).labels(model_name)
        self.itl = Histogram(
            "kvship:inter_token_latency_seconds", "Time between output tokens", labels, buckets=_ITL_BUCKETS, registry=r
        ).labels(model_name)
        self.e2e = Histogram(
            "kvship:e2e_request_latency_seconds",
            "Request latency, arrival to last token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.spec_accept_length = Histogram(
            "kvship:spec_accept_length",
            "Speculative decoding: tokens emitted per verify round, averaged over each finished request",
            labels,
            buckets=_ACCEPT_BUCKETS,
            registry=r,
        ).labels(model_name)
        kv_labels = labels + ["backend", "role"]
        self.kv_bytes = Histogram(
            "kvship:kv_transfer_bytes", "KV bytes moved per request", kv_labels, buckets=_KV_BYTES_BUCKETS, registry=r
        )
        self.kv_seconds = Histogram(
            "kvship:kv_transfer_duration_seconds",
            "Duration of one request's KV transfer (first byte sent / received to the last)",
            kv_labels,
            buckets=_KV_SECONDS_BUCKETS,
            registry=r,
        )
        self.kv_gbps = Histogram(
            "kvship:kv_transfer_throughput_gbps",
            "One request's KV transfer throughput, GB/s (bytes / duration / 1e9)",
            kv_labels,
            buckets=_KV_GBPS_BUCKETS,
            registry=r,
        )
        self.kv_failures = Counter(
            "kvship:kv_transfer_failures", "Failed KV transfers by reason", kv_labels + ["reason"], registry=r
        )
        r.register(_SchedulerCollector(stats_fn, model_name))
        self._expert_load_fn = expert_load_fn  # {layer: tokens per expert}, MoE models only

    def observe_tokens(
        self, n_new: int, now: float, first_token_time: float | None, last_token_time: float | None, created: float
    ) -> None:
        """Record ``n_new`` tokens arriving at ``now`` (one chunk)."""
        if n_new <= 0:
            return
        self.generation_tokens.inc(n_new)
        if first_token_time is None:
            self.ttft.observe(max(0.0, now - created))
            n_itl, since = n_new - 1, now
        else:
            n_itl, since = n_new, last_token_time or now
        if n_itl > 0:
            gap = max(0.0, now - since) / n_itl
            for _ in range(n_itl):
                self.itl.observe(gap)

    def observe_finished(
        self,
        finish_reason: str,
        prompt_tokens: int,
        cached_tokens: int,
        e2e: float,
        spec_accept_length: Optional[float] = None,
    ) -> None:
        if spec_accept_length is not None:
            self.spec_accept_length.observe(spec_accept_length)
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.cached_tokens.inc(max(0, cached_tokens))
        self._requests.labels(self.model_name, finish_reason).inc()
        self.e2e.observe(max(0.0, e2e))

    def observe_kv_transfers(self, bus: EventBus) -> Callable[[], None]:
        """Observe every ``KVTransferFinished`` of ``bus``; returns the unsubscribe function."""

        def on_event(ev: Event) -> None:
            if isinstance(ev, KVTransferFinished):
                self.observe_kv_transfer(ev)

        return bus.subscribe(on_event, kinds=(KVTransferFinished,))

    def observe_kv_transfer(self, ev: KVTransferFinished) -> None:
        labels = (self.model_name, ev.backend, ev.role)
        if not ev.ok:
            self.kv_failures.labels(*labels, ev.reason or "other").inc()
            return
        self.kv_bytes.labels(*labels).observe(ev.bytes)
        self.kv_seconds.labels(*labels).observe(ev.seconds)
        if ev.seconds > 0:
            self.kv_gbps.labels(*labels).observe(ev.bytes / ev.seconds / 1e9)

    def render(self) -> bytes:
        out = generate_latest(self.registry)
        if self._expert_load_fn is not None:
            try:
                out += expert_load_text(self._expert_load_fn() or {}, self.model_name).encode()
            except Exception as e:  # a scrape must never fail because the engine is down
                logger.warning("expert load unavailable for /metrics: %s", e)
        return out
