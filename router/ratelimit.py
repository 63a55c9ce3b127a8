"""Token-bucket rate limiter with a bounded, time-limited wait queue.

``rate`` tokens per second refill a bucket of ``burst`` tokens.  A request
takes a token at once when one is there; otherwise it reserves the next
token and sleeps until it is due (first come, first served, by construction
of the reservations).  It is refused (``RateLimited``, answered 429 with
``Retry-After``) when ``queue_size`` requests already wait, or when its token
would be due later than ``queue_timeout`` seconds from now.  A waiter that is
cancelled (client gone) gives its reservation back.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Callable


class RateLimited(Exception):
    def __init__(self, retry_after: float, reason: str):
        super().__init__(reason)
        self.retry_after = retry_after
        self.reason = reason

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after)))


class TokenBucket:
    def __init__(
        self,
        rate: float,
        burst: int,
        queue_size: int,
        queue_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        if rate <= 0:
            raise ValueError("rate must be > 0")
        self.rate = rate
        self.burst = max(1, burst)
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self._clock = clock
        self._tokens = float(self.burst)  # may go negative: -n = n reservations outstanding
        self._stamp = clock()
        self.waiting = 0

    def _refill(self, now: float) -> None:
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    async def acquire(self) -> None:
        """Take a token, waiting in the queue if allowed; raise ``RateLimited`` otherwise."""
        now = self._clock()
        self._refill(now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return
        wait = (1.0 - self._tokens) / self.rate
        if self.waiting >= self.queue_size:
            raise RateLimited(wait, "rate limit exceeded and the wait queue is full")
        if wait > self.queue_timeout:
            raise RateLimited(wait, "rate limit exceeded; the wait would pass the queue timeout")
        self._tokens -= 1.0
        self.waiting += 1
        try:
            await asyncio.sleep(wait)
        except BaseException:
            self._refill(self._clock())
            self._tokens = min(float(self.burst), self._tokens + 1.0)
            raise
        finally:
            self.waiting -= 1
