"""``DecodeScheduler``: the scheduler of a ``--mode decode`` worker.

Life cycle of a request (see ``kvship.decode`` for the whole picture)::

    submit --> PreallocQueue --(KV slots for the prompt)--> TransferQueue --(Success)--> PrebuiltQueue
           --> running (decode steps, streamed) --> finished
                                   \\--(Failed / timeout / abort)--> slots freed, finished "abort" + reason

* A request must carry ``bootstrap_host``, ``bootstrap_port`` and
  ``bootstrap_room`` (the router injects them); without them it is rejected.
* Pre-allocation: a request gets slots for its whole prompt only when the
  pool can also keep the running (and transferring) requests decoding (the
  same reservation rule as the unified scheduler's admission), a request row
  is free, and fewer than ``--max-running-requests`` are active; otherwise it
  waits in ``PreallocQueue``.  An idle worker always takes its first request.
* When the KV and the aux record arrived, the request joins the running
  batch through ``Scheduler.admit_prefilled`` with prefill's first token:
  no prompt token is recomputed here.
* Retracted requests (decode ran short of KV) go to the base scheduler's
  ``waiting`` queue and are recomputed locally, as in unified mode; while
  any wait, no new request is pre-allocated.
* Slots: a failed, timed-out or aborted transfer frees the prompt's slots
  only once the receiver reports a terminal state (nothing can land in them
  any more).  Finished requests hand their KV to the radix cache.
* Prefill liveness: the transfer layer's control link to each prefill
  worker carries heartbeats; a dead or silent prefill fails its rooms here
  (clear reason, slots freed).  The KV manager is closed when the loop exits.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from kvship.decode.queues import PrebuiltQueue, PreallocQueue, TransferQueue
from kvship.engine.disagg import KVPoll
from kvship.engine.io_struct import GenerateRequest
from kvship.engine.schedule_batch import Req, finish_abort
from kvship.prefill.pd_common import PDEntry, PDScheduler, PDStageQueue

logger = logging.getLogger(__name__)


class DecodeScheduler(PDScheduler):
    """Receives prompts' KV from prefill workers and decodes them in one running batch."""

    mode = "decode"

    def _init_stages(self) -> tuple[PDStageQueue, ...]:
        self.prealloc_queue = PreallocQueue(self.kv_manager)
        self.transfer_queue = TransferQueue()
        self.prebuilt_queue = PrebuiltQueue()
        return self.prealloc_queue, self.transfer_queue, self.prebuilt_queue

    # ------------------------------------------------------------ admission
    def _bootstrap_problem(self, greq: GenerateRequest) -> Optional[str]:
        host, port, room = greq.bootstrap_host, greq.bootstrap_port, greq.bootstrap_room
        if host is None or port is None or room is None:
            return ("this is a decode worker (--mode decode): a request needs bootstrap_host, "
                    "bootstrap_port and bootstrap_room; send requests through `kvship router --pd`")
        problem = self._room_problem(room)
        if problem is None and (not isinstance(port, int) or not 0 < port < 65536):
            problem = f"bootstrap_port must be in 1..65535, got {port!r}"
        return problem

    def _enter_stages(self, req: Req, greq: GenerateRequest) -> None:
        self.prealloc_queue.add(req, greq.bootstrap_host, greq.bootstrap_port, greq.bootstrap_room)

    def _num_active(self) -> int:
        return (len(self.running) + len(self.transfer_queue) + len(self.prebuilt_queue)
                + (1 if self.chunked_req is not None else 0))

    def _pending_reserve(self) -> int:
        """Decode headroom promised to requests whose KV is arriving (slots already held)."""
        clip = self.tuning.clip_max_new_tokens
        reqs = self.transfer_queue.reqs() + self.prebuilt_queue.reqs()
        return int(sum(min(r.max_new_tokens, clip) for r in reqs) * self.new_token_ratio)

    def _try_alloc(self, req: Req) -> Optional[torch.Tensor]:
        """Slots for ``req``'s prompt when the rules of the module docstring allow, else None."""
        if self._num_active() >= self.max_running:
            return None
        alone = self._num_active() == 0 and not self.waiting
        if self.waiting and not alone:
            return None  # retracted requests are recomputed first
        if not alone:
            ps = self.page_size
            need = (len(req.origin_input_ids) + ps - 1) // ps * ps
            reserve = int(min(req.max_new_tokens, self.tuning.clip_max_new_tokens) * self.new_token_ratio)
            if need + reserve > self._memory_left() - self._pending_reserve():
                return None
        return self.alloc_prefilled_kv(req)

    # ------------------------------------------------------------ stages
    def _advance_transfers(self) -> None:
        """Move requests between the stages according to their receivers' states."""
        failed = self.prealloc_queue.pop_failed()
        placed = self.prealloc_queue.allocate(self._try_alloc, self.page_size)
        done = self.transfer_queue.pop_done()
        self._poll.progressed(bool(failed or placed or done))
        for entry in failed:  # no slots yet
            self._guarded(entry, self._fail_entry, entry, self._failure(entry))
        for entry in placed:
            self.transfer_queue.add(entry)
        for entry, state in done:
            problem = self._failure(entry) if state != KVPoll.Success or entry.abort_reason else self._check_aux(entry)
            if problem is None:
                self.prebuilt_queue.add(entry)
            else:  # terminal: nothing can land in the slots any more
                self._guarded(entry, self._fail_entry, entry, problem)
        joined = self.prebuilt_queue.pop_all()
        for entry in joined:
            self._guarded(entry, self._join_running, entry)
        if joined:
            # prefill's first token goes out now, not with the first decode step's token (saves a step of TTFT)
            self._flush()

    def _join_running(self, entry: PDEntry) -> None:
        """The prebuilt extend: the prompt's KV is in place, the first token comes from prefill."""
        aux = entry.transfer.aux
        self.pd_counters["transferred"] += 1
        lp = float(aux.first_token_logprob)
        self.admit_prefilled(entry.req, int(aux.first_token_id), None if lp != lp else lp)

    def _fail_entry(self, entry: PDEntry, reason: str) -> None:
        self.pd_counters["failed"] += 1
        self._finish(entry.req, finish_abort(reason), keep_kv=False)

    def _check_aux(self, entry: PDEntry) -> Optional[str]:
        aux = entry.transfer.aux
        n = len(entry.req.origin_input_ids)
        if aux is None:
            return "KV transfer finished without an aux record"
        if aux.prompt_len != n:
            return (f"prefill computed a prompt of {aux.prompt_len} tokens but this request has {n}: the workers "
                    f"tokenized differently (same model, tokenizer and chat template on both?)")
        if not 0 <= aux.first_token_id < self.vocab_size:
            return f"prefill sent first token {aux.first_token_id}, outside the vocabulary [0, {self.vocab_size})"
        return None

    # ------------------------------------------------------------ aborts and failures
    def _abort_req(self, rid: str, message: str) -> None:
        entry = self.prebuilt_queue.remove(rid)
        if entry is not None:  # KV in place, nothing can land in the slots any more
            self._finish(entry.req, finish_abort(message), keep_kv=False)
            return
        super()._abort_req(rid, message)  # the prealloc and transfer stages, then the base scheduler

    # ------------------------------------------------------------ stats
    def _stage_stats(self) -> dict:
        return {
            "transfer_backend": self.kv_manager.config.backend,
            "prealloc_queue": len(self.prealloc_queue),
            "transfer_queue": len(self.transfer_queue),
            "prebuilt_queue": len(self.prebuilt_queue),
        }
