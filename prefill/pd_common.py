"""Pieces the prefill and decode schedulers share (PD disaggregation).

* ``make_kv_manager``: the worker's KV transfer layer for its role, built from
  ``ServerArgs`` (``--disaggregation-*``, ``--kv-transfer-checksum``); any
  start-up failure (port taken, backend package missing) becomes a
  ``RuntimeError`` whose message names the flag to change.
* ``request_pages``: the KV page indices of a request's prompt, in prompt
  order, read from its ``req_to_token`` row (what ``KVSender.send`` and
  ``KVReceiver.init`` take).
* ``PDEntry``: one request inside a PD stage queue (the request, its sender or
  receiver, and the abort asked for while a transfer was in flight).
* ``TransferPollBackoff``: how long an otherwise idle scheduler loop blocks on
  its inbox while transfers are pending (they progress on the transfer
  layer's threads; the scheduler only polls them): ``PD_POLL_S`` after any
  progress, doubling up to ``PD_POLL_MAX_S`` while nothing moves.  New
  requests and aborts still wake the loop at once (they arrive on the inbox).
* ``PDStageQueue``: the entries of one stage, keyed by request id, in arrival
  order (the stage queues of ``kvship.prefill.queues`` and
  ``kvship.decode.queues`` build on it).
* ``PDScheduler``: what ``PrefillScheduler`` and ``DecodeScheduler`` share on
  top of the unified scheduler: the transfer layer's life time, bootstrap
  field checks at submit, polling transfers before each step, per-entry
  failure isolation, aborts of staged requests, and the PD stats.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from kvship.engine.config import ServerArgs
from kvship.engine.disagg import (BackendUnavailableError, KVManager, KVPoll, KVTransferConfig, KVTransferError,
                                  create_kv_manager)
from kvship.engine.io_struct import GenerateRequest, TokenChunk
from kvship.engine.schedule_batch import Req, ScheduleBatch, finish_abort
from kvship.engine.schedule_policy import SchedulerTuning
from kvship.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

# Seconds an otherwise idle scheduler blocks on its inbox between two polls of pending transfers.
PD_POLL_S = 0.002
PD_POLL_MAX_S = 0.008

# Largest bootstrap_room a request may carry (rooms are unsigned 63-bit integers).
MAX_ROOM = (1 << 63) - 1


class TransferPollBackoff:
    """The inbox wait between polls: short right after progress, longer while nothing moves."""

    def __init__(self) -> None:
        self.wait_s = PD_POLL_S

    def progressed(self, moved: bool) -> None:
        self.wait_s = PD_POLL_S if moved else min(PD_POLL_MAX_S, self.wait_s * 2)


def make_kv_manager(role: str, server_args: ServerArgs, kv_pool: Any,
                    config: Optional[KVTransferConfig] = None) -> KVManager:
    """The ``role`` ("prefill" | "decode") transfer layer over ``kv_pool``.

    ``config`` overrides what ``ServerArgs`` would give (tests use it for short
    timeouts).  Raises ``RuntimeError`` with a user-facing message on failure.
    """
    cfg = config or KVTransferConfig.from_server_args(server_args)
    try:
        return create_kv_manager(role, kv_pool, cfg)
    except BackendUnavailableError as e:
        raise RuntimeError(f"--disaggregation-transfer-backend {cfg.backend}: {e}") from e
    except OSError as e:
        raise RuntimeError(f"cannot start the KV transfer layer ({role}, backend {cfg.backend}): {e}; "
                           f"pick another --disaggregation-bootstrap-port") from e


def request_pages(slots: torch.Tensor, page_size: int) -> np.ndarray:
    """Page indices of ``slots`` (a request's KV slots in position order, position 0 first).

    A request's position ``p`` lives in slot ``page * page_size + p % page_size``
    (see ``kvship.engine.mem.pools``), so every ``page_size``-th slot names one page.
    """
    flat = slots.reshape(-1).to("cpu", torch.int64)
    return (flat[::page_size] // page_size).numpy().astype(np.int64)


@dataclass
class PDEntry:
    """A request while it sits in one of the PD stage queues.

    ``transfer`` is the request's ``KVSender`` (prefill) or ``KVReceiver``
    (decode).  ``abort_reason`` is set when an abort arrived while the transfer
    layer may still touch the request's pages: the entry then stays queued until
    ``poll()`` reports a terminal state, and only then are its slots freed and
    its finished chunk sent.
    """

    req: Req
    transfer: Any
    room: int
    abort_reason: Optional[str] = None
    extra: dict = field(default_factory=dict)

    @property
    def rid(self) -> str:
        return self.req.rid


def nan_if_none(value: Optional[float]) -> float:
    return float("nan") if value is None else float(value)


class PDStageQueue:
    """The entries of one PD stage, keyed by request id, in arrival order.

    Subclasses add entries (with ``_put``) and decide when they leave; the
    queue itself never frees KV slots.
    """

    def __init__(self) -> None:
        self.entries: dict[str, PDEntry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def _put(self, entry: PDEntry) -> PDEntry:
        self.entries[entry.rid] = entry
        return entry

    def get(self, rid: str) -> Optional[PDEntry]:
        return self.entries.get(rid)

    def remove(self, rid: str) -> Optional[PDEntry]:
        return self.entries.pop(rid, None)

    def reqs(self) -> list[Req]:
        return [e.req for e in self.entries.values()]

    def pop_done(self) -> list[tuple[PDEntry, KVPoll]]:
        """Entries whose transfer reached ``Success`` or ``Failed``, with that state, removed from the queue."""
        done = []
        for rid, entry in list(self.entries.items()):
            state = entry.transfer.poll()
            if state.is_terminal:
                del self.entries[rid]
                done.append((entry, state))
        return done


class PDScheduler(Scheduler):
    """The part of the prefill and decode schedulers that does not depend on the role.

    A subclass sets ``mode`` ("prefill" | "decode") and implements:

    * ``_init_stages()``: create its stage queues and return them in stage
      order.  The first one holds requests that have no KV slots yet (an abort
      there aborts the transfer and finishes the request at once); the second
      one holds requests whose transfer may still touch their pages (an abort
      there is only recorded in ``abort_reason`` and asked of the transfer; the
      slots are freed once it is terminal).
    * ``_bootstrap_problem(greq)``: why ``greq`` cannot be served (missing or
      bad bootstrap fields), or None.
    * ``_enter_stages(req, greq)``: put an admitted request into the first
      stage; may raise ``KVTransferError`` (the request is then aborted).
    * ``_advance_transfers()``: move entries between stages (runs before each step).
    * ``_stage_stats()``: the role's entries of ``get_stats()`` between
      ``mode`` and the transfer counters.

    (These are plain methods of the subclasses; the base defines no stubs.)

    The transfer layer is built before the base scheduler and closed if that fails.
    """

    def __init__(self, server_args: ServerArgs, model_runner: Any, tokenizer: Any,
                 output_sink: Callable[[list[TokenChunk]], None], tuning: Optional[SchedulerTuning] = None,
                 kv_config: Optional[KVTransferConfig] = None):
        self.kv_manager = make_kv_manager(self.mode, server_args, model_runner.kv_pool, kv_config)
        self.pd_counters: Counter = Counter()
        self._poll = TransferPollBackoff()
        try:
            self._stages: tuple[PDStageQueue, ...] = tuple(self._init_stages())
            super().__init__(server_args, model_runner, tokenizer, output_sink, tuning)
        except BaseException:
            self.kv_manager.close()
            raise


    def close(self) -> None:
        """Stop the transfer layer (the loop does this itself when it exits)."""
        self.kv_manager.close()

    # ------------------------------------------------------------ admission
    @staticmethod
    def _room_problem(room: Any) -> Optional[str]:
        if not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
            return f"bootstrap_room must be an integer in [0, 2^63), got {room!r}"
        return None

    def _handle_submit(self, greq: GenerateRequest) -> None:
        if greq.rid in self.reqs:
            return super()._handle_submit(greq)  # rejected there as a duplicate
        problem = self._bootstrap_problem(greq)
        if problem is not None:
            return self._reject(greq, problem)
        super()._handle_submit(greq)
        req = self.reqs.get(greq.rid)
        if req is None or not self.waiting or self.waiting[-1] is not req:
            return  # rejected, or finished at once (max_new_tokens == 0)
        self.waiting.pop()
        try:
            self._enter_stages(req, greq)
        except KVTransferError as e:
            self._finish(req, finish_abort(f"KV transfer: {e}"), keep_kv=False)



    # ------------------------------------------------------------ stages
    def has_work(self) -> bool:
        return super().has_work() or self._transfers_pending()

    def _transfers_pending(self) -> bool:
        return any(self._stages)

    def _drain_inbox(self, block_s: float) -> None:
        if self._transfers_pending() and not Scheduler.has_work(self):
            block_s = self._poll.wait_s  # nothing to compute, but transfers to watch: poll soon, without spinning
        super()._drain_inbox(block_s)

    def _get_next_batch(self) -> Optional[ScheduleBatch]:
        self._advance_transfers()
        return super()._get_next_batch()


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

    # ------------------------------------------------------------ aborts and failures
    def _owns(self, rid: str) -> bool:
        return any(rid in q.entries for q in self._stages)

    def _abort_req(self, rid: str, message: str) -> None:
        entry = self._stages[0].remove(rid)
        if entry is not None:  # no slots yet, or none the transfer layer can touch
            entry.transfer.abort(message)
            self._finish(entry.req, finish_abort(message), keep_kv=False)
            return
        entry = self._stages[1].get(rid)
        if entry is not None:  # the slots are freed once the transfer layer lets go of them
            if entry.abort_reason is None:
                entry.abort_reason = message
                entry.transfer.abort(message)
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
        self.kv_manager.close()  # fails every room; afterwards no transfer thread touches the pool
        for entry in [e for q in self._stages for e in q.entries.values()]:
            try:
                self._finish(entry.req, finish_abort(message), keep_kv=False)
            except Exception:  # noqa: BLE001 - keep releasing the others
                logger.exception("could not release request %s", entry.rid)
        for q in self._stages:
            q.entries.clear()
        super()._abort_all(message)

    # ------------------------------------------------------------ stats
    def _update_stats(self) -> None:
        super()._update_stats()
        self._stats.update({
            "mode": self.mode,
            **self._stage_stats(),
            "kv_transfers_ok": self.pd_counters["transferred"],
            "kv_transfers_failed": self.pd_counters["failed"],
        })
