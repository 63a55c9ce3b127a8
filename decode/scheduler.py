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
from collections import Counter
from typing import Any, Callable, Optional

import torch

from kvship.decode.queues import PrebuiltQueue, PreallocQueue, TransferQueue
from kvship.engine.config import ServerArgs
from kvship.engine.disagg import KVPoll, KVTransferConfig, KVTransferError
from kvship.engine.io_struct import GenerateRequest, TokenChunk
from kvship.engine.schedule_batch import Req, ScheduleBatch, finish_abort
from kvship.engine.schedule_policy import SchedulerTuning
from kvship.engine.scheduler import Scheduler
from kvship.prefill.pd_common import PDEntry, TransferPollBackoff, make_kv_manager

logger = logging.getLogger(__name__)

_MAX_ROOM = (1 << 63) - 1


class DecodeScheduler(Scheduler):
    """Receives prompts' KV from prefill workers and decodes them in one running batch."""

    mode = "decode"

    def __init__(self, server_args: ServerArgs, model_runner: Any, tokenizer: Any,
                 output_sink: Callable[[list[TokenChunk]], None], tuning: Optional[SchedulerTuning] = None,
                 kv_config: Optional[KVTransferConfig] = None):
        self.kv_manager = make_kv_manager("decode", server_args, model_runner.kv_pool, kv_config)
        self.prealloc_queue = PreallocQueue(self.kv_manager)
        self.transfer_queue = TransferQueue()
        self.prebuilt_queue = PrebuiltQueue()
        self.pd_counters: Counter = Counter()
        self._poll = TransferPollBackoff()
        try:
            super().__init__(server_args, model_runner, tokenizer, output_sink, tuning)
        except BaseException:
            self.kv_manager.close()
            raise

    def close(self) -> None:
        """Stop the transfer layer (the loop does this itself when it exits)."""
        self.kv_manager.close()

    # ------------------------------------------------------------ admission
    def _handle_submit(self, greq: GenerateRequest) -> None:
        if greq.rid in self.reqs:
            return super()._handle_submit(greq)  # rejected there as a duplicate
        host, port, room = greq.bootstrap_host, greq.bootstrap_port, greq.bootstrap_room
        if host is None or port is None or room is None:
            return self._reject(greq, "this is a decode worker (--mode decode): a request needs bootstrap_host, "
                                      "bootstrap_port and bootstrap_room; send requests through `kvship router --pd`")
        if not isinstance(room, int) or not 0 <= room <= _MAX_ROOM:
            return self._reject(greq, f"bootstrap_room must be an integer in [0, 2^63), got {room!r}")
        if not isinstance(port, int) or not 0 < port < 65536:
            return self._reject(greq, f"bootstrap_port must be in 1..65535, got {port!r}")
        super()._handle_submit(greq)
        req = self.reqs.get(greq.rid)
        if req is None or not self.waiting or self.waiting[-1] is not req:
            return  # rejected, or finished at once (max_new_tokens == 0)
        self.waiting.pop()
        try:
            self.prealloc_queue.add(req, host, port, room)
        except KVTransferError as e:
            self._finish(req, finish_abort(f"KV transfer: {e}"), keep_kv=False)

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
    def has_work(self) -> bool:
        return super().has_work() or self._transfers_pending()

    def _transfers_pending(self) -> bool:
        return bool(self.prealloc_queue) or bool(self.transfer_queue) or bool(self.prebuilt_queue)

    def _drain_inbox(self, block_s: float) -> None:
        if self._transfers_pending() and not Scheduler.has_work(self):
            block_s = self._poll.wait_s  # nothing to compute, but transfers to watch: poll soon, without spinning
        super()._drain_inbox(block_s)

    def _get_next_batch(self) -> Optional[ScheduleBatch]:
        self._advance_transfers()
        return super()._get_next_batch()

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
        for entry in self.prebuilt_queue.pop_all():
            self._guarded(entry, self._join_running, entry)

    def _join_running(self, entry: PDEntry) -> None:
        """The prebuilt extend: the prompt's KV is in place, the first token comes from prefill."""
        aux = entry.transfer.aux
        self.pd_counters["transferred"] += 1
        lp = float(aux.first_token_logprob)
        self.admit_prefilled(entry.req, int(aux.first_token_id), None if lp != lp else lp)

    def _fail_entry(self, entry: PDEntry, reason: str) -> None:
        self.pd_counters["failed"] += 1
        self._finish(entry.req, finish_abort(reason), keep_kv=False)

    def _guarded(self, entry: PDEntry, fn: Callable[..., None], *args: Any) -> None:
        """Run one entry's transition; a failure fails that request alone (its transfer is terminal here)."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - one bad request must not fail the others
            logger.exception("PD request %s failed in a stage transition", entry.rid)
            if not entry.req.finish_sent:
                super()._fail_reqs([entry.req], e)

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

    @staticmethod
    def _failure(entry: PDEntry) -> str:
        if entry.abort_reason is not None:
            return entry.abort_reason
        return f"KV transfer failed: {entry.transfer.failure_reason or 'unknown reason'}"

    # ------------------------------------------------------------ aborts and failures
    def _owns(self, rid: str) -> bool:
        return any(q.get(rid) is not None for q in (self.prealloc_queue, self.transfer_queue)) or \
            rid in self.prebuilt_queue.entries

    def _abort_req(self, rid: str, message: str) -> None:
        entry = self.prealloc_queue.remove(rid)
        if entry is not None:  # no slots yet; the receiver was never registered
            entry.transfer.abort(message)
            self._finish(entry.req, finish_abort(message), keep_kv=False)
            return
        entry = self.transfer_queue.get(rid)
        if entry is not None:  # the slots are freed once prefill can no longer write into them
            if entry.abort_reason is None:
                entry.abort_reason = message
                entry.transfer.abort(message)
            return
        entry = self.prebuilt_queue.remove(rid)
        if entry is not None:
            self._finish(entry.req, finish_abort(message), keep_kv=False)
            return
        super()._abort_req(rid, message)

    def _fail_reqs(self, reqs: list[Req], exc: BaseException) -> None:
        rest = []
        for req in reqs:
            if self._owns(req.rid):
                self._abort_req(req.rid, f"internal error: {type(exc).__name__}: {exc}")
            else:
                rest.append(req)
        super()._fail_reqs(rest, exc)

    def _abort_all(self, message: str) -> None:
        self.kv_manager.close()  # fails every room; afterwards nothing lands in the pool
        entries = (list(self.prealloc_queue.entries.values()) + list(self.transfer_queue.entries.values())
                   + list(self.prebuilt_queue.entries.values()))
        for entry in entries:
            try:
                self._finish(entry.req, finish_abort(message), keep_kv=False)
            except Exception:  # noqa: BLE001 - keep releasing the others
                logger.exception("could not release request %s", entry.rid)
        for q in (self.prealloc_queue, self.transfer_queue, self.prebuilt_queue):
            q.entries.clear()
        super()._abort_all(message)

    # ------------------------------------------------------------ stats
    def _update_stats(self) -> None:
        super()._update_stats()
        self._stats.update({
            "mode": self.mode,
            "transfer_backend": self.kv_manager.config.backend,
            "prealloc_queue": len(self.prealloc_queue),
            "transfer_queue": len(self.transfer_queue),
            "prebuilt_queue": len(self.prebuilt_queue),
            "kv_transfers_ok": self.pd_counters["transferred"],
            "kv_transfers_failed": self.pd_counters["failed"],
        })
