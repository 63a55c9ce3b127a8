"""The scheduler: continuous batching over one model runner, built from public steps.

Life cycle of a request (unified role)::

    submit() -> inbox -> waiting -> [chunked prefill: chunked_req] -> running -> finished
                            ^                                              |
                            +------------- retract (KV short) -------------+

One iteration of the loop (``step``; ``OverlapLoop.step`` chains the same
steps differently, see ``kvship.engine.scheduler.overlap``)::

    recv(block_s)          drain the inbox (submits, aborts)
    batch = schedule()     role.before_schedule(); an extend batch if waiting
                           requests can be admitted (prefill first), else a
                           decode batch of every running request
    pending = launch(batch)   allocate, forward, sample (does not wait)
    process(pending)       append tokens, stop checks, finish / emit
    end_step()             hand the step's chunks to ``output_sink``

Contract:

* ``submit`` / ``abort`` may be called from any thread; they only enqueue.
* ``output_sink(list[TokenChunk])`` is called from the scheduler thread once
  per step with one chunk per request that has new tokens or finished; every
  request gets exactly one finished chunk (stop, length, abort, error).
* A failing step fails only the requests of that batch (finish reason abort
  with the error, KV released) and the loop keeps serving; a failure while
  scheduling fails every request (their state is suspect).
* KV slots are released on every finish: to the prefix cache when the KV is
  valid, freed otherwise.  When the loop exits, every open request is
  aborted and the role closes its stages.
* Roles (prefill, decode) plug in through ``RoleHooks``
  (``kvship.engine.scheduler.role``); the scheduler knows nothing of them.
* Collaborators are fixed at construction: ``io`` (``kvship.engine.scheduler.io``:
  one rank, or a rank of a multi-rank worker) makes the inbox, wraps the
  sampler and makes the grammar queue; replacing ``io``, ``runner``,
  ``inbox``, ``launcher``, ``grammar``, ``grammar_queue``, ``role``,
  ``speculator`` or ``pipeline`` afterwards raises ``AttributeError``.
  With pipeline stages (``io.pipeline()``) the loop is ``PipelineLoop``
  (``kvship.engine.scheduler.pipeline``).

Nothing here touches CUDA directly: tensors are built on the runner's device
and the allocator/cache are CPU bookkeeping, so the scheduler is unit-tested
on CPU with a test-double runner.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import Counter
from typing import Any, Callable, Optional

import torch

from kvship.common.envs import ENV
from kvship.common.events import (
    EventBus,
    FirstToken,
    ForwardFinished,
    ForwardStarted,
    RequestAdmitted,
    RequestFinished,
    RequestQueued,
    StepPhase,
)
from kvship.engine.config import ServerArgs
from kvship.engine.grammar.backend import GrammarBackend, GrammarLimits, GrammarQueue
from kvship.engine.io_struct import FinishReason, GenerateRequest, TokenChunk
from kvship.engine.mem.hicache import host_tier_for
from kvship.engine.mem.hicache_events import KVEventLog
from kvship.engine.mem.hicache_store import storage_tier_for
from kvship.engine.mem.radix_cache import create_prefix_cache
from kvship.engine.sampler import create_sampler
from kvship.engine.schedule_batch import Req, ScheduleBatch
from kvship.engine.scheduler.admission import Admission, RequestQueues, check_prompt, ids_in_vocab
from kvship.engine.scheduler.decode import DecodeBatcher
from kvship.engine.scheduler.inbox import Abort, GrammarReady, Submit
from kvship.engine.scheduler.io import LocalIO, SchedulerIO
from kvship.engine.scheduler.kv_budget import KVBudget
from kvship.engine.scheduler.launch import Launcher, Pending, needs_host_state
from kvship.engine.scheduler.overlap import OverlapLoop
from kvship.engine.scheduler.pipeline import PipelineLoop
from kvship.engine.scheduler.policy import SchedulePolicy, SchedulerTuning
from kvship.engine.scheduler.role import RoleHooks, UnifiedRole

logger = logging.getLogger(__name__)

OutputSink = Callable[[list[TokenChunk]], None]
_GRAMMAR_POLL_S = 0.002  # how long recv blocks while only grammar compiles are pending


class PhaseTotals:
    """Host seconds and calls per scheduler step phase (``--enable-step-timing``): a ``StepPhase`` subscriber.
    Written on the scheduler thread only; ``snapshot`` copies are read by others."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, event: StepPhase) -> None:
        self.seconds[event.phase] = self.seconds.get(event.phase, 0.0) + (event.end - event.start)
        self.calls[event.phase] = self.calls.get(event.phase, 0) + 1

    def snapshot(self) -> dict:
        return {"step_phase_s": {k: round(v, 6) for k, v in self.seconds.items()}, "step_phase_calls": dict(self.calls)}


def overlap_enabled(server_args: ServerArgs, device: torch.device) -> bool:
    """Overlap runs on CUDA unless disabled; elsewhere only when ``KVSHIP_FORCE_OVERLAP_SCHEDULE=1``."""
    if server_args.disable_overlap_schedule:
        return False
    return device.type == "cuda" or ENV.FORCE_OVERLAP_SCHEDULE


class Scheduler:
    """Continuous batching (see the module docstring).  ``role`` builds the role's hooks from the scheduler."""

    def __init__(
        self,
        server_args: ServerArgs,
        model_runner: Any,
        tokenizer: Any,
        output_sink: OutputSink,
        tuning: Optional[SchedulerTuning] = None,
        role: Optional[Callable[["Scheduler"], RoleHooks]] = None,
        speculator: Optional[Callable[["Scheduler"], Any]] = None,
        io: Optional[SchedulerIO] = None,
        events: Optional[EventBus] = None,
    ):
        self.server_args = server_args
        # typed events of each request's life (kvship.common.events): tracing, metrics and benchmarks listen
        self.events: EventBus = events or EventBus()
        # --enable-step-timing: host seconds per step phase, in the stats (docs/observability.md)
        self.phase_totals: Optional[PhaseTotals] = None
        if server_args.enable_step_timing:
            self.phase_totals = PhaseTotals()
            self.events.subscribe(self.phase_totals.add, (StepPhase,))
        # one rank, or a rank of a multi-rank worker: chosen here, fixed after (kvship.engine.scheduler.io)
        self.io: SchedulerIO = io or LocalIO()
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
        # --enable-kv-events: the cache's pages for the router (docs/cache.md, "KV events"); read by the HTTP server
        self.kv_events: Optional[KVEventLog] = KVEventLog(self.page_size) if server_args.enable_kv_events else None
        self.cache = create_prefix_cache(
            server_args.disable_radix_cache,
            self.req_to_token_pool,
            self.allocator,
            self.page_size,
            host_tier_for(server_args, model_runner),  # --hicache-*: None when off (docs/cache.md)
            self.kv_events,
            storage_tier_for(server_args, model_runner),  # --hicache-storage: None when off (docs/cache.md)
        )
        self.max_running = min(server_args.max_running_requests, self.req_to_token_pool.size)
        self.counters: Counter = Counter()
        self.queues = RequestQueues()
        self.kv = KVBudget(self.allocator, self.cache, self.page_size, self.tuning)
        chunk = None if server_args.chunked_prefill_size in (-1, 0) else server_args.chunked_prefill_size
        self.admission = Admission(
            self.queues,
            self.kv,
            SchedulePolicy(server_args.schedule_policy, self.cache, self.tuning),
            self.req_to_token_pool,
            self.counters,
            max_running=self.max_running,
            max_prefill_tokens=server_args.max_prefill_tokens,
            chunk_size=chunk,
            # host-tier pages loaded ahead of a request's extend: one rank decides alone when copies are done,
            # so replicated schedulers (TP, PP) keep every load-back in the extend that admits it
            load_ahead=ENV.HICACHE_LOAD_AHEAD if isinstance(self.io, LocalIO) else 0.0,
        )
        self.decoder = DecodeBatcher(self.queues, self.kv, self.counters, self.finish)
        self.decode_interleave = server_args.decode_interleave
        self.mixed_chunk = server_args.enable_mixed_chunk  # running requests decode inside extend steps
        self._extend_streak = 0  # extend steps since the last decode step (--decode-interleave)
        self.launcher = Launcher(
            model_runner,
            self.io.wrap_sampler(create_sampler(server_args.sampling_backend, self.device, server_args.seed)),
            self.vocab_size,
            self.cache,
        )
        self.inbox = self.io.make_inbox()
        # structured output: grammars compile in a small pool while their requests wait in grammar_queue
        limits = GrammarLimits(
            max_bytes=server_args.max_grammar_bytes,
            max_schema_depth=server_args.max_schema_depth,
            timeout_s=server_args.grammar_compile_timeout,
            processes=server_args.grammar_compile_processes,
        )
        self.grammar = GrammarBackend(tokenizer, self.vocab_size, self.eos_token_ids, limits)
        # tensor-parallel ranks admit constrained requests in lock step (kvship.engine.scheduler.io)
        self.grammar_queue: GrammarQueue = self.io.make_grammar_queue(self.grammar, self.inbox)
        self._outbox: list[TokenChunk] = []
        self._loop_running = False
        self._thread: Optional[threading.Thread] = None
        self._stats: dict = {}
        self.overlap: Optional[OverlapLoop] = None
        self.pipeline: Optional[PipelineLoop] = None
        self.role: RoleHooks = UnifiedRole() if role is None else role(self)
        # speculative decoding (decode/spec): runs every decode batch as a draft -> verify -> accept round
        self.speculator: Optional[Any] = None if speculator is None else speculator(self)
        try:
            link = self.io.pipeline()
            if link is not None:  # pipeline stages: micro-batches in flight (kvship.engine.scheduler.pipeline)
                self.pipeline = PipelineLoop(self, link)
            # decode steps chained on the GPU: CUDA unless --disable-overlap-schedule
            elif self.speculator is None and overlap_enabled(server_args, torch.device(self.device)):
                self.overlap = OverlapLoop(self)
            self.end_step()
        except BaseException:
            self.role.close("the scheduler failed to start")
            raise
        self._built = True

    # collaborators chosen in the constructor (docs/parallel.md, "The topology"): replacing one afterwards is refused
    FIXED = frozenset(
        {"io", "runner", "inbox", "launcher", "grammar_queue", "grammar", "role", "speculator", "events", "pipeline"}
    )

    def __setattr__(self, name: str, value: Any) -> None:
        if name in Scheduler.FIXED and self.__dict__.get("_built", False):
            raise AttributeError(f"Scheduler.{name} is fixed at construction (pass it to the constructor)")
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------ request state
    @property
    def waiting(self) -> list[Req]:
        return self.queues.waiting

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    @property
    def chunked_req(self) -> Optional[Req]:
        return self.queues.chunked_req

    @property
    def reqs(self) -> dict[str, Req]:
        return self.queues.reqs

    @property
    def new_token_ratio(self) -> float:
        return self.kv.new_token_ratio

    # ------------------------------------------------------------ any thread
    def submit(self, request: GenerateRequest) -> None:
        """Queue a request.  Raises ``SchedulerClosedError`` once the loop has exited."""
        self.inbox.put(Submit(request))

    def abort(self, rid: str) -> None:
        """Abort a request wherever it is; unknown or finished rids are ignored."""
        self.inbox.put(Abort(rid))

    def is_alive(self) -> bool:
        return self._loop_running and self._thread is not None and self._thread.is_alive()

    def get_stats(self) -> dict:
        """A snapshot taken at the end of the latest step."""
        return dict(self._stats)

    def start(self, stop_event: threading.Event, name: str = "kvship-scheduler") -> threading.Thread:
        """Run ``run_forever`` in a daemon thread and return it."""
        t = threading.Thread(target=self.run_forever, args=(stop_event,), name=name, daemon=True)
        self._thread = t
        self._loop_running = True
        t.start()
        return t

    # ------------------------------------------------------------ the loop
    def run_forever(self, stop_event: threading.Event) -> None:
        """Step until ``stop_event`` is set; on exit every request still open is aborted."""
        self._thread = threading.current_thread()
        self._loop_running = True
        reason = "server is shutting down"
        device = getattr(self.runner, "device", None)
        if device is not None and device.type == "cuda":
            # the current CUDA device is per thread and a new thread starts on cuda:0: a worker on another GPU
            # (--base-gpu-id, a TP rank) would record its step events and launch kernels on the wrong device
            torch.cuda.set_device(device)
        try:
            while not stop_event.is_set():
                self.step(block_s=0.0 if self.has_work() else self.tuning.idle_wait_s)
        except BaseException as e:  # noqa: BLE001 - the loop must report why it died
            logger.exception("scheduler loop crashed")
            reason = f"scheduler crashed: {type(e).__name__}: {e}"
            raise
        finally:
            self._loop_running = False
            self.inbox.close()
            self.abort_all(reason)
            self.grammar.close()  # its compile processes end with the loop

    def has_work(self) -> bool:
        return self._has_compute() or self.role.has_work() or len(self.grammar_queue) > 0

    def _has_compute(self) -> bool:
        q = self.queues
        return bool(
            q.waiting
            or q.running
            or q.chunked_req is not None
            or (self.overlap is not None and self.overlap.has_pending())
            or (self.pipeline is not None and self.pipeline.has_pending())
        )

    def idle(self) -> bool:
        """Nothing to compute, no stage pending and nothing in the inbox."""
        return not self.has_work() and self.inbox.empty()

    def step(self, block_s: float = 0.0) -> bool:
        """One scheduling iteration; returns True when a forward ran."""
        if self.overlap is not None:
            return self.overlap.step(block_s)
        if self.pipeline is not None:
            return self.pipeline.step(block_s)
        ph = self.events.phases  # StepPhase subscribers (docs/observability.md): time each step, else nothing
        t = time.perf_counter() if ph else 0.0
        self.recv(block_s)
        if ph:
            t = self.phase_done("recv", t)
        batch: Optional[ScheduleBatch] = None
        try:
            batch = self.schedule()
            if ph:
                t = self.phase_done("schedule", t)
            if batch is not None:
                if self.speculator is not None and batch.forward_mode.is_decode():
                    self._speculate(batch)
                else:
                    pending = self.launch(batch)
                    if ph:
                        t = self.phase_done("launch", t)
                    self.process(pending)
                    if ph:
                        t = self.phase_done("process", t)
        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
            self.fail_step(e, None if batch is None else batch.reqs)
        self.end_step()
        if ph:
            self.phase_done("end_step", t)
        return batch is not None

    def phase_done(self, phase: str, start: float) -> float:
        """Emit ``StepPhase(phase, start, now)`` (the loops call it only when ``events.phases``); returns now,
        the next phase's start."""
        now = time.perf_counter()
        self.events.emit(StepPhase(phase=phase, start=start, end=now))
        return now

    # ------------------------------------------------------------ public steps
    def recv(self, block_s: float = 0.0) -> None:
        """Drain the inbox, waiting up to ``block_s`` for the first message (less while stages poll)."""
        wait = self.role.poll_wait_s()
        if wait is not None and self.role.has_work() and not self._has_compute():
            block_s = wait  # nothing to compute, but stages to watch: poll soon, without spinning
        if len(self.grammar_queue) and not self._has_compute():
            block_s = _GRAMMAR_POLL_S  # only a grammar compiling: look again soon, without spinning against it
        for msg in self.inbox.drain(block_s):  # the same messages on every tensor-parallel rank
            try:
                if isinstance(msg, Submit):
                    self._handle_submit(msg.request)
                elif isinstance(msg, GrammarReady):  # tensor-parallel: admitted at this step on every rank
                    self.grammar_queue.resolve(msg.rid, msg.serialized, msg.error)
                else:
                    self.abort_request(msg.rid, "aborted")
            except Exception as e:  # noqa: BLE001 - one bad message must not stop the loop
                logger.exception("bad scheduler input %r", msg)
                if isinstance(msg, Submit) and msg.request.rid not in self.reqs:
                    self._outbox.append(
                        TokenChunk(
                            rid=msg.request.rid,
                            token_ids=[],
                            finished=True,
                            finish_reason=FinishReason.abort(f"internal error: {e}"),
                        )
                    )

    def schedule(self, busy: Optional[dict[int, Req]] = None, parts: int = 1) -> Optional[ScheduleBatch]:
        """The next batch: an extend when waiting requests can be admitted, else a decode; or None.  With
        ``--decode-interleave N`` (> 0) a decode of the running requests comes first after N extends in a row.

        ``busy`` (the pipeline loop): requests in batches still in flight (by id), which no batch may take;
        a decode then takes at most ``ceil(running / parts)`` of the others."""
        for req, greq, error in self.grammar_queue.poll():  # requests whose grammar compiled join now
            if error is not None:
                self.finish(req, FinishReason.abort(error), keep_kv=False)
            else:
                self._admit(req, greq)
        self.role.before_schedule()
        if 0 < self.decode_interleave <= self._extend_streak:  # running requests have waited long enough
            batch = self.decoder.build(busy, parts)
            if batch is not None:
                self._extend_streak = 0
                return batch
        batch = self.admission.build_extend(busy)
        if batch is not None:
            if self.mixed_chunk and busy is None and self._mix_running(batch):
                self._extend_streak = 0  # every running request got its token in this step
            else:
                self._extend_streak += 1
            return batch
        self._extend_streak = 0
        return self.decoder.build(busy, parts)

    def _mix_running(self, batch: ScheduleBatch) -> bool:
        """``--enable-mixed-chunk``: add the running requests to extend ``batch`` as one-token rows (their newest
        token, whose K/V is not computed yet), so they decode in this step too; True when every running request
        joined.  Left to a decode step of their own: requests with a grammar, penalties or a seed (their
        sampling reads host state the decode path keeps), and all of them when their slots do not fit beside
        the prompt's without eviction failing (the decode step can retract; an extend cannot)."""
        if self.speculator is not None or self.role.mode != "unified":
            return False
        rows = [r for r in self.queues.running if not needs_host_state(r)]
        if not rows:
            return False
        kv = self.kv
        need = kv.decode_need(rows) + sum(kv.round_up(r.extend_input_len) + kv.page_size for r in batch.reqs)
        if kv.shortfall_after_evict(need) > 0:
            return False
        for r in rows:
            r.extend_input_len = 1
        batch.reqs = batch.reqs + rows
        batch.decode_rows = frozenset(id(r) for r in rows)
        self.counters["mixed_decode_rows"] += len(rows)
        return len(rows) == len(self.queues.running)

    def launch(self, batch: ScheduleBatch, after: Optional[Pending] = None, defer_sampling: bool = False) -> Pending:
        """Run ``batch`` on the model without waiting for its tokens (``kvship.engine.scheduler.launch``)."""
        watch = self.role.watch_forward(batch) if batch.forward_mode.is_extend() else None
        if self.events.active:
            self._emit_forward_started(batch)
        pending = self.launcher.launch(batch, after, defer_sampling, watch)
        self.counters["extend_steps" if batch.forward_mode.is_extend() else "decode_steps"] += 1
        return pending

    def _emit_forward_started(self, batch: ScheduleBatch) -> None:
        """``ForwardStarted`` of ``batch``; an extend also admits the requests it starts (their first chunk)."""
        mode = batch.forward_mode.name.lower()
        if batch.forward_mode.is_extend():
            for r in batch.reqs:
                if not r.output_ids and r.kv_committed_len <= r.cached_tokens:
                    self.events.emit(RequestAdmitted(rid=r.rid, cached_tokens=r.cached_tokens))
        tokens = sum(r.extend_input_len for r in batch.reqs) if batch.forward_mode.is_extend() else len(batch.reqs)
        self.events.emit(ForwardStarted(mode=mode, rids=tuple(r.rid for r in batch.reqs), tokens=tokens))

    def sample(self, pending: Pending) -> None:
        """Queue the sampler of a step launched with ``defer_sampling`` once its grammar masks are filled
        (``kvship.engine.scheduler.launch``); a no-op for a sampled step."""
        self.launcher.sample(pending)

    def process(self, pending: Pending) -> None:
        """Wait for ``pending``'s tokens and apply them; requests finished meanwhile are skipped."""
        ids, lps, tops = pending.results()
        batch = pending.batch
        extend = batch.forward_mode.is_extend()
        if self.events.active:
            self.events.emit(
                ForwardFinished(mode=batch.forward_mode.name.lower(), rids=tuple(r.rid for r in batch.reqs))
            )
        q = self.queues
        j = -1
        for req, sampled in zip(batch.reqs, batch.sample_mask):
            if sampled:
                j += 1
            if req.finished:
                continue
            if not sampled:  # a chunk of a long prompt: share it, keep going next step
                self.cache.cache_unfinished_req(req)
                continue
            if req is q.chunked_req:
                q.chunked_req = None
            lp = lps[j] if lps is not None else None
            top = tops[j] if tops is not None else None
            prompt = extend and id(req) not in batch.decode_rows  # else a running request's token (mixed)
            if prompt and self.events.active and not req.output_ids:
                self.events.emit(FirstToken(rid=req.rid))
            if prompt and self.role.on_prompt_done(req, ids[j], lp, top):
                continue
            req.append_token(ids[j], self.tokenizer, lp, top)
            self.counters["generation_tokens"] += 1
            if req.finished:
                self.finish(req, req.finished_reason)
            elif prompt:
                q.running.append(req)
                self.emit(req)
            else:
                self.emit(req)

    def _speculate(self, batch: ScheduleBatch) -> None:
        """A decode batch as one speculative round (requests that need the host state decode plainly)."""
        spec, plain = self.speculator.splits(batch)
        if plain:
            batch.reqs = plain
            self.process(self.launch(batch))
        if spec:
            self.speculator.run(spec)

    def end_step(self) -> None:
        """Hand the step's chunks to the output sink and refresh the stats."""
        self.flush()
        self._update_stats()

    def fail_step(self, exc: BaseException, reqs: Optional[list[Req]]) -> None:
        """A step failed: fail ``reqs`` (its batch), or every request when scheduling itself failed."""
        logger.error("scheduler step failed:\n%s", traceback.format_exc())
        self.fail(list(self.reqs.values()) if reqs is None else reqs, exc)

    # ------------------------------------------------------------ admission
    def _reject(self, greq: GenerateRequest, message: str) -> None:
        self.counters["rejected"] += 1
        if self.events.active:
            self.events.emit(RequestFinished(rid=greq.rid, reason="abort", message=message))
        self._outbox.append(
            TokenChunk(
                rid=greq.rid,
                token_ids=[],
                finished=True,
                finish_reason=FinishReason.abort(message),
                prompt_tokens=len(greq.input_ids),
            )
        )

    def _request_problem(self, greq: GenerateRequest) -> Optional[str]:
        if greq.rid in self.reqs:
            return f"duplicate request id {greq.rid!r}"
        problem = self.role.check(greq)
        if problem is not None:
            return problem
        if not ids_in_vocab(greq.input_ids, self.vocab_size):
            return f"prompt token ids must be in [0, {self.vocab_size})"
        try:
            greq.sampling_params.verify(self.vocab_size)
        except ValueError as e:
            return str(e)
        if greq.return_logprob and greq.top_logprobs_num < 0:
            return "top_logprobs must be >= 0"
        if greq.sampling_params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer"
        prompt = check_prompt(len(greq.input_ids), self.context_len, self.allocator.total_slots)
        if prompt is not None:
            return prompt.message
        if len(self.waiting) >= self.server_args.max_queued_requests:
            return f"server overloaded: {len(self.waiting)} requests already waiting"
        return None

    def _handle_submit(self, greq: GenerateRequest) -> None:
        problem = self._request_problem(greq)
        if problem is not None:
            return self._reject(greq, problem)
        n = len(greq.input_ids)
        max_new = min(greq.sampling_params.max_new_tokens, self.context_len - n, self.allocator.total_slots - n)
        req = Req.from_generate_request(greq, self.eos_token_ids, max_new_tokens=max_new)
        self.counters["submitted"] += 1
        if greq.sampling_params.max_new_tokens == 0:
            req.finished_reason = FinishReason.of_length(0)
            self.counters["finished"] += 1
            if self.events.active:
                self.events.emit(RequestFinished(rid=req.rid, reason="length"))
            self.emit(req)
            return
        self.reqs[req.rid] = req
        if self.events.active:
            self.events.emit(RequestQueued(rid=req.rid, prompt_tokens=n))
        if greq.sampling_params.grammar_key is not None:
            self.grammar_queue.add(req, greq)  # admitted by ``schedule`` once its grammar compiled
            return
        self._admit(req, greq)

    def _admit(self, req: Req, greq: GenerateRequest) -> None:
        if not self.role.admit(req, greq):
            self.enqueue(req)

    def enqueue(self, req: Req) -> None:
        """Put a registered request at the back of the waiting queue (and have the shared KV tier, if any, read
        its prefix pages ahead while it waits)."""
        self.waiting.append(req)
        if self.cache.consults_storage:
            self.cache.prefetch(req.fill_ids[:-1])  # admission matches all but the last token

    # ------------------------------------------------------------ finishing
    def emit(self, req: Req) -> None:
        """Queue ``req``'s new tokens (and its finish, once) for the output sink."""
        chunk = req.take_chunk()
        if chunk is not None:
            self._outbox.append(chunk)

    def emit_chunk(self, chunk: TokenChunk) -> None:
        """Queue a chunk a role built itself (prefill's first token, sent before the request finishes)."""
        self._outbox.append(chunk)

    def finish(self, req: Req, reason: FinishReason, keep_kv: bool = True) -> None:
        """Finish ``req`` with ``reason``; its computed KV goes to the cache unless ``keep_kv`` is False."""
        req.finished_reason = reason
        if self.events.active:
            self.events.emit(
                RequestFinished(
                    rid=req.rid, reason=str(reason.kind), message=reason.message, completion_tokens=len(req.output_ids)
                )
            )
        self.role.on_finish(req)
        self.queues.detach(req)
        if req.req_pool_idx is not None:
            if keep_kv:
                self.cache.cache_finished_req(req)
            else:
                self.cache.release_req(req)
        self.counters["aborted" if reason.is_abort else "finished"] += 1
        self.emit(req)

    def abort_request(self, rid: str, message: str) -> None:
        """Abort ``rid`` now (scheduler thread); the role handles requests in its stages."""
        if self.role.abort(rid, message):
            return
        req = self.reqs.get(rid)
        if req is not None:
            self.finish(req, FinishReason.abort(message))

    def fail(self, reqs: list[Req], exc: BaseException) -> None:
        """Finish ``reqs`` with an internal-error abort, freeing their KV (it may be half-written)."""
        message = f"internal error: {type(exc).__name__}: {exc}"
        for req in reqs:
            if req.finish_sent or self.role.abort(req.rid, message):
                continue
            try:
                self.finish(req, FinishReason.abort(message), keep_kv=False)
            except Exception:  # noqa: BLE001 - keep failing the others
                logger.exception("could not release request %s", req.rid)
                self.queues.detach(req)
                req.finished_reason = FinishReason.abort(message)
                self.emit(req)

    def abort_all(self, message: str) -> None:
        """The loop is exiting: close the role's stages, reject queued submits, abort every request."""
        if self.overlap is not None:
            self.overlap.drop()
        if self.pipeline is not None:
            self.pipeline.drop()
        self.launcher.close()
        try:
            self.role.close(message)
        except Exception:  # noqa: BLE001 - keep releasing the rest
            logger.exception("role %s failed to close", self.role.mode)
        msg = self.inbox.get(0.0)
        while msg is not None:
            if isinstance(msg, Submit):
                self._reject(msg.request, message)
            msg = self.inbox.get(0.0)
        for req in list(self.reqs.values()):
            try:
                self.finish(req, FinishReason.abort(message), keep_kv=False)
            except Exception:  # noqa: BLE001
                logger.exception("could not release request %s", req.rid)
        self.end_step()

    def flush(self) -> None:
        """Hand the queued chunks to the output sink now."""
        if not self._outbox:
            return
        chunks, self._outbox = self._outbox, []
        try:
            self.output_sink(chunks)
        except Exception:  # noqa: BLE001 - a broken consumer must not stop the loop
            logger.exception("output sink failed")

    # ------------------------------------------------------------ prompts computed elsewhere (PD decode)
    def alloc_prefilled_kv(self, req: Req) -> Optional[torch.Tensor]:
        """Give ``req`` a req_to_token row and KV slots for its whole prompt.

        Returns the slots (int64 CPU, position order) for the sender to fill,
        or None when the pools are short even after evicting the cache.  Pair
        with ``admit_prefilled`` or ``finish(req, ..., keep_kv=False)``.
        """
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return None
        n = len(req.origin_input_ids)
        slots = self.allocator.alloc_extend([0], [n], [-1])
        if slots is None:
            self.kv.shortfall_after_evict(self.kv.round_up(n))
            slots = self.allocator.alloc_extend([0], [n], [-1])
        if slots is None:
            self.req_to_token_pool.free(idx)
            return None
        self.req_to_token_pool.write(idx, 0, slots)
        req.req_pool_idx = idx
        req.kv_allocated_len = n
        req.last_loc = int(slots[-1])
        return slots

    def admit_prefilled(
        self,
        req: Req,
        first_token_id: int,
        logprob: Optional[float] = None,
        top_logprobs: Optional[list[tuple[int, float]]] = None,
    ) -> None:
        """Join the running batch with the prompt's KV already in the slots from
        ``alloc_prefilled_kv`` and ``first_token_id`` sampled elsewhere."""
        if req.req_pool_idx is None or req.kv_allocated_len != len(req.origin_input_ids):
            raise ValueError("admit_prefilled needs the prompt's KV slots from alloc_prefilled_kv")
        req.kv_committed_len = req.kv_allocated_len
        self.admission.count_admission(req, from_cache=False)
        self.reqs[req.rid] = req
        if self.events.active:
            self.events.emit(RequestAdmitted(rid=req.rid))
            self.events.emit(FirstToken(rid=req.rid))
        req.append_token(first_token_id, self.tokenizer, logprob, top_logprobs)
        self.counters["generation_tokens"] += 1
        if req.finished:
            self.finish(req, req.finished_reason)
        else:
            self.running.append(req)
            self.emit(req)

    # ------------------------------------------------------------ stats
    def _update_stats(self) -> None:
        total = self.allocator.total_slots
        free = self.kv.free_and_evictable()
        c = self.counters
        self._stats = {
            "running": self.queues.num_active(),
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
            "new_token_ratio": self.kv.new_token_ratio,
            **self.cache.tier_stats(),
            **self.role.stats(),
            **(self.speculator.stats() if self.speculator is not None else {}),
            **(self.pipeline.stats() if self.pipeline is not None else {}),
            **(self.phase_totals.snapshot() if self.phase_totals is not None else {}),
        }
