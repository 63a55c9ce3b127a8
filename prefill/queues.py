"""The prefill worker's two transfer stages (the middle stage is the scheduler's own waiting queue).

    BootstrapQueue  --(decode registered the room)-->  scheduler.waiting / chunked prefill
    scheduler extend + first token  --(sender.send)-->  InflightQueue  --(Success | Failed)--> done

Both queues only *poll* the transfer layer; they never free KV slots
themselves.  They hand back entries whose transfer reached a state the
scheduler must act on, and the scheduler frees or caches the slots (see
``kvship.prefill.scheduler``).  Everything here runs on the scheduler thread.
"""

from __future__ import annotations

import numpy as np

from kvship.engine.disagg import AuxInfo, KVManager, KVPoll, KVTransferError
from kvship.engine.disagg.stages import PDEntry, PDStageQueue
from kvship.engine.schedule_batch import Req


class BootstrapQueue(PDStageQueue):
    """Stage 1: a sender exists for the room; decode has not registered its pages yet.

    ``pop_ready`` returns the entries decode has registered (``WaitingForInput``)
    and those that failed (bootstrap timeout, decode gone, aborted) in
    arrival order.  An entry holds no KV slots in this stage.
    """

    def __init__(self, manager: KVManager):
        super().__init__()
        self.manager = manager

    def add(self, req: Req, room: int) -> PDEntry:
        """Create the room's sender; raises ``KVTransferError`` (e.g. the room is already in use)."""
        return self.put(PDEntry(req=req, transfer=self.manager.create_sender(room), room=room))

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


class InflightQueue(PDStageQueue):
    """Stage 3: the prompt's KV and the first token are on their way to decode.

    ``add`` calls ``sender.send`` (the transfer threads do the work);
    ``pop_done`` returns the entries whose sender reached ``Success`` or
    ``Failed``: only then may their pages be freed or cached.
    """

    def add(self, entry: PDEntry, pages: np.ndarray, aux: AuxInfo) -> None:
        self.put(entry)
        try:
            entry.transfer.send(pages, aux)
        except KVTransferError as e:  # send() twice is a bug; fail the room rather than the loop
            entry.transfer.abort(f"cannot send: {e}")
