"""The decode role: the scheduler hooks of a ``--mode decode`` worker.

Life cycle of a request (see ``kvship.decode`` for the whole picture)::

    submit --> PreallocQueue --(KV slots for the prompt)--> TransferQueue --(Success)--> PrebuiltQueue
           --> running (decode steps, streamed) --> finished
                                   \\--(Failed / timeout / abort)--> slots freed, finished "abort" + reason

* A PD request carries ``bootstrap_host``, ``bootstrap_port`` and
  ``bootstrap_room`` (the router injects them); one that carries only some of
  them is rejected.  A request with none of them is served here alone: it goes
  to the scheduler's waiting queue and is prefilled locally, as in unified
  mode (the router's ``--pd-selective``, docs/router.md).
* Pre-allocation: a request gets slots for its whole prompt only when the
  pool can also keep the running (and transferring) requests decoding (the
  ``KVBudget`` reserve, as in unified admission), a request row is free, and
  fewer than ``--max-running-requests`` are active; otherwise it waits in
  ``PreallocQueue``.  An idle worker always takes its first request.
* When the KV and the aux record arrived, the request joins the running
  batch through ``Scheduler.admit_prefilled`` with prefill's first token:
  no prompt token is recomputed here.
* Retracted requests (decode ran short of KV) go to the scheduler's waiting
  queue and are recomputed locally, as in unified mode; while any wait, no
  new request is pre-allocated.
* Slots: a failed, timed-out or aborted transfer frees the prompt's slots
  only once the receiver reports a terminal state (nothing can land in them
  any more).  Finished requests hand their KV to the radix cache.
* Prefill liveness: the transfer layer's control link to each prefill
  worker carries heartbeats; a dead or silent prefill fails its rooms here
  (clear reason, slots freed).  The KV manager is closed when the loop exits.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from kvship.decode.queues import PreallocQueue, PrebuiltQueue, TransferQueue
from kvship.engine.disagg import KVPoll
from kvship.engine.disagg.pd_role import PDRole, PDScheduler
from kvship.engine.disagg.stages import PDEntry, PDStageQueue, room_problem, room_token_problem
from kvship.engine.io_struct import FinishReason, GenerateRequest
from kvship.engine.schedule_batch import Req

logger = logging.getLogger(__name__)


class DecodeRole(PDRole):
    """Receives prompts' KV from prefill workers and decodes them in the scheduler's running batch."""

    mode = "decode"

    def init_stages(self) -> tuple[PDStageQueue, ...]:
        self.prealloc_queue = PreallocQueue(self.kv_manager)
        self.transfer_queue = TransferQueue()
        self.prebuilt_queue = PrebuiltQueue()
        return self.prealloc_queue, self.transfer_queue, self.prebuilt_queue

    # ------------------------------------------------------------ admission
    @staticmethod
    def is_local(request: GenerateRequest) -> bool:
        """Whether ``request`` carries no bootstrap field at all: prefilled here, no transfer."""
        return (
            request.bootstrap_host is None
            and request.bootstrap_port is None
            and request.bootstrap_room is None
            and request.bootstrap_token is None
        )

    def bootstrap_problem(self, request: GenerateRequest) -> Optional[str]:
        if self.is_local(request):
            return None
        host, port, room = request.bootstrap_host, request.bootstrap_port, request.bootstrap_room
        if host is None or port is None or room is None:
            return (
                "this is a decode worker (--mode decode): a request needs bootstrap_host, "
                "bootstrap_port and bootstrap_room; send requests through `kvship router --pd`"
            )
        problem = room_problem(room)
        if problem is None and (not isinstance(port, int) or not 0 < port < 65536):
            problem = f"bootstrap_port must be in 1..65535, got {port!r}"
        return problem or room_token_problem(request.bootstrap_token, self.kv_manager.config.insecure)

    def admit(self, req: Req, request: GenerateRequest) -> bool:
        if self.is_local(request):
            return False  # the scheduler queues it for a local prefill
        return super().admit(req, request)

    def enter_stages(self, req: Req, request: GenerateRequest) -> None:
        self.prealloc_queue.add(
            req, request.bootstrap_host, request.bootstrap_port, request.bootstrap_room, request.bootstrap_token
        )

    def _num_active(self) -> int:
        return self.s.queues.num_active() + len(self.transfer_queue) + len(self.prebuilt_queue)

    def _try_alloc(self, req: Req) -> Optional[torch.Tensor]:
        """Slots for ``req``'s prompt when the rules of the module docstring allow, else None."""
        s = self.s
        if self._num_active() >= s.max_running:
            return None
        alone = self._num_active() == 0 and not s.waiting
        if s.waiting and not alone:
            return None  # retracted requests are recomputed first
        if not alone:
            kv = s.kv
            arriving = self.transfer_queue.reqs() + self.prebuilt_queue.reqs()  # slots held, decode promised
            need = kv.round_up(len(req.origin_input_ids)) + kv.reserve([req])
            if need > kv.memory_left(s.running) - kv.reserve(arriving):
                return None
        return s.alloc_prefilled_kv(req)

    # ------------------------------------------------------------ stages
    def advance(self) -> None:
        """Move requests between the stages according to their receivers' states."""
        failed = self.prealloc_queue.pop_failed()
        placed = self.prealloc_queue.allocate(self._try_alloc, self.s.page_size)
        done = self.transfer_queue.pop_done()
        self.poll.progressed(bool(failed or placed or done))
        for entry in failed:  # no slots yet
            self.guarded(entry, self.fail_entry, entry, entry.failure(), False)
        for entry in placed:
            self.transfer_queue.add(entry)
        for entry, state in done:
            self.stamp_transfer(
                entry, {"registered": "room_registered", "started": "kv_started", "arrived": "kv_arrived"}
            )
            self.stamp(entry.rid, "kv_verified")
            problem = entry.failure() if state != KVPoll.Success or entry.abort_reason else self._check_aux(entry)
            aux = entry.transfer.aux
            pages = aux.num_pages if aux is not None else 0
            self.emit_transfer(entry, problem is None, "started", "arrived", pages, problem)
            if problem is None:
                self.prebuilt_queue.add(entry)
            else:  # terminal: nothing can land in the slots any more
                self.guarded(entry, self.fail_entry, entry, problem, False)
        joined = self.prebuilt_queue.pop_all()
        for entry in joined:
            self.stamp(entry.rid, "admitted")
            self.guarded(entry, self._join_running, entry)
        if joined:
            now = time.time()
            for entry in joined:  # (a request that finished on joining still takes it: ``TraceStamps``)
                self.stamp(entry.rid, "first_token_flush", now)
            # prefill's first token goes out now, not with the first decode step's token (saves a step of TTFT)
            self.s.flush()

    def _join_running(self, entry: PDEntry) -> None:
        """The prebuilt extend: the prompt's KV is in place, the first token comes from prefill."""
        aux = entry.transfer.aux
        self.counters["transferred"] += 1
        # KV bytes that landed here (every layer's K and V of the prompt's pages; docs/router.md, "SLO figures")
        layout = self.kv_manager.layout
        self.counters["kv_transfer_bytes"] += int(aux.num_pages) * layout.page_bytes * layout.num_buffers
        lp = float(aux.first_token_logprob)
        top = [(int(t), float(v)) for t, v in aux.top_logprobs]
        # a constrained request's grammar accepts this token in ``append_token`` before decoding goes on
        self.s.admit_prefilled(entry.req, int(aux.first_token_id), None if lp != lp else lp, top)

    def _check_aux(self, entry: PDEntry) -> Optional[str]:
        aux = entry.transfer.aux
        n = len(entry.req.origin_input_ids)
        if aux is None:
            return "KV transfer finished without an aux record"
        if aux.prompt_len != n:
            return (
                f"prefill computed a prompt of {aux.prompt_len} tokens but this request has {n}: the workers "
                f"tokenized differently (same model, tokenizer and chat template on both?)"
            )
        if not 0 <= aux.first_token_id < self.s.vocab_size:
            return f"prefill sent first token {aux.first_token_id}, outside the vocabulary [0, {self.s.vocab_size})"
        return None

    # ------------------------------------------------------------ aborts
    def abort(self, rid: str, message: str) -> bool:
        entry = self.prebuilt_queue.remove(rid)
        if entry is not None:  # KV in place, nothing can land in the slots any more
            self.s.finish(entry.req, FinishReason.abort(message), keep_kv=False)
            return True
        return super().abort(rid, message)  # the prealloc and transfer stages

    def stage_stats(self) -> dict:
        return {
            "transfer_backend": self.kv_manager.config.backend,
            "prealloc_queue": len(self.prealloc_queue),
            "transfer_queue": len(self.transfer_queue),
            "prebuilt_queue": len(self.prebuilt_queue),
            "kv_transfer_bytes": self.counters["kv_transfer_bytes"],
        }


class DecodeScheduler(PDScheduler):
    """A ``Scheduler`` with the decode role."""

    role_cls = DecodeRole
    role: DecodeRole
