"""``KVBudget``: the KV-slot arithmetic every scheduling decision uses, in one place.

Invariants the scheduler keeps with it:

* A request's positions occupy whole pages: a prompt of ``n`` tokens needs
  ``round_up(n)`` slots, and a decode step needs a new page only for the
  requests whose committed length sits on a page boundary (``decode_need``).
* Admission keeps room for the running requests to decode: ``reserve(reqs)``
  is the part of their remaining ``max_new_tokens`` (clipped at
  ``clip_max_new_tokens``) that ``new_token_ratio`` expects them to use, and
  ``memory_left(running)`` is what an extend may take after that reserve.
* ``new_token_ratio`` starts at ``init_new_token_ratio``, decays towards
  ``min_new_token_ratio`` with every decode batch, and jumps back up after a
  retraction (the estimate was too optimistic).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from kvship.engine.mem.pools import page_round_up

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.mem.radix_cache import BasePrefixCache
    from kvship.engine.schedule_batch import Req
    from kvship.engine.scheduler.policy import SchedulerTuning


class KVBudget:
    """Page rounding, decode reserve and decode need over one allocator and prefix cache."""

    def __init__(self, allocator: Any, cache: "BasePrefixCache", page_size: int, tuning: "SchedulerTuning"):
        self.allocator = allocator
        self.cache = cache
        self.page_size = int(page_size)
        self.tuning = tuning
        self.new_token_ratio = tuning.init_new_token_ratio

    # ------------------------------------------------------------ arithmetic
    def round_up(self, n: int) -> int:
        """Slots that ``n`` positions starting on a page boundary occupy."""
        return page_round_up(n, self.page_size)

    def reserve(self, reqs: Iterable["Req"]) -> int:
        """Slots to keep free so ``reqs`` can go on decoding (the expected rest of their outputs)."""
        clip = self.tuning.clip_max_new_tokens
        left = sum(min(r.max_new_tokens - len(r.output_ids), clip) for r in reqs)
        return int(left * self.new_token_ratio)

    def decode_need(self, reqs: Iterable["Req"]) -> int:
        """Slots one decode step of ``reqs`` allocates (a page for each request at a page boundary)."""
        ps = self.page_size
        return sum(1 for r in reqs if r.kv_committed_len % ps == 0) * ps

    def free_and_evictable(self) -> int:
        return self.allocator.available_size() + self.cache.evictable_size()

    def memory_left(self, running: Iterable["Req"]) -> int:
        """Slots an extend may use: free + evictable, minus the reserve of ``running``."""
        return self.free_and_evictable() - self.reserve(running)

    def fits_decode(self, reqs: Iterable["Req"]) -> bool:
        """A decode step of ``reqs`` can get its slots (evicting the cache if needed)."""
        return self.decode_need(reqs) <= self.free_and_evictable()

    def shortfall_after_evict(self, need: int) -> int:
        """Evict the cache towards ``need`` free slots; returns how many are still missing (<= 0: none)."""
        short = need - self.allocator.available_size()
        if short > 0:
            self.cache.evict(short)
            short = need - self.allocator.available_size()
        return short

    # ------------------------------------------------------------ the estimate
    def decay(self) -> None:
        t = self.tuning
        step = (t.init_new_token_ratio - t.min_new_token_ratio) / t.new_token_ratio_decay_steps
        self.new_token_ratio = max(t.min_new_token_ratio, self.new_token_ratio - step)

    def after_retract(self, running: list["Req"]) -> None:
        decoded = sum(len(r.output_ids) for r in running)
        budget = sum(r.max_new_tokens for r in running) or 1
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, (decoded + 20 * len(running)) / budget))
