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
from collections import Counter
from typing import Any, Callable, Optional

from kvship.engine.config import ServerArgs
from kvship.engine.disagg import AuxInfo, KVPoll, KVTransferConfig, KVTransferError
from kvship.engine.io_struct import GenerateRequest, TokenChunk
from kvship.engine.schedule_batch import Req, ScheduleBatch, finish_abort, finish_length
from kvship.engine.schedule_policy import SchedulerTuning
from kvship.engine.scheduler import Scheduler
from kvship.prefill.pd_common import PDEntry, TransferPollBackoff, make_kv_manager, nan_if_none, request_pages
from kvship.prefill.queues import BootstrapQueue, InflightQueue

logger = logging.getLogger(__name__)

_MAX_ROOM = (1 << 63) - 1


class PrefillScheduler(Scheduler):
    """Runs extends, samples the first token and ships KV + first token to the decode worker."""

    mode = "prefill"

    def __init__(self, server_args: ServerArgs, model_runner: Any, tokenizer: Any,
                 output_sink: Callable[[list[TokenChunk]], None], tuning: Optional[SchedulerTuning] = None,
                 kv_config: Optional[KVTransferConfig] = None):
        self.kv_manager = make_kv_manager("prefill", server_args, model_runner.kv_pool, kv_config)
        self.bootstrap_queue = BootstrapQueue(self.kv_manager)
        self.inflight_queue = InflightQueue()
        self._computing: dict[str, PDEntry] = {}   # stage 2: registered rooms in waiting / extend
        self.pd_counters: Counter = Counter()
        self._poll = TransferPollBackoff()
        try:
            super().__init__(server_args, model_runner, tokenizer, output_sink, tuning)
        except BaseException:
            self.kv_manager.close()
            raise

    @property
    def bootstrap_port(self) -> int:
        """The port decode workers register rooms on (the real one when 0 was asked for)."""
        return int(self.kv_manager.bootstrap_port)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stop the transfer layer (the loop does this itself when it exits)."""
        self.kv_manager.close()

    # ------------------------------------------------------------ admission
    def _handle_submit(self, greq: GenerateRequest) -> None:
        if greq.rid in self.reqs:
            return super()._handle_submit(greq)  # rejected there as a duplicate
        room = greq.bootstrap_room
        if room is None:
            return self._reject(greq, "this is a prefill worker (--mode prefill): a request needs bootstrap_room, "
                                      "bootstrap_host and bootstrap_port; send requests through `kvship router --pd`")
        if not isinstance(room, int) or not 0 <= room <= _MAX_ROOM:
            return self._reject(greq, f"bootstrap_room must be an integer in [0, 2^63), got {room!r}")
        super()._handle_submit(greq)
        req = self.reqs.get(greq.rid)
        if req is None or not self.waiting or self.waiting[-1] is not req:
            return  # rejected, or finished at once (max_new_tokens == 0)
        self.waiting.pop()
        req.max_new_tokens = 1
        try:
            self.bootstrap_queue.add(req, room)
        except KVTransferError as e:
            self._finish(req, finish_abort(f"KV transfer: {e}"), keep_kv=False)

    # ------------------------------------------------------------ stages
    def has_work(self) -> bool:
        return super().has_work() or bool(self.bootstrap_queue) or bool(self.inflight_queue)

    def _drain_inbox(self, block_s: float) -> None:
        if (self.bootstrap_queue or self.inflight_queue) and not Scheduler.has_work(self):
            block_s = self._poll.wait_s  # nothing to compute, but transfers to watch: poll soon, without spinning
        super()._drain_inbox(block_s)

    def _get_next_batch(self) -> Optional[ScheduleBatch]:
        self._advance_transfers()
        return super()._get_next_batch()

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

    def _guarded(self, entry: PDEntry, fn: Callable[..., None], *args: Any) -> None:
        """Run one entry's transition; a failure fails that request alone (its transfer is terminal here)."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - one bad request must not fail the others
            logger.exception("PD request %s failed in a stage transition", entry.rid)
            if not entry.req.finish_sent:
                super()._fail_reqs([entry.req], e)

    @staticmethod
    def _failure(entry: PDEntry) -> str:
        if entry.abort_reason is not None:
            return entry.abort_reason
        return f"KV transfer failed: {entry.transfer.failure_reason or 'unknown reason'}"

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

    def _abort_req(self, rid: str, message: str) -> None:
        entry = self.bootstrap_queue.remove(rid)
        if entry is not None:
            entry.transfer.abort(message)
            self._finish(entry.req, finish_abort(message), keep_kv=False)
            return
        entry = self.inflight_queue.get(rid)
        if entry is not None:  # the slots are released once the sender lets go of them
            if entry.abort_reason is None:
                entry.abort_reason = message
                entry.transfer.abort(message)
            return
        super()._abort_req(rid, message)

    def _fail_reqs(self, reqs: list[Req], exc: BaseException) -> None:
        rest = []
        for req in reqs:
            if self.bootstrap_queue.get(req.rid) is not None or self.inflight_queue.get(req.rid) is not None:
                self._abort_req(req.rid, f"internal error: {type(exc).__name__}: {exc}")
            else:
                rest.append(req)
        super()._fail_reqs(rest, exc)

    def _abort_all(self, message: str) -> None:
        self.kv_manager.close()  # fails every room; afterwards no transfer thread reads the pool
        for entry in list(self.bootstrap_queue.entries.values()) + list(self.inflight_queue.entries.values()):
            try:
                self._finish(entry.req, finish_abort(message), keep_kv=False)
            except Exception:  # noqa: BLE001 - keep releasing the others
                logger.exception("could not release request %s", entry.rid)
        self.bootstrap_queue.entries.clear()
        self.inflight_queue.entries.clear()
        super()._abort_all(message)

    # ------------------------------------------------------------ stats
    def _update_stats(self) -> None:
        super()._update_stats()
        self._stats.update({
            "mode": self.mode,
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "transfer_backend": self.kv_manager.config.backend,
            "bootstrap_queue": len(self.bootstrap_queue),
            "prefill_waiting_queue": len(self._computing),
            "inflight_queue": len(self.inflight_queue),
            "kv_transfers_ok": self.pd_counters["transferred"],
            "kv_transfers_failed": self.pd_counters["failed"],
        })
