"""The prefill role: the scheduler hooks of a ``--mode prefill`` worker.

Life cycle of a request (see ``kvship.prefill`` for the whole picture)::

    submit --> ComputingQueue + waiting --> extend(s) (chunked prefill) --> first token sampled
           --> InflightQueue (send; the transfer starts once decode registered the room)
               --(Success)--> KV cached, finished "length 0"
               \\--(Failed)--> KV cached, finished "abort" + reason

* A request must carry ``bootstrap_room`` (the router injects it); without one
  it is rejected with a message saying so.
* The prompt computes as soon as it arrives, beside decode's pre-allocation
  and registration of the room (docs/pd.md, "Protocol, worker side"); the KV
  waits in ``InflightQueue`` for the registration if it is not there yet, at
  most ``--disaggregation-bootstrap-timeout``.  A room that fails while its
  prompt computes (decode aborted or died, bootstrap timeout) aborts the
  prompt.  With ``--disaggregation-prefill-wait-for-room`` the request waits
  in ``BootstrapQueue`` for the registration first instead, so prefill never
  computes KV nobody can take yet (at the cost of that wait in TTFT).
* The request's own ``max_new_tokens`` is set to 1 here: prefill samples
  exactly one token and never reserves memory for decoding.
* The finished chunk of a successful request carries no tokens
  (``finish_reason = {"type": "length", "length": 0}``): the client's tokens,
  the first one included, come from the decode worker.  Except: a streamed
  request the router asked the first token of (``pd_first_token``) gets it
  in a chunk of its own as soon as it is sampled, unless that token ends the
  request (EOS, a stop token, ``max_new_tokens`` 1) or the request has stop
  strings or a grammar (docs/pd.md, "The first token from prefill").  A failed transfer
  finishes the request with an ``abort`` naming the reason.
* Layer-wise transfer (docs/pd.md): when decode registered the room before
  the prompt's last chunk computes, the sender writes each layer as the
  forward stores it (``kvship.prefill.layerwise``); the request then enters
  ``InflightQueue`` when that forward starts, and ``send`` after it adds the
  first token.  ``--no-disaggregation-layerwise`` turns it off.
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
from kvship.engine.disagg.stages import (
    PDEntry,
    PDStageQueue,
    nan_if_none,
    request_pages,
    room_problem,
    room_token_problem,
)
from kvship.engine.forward_batch import ForwardMode
from kvship.engine.io_struct import FinishReason, GenerateRequest, TokenChunk
from kvship.engine.schedule_batch import Req, ScheduleBatch
from kvship.prefill.layerwise import LayerwiseWatch
from kvship.prefill.queues import BootstrapQueue, ComputingQueue, InflightQueue, unregistered_rooms

logger = logging.getLogger(__name__)

# the sender's stamps -> the request's trace (docs/pd.md, "Reading a request's trace")
_SENDER_STAMPS = {
    "registered": "room_registered",
    "transfer_start": "kv_send_start",
    "layers_first": "kv_layers_first",
    "layers_last": "kv_layers_last",
    "tail_start": "kv_tail_start",
    "transfer_end": "kv_send_end",
}


class PrefillRole(PDRole):
    """Runs extends, samples the first token and ships KV + first token to the decode worker."""

    mode = "prefill"

    def init_stages(self) -> tuple[PDStageQueue, ...]:
        self.wait_for_room = self.s.server_args.disaggregation_prefill_wait_for_room
        self.layerwise = self.s.server_args.disaggregation_layerwise and self.kv_manager.config.layerwise
        self.layerwise_min_tokens = self.s.server_args.disaggregation_layerwise_min_tokens
        self.num_layers = int(self.s.runner.kv_pool.num_layers)
        self.bootstrap_queue = BootstrapQueue()
        self.inflight_queue = InflightQueue()
        # rooms whose prompt waits / computes in the scheduler's queues; not a stage of ``PDRole``: an abort
        # there is the scheduler's (the transfer layer never touches these pages), ``on_finish`` tells decode
        self.computing = ComputingQueue()
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
        return room_problem(request.bootstrap_room) or room_token_problem(
            request.bootstrap_token, self.kv_manager.config.insecure
        )

    def enter_stages(self, req: Req, request: GenerateRequest) -> None:
        first_token = request.pd_first_token and req.max_new_tokens > 1
        req.max_new_tokens = 1
        room = request.bootstrap_room
        entry = PDEntry(req=req, transfer=self.kv_manager.create_sender(room, request.bootstrap_token), room=room)
        entry.extra["first_token"] = first_token
        if self.wait_for_room:
            self.bootstrap_queue.put(entry)
        else:
            self._compute(entry)

    def _compute(self, entry: PDEntry) -> None:
        self.stamp(entry.rid, "admitted")
        self.computing.put(entry)
        self.s.enqueue(entry.req)

    # ------------------------------------------------------------ stages
    def advance(self) -> None:
        """Move requests between the stages according to their senders' states."""
        ready, failed = self.bootstrap_queue.pop_ready()
        lost = self.computing.pop_failed()
        done = self.inflight_queue.pop_done()
        self.poll.progressed(bool(ready or failed or lost or done))
        for entry in failed:
            self.guarded(entry, self.fail_entry, entry, entry.failure(), False)
        for entry in ready:
            self.stamp_transfer(entry, {"registered": "room_registered"})
            self.guarded(entry, self._compute, entry)
        for entry in lost:  # the room failed while its prompt computes: stop computing it
            self.counters["failed"] += 1
            self.guarded(entry, self.s.abort_request, entry.rid, entry.failure())
        for entry, state in done:
            if "layers_first" in entry.transfer.stamps:  # some of its layers went while the forward ran
                self.counters["layerwise"] += 1
            self.stamp_transfer(entry, _SENDER_STAMPS)
            self.stamp(entry.rid, "transfer_done")
            ok = state == KVPoll.Success and entry.abort_reason is None
            self.emit_transfer(entry, ok, "transfer_start", "transfer_end", entry.extra.get("pages", 0))
            if ok:
                self.guarded(entry, self._finish_transferred, entry)
            else:  # prefill's own KV is valid (unless a layer-wise room's forward failed): to the radix cache
                self.guarded(entry, self.fail_entry, entry, entry.failure(), entry.extra.get("computed", True))

    def watch_forward(self, batch: ScheduleBatch) -> Optional[LayerwiseWatch]:
        """A forward that computes a prompt's last chunk ships its layers as they are stored (docs/pd.md,
        "Layer-wise transfer"), when layer-wise is on and some prompt of the batch waits for it."""
        if not self.layerwise or batch.forward_mode != ForwardMode.EXTEND or not self.computing:
            return None
        return LayerwiseWatch(self, batch)

    def abort(self, rid: str, message: str) -> bool:
        entry = self.inflight_queue.get(rid)
        if entry is not None and entry.extra.get("computed") is False:
            # a layer-wise room whose forward failed (the scheduler fails its batch): the request leaves the
            # compute queues now, its slots go once the sender lets go of them
            self.s.queues.detach(entry.req)
        return super().abort(rid, message)

    def _finish_transferred(self, entry: PDEntry) -> None:
        self.counters["transferred"] += 1
        self.s.finish(entry.req, FinishReason.of_length(0))

    def on_prompt_done(
        self, req: Req, token_id: int, logprob: Optional[float], top_logprobs: Optional[list[tuple[int, float]]]
    ) -> bool:
        """The prompt is computed: send its pages and the first token (stage 2 -> 3)."""
        entry = self.computing.remove(req.rid)
        if entry is None:  # a layer-wise room: in flight since its forward started
            held = self.inflight_queue.get(req.rid)
            entry = held if held is not None and held.extra.get("computed") is False else None
        if entry is None:
            self.s.finish(req, FinishReason.abort("internal error: prefill request without a KV sender"))
            return True
        entry.extra["computed"] = True
        n = len(req.origin_input_ids)
        s = self.s
        pages = request_pages(s.req_to_token_pool.read_host(req.req_pool_idx, 0, n), s.page_size)
        aux = AuxInfo(
            first_token_id=int(token_id),
            first_token_logprob=nan_if_none(logprob),
            prompt_len=n,
            first_token_top_logprobs=tuple((int(t), float(v)) for t, v in (top_logprobs or ())),
        )
        self.stamp(req.rid, "forward_done")
        if entry.extra.get("first_token") and self._first_token_goes_on(req, int(token_id)):
            chunk = TokenChunk(
                rid=req.rid,
                token_ids=[int(token_id)],
                prompt_tokens=n,
                completion_tokens=1,
                cached_tokens=req.cached_tokens,
            )
            if req.return_logprob:
                chunk.logprobs = [nan_if_none(logprob)]
                if req.top_logprobs_num > 0:
                    chunk.top_logprobs = [list(top_logprobs or [])]
            self.s.emit_chunk(chunk)
            self.s.flush()  # out before the transfer threads start competing for the host
        entry.extra["pages"] = len(pages)  # what the transfer moves (its metrics and trace span)
        self.inflight_queue.add(entry, pages, aux)
        return True

    @staticmethod
    def _first_token_goes_on(req: Req, token_id: int) -> bool:
        """Whether the request surely goes on after ``token_id`` (so decode's stream continues it)."""
        return (
            token_id not in req.eos_token_ids
            and token_id not in req.stop_token_ids
            and not req.stop_strs
            and req.grammar is None
        )

    def on_finish(self, req: Req) -> None:
        super().on_finish(req)
        entry = self.computing.remove(req.rid)
        if entry is not None:  # not sent: tell decode; no transfer reads these pages yet
            reason = req.finished_reason
            entry.transfer.abort((reason.message if reason is not None else "") or "aborted on prefill")

    def stage_stats(self) -> dict:
        return {
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "transfer_backend": self.kv_manager.config.backend,
            # rooms decode has not registered yet, whatever their stage
            "bootstrap_queue": len(self.bootstrap_queue) + unregistered_rooms(self.computing, self.inflight_queue),
            "prefill_waiting_queue": len(self.computing),
            "inflight_queue": len(self.inflight_queue),
            "kv_transfers_layerwise": self.counters["layerwise"],
        }


class PrefillScheduler(PDScheduler):
    """A ``Scheduler`` with the prefill role."""

    role_cls = PrefillRole
    role: PrefillRole

    @property
    def bootstrap_port(self) -> int:
        return self.role.bootstrap_port
