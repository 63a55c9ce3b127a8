"""``PrefillScheduler``: the scheduler of a ``--mode prefill`` worker.

Life cycle of a request (see ``kvship.prefill`` for the whole picture)::

    submit --> BootstrapQueue --(decode registered the room)--> waiting --> extend(s) (chunked prefill)
           --> first token sampled --> InflightQueue --(Success)--> KV cached, finished "length 0"
                                                    \\--(Failed)--> KV cached, finished "abort" + reason

* A request must carry ``bootstrap_room`` (the router injects it); without one
  it is rejected with a message saying so.
* Nothing is computed for a room before its decode worker has registered the
  destination pages, so prefill never burns compute on KV nobody can take.
* The request's own ``max_new_tokens`` is set to 1 here: prefill samples
  exactly one token and never reserves memory for decoding.
* The finished chunk of a successful request carries no tokens
  (``finish_reason = {"type": "length", "length": 0}``): the client's tokens,
  the first one included, come from the decode worker.  A failed transfer
  finishes the request with an ``abort`` naming the reason.
* Slots: a request's KV is pinned from its extend until the sender reaches a
  terminal state, then handed to the radix cache (``cache_finished_req``),
  so later requests sharing the prefix skip that compute.  An abort while
  the transfer is in flight only asks the sender to stop; the slots are
  released once ``poll()`` says the transfer layer let go of them.
* The transfer layer (``self.kv_manager``) is closed when the scheduler loop
  exits, which fails every open room on both sides.
"""

from __future__ import annotations

import logging
from typing import Optional

from kvship.engine.disagg import AuxInfo, KVPoll
from kvship.engine.io_struct import GenerateRequest
from kvship.engine.schedule_batch import Req, ScheduleBatch, finish_abort, finish_length
from kvship.prefill.pd_common import PDEntry, PDScheduler, PDStageQueue, nan_if_none, request_pages
from kvship.prefill.queues import BootstrapQueue, InflightQueue

logger = logging.getLogger(__name__)


class PrefillScheduler(PDScheduler):
    """Runs extends, samples the first token and ships KV + first token to the decode worker."""

    mode = "prefill"

    def _init_stages(self) -> tuple[PDStageQueue, ...]:
        self.bootstrap_queue = BootstrapQueue(self.kv_manager)
        self.inflight_queue = InflightQueue()
        self._computing: dict[str, PDEntry] = {}   # stage 2: registered rooms in waiting / extend
        return self.bootstrap_queue, self.inflight_queue

    @property
    def bootstrap_port(self) -> int:
        """The port decode workers register rooms on (the real one when 0 was asked for)."""
        return int(self.kv_manager.bootstrap_port)  # type: ignore[attr-defined]

    # ------------------------------------------------------------ admission
    def _bootstrap_problem(self, greq: GenerateRequest) -> Optional[str]:
        if greq.bootstrap_room is None:
            return ("this is a prefill worker (--mode prefill): a request needs bootstrap_room, "
                    "bootstrap_host and bootstrap_port; send requests through `kvship router --pd`")
        return self._room_problem(greq.bootstrap_room)

    def _enter_stages(self, req: Req, greq: GenerateRequest) -> None:
        req.max_new_tokens = 1
        self.bootstrap_queue.add(req, greq.bootstrap_room)

    # ------------------------------------------------------------ stages
    def _advance_transfers(self) -> None:
        """Move requests between the stages according to their senders' states."""
        ready, failed = self.bootstrap_queue.pop_ready()
        done = self.inflight_queue.pop_done()
        self._poll.progressed(bool(ready or failed or done))
        for entry in failed:
            self._guarded(entry, self._fail_entry, entry, False)
        for entry in ready:
            self._computing[entry.rid] = entry
            self.waiting.append(entry.req)
        for entry, state in done:
            if state == KVPoll.Success and entry.abort_reason is None:
                self._guarded(entry, self._finish_transferred, entry)
            else:  # prefill's own KV is valid: it still goes to the radix cache
                self._guarded(entry, self._fail_entry, entry, True)

    def _finish_transferred(self, entry: PDEntry) -> None:
        self.pd_counters["transferred"] += 1
        self._finish(entry.req, finish_length(0))

    def _fail_entry(self, entry: PDEntry, keep_kv: bool) -> None:
        self.pd_counters["failed"] += 1
        self._finish(entry.req, finish_abort(self._failure(entry)), keep_kv=keep_kv)

    def _process_result(self, batch: ScheduleBatch, result: Optional[tuple]) -> None:
        if not batch.forward_mode.is_extend():  # prefill never decodes; keep the base path for safety
            return super()._process_result(batch, result)
        ids, lps, _ = result if result is not None else ([], None, None)
        j = 0
        for req, sampled in zip(batch.reqs, batch.sample_mask):
            if not sampled:  # a chunk of a long prompt: share it through the cache, continue next step
                self.cache.cache_unfinished_req(req)
                continue
            if req is self.chunked_req:
                self.chunked_req = None
            self._ship(req, ids[j], lps[j] if lps is not None else None)
            j += 1

    def _ship(self, req: Req, token_id: int, logprob: Optional[float]) -> None:
        """The prompt is computed: send its pages and the first token (stage 2 -> 3)."""
        entry = self._computing.pop(req.rid, None)
        if entry is None:
            self._finish(req, finish_abort("internal error: prefill request without a KV sender"))
            return
        n = len(req.origin_input_ids)
        pages = request_pages(self.req_to_token_pool.read(req.req_pool_idx, 0, n), self.page_size)
        aux = AuxInfo(first_token_id=int(token_id), first_token_logprob=nan_if_none(logprob), prompt_len=n)
        self.inflight_queue.add(entry, pages, aux)

    # ------------------------------------------------------------ aborts and failures
    def _finish(self, req: Req, reason: dict, keep_kv: bool = True) -> None:
        entry = self._computing.pop(req.rid, None)
        if entry is not None:  # registered but not sent: tell decode; no transfer reads these pages yet
            entry.transfer.abort(str(reason.get("message") or "aborted on prefill"))
        super()._finish(req, reason, keep_kv)

    # ------------------------------------------------------------ stats
    def _stage_stats(self) -> dict:
        return {
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "transfer_backend": self.kv_manager.config.backend,
            "bootstrap_queue": len(self.bootstrap_queue),
            "prefill_waiting_queue": len(self._computing),
            "inflight_queue": len(self.inflight_queue),
        }
