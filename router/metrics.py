"""Prometheus metrics of one router (its own ``CollectorRegistry``, so several routers can live in one process)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvship.common import metrics_names as names

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
_RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class RouterMetrics:
    """Every series the router exports; label ``worker`` is the worker URL."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvship_router_requests",
            "Requests answered, by route, status and worker",
            ["route", "status", "worker"],
            registry=r,
        )
        self.latency = Histogram(
            "kvship_router_request_latency_seconds",
            "End-to-end request latency at the router",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvship_router_ttft_seconds",
            "Time to the first response byte from a worker (streams)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "kvship_router_worker_in_flight", "Requests in flight per worker", ["worker"], registry=r
        )
        self.healthy = Gauge(
            "kvship_router_worker_healthy", "1 when the worker passes health checks", ["worker"], registry=r
        )
        self.circuit = Gauge(
            "kvship_router_circuit_state",
            "Circuit state per worker (0 closed, 1 open, 2 half-open)",
            ["worker"],
            registry=r,
        )
        self.retries = Counter("kvship_router_retries", "Requests sent again to another worker", ["route"], registry=r)
        self.worker_failures = Counter(
            "kvship_router_worker_failures", "Failed attempts per worker", ["worker", "reason"], registry=r
        )
        self.rate_limited = Counter(
            "kvship_router_rate_limited", "Requests refused by the rate limiter (429)", registry=r
        )
        self.cache_match = Histogram(
            "kvship_router_cache_aware_match_ratio",
            "cache_aware: matched prefix / request text length of the chosen worker",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        )
        self.kv_predicted_cached_tokens = Histogram(
            "kvship_router_kv_predicted_cached_tokens",
            "kv_events: prompt tokens the chosen worker was expected to hold, by source (index: its KV events; "
            "tree: the approximate tree while its event stream is behind)",
            ["source"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.kv_actual_cached_tokens = Histogram(
            "kvship_router_kv_actual_cached_tokens",
            "kv_events: prompt tokens the chosen worker reported cached (its reply's cached_tokens), by the "
            "prediction's source",
            ["source"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.kv_prediction_error_tokens = Histogram(
            "kvship_router_kv_prediction_error_tokens",
            "kv_events: |actual - predicted| cached prompt tokens per request, by the prediction's source",
            ["source"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.kv_predictions = Counter(
            "kvship_router_kv_predictions",
            "kv_events: requests whose worker reported exactly the predicted cached tokens, more (under) or "
            "fewer (over), by the prediction's source",
            ["source", "outcome"],
            registry=r,
        )
        self.kv_lost_prompts = Counter(
            "kvship_router_kv_lost_prompts",
            "kv_events: returning prompts that every worker had lost, by where they went (contained: the worker "
            "that lost the most KV pages lately; spread: the usual tie rule)",
            ["placement"],
            registry=r,
        )
        self.kv_index_pages = Gauge(
            "kvship_router_kv_index_pages", "kv_events: page hashes in the router's prefix index", registry=r
        )
        self.kv_index_resyncs = Counter(
            "kvship_router_kv_index_resyncs",
            "kv_events: snapshots loaded per worker (the first sync, then one per gap or reconnect)",
            ["worker"],
            registry=r,
        )
        self.resumes = Counter(
            "kvship_router_resumes",
            "Broken streams continued on another worker, by what broke them",
            ["reason"],
            registry=r,
        )
        self.session_moves = Counter(
            "kvship_router_session_moves",
            "Sessions moved to another worker, by why (unavailable, failed, draining)",
            ["reason"],
            registry=r,
        )
        self.pd_selective = Counter(
            "kvship_router_pd_selective",
            "--pd-selective decisions: route 'decode' (the decode worker alone) or 'pd', by reason "
            "(short prompt, cached prefix, long)",
            ["route", "reason"],
            registry=r,
        )
        # live SLO figures (kvship.router.slo; names in kvship.common.metrics_names)
        self.slo_ttft = Histogram(
            names.ROUTER_TTFT,
            "Time from receiving a request to relaying its first token event (streams)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.slo_itl = Histogram(
            names.ROUTER_ITL,
            "Time between consecutive token events of a relayed stream",
            ["route"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.slo_e2e = Histogram(
            names.ROUTER_E2E,
            "Time from receiving a request to its last byte, requests that ended well",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.slo_tokens_per_second = Histogram(
            names.ROUTER_REQUEST_TOKENS_PER_SECOND,
            "Output tokens / end-to-end seconds of each request",
            ["route"],
            buckets=_RATE_BUCKETS,
            registry=r,
        )
        self.slo_output_tokens = Counter(
            names.ROUTER_OUTPUT_TOKENS, "Output tokens of the requests that ended well", ["route"], registry=r
        )
        self.slo_kv_transfer_bytes = Counter(
            names.ROUTER_KV_TRANSFER_BYTES,
            "KV bytes the decode workers received (scraped from their /get_server_info kv_transfer_bytes)",
            registry=r,
        )

    def forget_worker(self, url: str) -> None:
        """Drop the per-worker gauges of a removed worker."""
        for gauge in (self.in_flight, self.healthy, self.circuit, self.kv_index_resyncs):
            try:
                gauge.remove(url)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
