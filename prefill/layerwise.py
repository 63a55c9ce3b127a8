"""Layer-wise KV transfer on the prefill worker: the ``ForwardWatch`` of an extend batch (docs/pd.md, "Layer-wise
transfer").

``start()`` runs once the batch's KV slots are allocated, right before the model: every request whose last chunk
computes in this batch starts its transfer layer-wise (``KVSender.send_layerwise``, one ``LayerProgress`` for the
batch; a room decode registers later starts then, with every layer stored by that time) and moves from the role's
``ComputingQueue`` to its ``InflightQueue`` at once, since from then on the transfer layer reads its pages: an
abort there waits for the sender's terminal state before the slots are freed.  The pages before the chunk's first
token (earlier chunks, cached prefix) are complete and go first.  ``end(ok)`` tells the progress that the model
returned or raised; after a raise the scheduler fails the batch and the role's ``abort`` takes these requests out
of the compute queues (their KV is incomplete: freed, not cached).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from kvship.engine.disagg.layerwise import LayerProgress
from kvship.engine.disagg.stages import request_pages
from kvship.engine.schedule_batch import ScheduleBatch

if TYPE_CHECKING:  # pragma: no cover
    from kvship.prefill.scheduler import PrefillRole


class LayerwiseWatch:
    """One extend batch of a prefill worker (see the module docstring)."""

    def __init__(self, role: "PrefillRole", batch: ScheduleBatch):
        self.role = role
        self.batch = batch
        self.progress: Optional[LayerProgress] = None

    def start(self) -> Optional[Callable[[int], None]]:
        role, s = self.role, self.role.s
        progress = LayerProgress(role.num_layers, s.device)
        for req, prefix_len, sampled in zip(self.batch.reqs, self.batch.prefix_lens, self.batch.sample_mask):
            entry = role.computing.get(req.rid) if sampled else None  # not sampled: an earlier chunk
            if entry is None:
                continue
            n = len(req.origin_input_ids)
            if n < role.layerwise_min_tokens:  # short: the whole send after the forward costs less
                continue
            pages = request_pages(s.req_to_token_pool.read_host(req.req_pool_idx, 0, n), s.page_size)
            if not entry.transfer.send_layerwise(pages, prefix_len // s.page_size, progress):
                continue
            role.computing.remove(req.rid)
            entry.extra["computed"] = False
            role.inflight_queue.put(entry)
            self.progress = progress
        return None if self.progress is None else self.progress.layer_done

    def end(self, ok: bool) -> None:
        if self.progress is not None:
            if ok:
                self.progress.finish()
            else:
                self.progress.abandon()
