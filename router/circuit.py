"""Per-worker circuit breaker driven by request outcomes.

States: ``closed`` (traffic flows) -> ``open`` after ``failure_threshold``
consecutive failures (no traffic) -> ``half_open`` once ``cooldown`` seconds
have passed, letting exactly one trial request through -> ``closed`` when
that trial succeeds, back to ``open`` (cool-down restarts) when it fails.

Callers keep this protocol: filter candidates with ``can_attempt()``, call
``on_attempt()`` for the worker actually chosen (this is what turns an
expired ``open`` into ``half_open`` and claims the trial slot), then report
exactly one ``record_success()``, ``record_failure()`` or ``release_trial()`` (no verdict) per attempt.
A ``failure_threshold`` of 0 disables the breaker (always closed).
"""

from __future__ import annotations

import time
from typing import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_CODE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}


class CircuitBreaker:
    def __init__(self, failure_threshold: int, cooldown: float, clock: Callable[[], float] = time.monotonic):
        self.failure_threshold = failure_threshold
        self.cooldown = cooldown
        self._clock = clock
        self.state = CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self._trial_in_flight = False

    def can_attempt(self) -> bool:
        """Whether a request may be sent now (does not change state)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return self._clock() - self.opened_at >= self.cooldown
        return not self._trial_in_flight

    def on_attempt(self) -> None:
        """The caller is sending a request: an expired open circuit becomes half-open (one trial)."""
        if self.state == OPEN and self._clock() - self.opened_at >= self.cooldown:
            self.state = HALF_OPEN
        if self.state == HALF_OPEN:
            self._trial_in_flight = True

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self._trial_in_flight = False
        self.state = CLOSED

    def record_failure(self) -> None:
        self._trial_in_flight = False
        if self.failure_threshold <= 0:
            return
        self.consecutive_failures += 1
        if self.state == HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
            if self.state != OPEN:
                self.opened_at = self._clock()
            self.state = OPEN

    def release_trial(self) -> None:
        """An attempt ended with no verdict on the worker: a half-open circuit may send its trial again."""
        self._trial_in_flight = False

    def reset(self) -> None:
        """Back to closed (a worker that was restarted and passed its health checks)."""
        self.state = CLOSED
        self.consecutive_failures = 0
        self._trial_in_flight = False
