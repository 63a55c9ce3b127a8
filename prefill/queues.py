"""The prefill worker's transfer stages (the prompt itself runs in the scheduler's own waiting queue).

    [BootstrapQueue  --(decode registered the room)-->]  ComputingQueue (scheduler.waiting / chunked prefill)
    scheduler extend + first token  --(sender.send)-->  InflightQueue  --(Success | Failed)--> done

``BootstrapQueue`` is only used with ``--disaggregation-prefill-wait-for-room``;
by default a request computes at once and its sender waits for decode's
registration after ``send`` (``KVSender``'s contract allows it).

The queues only *poll* the transfer layer; they never free KV slots
themselves.  They hand back entries whose transfer reached a state the
scheduler must act on, and the scheduler frees or caches the slots (see
``kvship.prefill.scheduler``).  Everything here runs on the scheduler thread.
"""

from __future__ import annotations

import numpy as np

from kvship.engine.disagg import AuxInfo, KVPoll, KVTransferError
from kvship.engine.disagg.stages import PDEntry, PDStageQueue


def unregistered_rooms(*queues: PDStageQueue) -> int:
    """Entries of ``queues`` whose room decode has not registered yet (read from the senders' stamps)."""
    return sum("registered" not in e.transfer.stamps for q in queues for e in q.entries.values())


class BootstrapQueue(PDStageQueue):
    """Stage 1 (``--disaggregation-prefill-wait-for-room`` only): a sender exists for the room; decode has
    not registered its pages yet, and the prompt waits for it before computing.

    ``pop_ready`` returns the entries decode has registered (``WaitingForInput``)
    and those that failed (bootstrap timeout, decode gone, aborted) in
    arrival order.  An entry holds no KV slots in this stage.
    """

    def pop_ready(self) -> tuple[list[PDEntry], list[PDEntry]]:
        """(registered, failed) entries, both removed from the queue."""
        ready, failed = [], []
        for rid, entry in list(self.entries.items()):
            state = entry.transfer.poll()
            if state == KVPoll.Bootstrapping:
                continue
            del self.entries[rid]
            (failed if state == KVPoll.Failed else ready).append(entry)
        return ready, failed


class ComputingQueue(PDStageQueue):
    """Stage 2: the prompt waits for or runs its extends in the scheduler's queues; the room's sender
    exists and decode may not have registered yet.

    ``pop_failed`` returns (and removes) the entries whose sender failed meanwhile (decode aborted or died,
    bootstrap timeout), so their prompts stop computing; the scheduler aborts them like any computing
    request, since the transfer layer never touches their pages.
    """


class InflightQueue(PDStageQueue):
    """Stage 3: the prompt's KV and the first token are on their way to decode.

    ``add`` calls ``sender.send`` (the transfer threads do the work, once decode
    has registered the room); ``pop_done`` returns the entries whose sender
    reached ``Success`` or ``Failed``: only then may their pages be freed or
    cached.  A room decode never registers fails at the bootstrap timeout.
    """

    def add(self, entry: PDEntry, pages: np.ndarray, aux: AuxInfo) -> None:
        self.put(entry)
        try:
            entry.transfer.send(pages, aux)
        except KVTransferError as e:  # send() twice is a bug; fail the room rather than the loop
            entry.transfer.abort(f"cannot send: {e}")
