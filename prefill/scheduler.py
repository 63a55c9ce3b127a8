"""The prefill role: the scheduler hooks of a ``--mode prefill`` worker.

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
  terminal state, then handed to the radix cache, so later requests sharing
  the prefix skip that compute.  An abort while the transfer is in flight
  only asks the sender to stop; the slots are released once ``poll()`` says
  the transfer layer let go of them.
* The transfer layer (``kv_manager``) is closed when the scheduler loop
  exits, which fails every open room on both sides.
"""

from __future__ import annotations

import logging
from typing import Optional

from kvship.engine.disagg import AuxInfo, KVPoll
from kvship.engine.disagg.pd_role import PDRole, PDScheduler
from kvship.engine.disagg.stages import PDEntry, PDStageQueue, nan_if_none, request_pages, room_problem
from kvship.engine.io_struct import FinishReason, GenerateRequest
from kvship.engine.schedule_batch import Req
from kvship.prefill.queues import BootstrapQueue, InflightQueue

logger = logging.getLogger(__name__)


class PrefillRole(PDRole):
    """Runs extends, samples the first token and ships KV + first token to the decode worker."""

    mode = "prefill"

    def init_stages(self) -> tuple[PDStageQueue, ...]:
        self.bootstrap_queue = BootstrapQueue(self.kv_manager)
        self.inflight_queue = InflightQueue()
        self.computing: dict[str, PDEntry] = {}  # registered rooms in waiting / extend
        return self.bootstrap_queue, self.inflight_queue

    @property
    def bootstrap_port(self) -> int:
        """The port decode workers register rooms on (the real one when 0 was asked for)."""
        return int(self.kv_manager.bootstrap_port)  # type: ignore[attr-defined]

    # ------------------------------------------------------------ admission
    def bootstrap_problem(self, request: GenerateRequest) -> Optional[str]:
        if request.bootstrap_room is None:
            return (
                "this is a prefill worker (--mode prefill): a request needs bootstrap_room, "
                "bootstrap_host and bootstrap_port; send requests through `kvship router --pd`"
            )
        return room_problem(request.bootstrap_room)

    def enter_stages(self, req: Req, request: GenerateRequest) -> None:
        req.max_new_tokens = 1
        self.bootstrap_queue.add(req, request.bootstrap_room)

    # ------------------------------------------------------------ stages
    def advance(self) -> None:
        """Move requests between the stages according to their senders' states."""
        ready, failed = self.bootstrap_queue.pop_ready()
        done = self.inflight_queue.pop_done()
        self.poll.progressed(bool(ready or failed or done))
        for entry in failed:
            self.guarded(entry, self.fail_entry, entry, entry.failure(), False)
        for entry in ready:
            self.stamp_transfer(entry, {"registered": "room_registered"})
            self.stamp(entry.rid, "admitted")
            self.computing[entry.rid] = entry
            self.s.enqueue(entry.req)
        for entry, state in done:
            self.stamp_transfer(entry, {"transfer_start": "kv_send_start", "transfer_end": "kv_send_end"})
            self.stamp(entry.rid, "transfer_done")
            if state == KVPoll.Success and entry.abort_reason is None:
                self.guarded(entry, self._finish_transferred, entry)
            else:  # prefill's own KV is valid: it still goes to the radix cache
                self.guarded(entry, self.fail_entry, entry, entry.failure(), True)

    def _finish_transferred(self, entry: PDEntry) -> None:
        self.counters["transferred"] += 1
        self.s.finish(entry.req, FinishReason.of_length(0))

    def on_prompt_done(
        self, req: Req, token_id: int, logprob: Optional[float], top_logprobs: Optional[list[tuple[int, float]]]
    ) -> bool:
        """The prompt is computed: send its pages and the first token (stage 2 -> 3)."""
        entry = self.computing.pop(req.rid, None)
        if entry is None:
            self.s.finish(req, FinishReason.abort("internal error: prefill request without a KV sender"))
            return True
        n = len(req.origin_input_ids)
        s = self.s
        pages = request_pages(s.req_to_token_pool.read(req.req_pool_idx, 0, n), s.page_size)
        aux = AuxInfo(
            first_token_id=int(token_id),
            first_token_logprob=nan_if_none(logprob),
            prompt_len=n,
            first_token_top_logprobs=tuple((int(t), float(v)) for t, v in (top_logprobs or ())),
        )
        self.stamp(req.rid, "forward_done")
        self.inflight_queue.add(entry, pages, aux)
        return True

    def on_finish(self, req: Req) -> None:
        entry = self.computing.pop(req.rid, None)
        if entry is not None:  # registered but not sent: tell decode; no transfer reads these pages yet
            reason = req.finished_reason
            entry.transfer.abort((reason.message if reason is not None else "") or "aborted on prefill")

    def stage_stats(self) -> dict:
        return {
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "transfer_backend": self.kv_manager.config.backend,
            "bootstrap_queue": len(self.bootstrap_queue),
            "prefill_waiting_queue": len(self.computing),
            "inflight_queue": len(self.inflight_queue),
        }


class PrefillScheduler(PDScheduler):
    """A ``Scheduler`` with the prefill role."""

    role_cls = PrefillRole
    role: PrefillRole

    @property
    def bootstrap_port(self) -> int:
        return self.role.bootstrap_port
