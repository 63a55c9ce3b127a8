"""The decode worker's three stages before a request joins the running batch.

    PreallocQueue --(KV slots allocated, pages registered)--> TransferQueue
        --(Success: KV + aux arrived)--> PrebuiltQueue --(admit_prefilled)--> scheduler.running

The queues only poll the transfer layer and move entries; allocation and
freeing are the role's (``kvship.decode.scheduler``), which passes its
allocation function to ``PreallocQueue.allocate``.  Everything here runs on
the scheduler thread.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from kvship.engine.disagg import KVManager
from kvship.engine.disagg.stages import PDEntry, PDStageQueue, request_pages
from kvship.engine.schedule_batch import Req


class PreallocQueue(PDStageQueue):
    """Stage 1: a receiver exists for the room; the request waits for KV slots here.

    Entries are served first come, first served: ``allocate`` stops at the
    first request the scheduler cannot place, so a long prompt is not starved
    by shorter ones behind it.  An entry holds no KV slots in this stage.
    """

    def __init__(self, manager: KVManager):
        super().__init__()
        self.manager = manager

    def add(self, req: Req, host: str, port: int, room: int, token: Optional[str] = None) -> PDEntry:
        """Create the room's receiver (no network yet); raises ``KVTransferError`` if the manager is closed or the
        room token is missing / malformed while KV-plane authentication is on."""
        receiver = self.manager.create_receiver(host, port, room, token)
        return self.put(PDEntry(req=req, transfer=receiver, room=room))

    def allocate(self, alloc: Callable[[Req], Optional[torch.Tensor]], page_size: int) -> list[PDEntry]:
        """Place requests in arrival order with ``alloc`` (slots or None); register their pages.

        Returns the entries that got slots (now registered with prefill), removed from the queue.
        """
        moved = []
        for rid, entry in list(self.entries.items()):
            slots = alloc(entry.req)
            if slots is None:
                break
            del self.entries[rid]
            entry.transfer.init(request_pages(slots, page_size))
            moved.append(entry)
        return moved


class TransferQueue(PDStageQueue):
    """Stage 2: slots allocated and registered; prefill writes the KV and the aux record into them.

    ``pop_done`` returns the entries whose receiver reached ``Success`` or
    ``Failed``: only then may the scheduler free the slots of a failed one.
    """

    def add(self, entry: PDEntry) -> None:
        self.put(entry)


class PrebuiltQueue(PDStageQueue):
    """Stage 3 ("waiting"): the prompt's KV is in place and the first token known.

    The scheduler turns these into running requests (a prebuilt extend: no
    prompt compute) at the start of its next step.
    """

    def add(self, entry: PDEntry) -> None:
        self.put(entry)
