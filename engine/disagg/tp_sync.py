"""The transfer layer of a tensor-parallel PD worker: one manager per rank, one verdict per room.

Every rank of a prefill or decode worker at ``--tp-size`` > 1 runs its own
``KVManager`` over its own KV pool (its KV heads only; docs/parallel.md, "PD
with tensor parallelism"), and its replicated scheduler creates the same
senders / receivers in the same order.  The ranks' transfers progress at
their own pace, but the schedulers must move a request between stages on the
same step, or their KV allocations drift apart.  ``TPKVManager`` wraps the
rank's manager so that ``poll()`` is a collective over the ranks' host group
(``Communicator.all_gather_object``) and returns the same state on every rank:

* every rank terminal: ``Success`` if all succeeded, else ``Failed`` (with the
  first failing rank's reason);
* some rank ``Failed``, others still moving: the others are aborted and the
  state stays the slowest non-terminal one until every rank is terminal, so no
  rank frees pages a transfer may still write;
* otherwise the slowest rank's state (``Bootstrapping`` < ... < ``Transferring``).

A prefill manager also shares its bootstrap address with the other ranks at
construction (rank 0's ``Welcome`` lists them all).

Contract: ``poll()`` is called by the scheduler thread of every rank in the
same order (the stage queues guarantee it); ``send``, ``send_layerwise``,
``init`` and ``abort`` are local (ranks may differ in whether a room goes
layer-wise: each rank's writes are complete either way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from kvship.engine.disagg.base import AuxInfo, KVManager, KVPoll, KVReceiver, KVSender

if TYPE_CHECKING:
    from kvship.engine.disagg.layerwise import LayerProgress
    from kvship.engine.distributed.communicator import Communicator


def agree(states: Sequence[tuple[int, Optional[str]]]) -> tuple[KVPoll, Optional[str], Optional[str]]:
    """(state every rank reports, its failure reason, why a still-moving rank must abort) from each
    rank's ``(local state, local failure reason)``."""
    polls = [KVPoll(s) for s, _ in states]
    failed = [(rank, reason) for rank, (s, reason) in enumerate(states) if s == KVPoll.Failed]
    why = None
    if failed:
        rank, reason = failed[0]
        why = f"tensor-parallel rank {rank}: {reason or 'transfer failed'}"
    if all(p.is_terminal for p in polls):
        return (KVPoll.Success, None, None) if not failed else (KVPoll.Failed, why, None)
    return min(p for p in polls if not p.is_terminal), None, why


class TPTransfer(KVSender, KVReceiver):
    """One rank's sender or receiver whose ``poll()`` agrees with the other ranks'."""

    def __init__(self, inner: Any, tp: "Communicator"):
        self.inner = inner
        self.tp = tp
        self.room = inner.room
        self._reason: Optional[str] = None
        self._aborted = False

    def poll(self) -> KVPoll:
        local = self.inner.poll()
        mine = (int(local), self.inner.failure_reason if local == KVPoll.Failed else None)
        state, reason, abort_why = agree(self.tp.all_gather_object(mine))
        if abort_why is not None and not local.is_terminal and not self._aborted:
            self._aborted = True
            self.inner.abort(f"another rank's transfer failed ({abort_why})")
        if state == KVPoll.Failed:
            self._reason = reason
        return state

    def send(self, src_pages: Sequence[int], aux: AuxInfo) -> None:
        self.inner.send(src_pages, aux)

    def send_layerwise(self, src_pages: Sequence[int], ready_pages: int, progress: "LayerProgress") -> bool:
        return self.inner.send_layerwise(src_pages, ready_pages, progress)  # each rank decides for its own sender

    def init(self, dst_pages: Sequence[int]) -> None:
        self.inner.init(dst_pages)

    def abort(self, reason: str = "aborted") -> None:
        self.inner.abort(reason)

    @property
    def aux(self) -> Any:
        return self.inner.aux

    @property
    def stamps(self) -> dict:
        return self.inner.stamps

    @property
    def failure_reason(self) -> Optional[str]:
        return self._reason or self.inner.failure_reason


class TPKVManager(KVManager):
    """A rank's ``KVManager`` whose senders / receivers poll in agreement (see the module docstring)."""

    def __init__(self, inner: KVManager, tp: "Communicator"):
        self.inner = inner
        self.tp = tp
        self.role = inner.role
        self.config = inner.config
        if self.role == "prefill":  # a collective: every rank builds its manager at the same point
            mine = tuple(inner.rank_addresses[0])  # type: ignore[attr-defined]
            inner.rank_addresses = [tuple(a) for a in tp.all_gather_object(mine)]  # type: ignore[attr-defined]

    @property
    def bootstrap_port(self) -> Optional[int]:
        return self.inner.bootstrap_port

    @property
    def layout(self) -> Any:
        """This rank's ``KVLayout``."""
        return self.inner.layout  # type: ignore[attr-defined]

    def create_sender(self, room: int, token: Optional[str] = None) -> KVSender:
        return TPTransfer(self.inner.create_sender(room, token), self.tp)

    def create_receiver(
        self, bootstrap_host: str, bootstrap_port: int, room: int, token: Optional[str] = None
    ) -> KVReceiver:
        return TPTransfer(self.inner.create_receiver(bootstrap_host, bootstrap_port, room, token), self.tp)

    def set_progress_hook(self, hook: Optional[Callable[[], None]]) -> None:
        self.inner.set_progress_hook(hook)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.inner.close()
