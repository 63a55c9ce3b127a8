"""Decode batches and retraction.

``DecodeBatcher.build`` returns one decode batch of every running request
after making sure its step can get KV slots: first by evicting the prefix
cache, then by retracting running requests one at a time, the one with the
least progress first.  A retracted request's computed KV goes to the prefix
cache and it returns to the front of the waiting queue, to be recomputed
(mostly from the cache) later.  A request that cannot decode even alone is
finished with an abort naming the pool size.

With ``busy`` (the pipeline loop: requests of batches in flight) a batch
takes only requests not in flight, at most ``ceil(running / parts)`` of
them, so the running requests spread over ``parts`` micro-batches; the
caller first processes every batch in flight when a retraction may be
needed (a request in flight is never retracted).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Mapping, Optional

from kvship.engine.forward_batch import ForwardMode
from kvship.engine.io_struct import FinishReason
from kvship.engine.schedule_batch import Req, ScheduleBatch
from kvship.engine.scheduler.admission import RequestQueues
from kvship.engine.scheduler.kv_budget import KVBudget

logger = logging.getLogger(__name__)


class DecodeBatcher:
    def __init__(
        self, queues: RequestQueues, budget: KVBudget, counters: Counter, finish: Callable[[Req, FinishReason], None]
    ):
        self.q = queues
        self.budget = budget
        self.counters = counters
        self.finish = finish

    def build(self, busy: Optional[Mapping[int, Req]] = None, parts: int = 1) -> Optional[ScheduleBatch]:
        """A decode batch of every running request (``busy``: see the module docstring), retracting until its
        step fits; None when none runs."""
        q, kv = self.q, self.budget
        while q.running:
            if kv.shortfall_after_evict(kv.decode_need(q.running)) <= 0:
                break
            if kv.cache.settle_loads():  # load-aheads' locked pages: once written they can be evicted, try again
                continue
            if busy:
                raise RuntimeError("a decode with requests in flight would retract: process them first")
            self.retract_one()
        reqs = list(q.running)
        if busy:
            reqs = [r for r in reqs if id(r) not in busy]
        if parts > 1:
            reqs = reqs[: -(-len(q.running) // parts)]
        if not reqs:
            return None
        kv.decay()
        return ScheduleBatch(reqs, ForwardMode.DECODE)

    def retract_one(self) -> None:
        """Free KV for decode: retract the request with the least progress (or fail a lone one)."""
        q = self.q
        candidates = list(q.running) + ([q.chunked_req] if q.chunked_req is not None else [])
        if len(candidates) == 1:
            req = candidates[0]
            logger.warning("KV cache too small for request %s alone; aborting it", req.rid)
            self.finish(req, FinishReason.abort(f"KV cache exhausted ({self.budget.allocator.total_slots} slots)"))
            return
        victim = min(candidates, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        if victim is q.chunked_req:
            q.chunked_req = None
        else:
            q.running.remove(victim)
        self.budget.cache.cache_finished_req(victim)
        victim.retractions += 1
        self.counters["retracted"] += 1
        q.waiting.insert(0, victim)
        self.budget.after_retract(q.running)
        logger.info("retracted %s (KV short); new_token_ratio=%.2f", victim.rid, self.budget.new_token_ratio)
