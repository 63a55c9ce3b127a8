"""The pipeline-parallel loop: up to ``pp_size`` micro-batches in flight, so the stages work at once.

Every rank of every stage runs this loop over the same replicated scheduler
(``kvship.engine.scheduler.io.PipelineIO``), so they form the same batches
in the same order; a rank runs only its stage's part of each (the model
runner receives the previous stage's hidden states and sends its own on,
``kvship.engine.distributed.pipeline``).  One step::

    recv                 the leader's messages of this step (sent without waiting)
    schedule(busy)       a batch of requests not in flight: an extend, else a
                         decode of at most ceil(running / pp_size) requests
    launch               this stage's part (the last stage samples)
    process oldest       when pp_size batches are in flight (or nothing new
                         was launched): the last stage sends its results to
                         the earlier stages, which take them first

So while the last stage computes micro-batch i, stage 0 already computes
i + 1 (with two stages; i + pp_size - 1 with more).  The last stage sends
i's results only when it processes i, after it has launched i + 1 in the
same step: its host waits for i's tokens with i + 1 already queued behind
them on its GPU, so the GPU runs the two back to back instead of idling
while the host schedules (the earlier stages process i in that same step, so
nobody waits for a later step).

Invariants:

* A request is in at most one batch in flight (``busy``); its next batch is
  formed after its step was processed, from the true host state.  A chunked
  prompt's next chunk waits for the previous chunk's step.
* Every stage runs the batches in launch order, so KV slots freed by a
  request that finished (or was aborted) while a later batch was in flight
  are rewritten only by batches launched after it, on every stage.
* A decode that might retract (KV short even after evicting the cache)
  first processes every batch in flight, so retraction sees every request's
  true state.
* The last stage sends one result per launched batch and the earlier stages
  receive one per processed or dropped batch, in launch order.
* Speculative decoding (``Scheduler.speculator``; docs/speculative.md,
  "Pipeline parallelism"): a decode batch takes every running request not
  in flight and runs as one speculative round after every batch in flight
  was processed (the round's acceptance travels on the results channel,
  which must be empty of earlier steps); extends still overlap.
* ``stats()``: ``pp_max_in_flight`` (the most batches ever in flight at
  once) and ``pp_overlapped_launches`` (batches launched while another was
  in flight).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Optional

from kvship.engine.scheduler.launch import Pending

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.distributed.pipeline import StageLink
    from kvship.engine.schedule_batch import Req, ScheduleBatch
    from kvship.engine.scheduler.core import Scheduler

logger = logging.getLogger(__name__)


class PipelineLoop:
    """``step`` for a scheduler whose model runs as pipeline stages (see the module docstring)."""

    def __init__(self, sched: "Scheduler", link: "StageLink"):
        self.s = sched
        self.link = link
        self.depth = link.pp_size  # micro-batches in flight
        self.inflight: deque[Pending] = deque()
        self.busy: dict[int, "Req"] = {}  # id(req) -> req, for every request of a batch in flight
        self._processing: Optional[Pending] = None
        self._unsent: set[int] = set()  # the last stage: id() of launched batches whose results are not sent yet
        self.max_in_flight = 0
        self.overlapped = 0

    def has_pending(self) -> bool:
        return bool(self.inflight)

    def stats(self) -> dict:
        return {"pp_max_in_flight": self.max_in_flight, "pp_overlapped_launches": self.overlapped}

    def step(self, block_s: float = 0.0) -> bool:
        """One iteration; True when a batch was launched."""
        s = self.s
        s.recv(0.0 if self.inflight else block_s)
        if self.link.stopped:  # the leader has left its loop: no batch of this step reaches it
            return False
        batch: Optional["ScheduleBatch"] = None
        launched = False
        try:
            if self.inflight and not s.kv.fits_decode(s.running):
                self.drain()  # retraction needs every request's true state
            spec = s.speculator is not None
            batch = s.schedule(busy=self.busy, parts=1 if spec else self.depth)
            if batch is not None and spec and batch.forward_mode.is_decode():
                self._speculate(batch)
                launched = True
            elif batch is not None:
                pending = s.launch(batch)
                batch = None  # launched: it is in ``inflight`` from here on
                if self.link.is_last:
                    self._unsent.add(id(pending))  # sent when processed (module docstring)
                self.overlapped += int(bool(self.inflight))
                self.inflight.append(pending)
                self.busy.update((id(r), r) for r in pending.batch.reqs)
                self.max_in_flight = max(self.max_in_flight, len(self.inflight))
                launched = True
            if self.inflight and (len(self.inflight) >= self.depth or not launched):
                self._process(self.inflight.popleft())
        except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving
            failed = list(batch.reqs) if batch is not None else []
            dropped = ([self._processing] if self._processing is not None else []) + list(self.inflight)
            for p in dropped:
                failed += [r for r in p.batch.reqs if r not in failed]
            self._forget(dropped)
            s.fail_step(e, failed if failed or batch is not None else None)
        s.end_step()
        return launched

    def _speculate(self, batch: "ScheduleBatch") -> None:
        """A decode batch as one speculative round, with nothing else in flight (module docstring); requests that
        need the host state decode plainly first, their tokens sent from the last stage like any step's."""
        s = self.s
        self.drain()
        spec, plain = s.speculator.splits(batch)
        if plain:
            batch.reqs = plain
            pending = s.launch(batch)
            if self.link.is_last:
                self.link.send_results(pending.results())
            else:
                pending.resolve(self.link.recv_results())
            s.process(pending)
        if spec:
            s.speculator.run(spec)

    def drain(self) -> None:
        """Process every batch in flight, oldest first."""
        while self.inflight:
            self._process(self.inflight.popleft())

    def _process(self, p: Pending) -> None:
        self._processing = p
        if id(p) in self._unsent:
            self._unsent.discard(id(p))
            self.link.send_results(p.results())
        elif p.remote:
            p.resolve(self.link.recv_results())
        for r in p.batch.reqs:
            self.busy.pop(id(r), None)
        self.s.process(p)
        self._processing = None

    def _forget(self, dropped: list[Pending]) -> None:
        """A step failed: drop ``dropped`` (their requests are being failed), taking the results the last stage
        sent for them, so the channel stays in step with the launches."""
        self.inflight.clear()
        self._processing = None
        for p in dropped:
            for r in p.batch.reqs:
                self.busy.pop(id(r), None)
            if id(p) in self._unsent:  # the last stage: the earlier stages wait for one result per dropped batch
                self._unsent.discard(id(p))
                try:
                    results = p.results()
                except Exception:  # noqa: BLE001 - its requests are being failed: any placeholder keeps the channel
                    results = ([], None, None)
                self.link.send_results(results)
            elif p.awaiting_results:
                p.resolve(self.link.recv_results())

    def drop(self) -> None:
        """Forget the batches in flight (shutdown: their requests are being aborted)."""
        for p in self.inflight:
            p.wait()
        self.inflight.clear()
        self._unsent.clear()
        self.busy.clear()
