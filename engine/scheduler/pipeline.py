"""The pipeline-parallel loop: up to ``pp_size`` micro-batches in flight, so the stages work at once.

Every rank of every stage runs this loop over the same replicated scheduler
(``kvship.engine.scheduler.io.PipelineIO``), so they form the same batches
in the same order; a rank runs only its stage's part of each (the model
runner receives the previous stage's hidden states and sends its own on,
``kvship.engine.distributed.pipeline``).  One step::

    recv                 the leader's messages of this step (sent without waiting)
    schedule(busy)       a batch of requests not in flight: an extend, else a
                         decode of at most ceil(running / pp_size) requests
    launch               this stage's part (the last stage samples and, for
                         a decode, sends the ids to stage 0 on the device)
    chain                when the oldest batch in flight is a decode that is
                         about to be processed: its requests' next decode
                         (with any free running requests), launched *before*
                         it is processed, its input ids the oldest batch's
                         ids as stage 0 received them on the device
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

Chaining (``KVSHIP_PP_CHAIN``, on by default) takes the host out of the
loop between the stages: without it stage 0 forms micro-batch i's next
decode only after i's results reached its host and were processed, so both
GPUs idle for that round trip and the host work; with it stage 0's GPU
starts i's next decode as soon as the last stage's ids arrive (device to
device, ``StageLink.send_ids``), the host processing i meanwhile, as the
single-GPU overlap loop chains on ``after`` (docs/parallel.md, "Pipeline
parallelism").  The requests' host state is one step stale when the chained
batch is formed, with the overlap loop's rules: a request that stops by
length once i is processed is left out; one that stops otherwise (EOS, a
stop string, an abort) took part in the chained step, whose row is dropped
when it is processed, and its slot lies inside its ``kv_allocated_len``, so
finishing frees it.  A batch with a request that needs the host state
(seeds, penalties, a grammar) is not chained.

Invariants:

* A request is in at most one batch in flight (``busy``) outside a chained
  launch, and its next batch is formed after its step was processed, from
  the true host state, unless it is chained (above).  A chunked prompt's
  next chunk waits for the previous chunk's step.
* Every stage runs the batches in launch order, so KV slots freed by a
  request that finished (or was aborted) while a later batch was in flight
  are rewritten only by batches launched after it, on every stage.
* A decode that might retract (KV short even after evicting the cache)
  first processes every batch in flight, so retraction sees every request's
  true state.
* The last stage sends one result per launched batch and the earlier stages
  receive one per processed or dropped batch, in launch order; it sends
  device ids for every launched decode and stage 0 posts one receive per
  launched decode, in launch order (chained or not).
* Speculative decoding (``Scheduler.speculator``; docs/speculative.md,
  "Pipeline parallelism"): a decode batch takes every running request not
  in flight and runs as one speculative round after every batch in flight
  was processed (the round's acceptance travels on the results channel,
  which must be empty of earlier steps); extends still overlap.
* ``stats()``: ``pp_max_in_flight`` (the most batches ever in flight at
  once), ``pp_overlapped_launches`` (batches launched while another was
  in flight), ``pp_chained_launches`` (decodes launched on device ids) and
  ``pp_host_s`` (this rank's host seconds per part of its steps: ``recv``,
  ``schedule``, ``launch``, ``results_wait`` (blocked on the last stage's
  results), ``process``, ``end_step``; every rank logs its own every
  ``LOG_EVERY_S`` while it works).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any, Optional

import torch

from kvship.engine.scheduler.launch import Pending, chainable_rows, needs_host_state

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.distributed.pipeline import StageLink
    from kvship.engine.schedule_batch import Req, ScheduleBatch
    from kvship.engine.scheduler.core import Scheduler

logger = logging.getLogger(__name__)

LOG_EVERY_S = 30.0  # each rank logs its host seconds per step part this often while it works


class PipelineLoop:
    """``step`` for a scheduler whose model runs as pipeline stages (see the module docstring)."""

    def __init__(self, sched: "Scheduler", link: "StageLink", chain: Optional[bool] = None):
        self.s = sched
        self.link = link
        self.depth = link.pp_size  # micro-batches in flight
        self.chain = link.chain if chain is None else chain  # every rank agreed on it (``StageLink.chain``)
        self.inflight: deque[Pending] = deque()
        self.busy: dict[int, "Req"] = {}  # id(req) -> req, for every request of a batch in flight
        self._refs: Counter[int] = Counter()  # id(req) -> batches in flight holding it (2 while chained)
        self._ids_work: dict[int, Any] = {}  # stage 0: id(pending) -> the receive of its device ids
        self._processing: Optional[Pending] = None
        self._unsent: set[int] = set()  # the last stage: id() of launched batches whose results are not sent yet
        self.max_in_flight = 0
        self.overlapped = 0
        self.chained = 0
        self.steps = 0
        self.host_s: Counter[str] = Counter()  # step part -> host seconds (``stats``)
        self._logged = time.monotonic()

    def _took(self, part: str, t: float) -> float:
        now = time.perf_counter()
        self.host_s[part] += now - t
        return now

    def has_pending(self) -> bool:
        return bool(self.inflight)

    def stats(self) -> dict:
        return {
            "pp_max_in_flight": self.max_in_flight,
            "pp_overlapped_launches": self.overlapped,
            "pp_chained_launches": self.chained,
            "pp_steps": self.steps,
            "pp_host_s": {k: round(v, 3) for k, v in self.host_s.items()},
        }

    def step(self, block_s: float = 0.0) -> bool:
        """One iteration; True when a batch was launched."""
        s = self.s
        t = time.perf_counter()
        s.recv(0.0 if self.inflight else block_s)
        t = self._took("recv", t)
        if self.link.stopped:  # the leader has left its loop: no batch of this step reaches it
            return False
        batch: Optional["ScheduleBatch"] = None
        launched = False
        try:
            if self.inflight and not s.kv.fits_decode(s.running):
                self.drain()  # retraction needs every request's true state
            spec = s.speculator is not None
            full = len(self.inflight) >= self.depth
            if not (full and self._chainable(self.inflight[0])):  # a full pipeline chains its oldest instead
                batch = s.schedule(busy=self.busy, parts=1 if spec else self.depth)
                t = self._took("schedule", t)
                if batch is not None and spec and batch.forward_mode.is_decode():
                    self._speculate(batch)
                    launched = True
                elif batch is not None:
                    self._launch(batch)
                    batch = None  # launched: it is in ``inflight`` from here on
                    launched = True
                    t = self._took("launch", t)
            if self.inflight and (len(self.inflight) >= self.depth or not launched):
                oldest = self.inflight.popleft()
                self._processing = oldest
                if self._chainable(oldest) and s.kv.fits_decode(s.running):  # (a chained decode never retracts)
                    batch = s.schedule(busy=self._busy_but(oldest), parts=self.depth)
                    t = self._took("schedule", t)
                    if batch is not None:
                        launched |= self._launch_chained(batch, oldest)
                        batch = None
                        t = self._took("launch", t)
                self._process(oldest)
        except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving
            failed = list(batch.reqs) if batch is not None else []
            dropped = ([self._processing] if self._processing is not None else []) + list(self.inflight)
            for p in dropped:
                failed += [r for r in p.batch.reqs if r not in failed]
            self._forget(dropped)
            s.fail_step(e, failed if failed or batch is not None else None)
        t = time.perf_counter()
        s.end_step()
        self._took("end_step", t)
        self.steps += 1
        if launched and time.monotonic() - self._logged > LOG_EVERY_S:
            self._logged = time.monotonic()
            logger.info("%s: %s", self.link.describe(), self.stats())
        return launched

    def _chainable(self, p: Pending) -> bool:
        """``p``'s requests may decode again before ``p`` is processed (module docstring)."""
        return (
            self.chain
            and self.s.speculator is None
            and p.batch.forward_mode.is_decode()
            and not any(needs_host_state(r) for r in p.batch.reqs)
        )

    def _busy_but(self, p: Pending) -> dict[int, "Req"]:
        return {k: r for k, r in self.busy.items() if k not in p.index or self._refs[k] > 1}

    def _launch(self, batch: "ScheduleBatch", after: Optional[Pending] = None) -> Pending:
        """Launch ``batch`` (chained on ``after``'s device ids) and track it in flight; the last stage starts
        sending a decode's ids, stage 0 posts their receive."""
        s, link = self.s, self.link
        if after is not None:
            work = self._ids_work.pop(id(after), None)
            if work is not None:
                work.wait()  # NCCL: the current stream waits for the ids (the host does not)
        pending = s.launch(batch, after=after)
        decode = batch.forward_mode.is_decode() and bool(pending.index)
        if link.is_last:
            self._unsent.add(id(pending))  # sent when processed (module docstring)
            if decode and self.chain:
                link.send_ids(pending.next_ids)
        elif decode and self.chain:
            n = len(pending.index)
            if link.is_first:
                pending.next_ids, self._ids_work[id(pending)] = link.recv_ids(n, s.launcher.device)
            else:  # a middle stage embeds nothing: a chained batch's input ids are placeholders
                pending.next_ids = torch.zeros(n, dtype=torch.int64, device=s.launcher.device)
        self.overlapped += int(bool(self.inflight) or self._processing is not None)
        self.inflight.append(pending)
        for r in pending.batch.reqs:
            self.busy[id(r)] = r
            self._refs[id(r)] += 1
        self.max_in_flight = max(self.max_in_flight, len(self.inflight) + int(self._processing is not None))
        return pending

    def _launch_chained(self, batch: "ScheduleBatch", oldest: Pending) -> bool:
        """Launch ``batch`` before ``oldest`` is processed: chained on its ids when it is a decode (requests
        that stop by length once ``oldest`` is processed left out), as it is when it is an extend."""
        if batch.forward_mode.is_decode():
            batch.reqs = chainable_rows(batch.reqs, oldest)
            if not batch.reqs:
                return False
            self._launch(batch, after=oldest)
            self.chained += 1
            return True
        self._launch(batch)
        return True

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

    def _release(self, p: Pending) -> None:
        """``p`` left the pipeline: its requests are free unless a chained batch in flight holds them."""
        for r in p.batch.reqs:
            k = id(r)
            self._refs[k] -= 1
            if self._refs[k] <= 0:
                del self._refs[k]
                self.busy.pop(k, None)

    def _process(self, p: Pending) -> None:
        self._processing = p
        t = time.perf_counter()
        if id(p) in self._unsent:
            self._unsent.discard(id(p))
            self.link.send_results(p.results())
        elif p.remote:
            p.resolve(self.link.recv_results())
        work = self._ids_work.pop(id(p), None)
        if work is not None:  # not chained on: its receive completes (its ids arrived before its results)
            work.wait()
        t = self._took("results_wait", t)
        self._release(p)
        self.s.process(p)
        self._took("process", t)
        self._processing = None

    def _forget(self, dropped: list[Pending]) -> None:
        """A step failed: drop ``dropped`` (their requests are being failed), taking the results the last stage
        sent for them, so the channel stays in step with the launches."""
        self.inflight.clear()
        self._processing = None
        for p in dropped:
            self._release(p)
            if id(p) in self._unsent:  # the last stage: the earlier stages wait for one result per dropped batch
                self._unsent.discard(id(p))
                try:
                    results = p.results()
                except Exception:  # noqa: BLE001 - its requests are being failed: any placeholder keeps the channel
                    results = ([], None, None)
                self.link.send_results(results)
            elif p.awaiting_results:
                p.resolve(self.link.recv_results())
            work = self._ids_work.pop(id(p), None)
            if work is not None:
                work.wait()

    def drop(self) -> None:
        """Forget the batches in flight (shutdown: their requests are being aborted)."""
        for p in self.inflight:
            p.wait()
        self.inflight.clear()
        self._unsent.clear()
        self._ids_work.clear()
        self.busy.clear()
        self._refs.clear()
