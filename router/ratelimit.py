"""Token-bucket rate limiter with a bounded, time-limited wait queue.

``rate`` tokens per second refill a bucket of ``burst`` tokens.  A request
takes a token at once when one is there; otherwise it reserves the next
token and sleeps until it is due (first come, first served, by construction
of the reservations).  It is refused (``RateLimited``, answered 429 with
``Retry-After``) when ``queue_size`` requests already wait, or when its token
would be due later than ``queue_timeout`` seconds from now.  A waiter that is
cancelled (client gone) gives its reservation back.

``KeyLimits``: the per-key limits (docs/router.md, "Per-key limits").  Each
client key (or, on a router without client keys, each client address) has its
own token bucket (``--rate-limit-per-key`` requests/s, ``--rate-limit-burst``
tokens; no wait queue: an empty bucket is a 429 at once, ``Retry-After`` = when
its next token is due) and its own count of requests in flight
(``--max-in-flight-per-key``; a request is in flight until its response, stream
included, has ended).  At most ``--rate-limit-tracked-keys`` buckets are kept,
least recently used dropped first (a dropped key starts again with a full
bucket); in-flight counts live only while a key has a request in flight, so
they are bounded by the open requests themselves.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from typing import Callable, Optional


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


class KeyLimits:
    """Per-key token buckets and in-flight caps (see the module docstring).  Event-loop thread only."""

    def __init__(
        self,
        rate: float,
        burst: int,
        max_in_flight: int,
        max_keys: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.rate = rate
        self.burst = float(max(1, burst))
        self.max_in_flight = max_in_flight
        self.max_keys = max(1, max_keys)
        self._clock = clock
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # key -> [tokens, stamp]
        self._in_flight: dict[str, int] = {}

    @property
    def tracked_keys(self) -> int:
        return len(self._buckets)

    def in_flight(self, key: str) -> int:
        return self._in_flight.get(key, 0)

    def _take_token(self, key: str) -> None:
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = [self.burst, now]
            self._buckets[key] = bucket
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
            bucket[1] = now
        if bucket[0] < 1.0:
            raise RateLimited((1.0 - bucket[0]) / self.rate, f"per-key rate limit of {self.rate:g} requests/s exceeded")
        bucket[0] -= 1.0

    def admit(self, key: str) -> Callable[[], None]:
        """Count one request of ``key``; return its release (call it exactly once, when the response ended).
        Raises ``RateLimited`` (nothing counted) over either limit."""
        if self.max_in_flight > 0 and self._in_flight.get(key, 0) >= self.max_in_flight:
            raise RateLimited(
                1.0, f"this key already has {self.max_in_flight} requests in flight (--max-in-flight-per-key)"
            )
        if self.rate > 0:
            self._take_token(key)
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self._in_flight.get(key, 1) - 1
            if left > 0:
                self._in_flight[key] = left
            else:
                self._in_flight.pop(key, None)

        return release


def key_limits_or_none(rate: float, burst: int, max_in_flight: int, max_keys: int) -> Optional[KeyLimits]:
    """A ``KeyLimits`` when either per-key limit is on, else None."""
    if rate <= 0 and max_in_flight <= 0:
        return None
    return KeyLimits(rate, burst, max_in_flight, max_keys)
