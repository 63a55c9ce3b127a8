"""The overlapped loop: the host work of decode step N runs while the device computes step N+1.

Built from the scheduler's public steps (``recv``, ``schedule``, ``launch``,
``process``, ``end_step``); ``Scheduler.step`` is the synchronous loop::

    launch N+1 (its input ids are step N's sampled ids, still on the device)
    -> process N (its tokens were copied to pinned host memory behind an event)
    -> sample N+1 -> schedule and launch N+2 ...

A chained batch with constrained requests launches with its sampling
deferred: the launch queues N+1's forward, feeds step N's tokens to the
grammars and starts filling N+1's masks on the launcher's mask thread; the
scheduler thread processes N and hands its chunks to the output sink
meanwhile, then ``sample`` joins the fill, applies the masks and queues N+1's
sampler (``kvship.engine.scheduler.launch``).  Plain batches sample at launch,
so ``sample`` does nothing for them.

Invariants:

* Between steps a request of the pending step has K/V for every token of
  ``fill_ids`` (the synchronous loop has one less) and its next token in
  flight.  A request that finishes when step N is processed already took
  part in step N+1; its slot of N+1 lies inside ``kv_allocated_len``, so
  finishing frees (or caches) it, and ``process`` skips finished requests
  when N+1 resolves.  Requests known to stop by length once N is processed
  are left out of N+1.
* Anything that needs the true host state first processes the pending step
  and runs synchronously: extend batches, a decode that might retract (KV
  short even after evicting the cache), and batches with a request that is
  seeded or uses penalties (``reads_host_tokens``).  Constrained requests
  chain: their grammars take step N's tokens while step N+1's forward runs
  (``kvship.engine.scheduler.launch``).
* Between steps the pending step is sampled: a step's deferred sampling
  never outlives it, and a step that fails gives its mask fill up
  (``Launcher.abandon``) before its requests are failed.
* Greedy output equals the synchronous loop's token for token.

On CUDA unless ``--disable-overlap-schedule``; ``KVSHIP_FORCE_OVERLAP_SCHEDULE=1``
runs it anywhere (tests use it on CPU).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from kvship.engine.scheduler.launch import Pending, chainable_rows, reads_host_tokens

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.schedule_batch import ScheduleBatch
    from kvship.engine.scheduler.core import Scheduler

FORCE_ENV = "KVSHIP_FORCE_OVERLAP_SCHEDULE"


class OverlapLoop:
    """``step`` for a scheduler with overlap on (see the module docstring)."""

    def __init__(self, sched: "Scheduler"):
        self.s = sched
        self.pending: Optional[Pending] = None
        self._processing: Optional[Pending] = None  # the step being processed (failed with it on error)
        self.launched = 0  # decode steps launched ahead of their predecessor's processing
        self.synced = 0  # steps that had to process the pending step first

    def has_pending(self) -> bool:
        return self.pending is not None

    @staticmethod
    def _chainable(batch: Optional["ScheduleBatch"]) -> bool:
        return (
            batch is not None and batch.forward_mode.is_decode() and not any(reads_host_tokens(r) for r in batch.reqs)
        )

    def step(self, block_s: float = 0.0) -> bool:
        """One iteration of the overlapped loop; True when a forward ran."""
        s = self.s
        ph = s.events.phases  # StepPhase subscribers (docs/observability.md): time each step, else nothing
        t = time.perf_counter() if ph else 0.0
        s.recv(0.0 if self.pending is not None else block_s)
        if ph:
            t = s.phase_done("recv", t)
        batch = None
        ran = False
        try:
            if self.pending is not None and not s.kv.fits_decode(s.running):
                self.sync()
                if ph:
                    t = time.perf_counter()
            batch = s.schedule()
            if ph:
                t = s.phase_done("schedule", t)
            if self._chainable(batch):
                prev = self.pending
                if prev is not None:  # requests that stop by length once ``prev`` is processed need no step
                    batch.reqs = chainable_rows(batch.reqs, prev)
                # masks fill aside only while there is a step to process meanwhile
                self.pending = s.launch(batch, after=prev, defer_sampling=prev is not None) if batch.reqs else None
                if ph and self.pending is not None:
                    t = s.phase_done("launch", t)
                ran = self.pending is not None
                self.launched += int(ran and prev is not None)
                batch = None  # launched: it is ``self.pending`` from here on
                self._process(prev)  # while the masks of ``self.pending`` fill, if it has any
                if self.pending is not None and self.pending.sampling is not None:
                    t = time.perf_counter() if ph else 0.0
                    s.flush()  # step N's chunks go out before N+1's sampler waits for its masks
                    if ph:
                        t = s.phase_done("flush", t)
                    s.sample(self.pending)
                    if ph:
                        s.phase_done("sample", t)
            else:
                self.sync()
                if batch is not None:
                    # a decode built before the pending step was processed may hold finished requests
                    batch.reqs = [r for r in batch.reqs if not r.finished]
                    if batch.reqs:
                        t = time.perf_counter() if ph else 0.0
                        pending = s.launch(batch)
                        if ph:
                            t = s.phase_done("launch", t)
                        s.process(pending)
                        if ph:
                            s.phase_done("process", t)
                        ran = True
        except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving
            failed = list(batch.reqs) if batch is not None else []
            for p in (self._processing, self.pending):  # their host state is half-updated: fail them too
                if p is not None:
                    s.launcher.abandon(p)  # a mask fill in flight ends before its requests are failed
                    failed += [r for r in p.batch.reqs if r not in failed]
            self.pending = self._processing = None
            s.fail_step(e, failed if failed or batch is not None else None)
        t = time.perf_counter() if ph else 0.0
        s.end_step()
        if ph:
            s.phase_done("end_step", t)
        return ran

    def sync(self) -> None:
        """Process the pending step now (nothing is chained behind it)."""
        if self.pending is not None:
            self.synced += 1
            p, self.pending = self.pending, None
            self._process(p)

    def _process(self, p: Optional[Pending]) -> None:
        if p is None:
            return
        self._processing = p
        t = time.perf_counter() if self.s.events.phases else 0.0
        self.s.process(p)
        if t:
            self.s.phase_done("process", t)
        self._processing = None

    def drop(self) -> None:
        """Forget the pending step (shutdown: its requests are being aborted)."""
        p, self.pending = self.pending, None
        if p is not None:
            p.wait()
