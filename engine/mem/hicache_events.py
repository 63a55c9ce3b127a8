"""KV events: what a worker's prefix cache holds, page by page, for the router (docs/cache.md, "KV events").

Pages are named by a **hash chain** of their tokens: ``h(page i) = H(h(page
i-1) || tokens of page i)`` with ``h(page -1) = 0`` and ``H`` the first 8
bytes of BLAKE2b over the little-endian int64 parent hash and int32 tokens,
read as a signed int64.  Anyone who knows a prompt and the worker's page size
computes the same names (``page_hashes``), so the router can ask "how many
leading pages of this prompt does worker W hold, and on which tier".

``KVEventLog`` is the worker side.  The radix cache calls ``stored(hashes,
tier)`` when pages enter a tier (``gpu`` or ``host``), ``removed(hashes,
tier)`` when they leave one and ``removed(hashes)`` when they leave the
cache.  A page may be on both tiers (``--hicache-write-policy
write_through``: its host copy is made when it is cached); a page moving
between tiers is removed from the old one, then stored on the new one.
Each call becomes one event with the next sequence number (1, 2, ...).  The
log keeps the latest ``capacity`` events and the current set of pages:

* ``since(seq)`` -> the events after ``seq``, or None when some of them
  were already dropped (the subscriber must resync from a snapshot);
* ``snapshot()`` -> ``{"seq", "page_size", "pages": [[hash, tier], ...]}``:
  the state after event ``seq`` (apply only events after it); a page on
  two tiers is listed once per tier.

``pages()`` (and a mirror's ``pages``) name each page's fastest tier;
``page_tiers()`` (``tiers()``) give every (hash, tier) pair.

Thread rule: the scheduler thread writes; any thread may read (one lock).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Optional, Sequence

from kvship.common.kv_events import (  # noqa: F401 (page_hashes re-exported)
    TIER_BIT,
    TIERS,
    KVEvent,
    fastest_tier,
    page_hashes,
    tier_names,
)


class KVEventLog:
    """The worker's event log and page set (see the module docstring)."""

    def __init__(self, page_size: int, capacity: int = 4096):
        if capacity < 1:
            raise ValueError("the KV event log must keep at least one event")
        self.page_size = page_size
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._pages: dict[int, int] = {}  # hash -> its tiers (TIER_BIT mask)
        self._seq = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    @property
    def seq(self) -> int:
        return self._seq

    def stored(self, hashes: Sequence[int], tier: str) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}")
        if not hashes:
            return
        with self._lock:
            _store(self._pages, hashes, tier)
            self._append("stored", hashes, tier)

    def removed(self, hashes: Sequence[int], tier: Optional[str] = None) -> None:
        """The pages left ``tier`` (None: every tier, the cache)."""
        if tier is not None and tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}")
        if not hashes:
            return
        with self._lock:
            _remove(self._pages, hashes, tier)
            self._append("removed", hashes, tier)

    def _append(self, kind: str, hashes: Sequence[int], tier: Optional[str]) -> None:
        self._seq += 1
        self._events.append(KVEvent(self._seq, kind, tuple(hashes), tier))
        self._cond.notify_all()

    def since(self, seq: int) -> Optional[list[KVEvent]]:
        """Events after ``seq`` (empty when none yet), or None when the log no longer has all of them."""
        with self._lock:
            return self._since(seq)

    def _since(self, seq: int) -> Optional[list[KVEvent]]:
        if seq >= self._seq:
            return []
        if not self._events or self._events[0].seq > seq + 1:
            return None
        start = seq + 1 - self._events[0].seq
        return [self._events[i] for i in range(start, len(self._events))]

    def wait_since(self, seq: int, timeout_s: float) -> Optional[list[KVEvent]]:
        """``since(seq)``, waiting up to ``timeout_s`` for an event when there is none yet."""
        with self._cond:
            if seq >= self._seq:
                self._cond.wait_for(lambda: self._seq > seq, timeout=timeout_s)
            return self._since(seq)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "seq": self._seq,
                "page_size": self.page_size,
                "pages": [[h, t] for h, mask in self._pages.items() for t in tier_names(mask)],
            }

    def pages(self) -> dict[int, str]:
        """The current page set (a copy): hash -> its fastest tier."""
        with self._lock:
            return {h: fastest_tier(mask) for h, mask in self._pages.items()}

    def page_tiers(self) -> set[tuple[int, str]]:
        """The current page set, every tier of every page: {(hash, tier)}."""
        with self._lock:
            return {(h, t) for h, mask in self._pages.items() for t in tier_names(mask)}


class KVEventMirror:
    """A subscriber's copy of one worker's page set, kept by applying events in order.

    ``apply(events)`` returns False (and applies nothing) when the first event is not the next sequence
    number: a gap; call ``reset(snapshot)`` and go on from ``snapshot["seq"]``.
    """

    def __init__(self) -> None:
        self.seq = 0
        self.page_size: Optional[int] = None
        self._pages: dict[int, int] = {}  # hash -> its tiers (TIER_BIT mask)
        self.resyncs = 0

    @property
    def pages(self) -> dict[int, str]:
        """hash -> the page's fastest tier."""
        return {h: fastest_tier(mask) for h, mask in self._pages.items()}

    def tiers(self) -> set[tuple[int, str]]:
        """Every tier of every page: {(hash, tier)}."""
        return {(h, t) for h, mask in self._pages.items() for t in tier_names(mask)}

    def reset(self, snapshot: dict) -> None:
        self.seq = int(snapshot["seq"])
        self.page_size = int(snapshot["page_size"])
        self._pages = {}
        for h, t in snapshot["pages"]:
            _store(self._pages, [int(h)], str(t))
        self.resyncs += 1

    def apply(self, events: Sequence[KVEvent]) -> bool:
        events = [e for e in events if e.seq > self.seq]  # replays of what was applied are harmless
        if events and events[0].seq != self.seq + 1:
            return False
        for e in events:
            if e.kind == "stored":
                _store(self._pages, e.hashes, e.tier)  # type: ignore[arg-type]
            else:
                _remove(self._pages, e.hashes, e.tier)
            self.seq = e.seq
        return True


def _store(pages: dict[int, int], hashes: Sequence[int], tier: str) -> None:
    bit = TIER_BIT[tier]
    for h in hashes:
        pages[h] = pages.get(h, 0) | bit


def _remove(pages: dict[int, int], hashes: Sequence[int], tier: Optional[str]) -> None:
    keep = 0 if tier is None else ~TIER_BIT[tier]
    for h in hashes:
        mask = pages.get(h, 0) & keep
        if mask:
            pages[h] = mask
        else:
            pages.pop(h, None)
