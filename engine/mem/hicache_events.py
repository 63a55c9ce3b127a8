"""KV events: what a worker's prefix cache holds, page by page, for the router (docs/cache.md, "KV events").

Pages are named by a **hash chain** of their tokens: ``h(page i) = H(h(page
i-1) || tokens of page i)`` with ``h(page -1) = 0`` and ``H`` the first 8
bytes of BLAKE2b over the little-endian int64 parent hash and int32 tokens,
read as a signed int64.  Anyone who knows a prompt and the worker's page size
computes the same names (``page_hashes``), so the router can ask "how many
leading pages of this prompt does worker W hold, and on which tier".

``KVEventLog`` is the worker side.  The radix cache calls ``stored(hashes,
tier)`` when pages enter a tier (``gpu`` or ``host``; a page moving between
tiers is stored again with its new tier) and ``removed(hashes)`` when they
leave the cache.  Each call becomes one event with the next sequence number
(1, 2, ...).  The log keeps the latest ``capacity`` events and the current
set of pages:

* ``since(seq)`` -> the events after ``seq``, or None when some of them
  were already dropped (the subscriber must resync from a snapshot);
* ``snapshot()`` -> ``{"seq", "page_size", "pages": [[hash, tier], ...]}``:
  the state after event ``seq`` (apply only events after it).

Thread rule: the scheduler thread writes; any thread may read (one lock).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Optional, Sequence

from kvship.common.kv_events import TIERS, KVEvent, page_hashes  # noqa: F401 (re-exported)


class KVEventLog:
    """The worker's event log and page set (see the module docstring)."""

    def __init__(self, page_size: int, capacity: int = 4096):
        if capacity < 1:
            raise ValueError("the KV event log must keep at least one event")
        self.page_size = page_size
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._pages: dict[int, str] = {}
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
            for h in hashes:
                self._pages[h] = tier
            self._append("stored", hashes, tier)

    def removed(self, hashes: Sequence[int]) -> None:
        if not hashes:
            return
        with self._lock:
            for h in hashes:
                self._pages.pop(h, None)
            self._append("removed", hashes, None)

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
                "pages": [[h, t] for h, t in self._pages.items()],
            }

    def pages(self) -> dict[int, str]:
        """The current page set (a copy): hash -> tier."""
        with self._lock:
            return dict(self._pages)


class KVEventMirror:
    """A subscriber's copy of one worker's page set, kept by applying events in order.

    ``apply(events)`` returns False (and applies nothing) when the first event is not the next sequence
    number: a gap; call ``reset(snapshot)`` and go on from ``snapshot["seq"]``.
    """

    def __init__(self) -> None:
        self.seq = 0
        self.page_size: Optional[int] = None
        self.pages: dict[int, str] = {}
        self.resyncs = 0

    def reset(self, snapshot: dict) -> None:
        self.seq = int(snapshot["seq"])
        self.page_size = int(snapshot["page_size"])
        self.pages = {int(h): str(t) for h, t in snapshot["pages"]}
        self.resyncs += 1

    def apply(self, events: Sequence[KVEvent]) -> bool:
        events = [e for e in events if e.seq > self.seq]  # replays of what was applied are harmless
        if events and events[0].seq != self.seq + 1:
            return False
        for e in events:
            if e.kind == "stored":
                for h in e.hashes:
                    self.pages[h] = e.tier  # type: ignore[assignment]
            else:
                for h in e.hashes:
                    self.pages.pop(h, None)
            self.seq = e.seq
        return True
