"""The SLO planner's control law: router figures -> replicas per worker role (pure; no I/O).

``spec.autoscaling.mode: slo`` (docs/operator.md, "SLO planner") scales each worker role to the latency
targets of ``spec.slo``:

* **prefill** from TTFT (``ttftP90Ms``); its load is the prompt-token throughput of the role's workers
  (``roles.prefill.prompt_tokens_per_second`` of the router's ``GET /slo``), its capacity the prompt tokens
  per second one prefill replica takes within the target.  Where the router has no token figure yet (its
  workers not scraped), the request rate (``requests_per_second``) and a capacity in requests/s stand in;
* **decode** from ITL (``itlP50Ms``); its load is the concurrent decode requests (the running and queued
  requests the role's workers report, ``roles.decode.running + queue_depth``; else the sum of ``in_flight``
  over the role's workers in ``GET /workers``), its capacity the concurrent requests one decode replica
  runs within the target;
* **unified** workers (no prefill role) from both: the larger of the two wants wins.

Queue depth and KV usage guard both roles: a role whose workers queue requests while their KV pools are
nearly full (mean ``kv_usage`` >= :data:`KV_FULL`) cannot admit more, whatever the latency says, and wants
one replica more; a role that queues more requests than it has replicas is never shrunk, nor is one with
fewer replicas serving (in the router's rotation) than it has: a scale-up is judged once its replicas serve.

Capacity per replica is learnt from what is observed (or starts from ``spec.autoscaling.profile``): a
latency ``v`` at per-replica load ``c`` estimates the capacity at the target ``t`` as ``c * t / v`` (a
linear latency-vs-load model, smoothed with an exponential average); while latency is far below the
target (under half of it) latency no longer tracks load well, so such an observation only raises the estimate
to a lower bound: ``c * (target / 2) / v``, the load at which latency would reach half the target were it
proportional to load (at most :data:`MAX_ESTIMATE_RATIO` x ``c``).  Without that bound a role scaled up under
a miss would stay up once the load fell (the capacity learnt from the misses sizes the falling load).

One :meth:`Planner.step` per pass:

1. **want**: ``ceil(load / (capacity * utilization))``, but on a missed target at least one more replica,
   above ``utilization * target`` never fewer (may grow ahead of a miss), at or below it never more
   (may shrink); then the queue / KV guards above; no traffic at all -> ``minReplicas``;
2. **stabilisation**: the wants of the last ``scaleUpStabilizationSeconds`` (lowest of them) bound a
   scale-up, those of the last ``scaleDownStabilizationSeconds`` (highest of them) bound a scale-down,
   as the HorizontalPodAutoscaler's behavior windows do;
3. **cooldown**: no change within ``cooldownSeconds`` of the role's last change;
4. **step**: at most ``maxScaleUpStep`` / ``maxScaleDownStep`` replicas per change;
5. **bounds**: ``[minReplicas, maxReplicas]`` of the role's ``autoscaling`` (enforced at once, whatever
   the cooldown).

Callers pass their clock (seconds, monotonic) so tests replay recorded figures.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Optional

# Exponential-average weight of a new capacity estimate.
CAPACITY_ALPHA = 0.3
# Below this fraction of the target, latency does not track load: an observation only bounds capacity below.
LOAD_SENSITIVE = 0.5
# One observation moves the capacity estimate by at most this factor either way.
MAX_ESTIMATE_RATIO = 4.0
# Mean fraction of KV slots in use at which a role that queues requests counts as full.
KV_FULL = 0.9


@dataclass(frozen=True)
class PlannerSettings:
    """The knobs of ``spec.autoscaling`` (seconds, replicas)."""

    utilization: float = 0.8
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    cooldown_s: float = 60.0
    max_step_up: int = 2
    max_step_down: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {self.utilization}")
        if min(self.scale_up_window_s, self.scale_down_window_s, self.cooldown_s) < 0:
            raise ValueError("windows and cooldown must be >= 0 seconds")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError("step sizes must be >= 1")


@dataclass(frozen=True)
class RoleTarget:
    """One scaled role: its bounds, the SLO signals that drive it and their targets (ms)."""

    role: str  # prefill | decode | unified
    min_replicas: int
    max_replicas: int
    ttft_ms: Optional[float] = None  # drives it from TTFT (prefill, unified)
    itl_ms: Optional[float] = None  # drives it from ITL (decode, unified)
    profile_rps: Optional[float] = None  # starting capacity: requests/s per replica within the TTFT target
    profile_concurrency: Optional[float] = None  # starting capacity: concurrent requests per replica (ITL)

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"{self.role}: need 0 <= minReplicas <= maxReplicas")
        if self.ttft_ms is None and self.itl_ms is None:
            raise ValueError(f"{self.role}: no target drives it")


@dataclass(frozen=True)
class RoleLoad:
    """A role's live workers as the router sees them: ``serving`` in rotation, ``in_flight`` requests (from
    ``GET /workers``), and what its workers report (``roles.<role>`` of ``GET /slo``; None: not reported)."""

    serving: int = 0
    in_flight: int = 0
    prompt_tokens_per_second: Optional[float] = None
    queue_depth: Optional[int] = None
    running: Optional[int] = None
    kv_usage: Optional[float] = None

    @property
    def concurrent(self) -> int:
        """Requests the role runs or queues: its workers' own count when reported, else the router's."""
        if self.running is None:
            return self.in_flight
        return self.running + (self.queue_depth or 0)

    def describe(self, role: str) -> str:
        parts = [f"{self.in_flight} in flight on {self.serving}"]
        if self.prompt_tokens_per_second is not None:
            parts.append(f"{self.prompt_tokens_per_second:g} prompt tok/s")
        if self.running is not None:
            parts.append(f"{self.running} running")
        if self.queue_depth is not None:
            parts.append(f"{self.queue_depth} queued")
        if self.kv_usage is not None:
            parts.append(f"kv {self.kv_usage:.0%}")
        return f"{role} " + ", ".join(parts)


@dataclass(frozen=True)
class Figures:
    """One read of the router: ``GET /slo`` percentiles and rates plus per-role loads from ``GET /workers``."""

    requests: int = 0
    ttft_p90_ms: Optional[float] = None
    itl_p50_ms: Optional[float] = None
    requests_per_second: Optional[float] = None
    roles: dict[str, RoleLoad] = field(default_factory=dict)

    def load(self, role: str) -> RoleLoad:
        return self.roles.get(role, RoleLoad())

    def describe(self) -> str:
        def ms(v: Optional[float]) -> str:
            return "-" if v is None else f"{v:g} ms"

        rps = "-" if self.requests_per_second is None else f"{self.requests_per_second:g}"
        roles = "; ".join(x.describe(r) for r, x in sorted(self.roles.items()))
        return f"ttft p90 {ms(self.ttft_p90_ms)}, itl p50 {ms(self.itl_p50_ms)}, {rps} req/s; {roles or 'no workers'}"


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _count(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _reported_count(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _reported(v: Any) -> Optional[float]:
    n = _num(v)
    return n if n is not None and n >= 0 else None


def figures_from_router(slo: Optional[dict], workers: list[dict], revision: Optional[str]) -> Figures:
    """:class:`Figures` from the router's ``GET /slo`` and ``GET /workers`` answers (docs/router.md).

    Per-role loads count the in-rotation workers of ``revision`` (the current one: a draining revision's
    workers finish their requests and take no new ones) and the requests every worker of the role runs;
    the token rate, queue depth, running requests and KV usage come from ``roles`` of ``GET /slo`` (every
    scraped worker of the role, draining ones included: their requests are load too).
    """
    slo = slo or {}
    roles: dict[str, RoleLoad] = {}
    reported = slo.get("roles") if isinstance(slo.get("roles"), dict) else {}
    for role, fig in reported.items():
        if isinstance(role, str) and isinstance(fig, dict):
            roles[role] = RoleLoad(
                prompt_tokens_per_second=_reported(fig.get("prompt_tokens_per_second")),
                queue_depth=_reported_count(fig.get("queue_depth")),
                running=_reported_count(fig.get("running")),
                kv_usage=_reported(fig.get("kv_usage")),
            )
    for w in workers:
        role = w.get("role")
        if not isinstance(role, str):
            continue
        cur = roles.get(role, RoleLoad())
        serving = int(bool(w.get("in_rotation")) and (revision is None or w.get("revision") == revision))
        roles[role] = replace(cur, serving=cur.serving + serving, in_flight=cur.in_flight + _count(w.get("in_flight")))
    return Figures(
        requests=_count(slo.get("requests")),
        ttft_p90_ms=_num(slo.get("ttft_p90_ms")),
        itl_p50_ms=_num(slo.get("itl_p50_ms")),
        requests_per_second=_num(slo.get("requests_per_second")),
        roles=roles,
    )


@dataclass(frozen=True)
class Decision:
    """What the planner wants for one role on one pass; ``reason`` is the event's reason."""

    role: str
    current: int
    desired: int
    reason: str  # ScaledUp | ScaledDown | Hold
    message: str

    @property
    def changed(self) -> bool:
        return self.desired != self.current


@dataclass
class _Signal:
    """The learnt capacity of one (role, signal) pair: per-replica load that meets the target."""

    capacity: Optional[float] = None

    def learn(self, per_replica: float, value: float, target: float) -> None:
        if per_replica <= 0:
            return
        if value < LOAD_SENSITIVE * target:
            # far below the target: a lower bound only, the load at which latency would reach half the target
            # were it proportional to load (a latency floor makes it grow slower, so this is the cautious side)
            bound = per_replica * min(LOAD_SENSITIVE * target / max(value, 1e-9), MAX_ESTIMATE_RATIO)
            self.capacity = max(self.capacity or 0.0, bound)
            return
        ratio = min(max(target / value, 1 / MAX_ESTIMATE_RATIO), MAX_ESTIMATE_RATIO)
        estimate = per_replica * ratio
        self.capacity = (
            estimate if self.capacity is None else self.capacity + CAPACITY_ALPHA * (estimate - self.capacity)
        )


@dataclass
class _RoleMemory:
    ttft: _Signal  # requests/s per replica within the TTFT target (the profile's unit)
    itl: _Signal
    ttft_tokens: _Signal = field(default_factory=_Signal)  # prompt tokens/s per replica within the TTFT target
    wants: deque = field(default_factory=deque)  # (time, want)
    last_change: Optional[float] = None


class Planner:
    """Replicas per role for one InferenceService; keeps the learnt capacities and recent wants between passes.

    Contract: call :meth:`step` with non-decreasing ``now``; apply each changed :class:`Decision` (or not:
    the next pass reads the live replica counts again).  :meth:`applied` records a change that was made,
    which starts that role's cooldown.
    """

    def __init__(self, settings: PlannerSettings, targets: list[RoleTarget]):
        self.settings = settings
        self.targets = {t.role: t for t in targets}
        self.memory = {
            t.role: _RoleMemory(ttft=_Signal(t.profile_rps), itl=_Signal(t.profile_concurrency)) for t in targets
        }

    def capacity(self, role: str) -> dict[str, Optional[float]]:
        """The learnt capacities of ``role`` per replica: prompt tokens/s and requests/s (TTFT), concurrent
        requests (ITL)."""
        m = self.memory[role]
        return {
            "prompt_tokens_per_second": m.ttft_tokens.capacity,
            "rps": m.ttft.capacity,
            "concurrency": m.itl.capacity,
        }

    def step(self, figures: Figures, current: dict[str, int], now: float) -> list[Decision]:
        """One decision per role in ``current`` (its live desired replicas) that this planner scales."""
        return [self._decide(role, n, figures, now) for role, n in current.items() if role in self.targets]

    def applied(self, decision: Decision, now: float) -> None:
        if decision.changed:
            self.memory[decision.role].last_change = now

    # -- one role ---------------------------------------------------------------------------------------
    def _decide(self, role: str, current: int, f: Figures, now: float) -> Decision:
        t, m, s = self.targets[role], self.memory[role], self.settings
        want, why = self._want(t, m, current, f)
        m.wants.append((now, want))
        horizon = now - max(s.scale_up_window_s, s.scale_down_window_s)
        while m.wants and m.wants[0][0] < horizon:
            m.wants.popleft()
        up = min(w for ts, w in m.wants if ts >= now - s.scale_up_window_s)
        down = max(w for ts, w in m.wants if ts >= now - s.scale_down_window_s)
        desired, note = current, ""
        if up > current:
            desired = min(up, current + s.max_step_up)
        elif down < current:
            desired = max(down, current - s.max_step_down)
        elif want != current:
            note = f"; want {want} held by the stabilisation window"
        cooling = m.last_change is not None and now - m.last_change < s.cooldown_s
        if desired != current and cooling:
            note = f"; want {desired} held by the cooldown ({now - m.last_change:.0f}s of {s.cooldown_s:g}s)"
            desired = current
        bounded = min(max(desired, t.min_replicas), t.max_replicas)
        if bounded != desired:
            note += f"; bounded to [{t.min_replicas}, {t.max_replicas}]"
            desired = bounded
        reason = "ScaledUp" if desired > current else "ScaledDown" if desired < current else "Hold"
        head = f"{role} {current} -> {desired}" if desired != current else f"{role} stays at {current}"
        return Decision(role, current, desired, reason, f"{head}: {why}{note}; {f.describe()}")

    def _want(self, t: RoleTarget, m: _RoleMemory, current: int, f: Figures) -> tuple[int, str]:
        load = f.load(t.role)
        if f.requests == 0 and load.in_flight == 0 and load.concurrent == 0:
            return t.min_replicas, "no traffic in the router's window"
        wants: list[tuple[int, str]] = []
        if t.ttft_ms is not None:
            loads = [
                (m.ttft_tokens, load.prompt_tokens_per_second, "prompt tok/s"),
                (m.ttft, f.requests_per_second, "req/s"),
            ]
            wants.append(self._signal_want("ttft p90", f.ttft_p90_ms, t.ttft_ms, loads, current, load.serving))
        if t.itl_ms is not None:
            loads = [(m.itl, float(load.concurrent), "concurrent")]
            wants.append(self._signal_want("itl p50", f.itl_p50_ms, t.itl_ms, loads, current, load.serving))
        want, why = max(wants, key=lambda w: w[0])
        return self._guards(want, why, load, current)

    @staticmethod
    def _guards(want: int, why: str, load: RoleLoad, current: int) -> tuple[int, str]:
        """The queue / KV-usage guards of the module docstring."""
        queued = load.queue_depth or 0
        if queued and load.kv_usage is not None and load.kv_usage >= KV_FULL and want <= current:
            return current + 1, f"{why}; {queued} queued with kv {load.kv_usage:.0%} >= {KV_FULL:.0%}: full"
        if want < current and queued > max(load.serving, 1):
            return current, f"{why}; {queued} queued on {load.serving} replicas: not shrinking"
        if want < current and load.serving < current:
            # a scale-up (or a restarted replica) not serving yet: its load still sits on the others, and the
            # figures that asked for it cannot be judged until it takes its share
            return current, f"{why}; {load.serving} of {current} replicas serving: not shrinking before the rest are"
        return want, why

    def _signal_want(
        self,
        name: str,
        value: Optional[float],
        target: float,
        loads: list[tuple[_Signal, Optional[float], str]],
        current: int,
        serving: int,
    ) -> tuple[int, str]:
        """The want of one latency signal; ``loads``: (capacity, load, unit) in order of preference, each
        learnt from this observation, the first with a load and a learnt capacity sizing the role."""
        u = self.settings.utilization
        for sig, load, _ in loads:
            if value is not None and load is not None and serving > 0:
                sig.learn(load / serving, value, target)
        by_load: Optional[int] = None
        cap = "; capacity not learnt yet"
        for sig, load, unit in loads:
            if load is not None and sig.capacity:
                by_load = max(1, math.ceil(load / (sig.capacity * u) - 1e-9))
                cap = f"; {load:g} {unit} over capacity {sig.capacity:.3g} {unit}/replica x {u:g} -> {by_load}"
                break
        if value is None:
            return (by_load if by_load is not None and by_load > current else current), f"{name}: no samples{cap}"
        if value > target:
            want = max(current + 1, by_load or 0)
            return want, f"{name} {value:g} ms > target {target:g} ms{cap}"
        if by_load is None:
            by_load = max(1, math.ceil(current * value / (target * u) - 1e-9))
        if value > u * target:  # close to the target: may grow ahead of a miss, never shrink
            return max(by_load, current), f"{name} {value:g} ms near target {target:g} ms (above {u:g} x target){cap}"
        return min(by_load, current), f"{name} {value:g} ms <= target {target:g} ms{cap}"
