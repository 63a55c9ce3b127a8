"""The engine's event bus: typed events of a request's life, for whoever listens.

The scheduler and the PD roles emit; tracing (``kvship.common.tracing``),
the worker's metrics, the PD timestamps and benchmarks subscribe
(docs/observability.md, "Events").  Life of one request, as events::

    RequestQueued -> RequestAdmitted -> ForwardStarted/ForwardFinished (extend) -> FirstToken
        -> ForwardStarted/ForwardFinished (decode steps) ... -> RequestFinished
    PD prefill adds KVTransferStarted/KVTransferFinished (role "prefill") after its first token;
    PD decode adds KVTransferStarted/KVTransferFinished (role "decode") before RequestAdmitted;
    both add PDStage events for the stages of their life cycle (the ``return_trace`` stamps).

Contract:

* ``emit`` calls every subscriber synchronously on the emitting thread (the
  scheduler's): a subscriber must be quick, thread-safe and must not call
  into the scheduler.  A subscriber that raises is logged and skipped; the
  others still get the event.
* Emitters build an event only when somebody takes it: ``bus.active`` (a
  subscriber of every event) at the scheduler's per-step points,
  ``bus.wants(kind)`` elsewhere; with no subscriber an emit point costs one
  attribute read.
* ``StepPhase`` (the host time of each public step of a scheduler
  iteration) is opt-in: only subscribers that name the kind get it, and the
  scheduler builds it only then (``bus.phases``); a subscriber of every event
  (tracing, metrics) never sees it.
* ``at`` is wall clock (``time.time()``) so events line up across processes
  (router, prefill, decode).
* Events are frozen: subscribers share them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    at: float = field(default_factory=time.time, kw_only=True)


@dataclass(frozen=True)
class RequestQueued(Event):
    """The scheduler accepted ``rid`` (it waits for admission, or enters a PD role's first stage)."""

    rid: str
    prompt_tokens: int


@dataclass(frozen=True)
class RequestAdmitted(Event):
    """``rid`` starts computing: its first extend forward (``cached_tokens`` came from the prefix cache), or
    on a PD decode worker its join of the running batch with prefill's KV."""

    rid: str
    cached_tokens: int = 0


@dataclass(frozen=True)
class ForwardStarted(Event):
    """A forward of ``rids`` was launched; ``mode`` is ``extend`` or ``decode``; ``tokens`` it computes."""

    mode: str
    rids: tuple[str, ...]
    tokens: int


@dataclass(frozen=True)
class ForwardFinished(Event):
    """The forward's tokens are on the host.  Forwards finish in the order they started (with the overlap
    schedule the next one may start before this one finishes); a request is in at most one forward of a mode
    at a time, so ``(rid, mode)`` pairs a start with its finish."""

    mode: str
    rids: tuple[str, ...]


@dataclass(frozen=True)
class FirstToken(Event):
    """``rid``'s first output token was sampled here (or, PD decode, arrived from prefill)."""

    rid: str


@dataclass(frozen=True)
class KVTransferStarted(Event):
    """PD: ``rid``'s KV started to move (``role`` ``prefill`` sends, ``decode`` receives) over ``backend``."""

    rid: str
    role: str
    backend: str


@dataclass(frozen=True)
class KVTransferFinished(Event):
    """PD: ``rid``'s KV transfer ended: ``ok`` with ``bytes`` moved in ``seconds``, else ``reason`` (a short
    failure kind: ``timeout``, ``peer_failed``, ``aborted``, ...) and ``message``."""

    rid: str
    role: str
    backend: str
    ok: bool
    bytes: int = 0
    seconds: float = 0.0
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class PDStage(Event):
    """PD: ``rid`` passed ``stage`` of its ``role`` (the stage names of docs/pd.md, "Reading a request's
    trace": ``scheduled``, ``room_registered``, ``kv_send_start``, ``kv_arrived``, ...); ``at`` may be a
    transfer thread's own stamp, earlier than the emit."""

    rid: str
    role: str
    stage: str


@dataclass(frozen=True)
class RequestFinished(Event):
    """``rid`` finished: ``reason`` is ``stop``, ``length`` or ``abort`` (``message`` says why)."""

    rid: str
    reason: str
    message: str = ""
    completion_tokens: int = 0


@dataclass(frozen=True)
class StepPhase(Event):
    """One public step of a scheduler iteration ran on the host from ``start`` to ``end``
    (``time.perf_counter()`` seconds): ``phase`` is ``recv``, ``schedule``, ``launch``, ``sample``,
    ``process``, ``flush`` or ``end_step`` (which includes its own flush).  Host time only: a ``launch``
    returns once the forward is enqueued.  Opt-in (see the module docstring)."""

    phase: str
    start: float
    end: float


OPT_IN: frozenset[type] = frozenset({StepPhase})  # kinds only subscribers that name them get

Subscriber = Callable[[Event], None]


class EventBus:
    """Synchronous publish / subscribe of ``Event``s (see the module docstring)."""

    def __init__(self) -> None:
        self._subs: tuple[tuple[Subscriber, Optional[tuple[type, ...]]], ...] = ()
        self._lock = threading.Lock()
        self.active = False  # a subscriber takes every event: the scheduler's emit points build theirs
        self._kinds: frozenset[type] = frozenset()  # the kinds some subscriber takes
        self.phases = False  # a subscriber takes ``StepPhase``: the scheduler times its steps

    def subscribe(self, fn: Subscriber, kinds: Optional[tuple[type, ...]] = None) -> Callable[[], None]:
        """Call ``fn(event)`` for every event from now on (only those of ``kinds`` when given); returns the
        function that unsubscribes it."""
        entry = (fn, kinds)
        with self._lock:
            self._subs = self._subs + (entry,)
            self._refresh()

        def unsubscribe() -> None:
            with self._lock:
                self._subs = tuple(e for e in self._subs if e is not entry)
                self._refresh()

        return unsubscribe

    def _refresh(self) -> None:
        self.active = any(kinds is None for _, kinds in self._subs)
        self._kinds = frozenset(k for _, kinds in self._subs for k in kinds or ())
        self.phases = StepPhase in self._kinds

    def wants(self, kind: type) -> bool:
        """Whether an event of ``kind`` has a subscriber (build it only then)."""
        if kind in OPT_IN:
            return kind in self._kinds
        return self.active or kind in self._kinds

    def emit(self, event: Event) -> None:
        for fn, kinds in self._subs:  # a tuple swapped whole under the lock: safe to iterate without it
            if kinds is None:
                if type(event) in OPT_IN:
                    continue
            elif not isinstance(event, kinds):
                continue
            try:
                fn(event)
            except Exception:  # noqa: BLE001 - a broken listener must not stop the scheduler
                logger.exception("event subscriber %r failed on %s", fn, type(event).__name__)


def failure_kind(message: str) -> str:
    """A short, bounded label for a KV-transfer failure message (a metric label, a span attribute)."""
    m = (message or "").lower()
    for needle, kind in (
        ("timed out", "timeout"),
        ("timeout", "timeout"),
        ("abort", "aborted"),
        ("checksum", "corrupted"),
        ("corrupt", "corrupted"),
        ("heartbeat", "peer_lost"),
        ("died", "peer_lost"),
        ("gone", "peer_lost"),
        ("closed", "peer_lost"),
        ("refused", "connect"),
        ("connect", "connect"),
        ("token", "auth"),
        ("auth", "auth"),
    ):
        if needle in m:
            return kind
    return "other"
