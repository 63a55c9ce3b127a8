"""Overlap scheduling for decode: the host work of step N runs while the GPU computes step N+1.

SGLang calls this the zero-overhead scheduler.  Without it, every decode step
is: build the batch on the host -> launch -> wait for the tokens -> process
them (stop checks, streaming) -> next step, and the GPU idles during the host
parts (~0.5 ms a step for an 8B model on an H100, 7-9% of a step).  With it:

    launch N+1 (its input ids are step N's sampled ids, still on the GPU)
    -> wait for N's tokens (already copied to pinned host memory) -> process N
    -> build and launch N+2 ...

so the GPU always has the next step queued behind the current one.

How a step is chained (``OverlapScheduler.step``):

* After a decode launch the batch is committed at once (``kv_committed_len``
  covers the new position), and its sampled ids stay on the device in
  ``_Pending``; a non-blocking copy to pinned memory and a CUDA event follow.
* The next decode batch is built from the same running requests.  For a
  request of the pending step its input id is gathered on the GPU from the
  pending ids (a "future token": nothing on the host knows it yet); requests
  that joined since (a PD decode worker admits prefilled ones) feed their
  host-side last token.  The batch's tensors go to the GPU in one pinned,
  non-blocking copy, and the sampling tensors too, so launching never waits
  for the GPU.
* Then the pending step is resolved through the scheduler's own
  ``_process_result`` (append tokens, stop checks, ``_finish`` / ``_emit``),
  and its chunks are flushed while the GPU runs the step just launched.

Between steps a request of the pending step therefore has K/V for every token
of ``fill_ids`` (``kv_committed_len == len(fill_ids)``; the synchronous loop
has one less) and its next token in flight.  Consequences, all handled here:

* A request that finishes when step N is resolved already took part in step
  N+1 (the "speculative" extra step).  Its slot of N+1 lies inside
  ``kv_allocated_len``, so ``_finish`` frees it (or caches it: the K/V of that
  last token is valid); the extra token is dropped when N+1 is resolved
  (finished requests are skipped).  Requests known to stop by length when N
  resolves are left out of N+1 altogether.  GPU work is ordered on one
  stream, so a freed slot or request row re-used by a later step is written
  only after N+1 has run.
* Anything that needs the true host state first resolves the pending step
  and runs synchronously: extend (prefill) batches, a decode that would have
  to retract (KV short even after evicting the cache), and batches with a
  request that is seeded or uses frequency/presence/repetition penalties
  (both depend on the output tokens the host has not seen yet).

Enabled on CUDA unless ``--disable-overlap-schedule``; CPU keeps the
synchronous loop (``KVSHIP_FORCE_OVERLAP_SCHEDULE=1`` turns it on anywhere;
tests use it to run this path on CPU).  Output is identical to the
synchronous loop for greedy requests (tests compare them token for token).
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Optional

import torch

from kvship.engine.forward_batch import ForwardBatch, ForwardMode
from kvship.engine.sampler import SampleOutput, SamplingBatchInfo

if TYPE_CHECKING:  # pragma: no cover
    from kvship.engine.schedule_batch import Req, ScheduleBatch
    from kvship.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

FORCE_ENV = "KVSHIP_FORCE_OVERLAP_SCHEDULE"


def overlap_enabled(server_args: Any, device: torch.device) -> bool:
    """Overlap runs on CUDA unless disabled; elsewhere only when ``KVSHIP_FORCE_OVERLAP_SCHEDULE=1``."""
    if getattr(server_args, "disable_overlap_schedule", False):
        return False
    return device.type == "cuda" or os.environ.get(FORCE_ENV) == "1"


def _needs_host_state(req: "Req") -> bool:
    """Sampling that reads the output tokens on the host (seeds, penalties): cannot run a step ahead."""
    p = req.sampling_params
    seeded = p.seed is not None and not p.is_greedy
    penalties = p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0
    return seeded or penalties


@dataclass
class _Pending:
    """A launched decode step whose tokens the host has not processed yet."""
    batch: "ScheduleBatch"
    next_ids: torch.Tensor                 # [bs] int64 on the device (the next step's "future" inputs)
    host: SampleOutput                     # the same outputs in (pinned) host memory, filled by async copies
    top_nums: list[int]
    event: Optional[torch.cuda.Event]      # recorded after the copies (None on CPU)
    index: dict[int, int]                  # id(req) -> row in next_ids


class OverlapScheduler:
    """Runs ``Scheduler.step`` for a scheduler with overlap on (see the module docstring)."""

    def __init__(self, sched: "Scheduler"):
        self.s = sched
        self.device = torch.device(sched.device)
        self.cuda = self.device.type == "cuda"
        self.pending: Optional[_Pending] = None
        self._resolving: Optional[_Pending] = None  # the step being processed (failed with it on error)
        self.launched = 0   # decode steps launched ahead of their predecessor's processing
        self.synced = 0     # steps that had to resolve the pending step first

    # ------------------------------------------------------------ helpers
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _to_host(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        if not self.cuda:
            return t.clone()
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        return h

    def has_pending(self) -> bool:
        return self.pending is not None

    def _can_chain(self) -> bool:
        """The next decode can be built on the lagged state: it will not need to retract."""
        s = self.s
        ps = s.page_size
        need = sum(1 for r in s.running if r.kv_committed_len % ps == 0) * ps
        return need <= s.allocator.available_size() + s.cache.evictable_size()

    @staticmethod
    def _chainable(batch: Optional["ScheduleBatch"]) -> bool:
        return (batch is not None and batch.forward_mode.is_decode()
                and not any(_needs_host_state(r) for r in batch.reqs))

    # ------------------------------------------------------------ the step
    def step(self, block_s: float = 0.0) -> bool:
        """One iteration of the overlapped loop; True when a forward ran (launched)."""
        s = self.s
        s._drain_inbox(0.0 if self.pending is not None else block_s)
        batch = None
        ran = False
        try:
            if self.pending is not None and not self._can_chain():
                self.synced += 1
                self.resolve()
            batch = s._get_next_batch()
            if self._chainable(batch):
                prev = self.pending
                if prev is not None:
                    # requests that stop by length once ``prev`` is processed need no further step
                    batch.reqs = [r for r in batch.reqs if not (id(r) in prev.index
                                                                and len(r.output_ids) + 1 >= r.max_new_tokens)]
                new = self._launch(batch) if batch.reqs else None
                ran = new is not None
                self.launched += int(ran and prev is not None)
                batch = None  # launched: it is ``self.pending`` from here on
                self.pending = new
                self._resolve(prev)
            else:
                if self.pending is not None:
                    self.synced += 1
                    self.resolve()
                if batch is not None:
                    # a decode built before the pending step was processed may hold finished requests
                    batch.reqs = [r for r in batch.reqs if not r.finished]
                    if batch.reqs:
                        s._run_batch(batch)
                        ran = True
        except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving
            logger.error("scheduler step failed:\n%s", traceback.format_exc())
            failed: list = list(batch.reqs) if batch is not None else []
            in_flight = [p for p in (self._resolving, self.pending) if p is not None]
            self.pending = self._resolving = None
            for p in in_flight:  # their host state is half-updated: fail them too
                failed += [r for r in p.batch.reqs if r not in failed]
            if failed:
                s._fail_reqs(failed, e)
            elif batch is None:  # scheduling itself failed: the state of every request is suspect
                s._fail_reqs(list(s.reqs.values()), e)
        s._flush()
        s._update_stats()
        return ran

    def _launch(self, batch: "ScheduleBatch") -> _Pending:
        """Allocate, build and launch one decode step without waiting for the GPU; commit it."""
        s, dev = self.s, self.device
        reqs = batch.reqs
        n = len(reqs)
        prev = self.pending
        batch.prefix_lens = [r.kv_committed_len for r in reqs]
        batch.seq_lens = [p + 1 for p in batch.prefix_lens]
        batch.extend_lens = [1] * n
        last_locs = [r.last_loc for r in reqs]
        loc = batch._alloc(s.allocator, s.cache, lambda: s.allocator.alloc_decode(batch.seq_lens, last_locs))
        batch.out_cache_loc = loc
        locs = loc.tolist()
        for r, sl, l in zip(reqs, batch.seq_lens, locs):
            r.kv_allocated_len = sl
            r.last_loc = l
        batch.sample_mask = [True] * n
        # input ids: rows of the pending step come from its device ids, the others from the host
        n_prev = 0 if prev is None else int(prev.next_ids.shape[0])
        src, host_ids, shown = [], [], []
        for r in reqs:
            j = None if prev is None else prev.index.get(id(r))
            if j is None:
                src.append(n_prev + len(host_ids))
                host_ids.append(r.output_ids[-1])
                shown.append(r.output_ids[-1])
            else:
                src.append(j)
                shown.append(-1)  # known only on the device until the pending step is processed
        batch.input_ids = shown
        batch.positions = list(batch.prefix_lens)
        rows = [r.req_pool_idx for r in reqs]
        host = torch.tensor(batch.prefix_lens + rows + batch.seq_lens + locs + src + host_ids, dtype=torch.int64)
        d = self._to_device(host)
        positions, rows_d, seq_d = d[0:n], d[n:2 * n], d[2 * n:3 * n]
        loc_d, src_d, hid_d = d[3 * n:4 * n], d[4 * n:5 * n], d[5 * n:]
        ids_pool = hid_d if prev is None else torch.cat([prev.next_ids, hid_d])
        input_ids = ids_pool.index_select(0, src_d)
        table = s.req_to_token_pool.req_to_token
        table[rows_d, positions] = loc_d.to(table.dtype)
        runner = s.runner
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=n, input_ids=input_ids, positions=positions,
                          req_pool_indices=rows_d, seq_lens=seq_d, seq_lens_cpu=list(batch.seq_lens),
                          out_cache_loc=loc_d, req_to_token_pool=s.req_to_token_pool, kv_pool=runner.kv_pool,
                          attn_backend=runner.attn_backend)
        info = SamplingBatchInfo.from_reqs(reqs, s.vocab_size, "cpu")
        for f in fields(info):
            v = getattr(info, f.name)
            if isinstance(v, torch.Tensor):
                setattr(info, f.name, self._to_device(v))
        with torch.inference_mode():
            logits = runner.forward(fb).next_token_logits
            if logits.shape[0] != n:
                raise RuntimeError(f"model returned {logits.shape[0]} logits rows for {n} requests")
            out = s.sampler(logits[:, :s.vocab_size], info)
            host_out = SampleOutput(next_token_ids=self._to_host(out.next_token_ids),
                                    logprobs=self._to_host(out.logprobs),
                                    top_logprobs=self._to_host(out.top_logprobs),
                                    top_logprob_ids=self._to_host(out.top_logprob_ids))
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        batch.commit()
        s.counters["decode_steps"] += 1
        return _Pending(batch=batch, next_ids=out.next_token_ids, host=host_out, top_nums=info.top_logprobs_nums,
                        event=event, index={id(r): j for j, r in enumerate(reqs)})

    def resolve(self) -> None:
        """Process the pending step now (the next step is not launched yet)."""
        p, self.pending = self.pending, None
        self._resolve(p)

    def _resolve(self, p: Optional[_Pending]) -> None:
        """Wait for ``p``'s tokens and process them (requests finished meanwhile are skipped)."""
        if p is None:
            return
        self._resolving = p
        if p.event is not None:
            p.event.synchronize()
        ids, lps, tops = p.host.to_lists(p.top_nums)
        keep = [j for j, r in enumerate(p.batch.reqs) if not r.finished]
        if keep:
            batch = p.batch
            batch.reqs = [batch.reqs[j] for j in keep]
            batch.sample_mask = [True] * len(keep)
            result = ([ids[j] for j in keep], None if lps is None else [lps[j] for j in keep],
                      None if tops is None else [tops[j] for j in keep])
            self.s._process_result(batch, result)
        self._resolving = None

    def drop(self) -> None:
        """Forget the pending step (shutdown: its requests are being aborted)."""
        p, self.pending = self.pending, None
        if p is not None and p.event is not None:
            p.event.synchronize()
