"""Keeping the replicated schedulers of a tensor-parallel worker in lock step.

Every rank runs the same scheduler loop over the same (sharded) model; they
stay identical because they see the same inputs in the same order:

* ``BroadcastInbox``: rank 0's inbox.  Each ``recv`` rank 0 drains what HTTP
  handlers queued (submits, aborts) and broadcasts that list over the host
  (gloo) group; the other ranks block in the broadcast and handle the same
  list.  Rank 0 broadcasts at least every idle wait of the loop, so an idle
  worker's ranks still meet (and notice a dead rank) several times a second.
  When rank 0's loop exits, ``close`` broadcasts ``StopRanks`` and the others
  leave their loops; on rank 0 it calls ``on_stop`` too (its engine stops
  counting as alive before the loop aborts the open requests).
* ``RankZeroSampler``: rank 0's sampled ids are the truth.  Logits are the
  same on every rank (all-gathered), and so are the seeds, so every rank
  draws the same ids; broadcasting rank 0's makes that hold even where a
  sampling kernel is not bit-reproducible.

* ``LockstepGrammarQueue``: only rank 0 compiles grammars; when a compile
  ends, rank 0 queues ``GrammarReady`` (the serialized grammar, or the error)
  into its inbox and every rank admits the request at the step that
  broadcasts it.  No rank waits for a compile.

``make_scheduler_tensor_parallel(scheduler, tp, on_stop)`` installs all three
(the scheduler's ``inbox``, ``launcher.sampler`` and ``grammar_queue`` are
replaceable parts, swapped before its loop starts).
Contract: only the scheduler thread calls ``drain`` and ``close`` (the one
thread that runs collectives); ``put`` may come from any thread, on rank 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from kvship.engine.grammar.backend import LockstepGrammarQueue
from kvship.engine.parallel.group import RankLost, TPGroup
from kvship.engine.scheduler.inbox import GrammarReady, Inbox, Message

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StopRanks:
    """Rank 0's loop has exited: the other ranks leave theirs."""

    reason: str


class BroadcastInbox:
    """The scheduler inbox of a tensor-parallel rank (see the module docstring)."""

    def __init__(self, tp: TPGroup, on_stop: Callable[[], None]):
        self.tp = tp
        self.local = Inbox()
        self._on_stop = on_stop
        self._closed = False

    def put(self, msg: Message) -> None:
        self.local.put(msg)

    def get(self, block_s: float = 0.0) -> Optional[Message]:
        """A local message (this rank's own queue, no collective)."""
        return self.local.get(block_s)

    def empty(self) -> bool:
        return self.local.empty()

    def wake(self) -> None:
        self.local.wake()

    def drain(self, block_s: float = 0.0) -> list[Message]:
        """This step's messages, the same on every rank (a collective)."""
        if self.tp.is_leader:
            msgs = self.local.drain(block_s)
            self.tp.broadcast_object(msgs)
            return msgs
        msgs = self.tp.broadcast_object(None)
        if isinstance(msgs, StopRanks):
            logger.info("rank 0 stopped (%s): leaving the loop", msgs.reason)
            self._on_stop()
            return []
        return msgs

    def close(self, reason: str = "server is shutting down") -> None:
        self.local.close()
        if self.tp.is_leader and not self._closed:
            self._closed = True
            try:
                self.tp.broadcast_object(StopRanks(reason))
            except (Exception, RankLost) as e:  # noqa: BLE001 - a rank is gone already: nothing to tell it
                logger.warning("could not tell the other ranks to stop: %s", e)
            # the loop has ended: the worker is no longer alive before its open requests get their abort,
            # so a streaming client (a router) sees "the model loop died" and resumes them elsewhere
            self._on_stop()


class RankZeroSampler:
    """Wraps a sampler: every rank returns rank 0's sampled ids."""

    def __init__(self, inner: Any, tp: TPGroup):
        self.inner = inner
        self.tp = tp

    def __call__(self, logits: torch.Tensor, info: Any) -> Any:
        out = self.inner(logits, info)
        self.tp.broadcast_(out.next_token_ids)
        return out


def make_scheduler_tensor_parallel(scheduler: Any, tp: TPGroup, on_stop: Callable[[], None]) -> None:
    """Install the broadcast inbox, rank 0's sampling and the lock-step grammar queue on ``scheduler``
    (before its loop starts)."""
    inbox = scheduler.inbox = BroadcastInbox(tp, on_stop)
    scheduler.launcher.sampler = RankZeroSampler(scheduler.launcher.sampler, tp)
    scheduler.grammar_queue = LockstepGrammarQueue(
        scheduler.grammar,
        leader=tp.is_leader,
        publish=lambda rid, serialized, error: inbox.put(GrammarReady(rid, serialized, error)),
    )
