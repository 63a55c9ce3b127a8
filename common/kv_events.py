"""The KV-event wire format shared by workers and the router: the page hash chain and one event.

A page is named by a BLAKE2b-64 hash of its parent page's name and its own token ids, so a router can compute the
names of a prompt's pages without the worker (docs/cache.md, "KV events").  Pure Python: the router imports it
without the engine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

TIERS = ("gpu", "host")  # fastest first
TIER_BIT = {t: 1 << i for i, t in enumerate(TIERS)}  # a page's set of tiers as a bit mask


def tier_names(mask: int) -> list[str]:
    """The tiers of a mask of ``TIER_BIT`` values, fastest first."""
    return [t for t in TIERS if mask & TIER_BIT[t]]


def fastest_tier(mask: int) -> str:
    """The fastest tier of a non-empty mask (a page on the GPU and on the host is used from the GPU)."""
    return tier_names(mask)[0]


def _h(parent: int, tokens: Sequence[int]) -> int:
    data = parent.to_bytes(8, "little", signed=True) + b"".join(
        int(t).to_bytes(4, "little", signed=True) for t in tokens
    )
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def page_hashes(tokens: Sequence[int], page_size: int, parent: int = 0) -> list[int]:
    """The hash chain of the whole pages of ``tokens`` (a partial last page has no name), after ``parent``."""
    out = []
    for i in range(0, len(tokens) // page_size * page_size, page_size):
        parent = _h(parent, tokens[i : i + page_size])
        out.append(parent)
    return out


@dataclass(frozen=True)
class KVEvent:
    """``kind``: ``stored`` (the pages are now on ``tier`` too: a page may be on several tiers) or ``removed``
    (the pages left ``tier``, or the cache when ``tier`` is None)."""

    seq: int
    kind: str
    hashes: tuple[int, ...]
    tier: Optional[str] = None

    def to_json(self) -> dict:
        out = {"seq": self.seq, "kind": self.kind, "hashes": list(self.hashes)}
        if self.tier is not None:
            out["tier"] = self.tier
        return out

    @classmethod
    def from_json(cls, d: dict) -> "KVEvent":
        kind = d.get("kind")
        if kind not in ("stored", "removed"):
            raise ValueError(f"unknown KV event kind {kind!r}")
        tier = d.get("tier")
        if kind == "stored" and tier not in TIERS:
            raise ValueError(f"a stored KV event needs a tier in {TIERS}, got {tier!r}")
        if kind == "removed" and tier is not None and tier not in TIERS:
            raise ValueError(f"a removed KV event's tier must be in {TIERS} or absent, got {tier!r}")
        return cls(int(d["seq"]), kind, tuple(int(h) for h in d["hashes"]), tier)
