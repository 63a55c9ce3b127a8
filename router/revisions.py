"""Revisions: which workers may be paired, and which set takes new requests (docs/router.md, "Revisions").

A worker's *revision* names everything that must match between a prefill and
a decode worker (weights, dtypes, engine): the pod label ``kvship.io/revision``
for discovered workers, else the ``revision`` of the worker's
``/get_server_info`` (its ``--revision``, else its model fingerprint).  A
worker that reports none (an older worker) is in the revision ``None``.

Rules, applied per requested model (the workers that serve it):

* a PD pair is always a prefill and a decode worker of one revision;
* a revision is *ready* when each role the router dispatches to (prefill and
  decode, or unified) has an available worker of it;
* the *serving* revision is the newest ready one, newest meaning most
  recently first seen (``RevisionOrder``): a rollout's new revision takes the
  traffic as soon as both its roles are ready, older revisions get no new
  requests and drain (their in-flight requests finish where they are);
* when the serving revision stops being ready (its last prefill worker
  failed), the next newest ready revision serves.

``RevisionOrder`` forgets a revision when its last worker leaves, so a
revision that comes back (a rollback) counts as new again.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

if TYPE_CHECKING:
    from kvship.router.worker import Worker


@dataclass(frozen=True)
class Seen:
    """When a revision was first seen: wall-clock time and a sequence number (the order)."""

    at: float
    seq: int


class RevisionOrder:
    """Revision -> when it was first seen, kept in step with the registered workers by ``sync``."""

    def __init__(self) -> None:
        self._seen: dict[Optional[str], Seen] = {}
        self._seq = itertools.count()

    def sync(self, workers: Iterable["Worker"]) -> None:
        """Stamp revisions not seen before (in the order their workers were added); forget absent ones."""
        present: dict[Optional[str], None] = {}
        for w in sorted(workers, key=lambda w: w.added_at):
            if w.revision_known:
                present.setdefault(w.revision, None)
        for rev in list(self._seen):
            if rev not in present:
                del self._seen[rev]
        now = time.time()
        for rev in present:
            if rev not in self._seen:
                self._seen[rev] = Seen(now, next(self._seq))

    def seen(self, revision: Optional[str]) -> Optional[Seen]:
        return self._seen.get(revision)

    def ordered(self) -> list[Optional[str]]:
        """Known revisions, oldest first."""
        return sorted(self._seen, key=lambda r: self._seen[r].seq)

    def serving(self, available: dict[str, list["Worker"]]) -> Optional[str]:
        """The newest revision that has a worker of every role in ``available`` (role -> available
        workers), or None when no revision is ready.  ``ready_revisions`` lists the candidates."""
        ready = self.ready_revisions(available)
        return ready[-1] if ready else None

    def ready_revisions(self, available: dict[str, list["Worker"]]) -> list[Optional[str]]:
        """Revisions having an available worker of every role in ``available``, oldest first."""
        per_role = [{w.revision for w in ws} for ws in available.values()]
        if not per_role:
            return []
        common = set.intersection(*per_role)
        return [r for r in self.ordered() if r in common]


def describe_revisions(available: dict[str, list["Worker"]]) -> str:
    """``rev a: 1 prefill, 0 decode; rev b: ...`` (for a 503 saying why no revision is ready)."""
    counts: dict[Optional[str], dict[str, int]] = {}
    for role, ws in available.items():
        for w in ws:
            counts.setdefault(w.revision, {r: 0 for r in available})[role] += 1
    if not counts:
        return "no available worker"
    return "; ".join(
        f"revision {rev or '(none)'}: " + ", ".join(f"{n} {role}" for role, n in c.items()) for rev, c in counts.items()
    )
