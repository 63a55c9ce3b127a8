"""``RouterConfig``: the router's frozen configuration, one field per CLI flag.

The flag names are a contract shared with the operator (it builds the router
pod's arguments from them): see ``kvship router --help``.  Built with
``kvship.common.cli_args`` (``opt`` / ``add_dataclass_arguments``) so that
``--help`` documents every field.  ``--api-key`` / ``--admin-api-key`` /
``--worker-api-key`` default to ``KVSHIP_API_KEY`` / ``KVSHIP_ADMIN_API_KEY`` /
``KVSHIP_WORKER_API_KEY`` (read through ``kvship.common.envs.ENV``); the three
are separate credentials (docs/router.md, "Authentication").  Importing this module must never import torch
or the engine.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from kvship.common.cli_args import add_dataclass_arguments, dataclass_from_namespace, opt
from kvship.common.envs import ENV
from kvship.common.policies import DEFAULT_POLICY, POLICY_NAMES

__all__ = ["POLICY_NAMES", "RouterConfig", "parse_selector", "selector_string"]


def parse_selector(items: list[str] | tuple[str, ...], flag: str = "--selector") -> dict[str, str]:
    """``["app=kvship", "role=decode"]`` -> ``{"app": "kvship", "role": "decode"}``.

    Raises ValueError naming ``flag`` for an item that is not ``key=value``.
    """
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag}: expected key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def selector_string(selector: dict[str, str]) -> str:
    """A Kubernetes label selector string (``a=b,c=d``) for the API's ``label_selector``."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


@dataclass(frozen=True)
class RouterConfig:
    """Configuration of the router process (``kvship router``)."""

    # HTTP
    host: str = opt("0.0.0.0", "Address the router binds")
    port: int = opt(8000, "Router HTTP port")
    log_level: str = opt("info", "Log level", choices=("debug", "info", "warning", "error"))
    api_key: Optional[str] = opt(
        None,
        "Client key(s), comma-separated: the serving routes require 'Authorization: Bearer <key>' with one of "
        "them (default: env KVSHIP_API_KEY; none = the serving routes are open)",
    )
    api_keys_file: Optional[str] = opt(None, "File of more client keys, one per line ('#' comments)")
    admin_api_key: Optional[str] = opt(
        None,
        "Key of the admin API (POST/DELETE /workers; also reads GET /workers, /slo, /metrics) (default: env "
        "KVSHIP_ADMIN_API_KEY; none = the admin API answers 403)",
    )
    worker_api_key: Optional[str] = opt(
        None,
        "Bearer token the router sends to workers; also reads GET /workers, /slo, /metrics (default: env "
        "KVSHIP_WORKER_API_KEY; never the client key)",
    )
    worker_allow_cidrs: str = opt(
        "",
        "POST /workers: comma-separated CIDRs a worker URL's IP may be in (with --worker-allow-hosts empty too: "
        "127.0.0.0/8 and ::1 only)",
    )
    worker_allow_hosts: str = opt(
        "", "POST /workers: comma-separated host names or *.suffix patterns a worker URL's host may match"
    )
    debug_headers: bool = opt(
        False,
        "Give clients the x-kvship-* response headers (worker, prefill, decode, first-token, trace: they name "
        "internal worker URLs); off: clients get none of them",
    )
    # OpenTelemetry (docs/observability.md)
    otlp_traces_endpoint: Optional[str] = opt(
        None,
        "Export request traces over OTLP to this collector: http(s)://host:4318 for OTLP/HTTP, grpc://host:4317 "
        "(plaintext) or grpcs://host:4317 (TLS) for OTLP/gRPC; off if unset",
    )
    otlp_traces_sample_ratio: float = opt(
        1.0, "Fraction of new traces kept (a request whose traceparent is sampled is always traced)"
    )
    max_request_bytes: int = opt(8 * 1024 * 1024, "Largest accepted request body in bytes (413 above)")
    request_timeout: float = opt(600.0, "Seconds one request may take end to end, streaming included (504 after)")
    shutdown_timeout: float = opt(30.0, "Seconds a graceful shutdown (SIGTERM) waits for in-flight streams")

    # Workers and policy
    worker_urls: list[str] = opt([], "Unified workers (static), e.g. http://10.0.0.5:30000", nargs="+")
    policy: str = opt(DEFAULT_POLICY, "Routing policy", choices=POLICY_NAMES)
    cache_threshold: float = opt(0.5, "cache_aware: smallest prefix-match ratio that routes to the matching worker")
    balance_abs_threshold: int = opt(32, "cache_aware: balance load when max_load - min_load exceeds this ...")
    balance_rel_threshold: float = opt(1.5, "cache_aware: ... and max_load exceeds this times min_load")
    max_tree_size: int = opt(1_000_000, "cache_aware: characters kept per worker tree before LRU eviction")
    bucket_initial_span: int = opt(
        4096, "bucket: prompt characters split evenly over the workers' buckets until traffic moves the boundaries"
    )
    bucket_adjust_interval: float = opt(
        5.0, "bucket: seconds of recent requests the boundaries are fitted to (refitted once per interval)"
    )
    kv_index_max_pages: int = opt(
        1_000_000, "kv_events: page hashes the router's prefix index keeps (least recently used dropped first)"
    )
    kv_events_host_weight: float = opt(
        0.5, "kv_events: worth of a prefix token cached on a worker's host tier, against 1 for its GPU tier"
    )
    kv_events_load_tokens: float = opt(
        0.0,
        "kv_events: cached prompt tokens one in-flight request on a worker offsets in its score (0: load only "
        "breaks ties and the balance thresholds apply)",
    )
    kv_events_contain_thrash: bool = opt(
        True,
        "kv_events: a returning prompt that every worker has lost goes to the worker that lost the most KV pages "
        "lately, so the pools that still hold their conversations keep them (docs/cache.md, 'Thrash containment')",
    )
    kv_events_pending: bool = opt(
        True,
        "kv_events: the pages of a prompt just routed to a worker count as that worker's until its events report "
        "them stored (or removed), the reply ends, or 10 s pass, so prompts sharing a prefix that arrive together "
        "follow the first one (docs/cache.md, 'Pages on their way')",
    )
    session_affinity: bool = opt(
        True,
        "A request's session key (body 'session_id', header x-session-id, else the OpenAI 'user' field) pins it "
        "to the worker its session last used; the session moves when that worker fails or drains",
    )

    # PD disaggregation
    pd: bool = opt(False, "Prefill/decode mode: send each request to a prefill and a decode worker")
    pd_first_token: bool = opt(
        True,
        "PD: a streamed /generate or /v1/completions request the router can resume (--max-resumes > 0; no stop "
        "strings) gets its first token from the prefill worker as soon as it is sampled, before its KV reaches decode",
    )
    pd_selective: bool = opt(
        False,
        "PD: a prompt whose tokens left to prefill (its length less the prefix the chosen decode worker caches) "
        "are at most --pd-selective-max-tokens is served by the decode worker alone, no prefill worker",
    )
    pd_selective_max_tokens: int = opt(
        256, "PD --pd-selective: most prompt tokens left to prefill that the decode worker prefills itself"
    )
    prefill: list[str] = opt([], "PD: prefill worker URLs (bootstrap port read from their /get_server_info)", nargs="+")
    decode: list[str] = opt([], "PD: decode worker URLs", nargs="+")
    prefill_policy: Optional[str] = opt(
        None, "PD: policy choosing the prefill worker (default: --policy)", choices=POLICY_NAMES
    )
    decode_policy: Optional[str] = opt(
        None, "PD: policy choosing the decode worker (default: --policy)", choices=POLICY_NAMES
    )

    # Kubernetes discovery
    service_discovery: bool = opt(False, "Discover workers by watching Kubernetes pods")
    selector: list[str] = opt([], "Discovery: label selector of unified worker pods (k=v ...)", nargs="+")
    prefill_selector: list[str] = opt([], "Discovery (PD): label selector of prefill pods", nargs="+")
    decode_selector: list[str] = opt([], "Discovery (PD): label selector of decode pods", nargs="+")
    namespace: Optional[str] = opt(
        None, "Discovery: namespace to watch (default: the router pod's own, else 'default')"
    )
    service_discovery_port: int = opt(30000, "Discovery: worker HTTP port (pod annotation kvship.io/port overrides)")
    kubeconfig: Optional[str] = opt(
        None, "Discovery: kubeconfig file (default: in-cluster config, then ~/.kube/config)"
    )

    # Health and circuit breaking
    health_check_interval: float = opt(5.0, "Seconds between health checks of each worker")
    health_check_timeout: float = opt(2.0, "Seconds a health check may take")
    health_failure_threshold: int = opt(3, "Consecutive failed checks that mark a worker unhealthy")
    health_success_threshold: int = opt(1, "Consecutive passed checks that mark it healthy again")
    circuit_failure_threshold: int = opt(5, "Consecutive request failures that open a worker's circuit (0 = off)")
    circuit_cooldown: float = opt(30.0, "Seconds an open circuit waits before letting one trial request through")

    # Retries
    max_retries: int = opt(2, "Retries on another worker when a request fails before its first byte reached the client")
    retry_backoff_base: float = opt(0.05, "First retry delay in seconds (doubles each retry, with jitter)")
    retry_backoff_max: float = opt(1.0, "Largest retry delay in seconds")
    max_resumes: int = opt(
        2,
        "Times one stream that broke after its first byte (worker died) is continued on another worker "
        "from the tokens relayed so far (0 = off: the stream ends with an error event)",
    )

    # Live SLO figures (GET /slo, docs/router.md)
    slo_window: float = opt(60.0, "Seconds of finished requests GET /slo summarizes (p50/p90/p99, rates)")
    slo_scrape_interval: float = opt(
        5.0,
        "Seconds between reads of every worker's /get_server_info (GET /slo: per-role token rates, queue depth, "
        "KV usage, and the decode workers' KV-transfer rate)",
    )

    # Rate limiting
    rate_limit_rps: float = opt(0.0, "Token-bucket rate limit in requests/s over all clients (0 = off)")
    rate_limit_burst: int = opt(0, "Bucket size (0 = max(1, rate-limit-rps))")
    rate_limit_queue_size: int = opt(100, "Requests that may wait for a token before 429")
    rate_limit_queue_timeout: float = opt(30.0, "Longest wait for a token in seconds before 429")
    rate_limit_per_key: float = opt(
        0.0,
        "Token-bucket rate limit in requests/s per client key (per client address without client keys; 0 = off); "
        "bucket size --rate-limit-burst",
    )
    max_in_flight_per_key: int = opt(0, "Requests one client key (or address) may have in flight (0 = off)")
    rate_limit_tracked_keys: int = opt(10_000, "Per-key limits: keys tracked at most (least recently used dropped)")

    @property
    def resolved_prefill_policy(self) -> str:
        return self.prefill_policy or self.policy

    @property
    def resolved_decode_policy(self) -> str:
        return self.decode_policy or self.policy

    @property
    def resolved_rate_limit_burst(self) -> int:
        return self.rate_limit_burst if self.rate_limit_burst > 0 else max(1, int(round(self.rate_limit_rps)))

    @property
    def resolved_per_key_burst(self) -> int:
        return self.rate_limit_burst if self.rate_limit_burst > 0 else max(1, int(round(self.rate_limit_per_key)))

    @property
    def resolved_worker_api_key(self) -> Optional[str]:
        """The Bearer sent to workers: ``--worker-api-key`` only (never the client key)."""
        return self.worker_api_key or None

    def client_keys(self) -> list[str]:
        """``--api-key`` (comma-separated) and the keys of ``--api-keys-file``; ValueError for an unreadable file."""
        from kvship.router.auth import read_keys_file, split_keys

        keys = split_keys(self.api_key)
        if self.api_keys_file:
            keys += read_keys_file(self.api_keys_file)
        return keys

    def credentials(self):
        """The router's ``kvship.router.auth.Credentials``; ValueError naming the flag when inconsistent."""
        from kvship.router.auth import Credentials

        return Credentials(self.client_keys(), self.admin_api_key or None, self.resolved_worker_api_key)

    def worker_allow_list(self):
        """``kvship.router.auth.WorkerAllowList`` of the two allow flags; ValueError when one is malformed."""
        from kvship.router.auth import WorkerAllowList

        return WorkerAllowList.from_flags(self.worker_allow_cidrs, self.worker_allow_hosts)

    @property
    def selector_labels(self) -> dict[str, str]:
        return parse_selector(self.selector, "--selector")

    @property
    def prefill_selector_labels(self) -> dict[str, str]:
        return parse_selector(self.prefill_selector, "--prefill-selector")

    @property
    def decode_selector_labels(self) -> dict[str, str]:
        return parse_selector(self.decode_selector, "--decode-selector")

    def validate(self) -> None:
        """Raise ValueError with a message naming the flag for inconsistent settings."""
        if not 0 <= self.port < 65536:
            raise ValueError("--port must be in 0..65535")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("--cache-threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1")
        if self.max_tree_size < 1:
            raise ValueError("--max-tree-size must be >= 1")
        if self.kv_index_max_pages < 1:
            raise ValueError("--kv-index-max-pages must be >= 1")
        if not 0.0 <= self.kv_events_host_weight <= 1.0 or self.kv_events_load_tokens < 0:
            raise ValueError("--kv-events-host-weight must be in [0, 1] and --kv-events-load-tokens >= 0")
        if self.bucket_initial_span < 1:
            raise ValueError("--bucket-initial-span must be >= 1")
        if self.pd_selective_max_tokens < 0:
            raise ValueError("--pd-selective-max-tokens must be >= 0")
        if self.pd_selective and not self.pd:
            raise ValueError("--pd-selective needs --pd")
        for name in (
            "health_check_interval",
            "health_check_timeout",
            "bucket_adjust_interval",
            "request_timeout",
            "slo_window",
            "slo_scrape_interval",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.health_failure_threshold < 1 or self.health_success_threshold < 1:
            raise ValueError("--health-failure-threshold and --health-success-threshold must be >= 1")
        if self.circuit_failure_threshold < 0 or self.circuit_cooldown < 0:
            raise ValueError("--circuit-failure-threshold and --circuit-cooldown must be >= 0")
        if self.max_retries < 0 or self.retry_backoff_base < 0 or self.retry_backoff_max < 0:
            raise ValueError("--max-retries, --retry-backoff-base and --retry-backoff-max must be >= 0")
        if self.max_resumes < 0:
            raise ValueError("--max-resumes must be >= 0")
        if not 0.0 <= self.otlp_traces_sample_ratio <= 1.0:
            raise ValueError("--otlp-traces-sample-ratio must be in [0, 1]")
        if self.otlp_traces_endpoint:
            from kvship.common.trace_export import otlp_target

            otlp_target(self.otlp_traces_endpoint)  # ValueError naming the flag: http(s):// or grpc(s):// only
        if self.rate_limit_rps < 0 or self.rate_limit_burst < 0 or self.rate_limit_queue_size < 0:
            raise ValueError("--rate-limit-rps, --rate-limit-burst and --rate-limit-queue-size must be >= 0")
        if self.rate_limit_queue_timeout < 0 or self.shutdown_timeout < 0:
            raise ValueError("--rate-limit-queue-timeout and --shutdown-timeout must be >= 0")
        if self.rate_limit_per_key < 0 or self.max_in_flight_per_key < 0 or self.rate_limit_tracked_keys < 1:
            raise ValueError(
                "--rate-limit-per-key and --max-in-flight-per-key must be >= 0, --rate-limit-tracked-keys >= 1"
            )
        self.credentials()  # (validates the keys: a readable --api-keys-file, no key of two kinds)
        self.worker_allow_list()
        if self.max_request_bytes < 1:
            raise ValueError("--max-request-bytes must be >= 1")
        self.selector_labels, self.prefill_selector_labels, self.decode_selector_labels  # noqa: B018 (validates)
        if self.pd:
            if self.worker_urls or self.selector:
                raise ValueError(
                    "--pd uses --prefill/--decode (or --prefill-selector/--decode-selector), "
                    "not --worker-urls/--selector"
                )
            if self.service_discovery and not (self.prefill_selector and self.decode_selector):
                raise ValueError("--pd with --service-discovery needs --prefill-selector and --decode-selector")
        else:
            if self.prefill or self.decode or self.prefill_selector or self.decode_selector:
                raise ValueError("--prefill/--decode/--prefill-selector/--decode-selector need --pd")
            if self.service_discovery and not self.selector:
                raise ValueError("--service-discovery needs --selector k=v")
        for url in list(self.worker_urls) + list(self.prefill) + list(self.decode):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL must start with http:// or https://, got {url!r}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_arguments(parser, cls)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "RouterConfig":
        """Build from parsed flags, filling the API keys from the environment when not given."""
        overrides = {}
        for name, value in (
            ("api_key", ENV.API_KEY),
            ("admin_api_key", ENV.ADMIN_API_KEY),
            ("worker_api_key", ENV.WORKER_API_KEY),
        ):
            if getattr(ns, name, None) is None and value:
                overrides[name] = value
        return dataclass_from_namespace(cls, ns, **overrides)
