"""The scheduler's I/O, chosen when the scheduler is built: one rank, or a rank of a multi-rank worker.

A ``SchedulerIO`` makes the three parts through which a scheduler meets the
outside world: its inbox (what each step handles), its sampler (whose ids
are the truth) and its grammar queue (when a constrained request may start).
``Scheduler(..., io=...)`` builds them once in its constructor; they are
fixed afterwards (``Scheduler`` refuses to have them replaced).

* ``LocalIO`` (one rank): a plain ``Inbox``, the sampler as it is, a
  ``GrammarQueue`` that admits a request when its own compile ends.
* ``BroadcastIO(comm, on_stop)`` (every rank of a TP worker; ``comm`` is the
  TP communicator): the replicated schedulers stay identical because they
  see the same inputs in the same order.

  - ``BroadcastInbox``: each ``drain`` rank 0 (the leader) takes what HTTP
    handlers queued (submits, aborts, ``GrammarReady``) and broadcasts the
    list over the host group; the others block in the broadcast and handle
    the same list.  Rank 0 broadcasts at least every idle wait of the loop,
    so an idle worker's ranks still meet (and notice a dead rank) several
    times a second.  ``close`` on rank 0 broadcasts ``StopRanks`` and the
    others leave their loops; ``on_stop`` runs on every rank (the engine
    stops counting as alive before the loop aborts the open requests).
  - ``RankZeroSampler``: rank 0's sampled ids are broadcast.  Logits and
    seeds are the same on every rank, so this only guards against sampling
    kernels that are not bit-reproducible.
  - ``LockstepGrammarQueue``: only rank 0 compiles; its ``GrammarReady``
    goes through the inbox, so every rank admits the request at one step.

* ``PipelineIO(link, tp, on_stop)`` (every rank of a worker with
  ``--pp-size`` > 1; ``link`` is the rank's ``StageLink``): every rank of
  every stage runs the same scheduler on the same inputs, so the stages
  agree on every micro-batch without further messages.

  - ``PipelineInbox``: each ``drain`` the leader sends its list to every
    other rank without waiting (``StageLink.send_inbox``); the others
    receive it.  A stage busy with an earlier micro-batch thus never holds
    the leader up.  ``StopRanks`` as in ``BroadcastInbox`` (it also marks
    the link ``stopped``: the rest of that step is skipped).
  - the sampler of the last stage is ``RankZeroSampler`` over its TP group
    (the other stages never sample: their steps are resolved with the last
    stage's results, ``kvship.engine.scheduler.pipeline``).
  - ``LockstepGrammarQueue`` led by the leader, through the inbox.

  ``pipeline()`` returns the link: the scheduler then runs its
  ``PipelineLoop``.

Contract: only the scheduler thread calls ``drain`` and ``close`` (the one
thread that runs collectives); ``put`` may come from any thread, on rank 0.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from kvship.engine.grammar.backend import GrammarBackend, GrammarQueue, LockstepGrammarQueue
from kvship.engine.scheduler.inbox import GrammarReady, Inbox, Message

if TYPE_CHECKING:
    from kvship.engine.distributed.communicator import Communicator
    from kvship.engine.distributed.pipeline import StageLink

logger = logging.getLogger(__name__)


class SchedulerIO(ABC):
    """Makes a scheduler's inbox, sampler and grammar queue (called once, from its constructor)."""

    @abstractmethod
    def make_inbox(self) -> Any:
        """An object with ``Inbox``'s interface (put, get, drain, empty, wake, close)."""

    @abstractmethod
    def wrap_sampler(self, sampler: Any) -> Any:
        """The sampler the launcher calls: ``(logits, info) -> SampleOutput``."""

    @abstractmethod
    def make_grammar_queue(self, backend: GrammarBackend, inbox: Any) -> GrammarQueue:
        """The queue constrained requests wait in until their grammar is ready."""

    def pipeline(self) -> Optional["StageLink"]:
        """The rank's pipeline link when the worker has several stages (the scheduler runs its
        ``PipelineLoop``), else None."""
        return None


class LocalIO(SchedulerIO):
    """One rank: nothing to agree on."""

    def make_inbox(self) -> Inbox:
        return Inbox()

    def wrap_sampler(self, sampler: Any) -> Any:
        return sampler

    def make_grammar_queue(self, backend: GrammarBackend, inbox: Any) -> GrammarQueue:
        return GrammarQueue(backend)


@dataclass(frozen=True)
class StopRanks:
    """Rank 0's loop has exited: the other ranks leave theirs."""

    reason: str


class BroadcastInbox:
    """The inbox of a TP rank (module docstring)."""

    def __init__(self, comm: "Communicator", on_stop: Callable[[], None]):
        self.comm = comm
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
        if self.comm.is_leader:
            msgs = self.local.drain(block_s)
            self.comm.broadcast_object(msgs)
            return msgs
        msgs = self.comm.broadcast_object(None)
        if isinstance(msgs, StopRanks):
            logger.info("rank 0 stopped (%s): leaving the loop", msgs.reason)
            self._on_stop()
            return []
        return msgs

    def close(self, reason: str = "server is shutting down") -> None:
        from kvship.engine.distributed.communicator import RankLost

        self.local.close()
        if self.comm.is_leader and not self._closed:
            self._closed = True
            try:
                self.comm.broadcast_object(StopRanks(reason))
            except (Exception, RankLost) as e:  # noqa: BLE001 - a rank is gone already: nothing to tell it
                logger.warning("could not tell the other ranks to stop: %s", e)
            # the loop has ended: the worker is no longer alive before its open requests get their abort,
            # so a streaming client (a router) sees "the model loop died" and resumes them elsewhere
            self._on_stop()


class RankZeroSampler:
    """Wraps a sampler: every rank returns rank 0's sampled ids."""

    def __init__(self, inner: Any, comm: "Communicator"):
        self.inner = inner
        self.comm = comm

    @property
    def generator(self) -> torch.Generator:
        """The inner sampler's shared generator (rank 0's speculator draws its acceptances from it)."""
        return self.inner.generator

    def __call__(self, logits: torch.Tensor, info: Any) -> Any:
        out = self.inner(logits, info)
        self.comm.broadcast(out.next_token_ids)
        return out


class BroadcastIO(SchedulerIO):
    """Every rank of a TP worker (module docstring); ``comm`` is the TP communicator."""

    def __init__(self, comm: "Communicator", on_stop: Callable[[], None]):
        self.comm = comm
        self.on_stop = on_stop

    def make_inbox(self) -> BroadcastInbox:
        return BroadcastInbox(self.comm, self.on_stop)

    def wrap_sampler(self, sampler: Any) -> RankZeroSampler:
        return RankZeroSampler(sampler, self.comm)

    def make_grammar_queue(self, backend: GrammarBackend, inbox: Any) -> GrammarQueue:
        return LockstepGrammarQueue(
            backend,
            leader=self.comm.is_leader,
            publish=lambda rid, serialized, error: inbox.put(GrammarReady(rid, serialized, error)),
        )


class PipelineInbox(BroadcastInbox):
    """The inbox of a rank of a pipeline-parallel worker (module docstring)."""

    def __init__(self, link: "StageLink", on_stop: Callable[[], None]):
        super().__init__(link.world, on_stop)
        self.link = link

    def drain(self, block_s: float = 0.0) -> list[Message]:
        """This step's messages, the same on every rank (the leader sends, the others receive)."""
        if self.link.is_leader:
            msgs = self.local.drain(block_s)
            self.link.send_inbox(msgs)
            return msgs
        msgs = self.link.recv_inbox()
        if isinstance(msgs, StopRanks):
            logger.info("rank 0 stopped (%s): leaving the loop", msgs.reason)
            self.link.stopped = True
            self._on_stop()
            return []
        return msgs

    def close(self, reason: str = "server is shutting down") -> None:
        from kvship.engine.distributed.communicator import RankLost

        self.local.close()
        if self.link.is_leader and not self._closed:
            self._closed = True
            try:
                self.link.send_inbox(StopRanks(reason))
                self.link.flush()
            except (Exception, RankLost) as e:  # noqa: BLE001 - a rank is gone already: nothing to tell it
                logger.warning("could not tell the other ranks to stop: %s", e)
            self._on_stop()


class PipelineIO(SchedulerIO):
    """Every rank of a pipeline-parallel worker (module docstring); ``tp``: the rank's TP communicator."""

    def __init__(self, link: "StageLink", tp: Optional["Communicator"], on_stop: Callable[[], None]):
        self.link = link
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.on_stop = on_stop

    def make_inbox(self) -> PipelineInbox:
        return PipelineInbox(self.link, self.on_stop)

    def wrap_sampler(self, sampler: Any) -> Any:
        return sampler if self.tp is None else RankZeroSampler(sampler, self.tp)

    def make_grammar_queue(self, backend: GrammarBackend, inbox: Any) -> GrammarQueue:
        return LockstepGrammarQueue(
            backend,
            leader=self.link.is_leader,
            publish=lambda rid, serialized, error: inbox.put(GrammarReady(rid, serialized, error)),
        )

    def pipeline(self) -> "StageLink":
        return self.link


def scheduler_io(
    comm: Optional["Communicator"], on_stop: Callable[[], None], link: Optional["StageLink"] = None
) -> SchedulerIO:
    """``PipelineIO`` when the worker has pipeline stages (``link``: the model runner's ``pipeline``), else
    ``BroadcastIO`` over ``comm`` (a TP communicator of several ranks), else ``LocalIO``."""
    if link is not None:
        return PipelineIO(link, comm, on_stop)
    return LocalIO() if comm is None or comm.size == 1 else BroadcastIO(comm, on_stop)
