"""Live SLO figures, measured on the responses the router relays (docs/router.md, "SLO figures").

Per request (``RequestMeter``), on the bytes the router sends to the client:

* **TTFT**: from the moment the router received the request to the first
  *token event* it relayed: an SSE ``data:`` event carrying output (an OpenAI
  chunk with non-empty ``text`` / ``delta.content`` / ``delta.reasoning_content``
  / ``delta.tool_calls``, or a ``/generate`` event whose
  ``meta_info.completion_tokens`` grew).  Role-only and empty chunks do not count;
* **ITL**: the gaps between consecutive token events of one stream (an event
  carrying several tokens counts once, as a client sees it);
* **end-to-end latency**: receipt to the last byte (streams) or to the whole
  body (non-streaming replies, which have no TTFT / ITL);
* **output tokens**: the worker's own count (``usage.completion_tokens``,
  ``meta_info.completion_tokens``) when the reply has it, else the token ids
  a resumable stream carried (``kvship.router.resume`` asks workers for
  them), else the number of token events (an undercount when one event
  carries several tokens); **tokens/s** of a request: output tokens /
  end-to-end seconds.

Only requests that ended well (status 200, stream finished) are recorded.
``SLOTracker`` keeps the samples of the last ``--slo-window`` seconds (and
feeds the Prometheus histograms) and summarizes them for ``GET /slo``:
p50/p90/p99 (linear interpolation between order statistics), requests and
output tokens per second over the window (or over the router's uptime while
that is shorter).

**Per-role worker figures** (``roles`` of ``GET /slo``): ``WorkerStatsScraper``
reads every registered worker's ``/get_server_info`` each
``--slo-scrape-interval`` seconds (the scheduler's own figures: ``running``,
``waiting``, ``token_usage`` and the cumulative ``prompt_tokens`` /
``generation_tokens``) and sums them per role (prefill, decode, unified):
prompt and generated tokens per second over the window (like the KV rate
below, a cumulative counter's growth over the window, restarts survived),
queue depth (requests waiting for admission), running requests, and KV usage
(mean and max fraction of KV slots in use over the role's workers).  A worker
that leaves the registry leaves the figures.

**KV-transfer rate**: decode workers count the KV bytes they received
(``kv_transfer_bytes`` in the same ``/get_server_info``); the rate over the
window is the sum over decode workers of (bytes now - bytes at the window's
start) / elapsed, in GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import aiohttp

if TYPE_CHECKING:
    from kvship.router.metrics import RouterMetrics
    from kvship.router.worker import WorkerRegistry

logger = logging.getLogger(__name__)

MAX_SAMPLES = 200_000  # per series, whatever the window (bounds memory under extreme load)


@dataclass
class RequestSample:
    """One finished request's figures (seconds; ``ttft`` and ``itls`` are empty for non-streaming replies)."""

    e2e: float
    output_tokens: int
    ttft: Optional[float] = None
    itls: list[float] = field(default_factory=list)


class RequestMeter:
    """Watches one relayed response: ``feed`` every chunk sent to the client, then ``sample``."""

    def __init__(self, started: float, clock: Callable[[], float] = time.perf_counter):
        self.started = started  # perf_counter time the router received the request
        self.clock = clock
        self._buf = b""
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.itls: list[float] = []
        self.events = 0
        self.reported_tokens: dict[Any, int] = {}  # choice / batch index -> the worker's cumulative count
        self._usage_tokens: Optional[int] = None

    def feed(self, data: bytes) -> None:
        """Bytes as relayed (any split of an SSE stream)."""
        if not data:
            return
        now = self.clock()
        self._buf += data
        while True:
            cut = self._buf.find(b"\n\n")
            if cut < 0:
                break
            event, self._buf = self._buf[:cut], self._buf[cut + 2 :]
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        payload = b"\n".join(
            line[5:].lstrip(b" ") for line in event.replace(b"\r\n", b"\n").split(b"\n") if line.startswith(b"data:")
        )
        if not payload or payload == b"[DONE]":
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            return
        if isinstance(obj, dict) and self._carries_output(obj):
            if self.first is None:
                self.first = now
            else:
                assert self.last is not None
                self.itls.append(now - self.last)
            self.last = now
            self.events += 1

    def _carries_output(self, obj: dict) -> bool:
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self._usage_tokens = usage["completion_tokens"]
        meta = obj.get("meta_info")
        if isinstance(meta, dict):  # /generate: cumulative completion_tokens per item
            n = meta.get("completion_tokens")
            if isinstance(n, int):
                key = obj.get("index", 0)
                grew = n > self.reported_tokens.get(key, 0)
                self.reported_tokens[key] = max(n, self.reported_tokens.get(key, 0))
                return grew
            return False
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("text"):
                return True
            delta = choice.get("delta")
            if isinstance(delta, dict) and (
                delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
            ):
                return True
        return False

    def stream_sample(self, token_ids: Optional[int] = None) -> RequestSample:
        """The figures of a stream that ended well; ``token_ids``: the output ids the stream carried, if known."""
        now = self.clock()
        tokens = self._usage_tokens
        if tokens is None and self.reported_tokens:
            tokens = sum(self.reported_tokens.values())
        if tokens is None:
            tokens = token_ids if token_ids else self.events
        ttft = None if self.first is None else self.first - self.started
        return RequestSample(e2e=now - self.started, output_tokens=tokens, ttft=ttft, itls=self.itls)

    @staticmethod
    def body_sample(started: float, body: bytes, clock: Callable[[], float] = time.perf_counter) -> RequestSample:
        """The figures of a whole (non-streaming) reply: end-to-end latency and the worker's token count."""
        e2e = clock() - started
        tokens = 0
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            obj = None
        for item in obj if isinstance(obj, list) else [obj]:
            if not isinstance(item, dict):
                continue
            usage, meta = item.get("usage"), item.get("meta_info")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                tokens += usage["completion_tokens"]
            elif isinstance(meta, dict) and isinstance(meta.get("completion_tokens"), int):
                tokens += meta["completion_tokens"]
        return RequestSample(e2e=e2e, output_tokens=tokens)


def percentile(sorted_values: list[float], q: float) -> Optional[float]:
    """The ``q``-quantile (0..1) of ascending ``sorted_values`` with linear interpolation; None if empty."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class SLOTracker:
    """The samples of the last ``window_s`` seconds and their summary; also observes the histograms."""

    def __init__(self, metrics: "RouterMetrics", window_s: float, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        self._requests: deque[tuple[float, RequestSample]] = deque()
        self._itls: deque[tuple[float, float]] = deque()
        self._kv: dict[str, deque[tuple[float, int]]] = {}  # decode worker URL -> (time, cumulative bytes)
        self._workers: dict[str, _WorkerSeries] = {}  # worker URL -> its scraped figures

    # -- recording -----------------------------------------------------------
    def record(self, route: str, sample: RequestSample) -> None:
        now = self.clock()
        m = self.metrics
        self._requests.append((now, sample))
        m.slo_e2e.labels(route).observe(sample.e2e)
        m.slo_output_tokens.labels(route).inc(sample.output_tokens)
        if sample.e2e > 0 and sample.output_tokens:
            m.slo_tokens_per_second.labels(route).observe(sample.output_tokens / sample.e2e)
        if sample.ttft is not None:
            m.slo_ttft.labels(route).observe(sample.ttft)
        itl_hist = m.slo_itl.labels(route)
        for gap in sample.itls:
            self._itls.append((now, gap))
            itl_hist.observe(gap)
        self._trim(now, self.window_s)

    def record_kv_bytes(self, url: str, total: int) -> None:
        """A decode worker's cumulative received KV bytes, as scraped now."""
        now = self.clock()
        series = self._kv.setdefault(url, deque())
        if series and total >= series[-1][1]:
            self.metrics.slo_kv_transfer_bytes.inc(total - series[-1][1])
        elif series:  # the worker restarted: its counter began again
            self.metrics.slo_kv_transfer_bytes.inc(total)
            series.clear()
        series.append((now, total))
        self._trim(now, self.window_s)

    def record_worker(self, url: str, role: str, info: dict) -> None:
        """A worker's ``/get_server_info`` as scraped now (the figures of its scheduler, module docstring)."""
        now = self.clock()
        series = self._workers.get(url)
        if series is None or series.role != role:
            series = self._workers[url] = _WorkerSeries(role)
        series.add(now, info)
        series.trim(now - self.window_s)
        kv = info.get("kv_transfer_bytes")
        if role == "decode" and _count(kv) is not None:
            self.record_kv_bytes(url, kv)

    def known_workers(self) -> set[str]:
        return set(self._kv) | set(self._workers)

    def forget_worker(self, url: str) -> None:
        self._kv.pop(url, None)
        self._workers.pop(url, None)

    def _trim(self, now: float, keep_s: float) -> None:
        horizon = now - max(keep_s, self.window_s)
        for dq in (self._requests, self._itls):
            while dq and (dq[0][0] < horizon or len(dq) > MAX_SAMPLES):
                dq.popleft()
        for series in self._kv.values():
            # keep one sample at or before the horizon: the window's baseline
            while len(series) > 1 and series[1][0] <= horizon:
                series.popleft()

    # -- summary -------------------------------------------------------------
    def summary(self, window_s: Optional[float] = None) -> dict:
        """``GET /slo`` (the contract in docs/router.md): figures over the last ``window_s`` seconds."""
        window = self.window_s if window_s is None else min(window_s, self.window_s)
        now = self.clock()
        since = now - window
        span = max(min(window, now - self.started), 1e-9)
        reqs = [s for t, s in self._requests if t >= since]
        itls = sorted(g for t, g in self._itls if t >= since)
        ttfts = sorted(s.ttft for s in reqs if s.ttft is not None)
        e2es = sorted(s.e2e for s in reqs)
        out: dict[str, Any] = {"window_s": window, "requests": len(reqs)}
        for name, values in (("ttft", ttfts), ("itl", itls), ("e2e", e2es)):
            for q in (50, 90, 99):
                v = percentile(values, q / 100)
                out[f"{name}_p{q}_ms"] = None if v is None else round(v * 1000, 3)
        out["requests_per_second"] = round(len(reqs) / span, 4) if reqs else None
        tokens = sum(s.output_tokens for s in reqs)
        out["output_tokens_per_second"] = round(tokens / span, 3) if reqs else None
        out["kv_transfer_gbps"] = self._kv_rate(since)
        out["roles"] = self._roles(since)
        return out

    def _roles(self, since: float) -> dict[str, dict]:
        """Per role: the sums over its scraped workers (module docstring); ``None`` for a figure none reported."""
        roles: dict[str, list[_WorkerSeries]] = {}
        for series in self._workers.values():
            if series.samples:
                roles.setdefault(series.role, []).append(series)
        out = {}
        for role, members in sorted(roles.items()):
            fig: dict[str, Any] = {"workers": len(members)}
            for key, name in (
                ("prompt_tokens", "prompt_tokens_per_second"),
                ("generation_tokens", "generation_tokens_per_second"),
            ):
                rates = [r for r in (w.rate(key, since) for w in members) if r is not None]
                fig[name] = round(sum(rates), 3) if rates else None
            for key, name in (("waiting", "queue_depth"), ("running", "running")):
                values = [v for v in (w.gauge(key) for w in members) if v is not None]
                fig[name] = int(sum(values)) if values else None
            usage = [v for v in (w.gauge("token_usage") for w in members) if v is not None]
            fig["kv_usage"] = round(sum(usage) / len(usage), 4) if usage else None
            fig["kv_usage_max"] = round(max(usage), 4) if usage else None
            out[role] = fig
        return out

    def _kv_rate(self, since: float) -> Optional[float]:
        total, any_rate = 0.0, False
        for series in self._kv.values():
            if len(series) < 2:
                continue
            base = next((p for p in reversed(series) if p[0] <= since), series[0])
            last = series[-1]
            if last[0] > base[0]:
                total += (last[1] - base[1]) / (last[0] - base[0])
                any_rate = True
        return round(total / 1e9, 6) if any_rate else None


def _count(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _number(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and v == v else None


class _WorkerSeries:
    """One worker's scrapes: cumulative counters over time (for rates) and its latest gauges."""

    COUNTERS = ("prompt_tokens", "generation_tokens")
    GAUGES = ("running", "waiting", "token_usage")

    def __init__(self, role: str):
        self.role = role
        self.samples: deque[tuple[float, dict[str, int]]] = deque()  # (time, counters)
        self.gauges: dict[str, float] = {}

    def add(self, now: float, info: dict) -> None:
        counters = {k: v for k in self.COUNTERS if (v := _count(info.get(k))) is not None}
        if self.samples and any(counters.get(k, 0) < v for k, v in self.samples[-1][1].items()):
            self.samples.clear()  # a counter went back: the worker restarted, its series starts again
        self.samples.append((now, counters))
        self.gauges = {k: v for k in self.GAUGES if (v := _number(info.get(k))) is not None}

    def trim(self, horizon: float) -> None:
        while len(self.samples) > 1 and self.samples[1][0] <= horizon:  # keep the window's baseline
            self.samples.popleft()

    def rate(self, key: str, since: float) -> Optional[float]:
        if len(self.samples) < 2:
            return None
        base = next((p for p in reversed(self.samples) if p[0] <= since), self.samples[0])
        last = self.samples[-1]
        if last[0] <= base[0] or key not in last[1] or key not in base[1]:
            return None
        return (last[1][key] - base[1][key]) / (last[0] - base[0])

    def gauge(self, key: str) -> Optional[float]:
        return self.gauges.get(key)


class WorkerStatsScraper:
    """Reads every registered worker's ``/get_server_info`` every ``interval`` s into the tracker (per-role
    figures, and the decode workers' ``kv_transfer_bytes``)."""

    def __init__(
        self,
        registry: "WorkerRegistry",
        tracker: SLOTracker,
        interval: float,
        client_fn: Callable[[], Optional[aiohttp.ClientSession]],
        headers: dict[str, str],
        timeout: float,
    ):
        self.registry = registry
        self.tracker = tracker
        self.interval = interval
        self.client_fn = client_fn
        self.headers = headers
        self.timeout = timeout
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvship-router-stats-scrape")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def scrape_once(self) -> None:
        workers = [w for w in self.registry.all() if w.info is not None]
        known = {w.url for w in workers}
        for url in self.tracker.known_workers() - known:
            self.tracker.forget_worker(url)
        await asyncio.gather(*(self._scrape(w.url, w.role) for w in workers))

    async def _scrape(self, url: str, role: str) -> None:
        client = self.client_fn()
        if client is None:
            return
        try:
            async with client.get(
                url + "/get_server_info", headers=self.headers, timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as resp:
                if resp.status != 200:
                    return
                info = json.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            logger.debug("stats scrape of %s failed: %s", url, e)
            return
        if isinstance(info, dict) and self.registry.get(url) is not None:  # not removed while we waited
            self.tracker.record_worker(url, role, info)

    async def _run(self) -> None:
        while True:
            try:
                await self.scrape_once()
            except Exception as e:  # noqa: BLE001 - the loop must survive any one scrape
                logger.warning("worker stats scrape failed: %r", e)
            await asyncio.sleep(self.interval)
