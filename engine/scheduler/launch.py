"""Launching a batch on the model and reading its sampled tokens back.

``Launcher.launch(batch, after=None, defer_sampling=False)`` allocates the
batch's KV slots, builds its ``ForwardBatch``, runs the model and the sampler
(with ``defer_sampling``, the sampler may wait for ``Launcher.sample``), and
returns a ``Pending`` without waiting for the device: the sampled ids stay on
the device (``Pending.next_ids``) and are copied to (pinned) host memory
behind an event.  ``Pending.results()`` waits for that copy.

Contract:

* The batch is committed at launch (``kv_committed_len`` covers every
  position it computes): once launched, a step counts as done for KV
  bookkeeping; if ``results()`` or the processing fails, the caller fails the
  batch's requests.
* ``after``: a decode launched while ``after`` (the previous decode) is not
  processed yet.  A request of ``after`` takes its input id from
  ``after.next_ids`` on the device (its newest token is not known on the
  host); the others feed their host-side newest token.  GPU work is ordered
  on one stream, so the chained step reads ids that are written before it.
* Decode inputs go to the device in one non-blocking copy from pinned
  memory, and so do the sampling tensors, unless a request samples from a
  seeded per-request generator or uses penalties (``reads_host_tokens``),
  whose tensors are built on the device directly.  An all-greedy batch's
  sampling tensors stay on the host: its sampler reads only the logits.
  The decode inputs reach a CUDA graph's buffers in one copy
  (``ForwardBatch.decode_inputs``), and a chained step whose rows are
  ``after``'s in order takes ``after.next_ids`` as its input ids as they are.
* Constrained requests (structured output) get their grammar's mask applied
  to the logits before sampling (``kvship.engine.grammar.mask``), after the
  forward is queued, so the host fills masks while the device computes.  In
  a chained step the matchers have not seen ``after``'s tokens yet: the
  launch waits for ``after``'s tokens only (this step's forward is already
  queued behind them), feeds them to the grammars in one call
  (``Req.feed_grammars``; ``append_token`` takes that outcome when ``after``
  is processed) and then fills the masks.  Rows whose grammar refused or
  ended on that token are left unmasked: those requests finish when
  ``after`` is processed and this step's token for them is dropped, as for
  any request that finished.
* ``watch`` (``RoleHooks.watch_forward``): ``start()`` once the batch's
  slots are allocated, its result as ``ForwardBatch.layer_done``; ``end(ok)``
  once the model returned or raised.
* ``defer_sampling=True`` (the overlapped loop's chained steps): when the
  batch has masks to fill, they fill on the launcher's ``MaskFiller`` thread
  and the launch returns with the sampler not queued yet
  (``Pending.sampling``); the caller processes ``after`` meanwhile, then
  calls ``sample``, which waits for the masks, applies them and queues the
  sampler.  Until then the matchers of the filled rows belong to the filler
  (``after``'s processing does not touch them: ``append_token`` takes the
  fed outcome), ``results`` may not be called, and a request that finishes
  meanwhile has its KV released as usual (its row is sampled and dropped).
  A step that fails in between is given up with ``abandon``.  Without
  ``defer_sampling``, or with no mask to fill, the launch samples at once.
* A pipeline stage before the last (its runner returns a ``StageOutput``)
  samples nothing: its ``Pending`` is ``remote`` and gets the last stage's
  results through ``resolve`` before it is processed
  (``kvship.engine.scheduler.pipeline``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

from kvship.engine.forward_batch import ForwardBatch, ForwardMode, StageOutput, build_forward_batch
from kvship.engine.grammar.mask import MaskFill, MaskFiller, apply_bitmask, fill_bitmask
from kvship.engine.sampler import SampleOutput, SamplingBatchInfo
from kvship.engine.schedule_batch import Req, ScheduleBatch
from kvship.engine.scheduler.role import ForwardWatch

Results = tuple[list[int], Optional[list[float]], Optional[list[list[tuple[int, float]]]]]


def reads_host_tokens(req: Req) -> bool:
    """Sampling that reads the output tokens on the host (seeds, penalties): cannot run a step ahead."""
    p = req.sampling_params
    seeded = p.seed is not None and not p.is_greedy
    return seeded or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0


def chainable_rows(reqs: list[Req], prev: Pending) -> list[Req]:
    """The requests of a decode launched before ``prev`` is processed: all but the finished ones and those of
    ``prev`` that stop by length once it is (their last token is ``prev``'s); the overlap and pipeline loops."""
    return [
        r for r in reqs if not r.finished and not (id(r) in prev.index and len(r.output_ids) + 1 >= r.max_new_tokens)
    ]


def needs_host_state(req: Req) -> bool:
    """``reads_host_tokens`` or constrained by a grammar: every token known on the host before the
    next is chosen (speculative rounds leave such requests out)."""
    return reads_host_tokens(req) or req.grammar is not None


@dataclass
class DeferredSampling:
    """A launched step's sampler inputs, kept until its grammar masks are filled (``Launcher.sample``)."""

    logits: torch.Tensor  # [n sampled, vocab] on the device, the forward's output
    info: SamplingBatchInfo
    masks: Optional[MaskFill]  # None: no constrained row


@dataclass
class Pending:
    """A launched batch whose sampled tokens the host has not processed yet."""

    batch: ScheduleBatch
    next_ids: Optional[torch.Tensor]  # [n sampled] int64 on the device; None when nothing was sampled
    host: Optional[SampleOutput]  # the same outputs in host memory, filled by async copies
    top_nums: list[int]
    event: Optional[Any]  # torch.cuda.Event recorded after the copies (None off CUDA)
    index: dict[int, int]  # id(req) -> row in next_ids (decode batches)
    sampling: Optional[DeferredSampling] = None  # set while the sampler is not queued yet (``defer_sampling``)
    remote: bool = False  # sampled by a later pipeline stage: its results come through ``resolve``
    _results: Optional[Results] = None  # ``results()``, once read

    @property
    def awaiting_results(self) -> bool:
        """A ``remote`` step not resolved yet."""
        return self.remote and self._results is None

    def resolve(self, results: Results) -> None:
        """A ``remote`` step's results, as the last pipeline stage sampled them."""
        if not self.remote:
            raise RuntimeError("only a step sampled by a later pipeline stage is resolved from outside")
        self._results = results

    def results(self) -> Results:
        """Wait for the host copies; (ids, logprobs, top logprobs) per sampled request, in batch order."""
        if self.sampling is not None:
            raise RuntimeError("this step is not sampled yet: Launcher.sample(pending) first")
        if self.remote and self._results is None:
            raise RuntimeError("this step is sampled by the last pipeline stage: resolve it with its results first")
        if self._results is None:
            if self.event is not None:
                self.event.synchronize()
            self._results = ([], None, None) if self.host is None else self.host.to_lists(self.top_nums)
        return self._results

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class Launcher:
    """Turns ``ScheduleBatch``es into model forwards (see the module docstring)."""

    def __init__(self, runner: Any, sampler: Any, vocab_size: int, cache: Any):
        self.runner = runner
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.cache = cache
        self.device = torch.device(runner.device)
        self.cuda = self.device.type == "cuda"
        self.masks = MaskFiller()  # chained steps' grammar masks fill on its thread (``defer_sampling``)
        self._built = True

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("runner", "sampler") and self.__dict__.get("_built", False):
            raise AttributeError(f"Launcher.{name} is fixed at construction (the scheduler's io wraps the sampler)")
        object.__setattr__(self, name, value)

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

    def launch(
        self,
        batch: ScheduleBatch,
        after: Optional[Pending] = None,
        defer_sampling: bool = False,
        watch: Optional[ForwardWatch] = None,
    ) -> Pending:
        runner = self.runner
        if batch.forward_mode.is_decode():
            fb = self._decode_forward_batch(batch, after)
        else:
            batch.prepare_for_extend(runner.allocator, runner.req_to_token_pool, self.cache)
            fb = batch.to_forward_batch(self.device, runner.req_to_token_pool, runner.kv_pool, runner.attn_backend)
        # host-tier pages loaded back at admission: copied layer by layer while the forward runs
        loads = None if batch.forward_mode.is_decode() else self.cache.take_loads()
        if loads is not None:
            fb.kv_ready = loads.wait
        reqs = batch.sampling_reqs
        try:
            if watch is not None:
                fb.layer_done = watch.start()
            with torch.inference_mode():
                out = runner.forward(fb)
        except BaseException:
            if watch is not None:
                watch.end(False)
            if loads is not None:
                with contextlib.suppress(RuntimeError):
                    loads.finish()
            raise
        if loads is not None:
            loads.finish()
            self.cache.poll_loads()  # (on CPU the copies are done now: their pages unlock at once)
        if watch is not None:
            watch.end(True)
        index = {id(r): j for j, r in enumerate(reqs)}
        if isinstance(out, StageOutput):  # an earlier pipeline stage: the last one samples (module docstring)
            batch.commit()
            return Pending(batch=batch, next_ids=None, host=None, top_nums=[], event=None, index=index, remote=True)
        info = self._sampling_info(reqs) if reqs else None
        logits = out.next_token_logits[:, : self.vocab_size]
        if logits.shape[0] != len(reqs):
            raise RuntimeError(f"model returned {logits.shape[0]} logits rows for {len(reqs)} requests")
        batch.commit()
        pending = Pending(
            batch=batch,
            next_ids=None,
            host=None,
            top_nums=[] if info is None else info.top_logprobs_nums,
            event=None,
            index=index,
        )
        if info is None:
            pending.event = self._record_event()
            return pending
        masks = None
        if any(r.grammar is not None for r in reqs):  # structured output: constrained rows only
            skip = self._feed_grammars(reqs, after)
            if defer_sampling:
                masks = self.masks.start(reqs, self.vocab_size, skip, pin=self.cuda)
            else:
                masks = MaskFill(*fill_bitmask(reqs, self.vocab_size, skip))
        pending.sampling = DeferredSampling(logits, info, masks)
        if masks is None or not masks.in_flight:
            self.sample(pending)
        return pending

    def sample(self, pending: Pending) -> None:
        """Queue the sampler of a step launched with ``defer_sampling`` (a no-op once sampled): wait for
        its masks, apply them, sample, and start the copies of the tokens to the host."""
        d, pending.sampling = pending.sampling, None
        if d is None:
            return
        with torch.inference_mode():
            logits = d.logits
            if d.masks is not None:
                apply_bitmask(logits, *d.masks.wait())
            out = self.sampler(logits, d.info)
            pending.next_ids = out.next_token_ids
            pending.host = SampleOutput(
                next_token_ids=self._to_host(out.next_token_ids),
                logprobs=self._to_host(out.logprobs),
                top_logprobs=self._to_host(out.top_logprobs),
                top_logprob_ids=self._to_host(out.top_logprob_ids),
            )
        pending.event = self._record_event()

    @staticmethod
    def abandon(pending: Optional[Pending]) -> None:
        """Give up a step whose sampling was deferred (it failed): wait for its mask fill, so its
        matchers are the scheduler thread's again, and never sample it."""
        d = None if pending is None else pending.sampling
        if d is not None:
            pending.sampling = None
            if d.masks is not None:
                d.masks.abandon()

    def close(self) -> None:
        self.masks.close()

    def _record_event(self) -> Optional[Any]:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @staticmethod
    def _feed_grammars(reqs: list[Req], after: Optional[Pending]) -> set[int]:
        """A chained step's grammars take ``after``'s tokens (see the module docstring); returns the
        ids of requests whose grammar refused or ended on it (their rows stay unmasked)."""
        if after is None:
            return set()
        fed = [r for r in reqs if r.grammar is not None and not r.finished and id(r) in after.index]
        if not fed:
            return set()
        ids = after.results()[0]  # waits for ``after`` only: this step's forward is queued
        ok = Req.feed_grammars(fed, [ids[after.index[id(r)]] for r in fed])
        return {id(r) for r, keep in zip(fed, ok) if not keep}

    def _sampling_info(self, reqs: list[Req]) -> SamplingBatchInfo:
        if any(reads_host_tokens(r) for r in reqs):
            return SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.device)
        info = SamplingBatchInfo.from_reqs(reqs, self.vocab_size, "cpu")
        if info.is_all_greedy:
            return info  # the sampler reads only the logits of an all-greedy batch: no tensor to copy
        for f in fields(info):
            v = getattr(info, f.name)
            if isinstance(v, torch.Tensor):
                setattr(info, f.name, self._to_device(v))
        return info

    def _decode_forward_batch(self, batch: ScheduleBatch, after: Optional[Pending]) -> ForwardBatch:
        runner = self.runner
        reqs = batch.reqs
        n = len(reqs)
        locs = batch.prepare_for_decode(runner.allocator, self.cache)
        # input ids: rows of ``after`` come from its device ids, the others from the host
        prev_ids = None if after is None else after.next_ids
        n_prev = 0 if prev_ids is None else int(prev_ids.shape[0])
        src, host_ids, shown = [], [], []
        for r in reqs:
            j = None if after is None else after.index.get(id(r))
            if j is None:
                src.append(n_prev + len(host_ids))
                host_ids.append(r.output_ids[-1])
                shown.append(r.output_ids[-1])
            else:
                src.append(j)
                shown.append(-1)  # known only on the device until ``after`` is processed
        batch.input_ids = shown
        rows = [r.req_pool_idx for r in reqs]
        host = torch.tensor(batch.prefix_lens + rows + batch.seq_lens + locs + src + host_ids, dtype=torch.int64)
        d = self._to_device(host)
        positions, rows_d, seq_d = d[0:n], d[n : 2 * n], d[2 * n : 3 * n]
        loc_d, src_d, hid_d = d[3 * n : 4 * n], d[4 * n : 5 * n], d[5 * n :]
        if prev_ids is not None and not host_ids and src == list(range(n_prev)):
            input_ids = prev_ids  # the steady chained step: ``after``'s rows in order, nothing to gather
        else:
            ids_pool = hid_d if prev_ids is None else torch.cat([prev_ids, hid_d])
            input_ids = ids_pool.index_select(0, src_d)
        # the new slots into req_to_token and its host mirror (host: the same rows, positions and slots)
        runner.req_to_token_pool.write_points(
            host[n : 2 * n], host[0:n], host[3 * n : 4 * n], (rows_d, positions, loc_d)
        )
        return build_forward_batch(
            ForwardMode.DECODE,
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=rows_d,
            seq_lens=seq_d,
            seq_lens_cpu=list(batch.seq_lens),
            out_cache_loc=loc_d,
            decode_inputs=d[: 4 * n].view(4, n),
            req_to_token_pool=runner.req_to_token_pool,
            kv_pool=runner.kv_pool,
            attn_backend=runner.attn_backend,
        )
