"""Admission policy: which waiting requests join the next extend batch, and how much of each.

* ``SchedulePolicy.order`` sorts the waiting queue: ``lpm`` puts the requests
  with the longest cached prefix first (ties keep arrival order), ``fcfs``
  keeps arrival order.  Large queues fall back to ``fcfs`` (matching every
  request each step would cost more than it saves).
* ``PrefillBudget`` carries the three limits of one extend batch: the
  ``--max-prefill-tokens`` input budget, the ``--chunked-prefill-size`` chunk
  budget, and KV memory (free + evictable slots, minus what running requests
  are expected to still need for decoding).
* ``SchedulerTuning`` holds the knobs that are not CLI flags (the
  new-token-ratio estimate of how much of ``max_new_tokens`` a running
  request will really use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from kvship.engine.mem.pools import page_round_up

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.mem.radix_cache import BasePrefixCache
    from kvship.engine.schedule_batch import Req


@dataclass(frozen=True)
class SchedulerTuning:
    # fraction of the remaining max_new_tokens reserved per running request when admitting
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay_steps: int = 600
    # remaining max_new_tokens above this count as this much for reservations
    clip_max_new_tokens: int = 4096
    # above this many waiting requests, lpm orders like fcfs
    lpm_max_waiting: int = 128
    # run_forever: how long to block on the input queue when there is nothing to do
    idle_wait_s: float = 0.05


class SchedulePolicy:
    def __init__(self, policy: str, cache: "BasePrefixCache", tuning: SchedulerTuning):
        if policy not in ("lpm", "fcfs"):
            raise ValueError(f"unknown schedule policy '{policy}'")
        self.policy = policy
        self.cache = cache
        self.tuning = tuning

    def order(self, waiting: list["Req"]) -> list["Req"]:
        """The waiting requests in admission order (a new list; ``waiting`` is untouched)."""
        if self.policy == "fcfs" or len(waiting) > self.tuning.lpm_max_waiting or len(waiting) < 2:
            return list(waiting)
        lens = {id(r): _cached_len(self.cache.match_prefix(r.fill_ids[:-1])) for r in waiting}
        return sorted(waiting, key=lambda r: -lens[id(r)])


def _cached_len(match) -> int:
    """Tokens of a match cached on any tier (a host hit is loaded back at admission)."""
    return match.length + match.host_len


@dataclass
class PrefillBudget:
    """Limits of one extend batch; ``fit`` says how many new tokens a request may take."""

    page_size: int
    rem_input: int  # --max-prefill-tokens left
    rem_chunk: Optional[int]  # --chunked-prefill-size left (None: chunking disabled)
    rem_memory: int  # KV slots left after reservations
    consumed: int = 0  # KV slots (and reservations) taken by this batch so far

    def fit(self, remaining: int, first: bool) -> int:
        """New tokens (of ``remaining`` still to compute) a request may extend by now.

        With chunking, the answer may be a page-aligned part of ``remaining``;
        without, it is all or nothing (and the first request of a batch may
        exceed ``--max-prefill-tokens``).  0 means: stop adding requests.
        """
        mem = self.rem_memory // self.page_size * self.page_size
        if self.rem_chunk is None:
            if remaining > self.rem_input and not first:
                return 0
            return remaining if remaining <= mem else 0
        cap = min(self.rem_chunk, self.rem_input, mem)
        if cap <= 0:
            return 0
        if remaining <= cap:
            return remaining
        return cap // self.page_size * self.page_size

    def take(self, extend_len: int, reserve: int) -> None:
        self.rem_input -= extend_len
        if self.rem_chunk is not None:
            self.rem_chunk -= extend_len
        used = page_round_up(extend_len, self.page_size) + reserve
        self.consumed += used
        self.rem_memory -= used

    def refresh(self, memory_left: int) -> None:
        """Re-read the memory left (e.g. after locking cache nodes made them unevictable)."""
        self.rem_memory = memory_left - self.consumed
