"""The drafter interface the ``Speculator`` drives (docs/speculative.md).

A drafter proposes one ``DraftTree`` per request and round; the target's
verify decides what is kept, so a drafter can never change the output, only
the acceptance length.  Contract:

* ``k``: the most draft nodes (below the root) a tree of this drafter has; on
  CUDA the verify graphs are captured for trees of ``k + 1`` slots.
* ``attach(target_runner)``: called once by the ``Speculator`` with the
  target's ``ModelRunner`` before the first round.
* ``transfer_features(target_runner)``: on a decode worker, before the
  scheduler (and ``attach``): the per-KV-slot buffer the PD transfer layer
  fills for the prompt's slots (``SlotFeatures``), or None when the drafter
  needs nothing of the prompt but its tokens.
* ``draft_trees(reqs)``: one tree per request, in order; the root of a tree is the
  request's newest token (``req.fill_ids[-1]``), whose K/V is not cached yet.
* ``release_missing(open_rids)``: drop per-request state (rows, KV) of every
  request not in ``open_rids``; the ``Speculator`` calls it at each round's
  start, so finished and aborted requests give their drafter state back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Optional

from kvship.decode.spec.tree import DraftTree

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.disagg.base import SlotFeatures
    from kvship.engine.schedule_batch import Req


class Drafter(ABC):
    k: int

    def attach(self, target_runner: Any) -> None:
        """Nothing by default: drafters that read only the token sequence need no part of the target."""

    def transfer_features(self, target_runner: Any) -> Optional["SlotFeatures"]:
        """None by default: the prompt's tokens are all such a drafter needs from prefill."""
        return None

    @abstractmethod
    def draft_trees(self, reqs: list["Req"]) -> list[DraftTree]: ...

    @abstractmethod
    def release_missing(self, open_rids: set[str]) -> None: ...


class SequenceDrafter(Drafter):
    """A drafter that looks at one request's token sequence at a time (n-gram, a draft model)."""

    def draft_trees(self, reqs: list["Req"]) -> list[DraftTree]:
        return [self.propose_for(r.rid, r.fill_ids) for r in reqs]

    @abstractmethod
    def propose_for(self, rid: str, seq: list[int]) -> DraftTree:
        """The draft below ``seq[-1]``."""
