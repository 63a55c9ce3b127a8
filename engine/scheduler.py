"""The scheduler: continuous batching over one ``ModelRunner``.

Life cycle of a request (unified mode)::

    submit() -> inbox -> waiting -> [chunked prefill: chunked_req] -> running -> finished
                            ^                                              |
                            +------------- retract (KV short) -------------+

* ``submit`` / ``abort`` may be called from any thread; they only enqueue.
  Each ``step`` drains the inbox, then runs one forward: an **extend** batch
  when waiting requests can be admitted (prefill has priority), otherwise a
  **decode** batch of every running request.
* Admission (``_get_new_prefill_batch``): the waiting queue is ordered by the
  policy (``lpm``/``fcfs``), each request's prompt is matched against the
  prefix cache and only the rest is computed, within ``--max-prefill-tokens``,
  ``--chunked-prefill-size`` (a long prompt is computed over several steps as
  the single ``chunked_req``), ``--max-running-requests`` and KV memory.
* When decode cannot get KV slots: evict the prefix cache, then retract the
  running request with the least progress (its computed KV goes to the cache,
  it returns to the front of the waiting queue and is recomputed later).
* ``output_sink(list[TokenChunk])`` is called from the scheduler thread once
  per step with one chunk per request that has new tokens or finished; every
  request gets exactly one finished chunk (stop, length, abort, error).
* A failing step (model error, bug) fails only the requests of that batch
  (finish reason abort with the error) and the loop keeps serving.

Overlap scheduling (``kvship.engine.overlap``, on CUDA unless
``--disable-overlap-schedule``) replaces ``step`` with a loop that launches
decode step N+1 before processing step N's tokens; it reuses the batch
building, ``_process_result`` and finishing code below.

Nothing here touches CUDA directly: tensors are built on ``runner.device``
and the allocator/cache are CPU bookkeeping, so the scheduler is unit-tested
on CPU with a test-double runner.

Extension points for the PD roles: ``_on_prefill_done`` (prefill mode hands
the request to the KV sender instead of decoding it), ``alloc_prefilled_kv``
+ ``admit_prefilled`` (decode mode: reserve slots for a prompt whose KV
arrives from elsewhere, then join the running batch with the first token).
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections import Counter
from typing import Any, Callable, Optional

import torch

from kvship.engine.config import ServerArgs
from kvship.engine.forward_batch import ForwardMode
from kvship.engine.io_struct import GenerateRequest, TokenChunk
from kvship.engine.mem.radix_cache import create_prefix_cache
from kvship.engine.overlap import OverlapScheduler, overlap_enabled
from kvship.engine.sampler import SamplingBatchInfo, create_sampler
from kvship.engine.schedule_batch import Req, ScheduleBatch, finish_abort, finish_length
from kvship.engine.schedule_policy import PrefillBudget, SchedulePolicy, SchedulerTuning

logger = logging.getLogger(__name__)


class SchedulerClosedError(RuntimeError):
    """``submit`` after the scheduler loop has exited."""


class Scheduler:
    def __init__(self, server_args: ServerArgs, model_runner: Any, tokenizer: Any,
                 output_sink: Callable[[list[TokenChunk]], None], tuning: Optional[SchedulerTuning] = None):
        self.server_args = server_args
        self.runner = model_runner
        self.tokenizer = tokenizer
        self.output_sink = output_sink
        self.tuning = tuning or SchedulerTuning()
        self.device = model_runner.device
        self.vocab_size = int(model_runner.model_config.vocab_size)
        self.eos_token_ids = frozenset(model_runner.model_config.eos_token_ids)
        self.context_len = int(model_runner.context_len)
        self.page_size = int(model_runner.page_size)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.allocator = model_runner.allocator
        self.cache = create_prefix_cache(server_args.disable_radix_cache, self.req_to_token_pool,
                                         self.allocator, self.page_size)
        self.policy = SchedulePolicy(server_args.schedule_policy, self.cache, self.tuning)
        self.sampler = create_sampler(server_args.sampling_backend, self.device, server_args.seed)
        self.max_running = min(server_args.max_running_requests, self.req_to_token_pool.size)
        self.chunk_size = None if server_args.chunked_prefill_size in (-1, 0) else server_args.chunked_prefill_size
        self.max_prefill_tokens = server_args.max_prefill_tokens

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        self.reqs: dict[str, Req] = {}          # every unfinished request, by rid
        self.new_token_ratio = self.tuning.init_new_token_ratio
        self.counters: Counter = Counter()
        self._outbox: list[TokenChunk] = []
        self._inbox: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self._submit_lock = threading.Lock()
        self._closed = False
        self._loop_running = False
        self._thread: Optional[threading.Thread] = None
        self._stats: dict = {}
        # decode steps chained on the GPU (kvship.engine.overlap): CUDA unless --disable-overlap-schedule
        self.overlap: Optional[OverlapScheduler] = (OverlapScheduler(self)
                                                     if overlap_enabled(server_args, torch.device(self.device))
                                                     else None)
        self._update_stats()

    # ------------------------------------------------------------------ public
    def submit(self, request: GenerateRequest) -> None:
        """Queue a request (any thread).  Raises ``SchedulerClosedError`` once the loop has exited."""
        with self._submit_lock:
            if self._closed:
                raise SchedulerClosedError("the scheduler is not running")
            self._inbox.put(("submit", request))

    def abort(self, rid: str) -> None:
        """Abort a request wherever it is (any thread); unknown or finished rids are ignored."""
        self._inbox.put(("abort", rid))

    def is_alive(self) -> bool:
        return self._loop_running and self._thread is not None and self._thread.is_alive()

    def get_stats(self) -> dict:
        """A snapshot taken at the end of the latest step (safe from any thread)."""
        return dict(self._stats)

    def start(self, stop_event: threading.Event, name: str = "kvship-scheduler") -> threading.Thread:
        """Run ``run_forever`` in a daemon thread and return it."""
        t = threading.Thread(target=self.run_forever, args=(stop_event,), name=name, daemon=True)
        self._thread = t
        self._loop_running = True
        t.start()
        return t

    def run_forever(self, stop_event: threading.Event) -> None:
        """Step until ``stop_event`` is set; on exit every request still open is aborted."""
        self._thread = threading.current_thread()
        self._loop_running = True
        reason = "server is shutting down"
        try:
            while not stop_event.is_set():
                self.step(block_s=0.0 if self.has_work() else self.tuning.idle_wait_s)
        except BaseException as e:  # noqa: BLE001 - the loop must report why it died
            logger.exception("scheduler loop crashed")
            reason = f"scheduler crashed: {type(e).__name__}: {e}"
            raise
        finally:
            self._loop_running = False
            with self._submit_lock:
                self._closed = True
            self._abort_all(reason)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req is not None
                    or (self.overlap is not None and self.overlap.has_pending()))

    def step(self, block_s: float = 0.0) -> bool:
        """One scheduling iteration; returns True when a forward ran."""
        if self.overlap is not None:  # decode steps chained on the GPU (kvship.engine.overlap)
            return self.overlap.step(block_s)
        self._drain_inbox(block_s)
        batch: Optional[ScheduleBatch] = None
        ran = False
        try:
            batch = self._get_next_batch()
            if batch is not None:
                self._run_batch(batch)
                ran = True
        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
            logger.error("scheduler step failed:\n%s", traceback.format_exc())
            if batch is not None:
                self._fail_reqs(batch.reqs, e)
            else:  # scheduling itself failed: the state of every request is suspect
                self._fail_reqs(list(self.reqs.values()), e)
        self._flush()
        self._update_stats()
        return ran

    # ------------------------------------------------------------ inbox
    def _drain_inbox(self, block_s: float) -> None:
        first = True
        while True:
            try:
                if first and block_s > 0:
                    kind, payload = self._inbox.get(timeout=block_s)
                else:
                    kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            first = False
            try:
                if kind == "submit":
                    self._handle_submit(payload)
                else:
                    self._abort_req(payload, "aborted")
            except Exception as e:  # noqa: BLE001 - one bad message must not stop the loop
                logger.exception("bad scheduler input %s", kind)
                if kind == "submit" and payload.rid not in self.reqs:
                    self._outbox.append(TokenChunk(rid=payload.rid, token_ids=[], finished=True,
                                                   finish_reason=finish_abort(f"internal error: {e}")))

    def _reject(self, greq: GenerateRequest, message: str) -> None:
        self.counters["rejected"] += 1
        self._outbox.append(TokenChunk(rid=greq.rid, token_ids=[], finished=True,
                                       finish_reason=finish_abort(message),
                                       prompt_tokens=len(greq.input_ids)))

    def _handle_submit(self, greq: GenerateRequest) -> None:
        n = len(greq.input_ids)
        total = self.allocator.total_slots
        if greq.rid in self.reqs:
            return self._reject(greq, f"duplicate request id {greq.rid!r}")
        if n == 0:
            return self._reject(greq, "the prompt is empty")
        if any(not 0 <= int(t) < self.vocab_size for t in greq.input_ids):
            return self._reject(greq, f"prompt token ids must be in [0, {self.vocab_size})")
        try:
            greq.sampling_params.verify(self.vocab_size)
        except ValueError as e:
            return self._reject(greq, str(e))
        if greq.return_logprob and greq.top_logprobs_num < 0:
            return self._reject(greq, "top_logprobs must be >= 0")
        if greq.sampling_params.stop and self.tokenizer is None:
            return self._reject(greq, "stop strings need a tokenizer")
        if n >= self.context_len:
            return self._reject(greq, f"the prompt has {n} tokens but the context length is {self.context_len}; "
                                      "it must leave room for at least one new token")
        if n + 1 > total:
            return self._reject(greq, f"the prompt has {n} tokens but the KV cache holds only {total}")
        if len(self.waiting) >= self.server_args.max_queued_requests:
            return self._reject(greq, f"server overloaded: {len(self.waiting)} requests already waiting")
        max_new = min(greq.sampling_params.max_new_tokens, self.context_len - n, total - n)
        req = Req.from_generate_request(greq, self.eos_token_ids, max_new_tokens=max_new)
        self.counters["submitted"] += 1
        if greq.sampling_params.max_new_tokens == 0:
            req.finished_reason = finish_length(0)
            self.counters["finished"] += 1
            self._emit(req)
            return
        self.reqs[req.rid] = req
        self.waiting.append(req)

    # ------------------------------------------------------------ batches
    def _get_next_batch(self) -> Optional[ScheduleBatch]:
        batch = self._get_new_prefill_batch()
        if batch is not None:
            return batch
        if self.running:
            return self._get_decode_batch()
        return None

    def _decode_reserve(self) -> int:
        clip = self.tuning.clip_max_new_tokens
        left = sum(min(r.max_new_tokens - len(r.output_ids), clip) for r in self.running)
        return int(left * self.new_token_ratio)

    def _memory_left(self) -> int:
        """KV slots an extend batch may use: free + evictable, minus the running requests' reserve."""
        return self.allocator.available_size() + self.cache.evictable_size() - self._decode_reserve()

    def _get_new_prefill_batch(self) -> Optional[ScheduleBatch]:
        if not self.waiting and self.chunked_req is None:
            return None
        budget = PrefillBudget(page_size=self.page_size, rem_input=self.max_prefill_tokens,
                               rem_chunk=self.chunk_size, rem_memory=self._memory_left())
        reqs: list[Req] = []
        if self.chunked_req is not None:
            req = self.chunked_req
            n = budget.fit(len(req.fill_ids) - req.kv_committed_len, first=True)
            if n == 0:
                return None
            req.extend_input_len = n
            budget.take(n, 0)
            reqs.append(req)
            if req.kv_committed_len + n < len(req.fill_ids):
                return ScheduleBatch(reqs, ForwardMode.EXTEND)
        n_active = len(self.running) + len(reqs)
        if (not self.waiting or n_active >= self.max_running or self.req_to_token_pool.available_size() == 0
                or (budget.rem_memory < self.page_size and self.running)):
            # nothing more can join (skip ordering the queue, which costs a prefix match per request)
            return ScheduleBatch(reqs, ForwardMode.EXTEND) if reqs else None
        clip = self.tuning.clip_max_new_tokens
        for req in self.policy.order(self.waiting):
            if n_active >= self.max_running:
                break
            fill = req.fill_ids
            match = self.cache.match_prefix(fill[:-1])  # at least one token is computed for logits
            remaining = len(fill) - match.length
            n = budget.fit(remaining, first=not reqs)
            if n == 0:
                break
            alone = not reqs and not self.running  # an idle server always admits its first request
            reserve = 0
            if n == remaining:  # the prompt completes here: reserve room for its decoding
                reserve = int(min(req.max_new_tokens - len(req.output_ids), clip) * self.new_token_ratio)
                pages = (n + self.page_size - 1) // self.page_size * self.page_size
                if pages + reserve > budget.rem_memory and not alone:
                    break
            idx = self.req_to_token_pool.alloc()
            if idx is None:
                break
            self._bind_prefix(req, idx, match)
            budget.take(n, reserve)
            budget.refresh(self._memory_left())  # locking the matched path made it unevictable
            if budget.rem_memory < 0 and not alone:
                self._unbind_prefix(req)
                break
            self._count_admission(req)
            req.extend_input_len = n
            self.waiting.remove(req)
            reqs.append(req)
            n_active += 1
            if n < remaining:
                self.chunked_req = req
                break
        if not reqs:
            return None
        return ScheduleBatch(reqs, ForwardMode.EXTEND)

    def _bind_prefix(self, req: Req, idx: int, match: Any) -> None:
        """Give ``req`` a req_to_token row holding its cached prefix (locked in the cache)."""
        self.cache.inc_lock_ref(match.last_node)
        req.req_pool_idx = idx
        req.prefix_indices = match.indices
        req.last_node = match.last_node
        req.cache_protected_len = req.kv_committed_len = req.kv_allocated_len = match.length
        req.last_loc = int(match.indices[-1]) if match.length else -1
        if match.length:
            self.req_to_token_pool.write(idx, 0, match.indices)

    def _unbind_prefix(self, req: Req) -> None:
        """Undo ``_bind_prefix`` (the request stays waiting)."""
        self.cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.reset_kv_state()

    def _count_admission(self, req: Req) -> None:
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = min(req.cache_protected_len, len(req.origin_input_ids))
            self.counters["prompt_tokens"] += len(req.origin_input_ids)
            self.counters["cached_tokens"] += req.cached_tokens

    def _get_decode_batch(self) -> Optional[ScheduleBatch]:
        ps = self.page_size
        while self.running:
            need = sum(1 for r in self.running if r.kv_committed_len % ps == 0) * ps
            short = need - self.allocator.available_size()
            if short > 0:
                self.cache.evict(short)
                short = need - self.allocator.available_size()
            if short <= 0:
                break
            self._retract_one()
        if not self.running:
            return None
        self.new_token_ratio = max(self.tuning.min_new_token_ratio, self.new_token_ratio - (
            self.tuning.init_new_token_ratio - self.tuning.min_new_token_ratio) / self.tuning.new_token_ratio_decay_steps)
        return ScheduleBatch(list(self.running), ForwardMode.DECODE)

    def _retract_one(self) -> None:
        """Free KV for decode: retract the request with the least progress (or fail a lone one)."""
        candidates = list(self.running) + ([self.chunked_req] if self.chunked_req is not None else [])
        if len(candidates) == 1:
            req = candidates[0]
            logger.warning("KV cache too small for request %s alone; aborting it", req.rid)
            self._finish(req, finish_abort(f"KV cache exhausted ({self.allocator.total_slots} slots)"))
            return
        victim = min(candidates, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        if victim is self.chunked_req:
            self.chunked_req = None
        else:
            self.running.remove(victim)
        self.cache.cache_finished_req(victim)
        victim.retractions += 1
        self.counters["retracted"] += 1
        self.waiting.insert(0, victim)
        decoded = sum(len(r.output_ids) for r in self.running)
        budget = sum(r.max_new_tokens for r in self.running) or 1
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, (decoded + 20 * len(self.running)) / budget))
        logger.info("retracted %s (KV short); new_token_ratio=%.2f", victim.rid, self.new_token_ratio)

    # ------------------------------------------------------------ running a batch
    def _run_batch(self, batch: ScheduleBatch) -> None:
        runner = self.runner
        if batch.forward_mode.is_decode():
            batch.prepare_for_decode(self.allocator, self.req_to_token_pool, self.cache)
        else:
            batch.prepare_for_extend(self.allocator, self.req_to_token_pool, self.cache)
        fb = batch.to_forward_batch(self.device, self.req_to_token_pool, runner.kv_pool, runner.attn_backend)
        sampling_reqs = batch.sampling_reqs
        with torch.inference_mode():
            logits_out = runner.forward(fb)
            logits = logits_out.next_token_logits
            if logits.shape[0] != len(sampling_reqs):
                raise RuntimeError(f"model returned {logits.shape[0]} logits rows for {len(sampling_reqs)} requests")
            result = None
            if sampling_reqs:
                info = SamplingBatchInfo.from_reqs(sampling_reqs, self.vocab_size, self.device)
                result = self.sampler(logits[:, :self.vocab_size], info).to_lists(info.top_logprobs_nums)
        batch.commit()
        self.counters["extend_steps" if batch.forward_mode.is_extend() else "decode_steps"] += 1
        self._process_result(batch, result)

    def _process_result(self, batch: ScheduleBatch, result: Optional[tuple]) -> None:
        ids, lps, tops = result if result is not None else ([], None, None)
        j = 0
        for req, sampled in zip(batch.reqs, batch.sample_mask):
            if not sampled:  # a chunk of a long prompt: share it, keep going next step
                self.cache.cache_unfinished_req(req)
                continue
            if req is self.chunked_req:
                self.chunked_req = None
            req.append_token(ids[j], self.tokenizer, lps[j] if lps is not None else None,
                             tops[j] if tops is not None else None)
            j += 1
            self.counters["generation_tokens"] += 1
            if req.finished:
                self._finish(req, req.finished_reason)
            elif batch.forward_mode.is_extend():
                self._on_prefill_done(req)
            else:
                self._emit(req)

    def _on_prefill_done(self, req: Req) -> None:
        """The prompt is computed and the first token sampled (prefill mode overrides this)."""
        self.running.append(req)
        self._emit(req)

    # ------------------------------------------------------------ finishing
    def _emit(self, req: Req) -> None:
        chunk = req.take_chunk()
        if chunk is not None:
            self._outbox.append(chunk)

    def _detach(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        if req in self.waiting:
            self.waiting.remove(req)
        self.reqs.pop(req.rid, None)

    def _finish(self, req: Req, reason: dict, keep_kv: bool = True) -> None:
        """Finish ``req`` with ``reason``; its computed KV goes to the cache unless ``keep_kv`` is False."""
        req.finished_reason = reason
        self._detach(req)
        if req.req_pool_idx is not None:
            if keep_kv:
                self.cache.cache_finished_req(req)
            else:
                self.cache.release_req(req)
        self.counters["aborted" if reason.get("type") == "abort" else "finished"] += 1
        self._emit(req)

    def _abort_req(self, rid: str, message: str) -> None:
        req = self.reqs.get(rid)
        if req is None:
            return
        self._finish(req, finish_abort(message))

    def _fail_reqs(self, reqs: list[Req], exc: BaseException) -> None:
        for req in reqs:
            if req.finish_sent:
                continue
            try:
                self._finish(req, finish_abort(f"internal error: {type(exc).__name__}: {exc}"), keep_kv=False)
            except Exception:  # noqa: BLE001 - keep failing the others
                logger.exception("could not release request %s", req.rid)
                self._detach(req)
                req.finished_reason = finish_abort(f"internal error: {type(exc).__name__}: {exc}")
                self._emit(req)

    def _abort_all(self, message: str) -> None:
        if self.overlap is not None:
            self.overlap.drop()
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._reject(payload, message)
        for req in list(self.reqs.values()):
            try:
                self._finish(req, finish_abort(message), keep_kv=False)
            except Exception:  # noqa: BLE001
                logger.exception("could not release request %s", req.rid)
        self._flush()
        self._update_stats()

    def _flush(self) -> None:
        if not self._outbox:
            return
        chunks, self._outbox = self._outbox, []
        try:
            self.output_sink(chunks)
        except Exception:  # noqa: BLE001 - a broken consumer must not stop the loop
            logger.exception("output sink failed")

    # ------------------------------------------------------------ PD hooks
    def alloc_prefilled_kv(self, req: Req) -> Optional[torch.Tensor]:
        """Decode side of PD: give ``req`` a req_to_token row and KV slots for its whole prompt.

        Returns the slots (int64 CPU, position order) for the sender to fill,
        or None when the pools are short even after evicting the cache.  Call
        from the scheduler thread; pair with ``admit_prefilled`` or
        ``cache.release_req(req)``.
        """
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return None
        n = len(req.origin_input_ids)
        slots = self.allocator.alloc_extend([0], [n], [-1])
        if slots is None:
            self.cache.evict(self.allocator.pages_needed([0], [n]) * self.page_size - self.allocator.available_size())
            slots = self.allocator.alloc_extend([0], [n], [-1])
        if slots is None:
            self.req_to_token_pool.free(idx)
            return None
        self.req_to_token_pool.write(idx, 0, slots)
        req.req_pool_idx = idx
        req.kv_allocated_len = n
        req.last_loc = int(slots[-1])
        return slots

    def admit_prefilled(self, req: Req, first_token_id: int, logprob: Optional[float] = None,
                        top_logprobs: Optional[list[tuple[int, float]]] = None) -> None:
        """Join the running batch with the prompt's KV already in the slots from
        ``alloc_prefilled_kv`` and ``first_token_id`` sampled elsewhere (call from the scheduler thread)."""
        if req.req_pool_idx is None or req.kv_allocated_len != len(req.origin_input_ids):
            raise ValueError("admit_prefilled needs the prompt's KV slots from alloc_prefilled_kv")
        req.kv_committed_len = req.kv_allocated_len
        if not req.admitted:
            req.admitted = True
            self.counters["prompt_tokens"] += len(req.origin_input_ids)
        self.reqs[req.rid] = req
        req.append_token(first_token_id, self.tokenizer, logprob, top_logprobs)
        self.counters["generation_tokens"] += 1
        if req.finished:
            self._finish(req, req.finished_reason)
        else:
            self.running.append(req)
            self._emit(req)

    # ------------------------------------------------------------ stats
    def _update_stats(self) -> None:
        total = self.allocator.total_slots
        free = self.allocator.available_size() + self.cache.evictable_size()
        c = self.counters
        self._stats = {
            "running": len(self.running) + (1 if self.chunked_req is not None else 0),
            "waiting": len(self.waiting),
            "total_slots": total,
            "free_slots": free,
            "used_slots": total - free,
            "cached_slots": self.cache.total_size(),
            "token_usage": (total - free) / total if total else 0.0,
            "cache_hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
            "prompt_tokens": c["prompt_tokens"],
            "cached_tokens": c["cached_tokens"],
            "generation_tokens": c["generation_tokens"],
            "num_submitted": c["submitted"],
            "num_finished": c["finished"],
            "num_aborted": c["aborted"],
            "num_rejected": c["rejected"],
            "num_retracted": c["retracted"],
            "extend_steps": c["extend_steps"],
            "decode_steps": c["decode_steps"],
            "new_token_ratio": self.new_token_ratio,
        }
