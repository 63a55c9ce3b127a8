"""Names of the Prometheus series a kvship worker exports on ``GET /metrics``.

The one list the operator (CRD descriptions, autoscaling validation), the
examples and the docs take metric names from.  ``kvship.engine.metrics``
exports exactly these (tests/test_operator_metrics.py renders a worker's
registry and checks both ways), so renaming a series means renaming it here
and there together.

Names are the Prometheus names (``kvship:`` prefix, colon-separated, as
vLLM and SGLang do).  A HorizontalPodAutoscaler names a per-pod metric the
way the metrics adapter exposes it; kvship's examples assume the adapter
keeps the Prometheus name unchanged.
"""

from __future__ import annotations

PREFIX = "kvship:"

# Gauges read from the scheduler at scrape time: what an HPA can average per pod.
NUM_RUNNING_REQS = "kvship:num_running_reqs"
NUM_QUEUE_REQS = "kvship:num_queue_reqs"
KV_TOTAL_SLOTS = "kvship:kv_total_slots"
KV_FREE_SLOTS = "kvship:kv_free_slots"
TOKEN_USAGE = "kvship:token_usage"
CACHE_HIT_RATE = "kvship:cache_hit_rate"
GAUGES = (NUM_RUNNING_REQS, NUM_QUEUE_REQS, KV_TOTAL_SLOTS, KV_FREE_SLOTS, TOKEN_USAGE, CACHE_HIT_RATE)

# Counters (exported with the ``_total`` suffix) and histograms (``_bucket`` / ``_sum`` / ``_count``).
COUNTERS = (
    "kvship:prompt_tokens_total",
    "kvship:generation_tokens_total",
    "kvship:cached_tokens_total",
    "kvship:requests_total",
)
HISTOGRAMS = (
    "kvship:time_to_first_token_seconds",
    "kvship:inter_token_latency_seconds",
    "kvship:e2e_request_latency_seconds",
    "kvship:spec_accept_length",  # speculative decoding: tokens per round, one observation per finished request
)

# Mixture-of-Experts workers only: tokens routed to each expert (counter, labels ``layer`` and ``expert``)
# and each MoE layer's max / mean of those counts (gauge, label ``layer``; 1.0 is perfectly balanced).
MOE_EXPERT_TOKENS = "kvship:moe_expert_tokens"
MOE_EXPERT_LOAD_IMBALANCE = "kvship:moe_expert_load_imbalance"
MOE_METRICS = (MOE_EXPERT_TOKENS + "_total", MOE_EXPERT_LOAD_IMBALANCE)

# PD workers only: per-request KV transfers (labels ``backend``, ``role``; failures also ``reason``),
# docs/observability.md
KV_TRANSFER_HISTOGRAMS = (
    "kvship:kv_transfer_bytes",
    "kvship:kv_transfer_duration_seconds",
    "kvship:kv_transfer_throughput_gbps",
)
KV_TRANSFER_FAILURES = "kvship:kv_transfer_failures"
KV_TRANSFER_METRICS = KV_TRANSFER_HISTOGRAMS + (KV_TRANSFER_FAILURES + "_total",)

# Workers started with --enable-step-timing only: the scheduler's host seconds per step phase (label ``phase``;
# docs/observability.md)
SCHEDULER_PHASE_SECONDS = "kvship:scheduler_phase_seconds"
STEP_TIMING_METRICS = (SCHEDULER_PHASE_SECONDS + "_total",)

WORKER_METRICS = GAUGES + COUNTERS + HISTOGRAMS + MOE_METRICS + KV_TRANSFER_METRICS + STEP_TIMING_METRICS

# What the examples and the CRD's description use to autoscale decode workers.
AUTOSCALING_EXAMPLE = NUM_RUNNING_REQS

# The router's live SLO series (``kvship router`` ``GET /metrics``; docs/router.md, "SLO figures"), measured on
# the responses it relays; label ``route``.  Histograms, except the two counters (exported with ``_total``).
ROUTER_TTFT = "kvship_router_time_to_first_token_seconds"
ROUTER_ITL = "kvship_router_inter_token_latency_seconds"
ROUTER_E2E = "kvship_router_e2e_request_latency_seconds"
ROUTER_REQUEST_TOKENS_PER_SECOND = "kvship_router_request_output_tokens_per_second"
ROUTER_OUTPUT_TOKENS = "kvship_router_output_tokens"
ROUTER_KV_TRANSFER_BYTES = "kvship_router_kv_transfer_bytes"  # summed over decode workers (their kv_transfer_bytes)
ROUTER_SLO_METRICS = (
    ROUTER_TTFT,
    ROUTER_ITL,
    ROUTER_E2E,
    ROUTER_REQUEST_TOKENS_PER_SECOND,
    ROUTER_OUTPUT_TOKENS + "_total",
    ROUTER_KV_TRANSFER_BYTES + "_total",
)
