"""``PDRole`` / ``PDScheduler``: the part of the prefill and decode roles that does not depend on the role.

A role is the ``RoleHooks`` of a scheduler (``kvship.engine.scheduler.role``).
This base owns the transfer layer's life time, checks bootstrap fields at
submit, advances the stages before each step, isolates per-entry failures,
aborts staged requests and reports the PD stats.  Its stage queues come in
stage order:

* ``stages[0]``: requests that hold no KV slots the transfer layer can touch
  (an abort there aborts the transfer and finishes the request at once);
* ``stages[1]``: requests whose transfer may still touch their pages (an abort
  there is recorded in ``abort_reason`` and asked of the transfer; the slots
  are freed once ``poll()`` is terminal);
* further stages belong to the role (it handles aborts there itself).

The transfer layer is built first; if the role cannot be built it is closed.
Its progress hook wakes the scheduler loop (``inbox.wake``) whenever a
sender's or receiver's ``poll()`` may report something new, so a stage
advances as soon as its transfer moved; ``poll_wait_s`` is only the safety
net between wakes.

Tracing (docs/pd.md, "Reading a request's trace"): ``stamp(rid, stage)``
emits a ``PDStage`` event (wall clock, ``time.time()``) while a request
passes the stages, when anyone listens: the scheduler's event subscribers
(docs/observability.md) and the role's own ``TraceStamps``, which writes the
stages of a request submitted with a ``trace`` dict (``return_trace``) into
that dict.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from typing import Any, Callable, Optional

from kvship.common.events import Event, KVTransferFinished, KVTransferStarted, PDStage, failure_kind
from kvship.engine.disagg import KVTransferConfig, KVTransferError
from kvship.engine.disagg.base import SlotFeatures
from kvship.engine.disagg.stages import PDEntry, PDStageQueue, TransferPollBackoff, make_kv_manager
from kvship.engine.io_struct import FinishReason, GenerateRequest
from kvship.engine.schedule_batch import Req
from kvship.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class TraceStamps:
    """The ``return_trace`` subscriber: ``PDStage`` events of the watched requests go into their trace dicts
    (shared with the HTTP layer, which reads them after the finish).

    A finished request's dict takes stages until the next ``drop_released`` (the start of the next
    scheduling step), so a stage stamped right after the finish (decode's ``first_token_flush``) lands."""

    def __init__(self) -> None:
        self._traces: dict[str, dict[str, float]] = {}
        self._released: list[str] = []

    def __contains__(self, rid: str) -> bool:
        return rid in self._traces

    def watch(self, rid: str, trace: dict[str, float]) -> None:
        self._traces[rid] = trace

    def release(self, rid: str) -> None:
        if rid in self._traces:
            self._released.append(rid)

    def drop_released(self) -> None:
        for rid in self._released:
            self._traces.pop(rid, None)
        self._released.clear()

    def on_event(self, ev: Event) -> None:
        if isinstance(ev, PDStage):
            trace = self._traces.get(ev.rid)
            if trace is not None:
                trace[ev.stage] = ev.at


class PDRole(ABC):
    mode: str

    def __init__(
        self, sched: "Scheduler", kv_config: Optional[KVTransferConfig] = None, features: Optional[SlotFeatures] = None
    ):
        self.s = sched
        # tensor / pipeline parallelism: this rank's manager, polls agreed over every rank of the worker
        # (kvship.engine.disagg.tp_sync; with pipeline stages that is the world, else the TP group)
        pipeline = sched.runner.pipeline
        self.tp = pipeline.world if pipeline is not None else sched.runner.tp
        self.kv_manager = make_kv_manager(
            self.mode,
            sched.server_args,
            sched.runner.kv_pool,
            kv_config,
            tp=sched.runner.tp,
            total_kv_heads=sched.runner.model_config.num_key_value_heads,
            features=features,
            pipeline=pipeline,
        )
        self.free_slots_per_rank: Optional[list[int]] = None
        self.counters: Counter = Counter()
        self.poll = TransferPollBackoff()
        self.trace_stamps = TraceStamps()  # ``return_trace``: the stages of the requests that asked for them
        sched.events.subscribe(self.trace_stamps.on_event, kinds=(PDStage,))
        # the scheduler's inbox (made by its io before the role) is woken when a transfer moves
        self.kv_manager.set_progress_hook(lambda: sched.inbox.wake())
        try:
            self.stages: tuple[PDStageQueue, ...] = tuple(self.init_stages())
        except BaseException:
            self.kv_manager.close()
            raise

    # ------------------------------------------------------------ what a role declares
    @abstractmethod
    def init_stages(self) -> tuple[PDStageQueue, ...]:
        """Create the stage queues and return them in stage order (see the module docstring)."""

    @abstractmethod
    def bootstrap_problem(self, request: GenerateRequest) -> Optional[str]:
        """Why ``request`` cannot be served (missing or bad bootstrap fields), or None."""

    @abstractmethod
    def enter_stages(self, req: Req, request: GenerateRequest) -> None:
        """Put an admitted request into the first stage; may raise ``KVTransferError``."""

    @abstractmethod
    def advance(self) -> None:
        """Move entries between stages (runs before each step); report progress to ``self.poll``."""

    @abstractmethod
    def stage_stats(self) -> dict:
        """The role's entries of ``get_stats()``."""

    # ------------------------------------------------------------ RoleHooks
    def check(self, request: GenerateRequest) -> Optional[str]:
        return self.bootstrap_problem(request)

    def admit(self, req: Req, request: GenerateRequest) -> bool:
        if request.trace is not None:
            self.trace_stamps.watch(req.rid, request.trace)
        self.stamp(req.rid, "scheduled")
        try:
            self.enter_stages(req, request)
        except KVTransferError as e:
            self.s.finish(req, FinishReason.abort(f"KV transfer: {e}"), keep_kv=False)
        return True

    def before_schedule(self) -> None:
        self.trace_stamps.drop_released()
        self.advance()
        if self.tp is not None:  # every rank's free KV slots, for get_stats (a collective, like advance's polls)
            self.free_slots_per_rank = self.tp.all_gather_object(self.s.kv.free_and_evictable())

    def on_prompt_done(
        self, req: Req, token_id: int, logprob: Optional[float], top_logprobs: Optional[list[tuple[int, float]]]
    ) -> bool:
        return False

    def watch_forward(self, batch: Any) -> Optional[Any]:
        return None

    def abort(self, rid: str, message: str) -> bool:
        entry = self.stages[0].remove(rid)
        if entry is not None:  # no slots yet, or none the transfer layer can touch
            entry.transfer.abort(message)
            self.s.finish(entry.req, FinishReason.abort(message), keep_kv=False)
            return True
        entry = self.stages[1].get(rid)
        if entry is not None:  # the slots are freed once the transfer layer lets go of them
            if entry.abort_reason is None:
                entry.abort_reason = message
                entry.transfer.abort(message)
            return True
        return False

    def on_finish(self, req: Req) -> None:
        """Staged requests are released by ``abort`` / ``close``; prefill also aborts a registered room here."""
        self.trace_stamps.release(req.rid)

    def has_work(self) -> bool:
        return any(self.stages)

    def poll_wait_s(self) -> Optional[float]:
        return self.poll.wait_s

    def close(self, message: str) -> None:
        self.kv_manager.close()  # fails every room; afterwards no transfer thread touches the pool
        for entry in [e for q in self.stages for e in q.pop_all()]:
            try:
                self.s.finish(entry.req, FinishReason.abort(message), keep_kv=False)
            except Exception:  # noqa: BLE001 - keep releasing the others
                logger.exception("could not release request %s", entry.rid)

    def stats(self) -> dict:
        return {
            "mode": self.mode,
            **self.stage_stats(),
            "kv_transfers_ok": self.counters["transferred"],
            "kv_transfers_failed": self.counters["failed"],
            **({} if self.free_slots_per_rank is None else {"free_slots_per_rank": self.free_slots_per_rank}),
        }

    # ------------------------------------------------------------ helpers for the roles
    def traced(self, rid: str) -> bool:
        """Whether ``rid``'s stages are wanted: a subscriber of every event, or its own ``return_trace``."""
        return self.s.events.active or rid in self.trace_stamps

    def stamp(self, rid: str, stage: str, at: Optional[float] = None) -> None:
        """``rid`` passed ``stage`` at ``at`` (default now, ``time.time()``): a ``PDStage`` event, when wanted."""
        if self.traced(rid):
            self.s.events.emit(PDStage(rid=rid, role=self.mode, stage=stage, at=time.time() if at is None else at))

    def stamp_transfer(self, entry: PDEntry, names: dict[str, str]) -> None:
        """Stamp the sender's / receiver's own ``stamps`` (``names``: its key -> the stage's name)."""
        if self.traced(entry.rid):
            for key, stage in names.items():
                at = entry.transfer.stamps.get(key)
                if at is not None:
                    self.stamp(entry.rid, stage, at)

    def emit_transfer(
        self, entry: PDEntry, ok: bool, start_key: str, end_key: str, pages: int, problem: Optional[str] = None
    ) -> None:
        """``KVTransferStarted`` / ``KVTransferFinished`` of ``entry``'s terminal transfer (docs/observability.md),
        timed by the sender's / receiver's own stamps ``start_key`` / ``end_key``; ``pages``: the prompt's pages
        that moved (every layer's K and V of each); ``problem``: why it failed (default ``entry.failure()``)."""
        bus = self.s.events
        if not bus.wants(KVTransferFinished):
            return
        stamps, backend = entry.transfer.stamps, self.kv_manager.config.backend
        start, end = stamps.get(start_key), stamps.get(end_key) or time.time()
        if start is not None and bus.wants(KVTransferStarted):
            bus.emit(KVTransferStarted(rid=entry.rid, role=self.mode, backend=backend, at=start))
        layout = self.kv_manager.layout
        message = "" if ok else problem or entry.failure()
        bus.emit(
            KVTransferFinished(
                rid=entry.rid,
                role=self.mode,
                backend=backend,
                ok=ok,
                bytes=int(pages) * layout.page_bytes * layout.num_buffers if ok else 0,
                seconds=max(0.0, end - start) if start is not None else 0.0,
                reason="" if ok else failure_kind(message),
                message=message,
                at=end,
            )
        )

    def guarded(self, entry: PDEntry, fn: Callable[..., None], *args: Any) -> None:
        """Run one entry's transition; a failure fails that request alone (its transfer is terminal here)."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - one bad request must not fail the others
            logger.exception("PD request %s failed in a stage transition", entry.rid)
            if not entry.req.finish_sent:
                self.s.fail([entry.req], e)

    def fail_entry(self, entry: PDEntry, reason: str, keep_kv: bool) -> None:
        self.counters["failed"] += 1
        self.s.finish(entry.req, FinishReason.abort(reason), keep_kv=keep_kv)


class PDScheduler(Scheduler):
    """A ``Scheduler`` whose role is ``role_cls``; adds only the constructor and the transfer layer's handle.

    ``slot_features``: a per-KV-slot buffer the transfer layer ships with the prompt's pages (prefill) or
    fills for them (decode): an EAGLE head's features (docs/speculative.md, "PD"); the app shell builds it.
    """

    role_cls: type[PDRole]
    role: PDRole

    def __init__(
        self,
        server_args: Any,
        model_runner: Any,
        tokenizer: Any,
        output_sink: Any,
        tuning: Any = None,
        kv_config: Optional[KVTransferConfig] = None,
        speculator: Any = None,
        slot_features: Optional[SlotFeatures] = None,
        io: Any = None,
        events: Any = None,
    ):
        super().__init__(
            server_args,
            model_runner,
            tokenizer,
            output_sink,
            tuning,
            role=lambda sched: self.role_cls(sched, kv_config, slot_features),
            speculator=speculator,
            io=io,
            events=events,
        )

    @property
    def kv_manager(self) -> Any:
        return self.role.kv_manager

    def close(self) -> None:
        """Stop the transfer layer (the loop does this itself when it exits)."""
        self.role.kv_manager.close()
