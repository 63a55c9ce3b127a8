"""The engine: tokenizer + model runner + scheduler thread, bridged to asyncio.

Threads and queues::

    event loop (HTTP)                         scheduler thread
    Engine.generate(req) --submit(req)------> Scheduler.run_forever(stop_event)
        awaits its asyncio.Queue  <--call_soon_threadsafe-- output_sink(list[TokenChunk])

Contract of ``generate``:
* yields the request's ``TokenChunk``s in order; the last has ``finished=True``
  and exactly one finished chunk is yielded on every path;
* raises ``EngineOverloaded`` (queue full) or ``EngineDead`` before
  submitting, and ``ValueError`` for a duplicate ``rid``;
* if the consumer stops early (client disconnect, stop string matched on the
  text side, task cancelled), closing the generator aborts the request in the
  scheduler, which frees its KV slots.

If the scheduler thread dies, every open request gets a finished abort chunk,
``is_alive()`` turns False (``/health`` answers 503) and new requests raise
``EngineDead``.

``open(reqs)`` admits several requests at once (all or none) and returns
``RequestHandle``s; ``stream_text(handle)`` / ``generate_text(req)`` layer
the text side on top (incremental detokenizer + stop strings) and yield
``TextDelta``s; both HTTP APIs use them.

``groups`` (the leader rank of a multi-rank worker, ``kvship.engine.distributed``):
the model runner holds this rank's shard, and the scheduler is built with a
``BroadcastIO`` (``kvship.engine.scheduler.io``): its inbox and sampled ids
are broadcast to the other ranks, which run the same loop.

``scheduler_factory`` builds the scheduler (the app shell maps ``--mode`` to
the role's scheduler: ``kvship.app.roles``); the default is the unified
``Scheduler``.  All share one constructor and the submit / abort /
run_forever / get_stats interface.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional

from kvship.common.events import EventBus
from kvship.common.tracing import Tracing, WorkerTracer
from kvship.engine.config import ServerArgs
from kvship.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvship.engine.fingerprint import revision_info
from kvship.engine.io_struct import FinishReason, GenerateRequest, TokenChunk
from kvship.engine.metrics import EngineMetrics
from kvship.engine.scheduler import Scheduler, SchedulerClosedError
from kvship.engine.scheduler.io import scheduler_io
from kvship.engine.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from kvship.engine.distributed.groups import ProcessGroups

logger = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (``--max-queued-requests``)."""


class EngineDead(RuntimeError):
    """The scheduler thread is not running."""


@dataclass
class TextDelta:
    """What one request produced since its previous delta, on the text side."""

    text: str
    token_ids: list[int]
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    reason: Optional[FinishReason] = None  # set on the last delta of a request
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_accept_length: Optional[float] = None

    @classmethod
    def of_chunk(cls, chunk: TokenChunk, text: str, reason: Optional[FinishReason] = None) -> "TextDelta":
        """The delta for ``chunk`` with ``text``; ``reason`` when the request ends here."""
        return cls(
            text=text,
            token_ids=list(chunk.token_ids),
            logprobs=chunk.logprobs,
            top_logprobs=chunk.top_logprobs,
            reason=reason,
            prompt_tokens=chunk.prompt_tokens,
            completion_tokens=chunk.completion_tokens,
            cached_tokens=chunk.cached_tokens,
            spec_accept_length=chunk.spec_accept_length,
        )

    @property
    def finished(self) -> bool:
        return self.reason is not None

    @property
    def finish_reason(self) -> Optional[str]:
        """ "stop" | "length" | "abort" on the last delta, else None (OpenAI's ``finish_reason``)."""
        return None if self.reason is None else self.reason.kind

    @property
    def matched_stop(self) -> Any:
        """The stop token id or stop string that ended the request, if one did."""
        return self.reason.matched if self.reason is not None and self.reason.kind == "stop" else None

    @property
    def abort_message(self) -> Optional[str]:
        return self.reason.message if self.reason is not None and self.reason.is_abort else None


SchedulerFactory = Callable[..., Any]


class Engine:
    """One worker's model loop plus the asyncio bridge (see module docstring)."""

    def __init__(
        self,
        server_args: ServerArgs,
        *,
        start: bool = True,
        scheduler_factory: Optional[SchedulerFactory] = None,
        groups: Optional["ProcessGroups"] = None,
    ):
        from kvship.engine.model_runner import ModelRunner, resolve_model_path

        server_args.validate()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._num_unstarted = 0  # open requests that have not received a chunk yet
        self._lock = threading.Lock()
        self.model_path = resolve_model_path(server_args.model_path)
        self.server_args = dataclasses.replace(server_args, model_path=self.model_path)
        self.served_model_name = server_args.served_model_name or self._default_model_name(server_args)
        tok_path = server_args.tokenizer_path or self.model_path
        self.tokenizer: Tokenizer = load_tokenizer(tok_path, trust_remote_code=server_args.trust_remote_code)
        _ = self.tokenizer.max_chars_per_token  # computed once here, not on the first request
        self.model_runner = ModelRunner(self.server_args, groups=groups)
        self.model_config = self.model_runner.model_config
        self.context_len: int = self.model_runner.context_len
        self.max_total_tokens: int = self.model_runner.max_total_tokens
        self.vocab_size: int = max(self.model_config.vocab_size, 1)
        factory = scheduler_factory or Scheduler
        # the leader of a multi-rank worker: its inbox and samples drive every rank
        io = scheduler_io(self.model_runner.tp, lambda: self._stop_event.set(), link=self.model_runner.pipeline)
        # the request events (kvship.common.events): tracing and the KV-transfer metrics listen to the scheduler
        self.events = EventBus()
        self.scheduler = factory(
            self.server_args, self.model_runner, self.tokenizer, self._output_sink, io=io, events=self.events
        )
        self.grammar = self.scheduler.grammar  # structured output: the HTTP layer checks grammars with it
        expert_load_fn = None
        if self.model_config.moe is not None:  # MoE: tokens per expert in /metrics (docs/parallel.md)
            from kvship.engine.layers.moe.layer import expert_load

            expert_load_fn = functools.partial(expert_load, self.model_runner.model)
        self.metrics = EngineMetrics(self.served_model_name, self._safe_stats, expert_load_fn)
        self.metrics.observe_kv_transfers(self.events)  # per-request KV-transfer histograms (PD roles emit them)
        sa = self.server_args  # OpenTelemetry spans from the same events (docs/observability.md)
        tracing = Tracing.configure(  # spans are encoded and exported by a child process (docs/observability.md)
            sa.otlp_traces_endpoint, sa.otlp_traces_sample_ratio, f"kvship-{sa.mode}", export_process=True
        )
        self.tracer = WorkerTracer(tracing, self.events, sa.mode)
        self.revision = revision_info(self.server_args)  # {"fingerprint", "revision"} for /get_server_info

        self._stop_event = threading.Event()
        self._failure: Optional[str] = None
        self._thread = threading.Thread(target=self._run_scheduler, name="kvship-scheduler", daemon=True)
        self.start_time = time.time()
        if start:
            self.start()

    def start(self) -> None:
        """Start the scheduler thread (``Engine(..., start=False)`` defers it; idempotent)."""
        if self._thread.ident is None and not self._stop_event.is_set():
            self._thread.start()

    @staticmethod
    def _default_model_name(sa: ServerArgs) -> str:
        """The embedded model's name, else the model path as given (SGLang's default)."""
        if sa.model_path is None:
            from kvship.engine.embedded import EMBEDDED_MODEL_NAME

            return EMBEDDED_MODEL_NAME
        return sa.model_path.rstrip("/")

    # --- scheduler thread ----------------------------------------------
    def _run_scheduler(self) -> None:
        try:
            self.scheduler.run_forever(self._stop_event)
            if not self._stop_event.is_set():
                self._failure = "the scheduler loop returned unexpectedly"
        except BaseException as e:  # noqa: BLE001 - the thread must report any death
            logger.exception("scheduler thread died")
            self._failure = f"scheduler died: {type(e).__name__}: {e}"
        finally:
            self._fail_pending(self._failure or "server is shutting down")

    def _fail_pending(self, message: str) -> None:
        with self._lock:
            items = list(self._queues.items())
        for rid, (loop, q) in items:
            chunk = TokenChunk(rid=rid, token_ids=[], finished=True, finish_reason=FinishReason.abort(message))
            try:
                loop.call_soon_threadsafe(q.put_nowait, chunk)
            except RuntimeError:  # loop closed
                pass

    def _output_sink(self, chunks: list[TokenChunk]) -> None:
        """Called from the scheduler thread; hands chunks to their event loops."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TokenChunk]]] = {}
        with self._lock:
            for c in chunks:
                entry = self._queues.get(c.rid)
                if entry is not None:
                    by_loop.setdefault(entry[0], []).append((entry[1], c))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass

    # --- public API ----------------------------------------------------
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._failure is None and not self._stop_event.is_set()

    @property
    def failure(self) -> Optional[str]:
        return self._failure

    def num_active(self) -> int:
        with self._lock:
            return len(self._queues)

    def has_request(self, rid: str) -> bool:
        with self._lock:
            return rid in self._queues

    def open(self, reqs: list[GenerateRequest]) -> list["RequestHandle"]:
        """Admit and submit ``reqs`` together (all or none), returning one handle each.

        Raises ``EngineDead``, ``EngineOverloaded`` (the queue cannot take all
        of them) or ``ValueError`` (duplicate ``rid``) before submitting any.
        Every handle must be drained (``chunks()``) or ``close()``d.
        """
        if not self.is_alive():
            raise EngineDead(self._failure or "the model loop is not running")
        sa = self.server_args
        loop = asyncio.get_running_loop()
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids):
            raise ValueError("request ids (rid) must be unique")
        handles = []
        with self._lock:
            for rid in rids:
                if rid in self._queues:
                    raise ValueError(f"a request with rid '{rid}' is already running")
            # Requests without a first chunk are waiting or prefilling: a superset of the
            # scheduler's waiting queue, so the scheduler's own queue limit is never hit first.
            if (
                self._num_unstarted + len(reqs) > sa.max_queued_requests
                or len(self._queues) + len(reqs) > sa.max_running_requests + sa.max_queued_requests
            ):
                raise EngineOverloaded(
                    f"server overloaded: {self._num_unstarted} requests are waiting and the queue holds "
                    f"{sa.max_queued_requests} (--max-queued-requests); retry later"
                )
            for r in reqs:
                h = RequestHandle(self, r, loop)
                self._queues[r.rid] = (loop, h.queue)
                self._num_unstarted += 1
                handles.append(h)
        try:
            for h in handles:
                self.scheduler.submit(h.req)
                h.submitted = True
        except SchedulerClosedError as e:
            for h in handles:
                h.close()
            raise EngineDead(str(e)) from None
        except BaseException:
            for h in handles:
                h.close()
            raise
        return handles

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Submit ``req`` and yield its chunks (see the module docstring for the contract)."""
        handle = self.open([req])[0]
        try:
            async for chunk in handle.chunks():
                yield chunk
        finally:
            handle.close()

    def _unregister(self, rid: str, started: bool) -> None:
        with self._lock:
            self._queues.pop(rid, None)
            if not started:
                self._num_unstarted -= 1

    def _mark_started(self) -> None:
        with self._lock:
            self._num_unstarted -= 1

    def abort(self, rid: str) -> bool:
        """Abort a running or waiting request; False when no such request is open."""
        if not self.has_request(rid):
            return False
        self.scheduler.abort(rid)
        return True

    async def generate_text(self, req: GenerateRequest) -> AsyncIterator[TextDelta]:
        """Submit ``req``; ``stream_text`` of its handle."""
        handle = self.open([req])[0]
        async for delta in self.stream_text(handle):
            yield delta

    async def stream_text(self, handle: "RequestHandle") -> AsyncIterator[TextDelta]:
        """A handle's chunks plus incremental detokenization and stop strings.

        Stop strings are matched on the text: text that could start a stop
        string is held back, and a matched stop string is trimmed from the
        output and ends the request (``finish_reason == "stop"``).  A stop
        token id that is not EOS is left out of the text but kept in
        ``token_ids``.
        """
        sp = handle.req.sampling_params
        detok = IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
        )
        matcher = StopStringMatcher(sp.stop)
        resumed = handle.req.resumed
        if resumed is not None and resumed.output_len:
            # continue the broken stream's text: stop strings may span the join (docs/router.md)
            prior = detok.prime(handle.req.input_ids[-resumed.output_len :])
            matcher.hold(prior[resumed.relayed_chars :])
        stop_ids = set(sp.stop_token_ids)
        agen = handle.chunks()
        try:
            async for chunk in agen:
                ids = list(chunk.token_ids)
                text_ids = ids
                reason = FinishReason.from_wire(chunk.finish_reason) if chunk.finished else None
                if (
                    reason is not None
                    and reason.kind == "stop"
                    and isinstance(reason.matched, int)
                    and ids
                    and ids[-1] == reason.matched
                    and reason.matched in stop_ids
                ):
                    text_ids = ids[:-1]
                raw = detok.add(text_ids)
                if chunk.finished:
                    raw += detok.finish()
                m = matcher.feed(raw)
                if m.matched is not None:
                    handle.close(reason="stop")  # the scheduler may still be generating: stop it now
                    yield TextDelta.of_chunk(chunk, m.text, FinishReason.stop(m.matched))
                    return
                if reason is not None:
                    yield TextDelta.of_chunk(chunk, m.text + matcher.flush(), reason)
                    return
                yield TextDelta.of_chunk(chunk, m.text)
        finally:
            await agen.aclose()
            handle.close()

    def get_stats(self) -> dict:
        stats = dict(self.scheduler.get_stats())
        stats.setdefault("active_requests", self.num_active())
        return stats

    def _safe_stats(self) -> dict:
        try:
            return self.get_stats()
        except Exception as e:
            logger.warning("get_stats failed: %s", e)
            return {}

    def model_info(self) -> dict:
        mc = self.model_config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.server_args.tokenizer_path or self.model_path,
            "served_model_name": self.served_model_name,
            "architectures": list(mc.architectures),
            "context_len": self.context_len,
            "vocab_size": mc.vocab_size,
            "is_generation": True,
            "dtype": str(self.model_runner.dtype).removeprefix("torch."),
        }

    def server_info(self) -> dict:
        args = {k: v for k, v in dataclasses.asdict(self.server_args).items() if k != "api_key"}
        info = {
            "server_args": args,
            "model": self.model_info(),
            "alive": self.is_alive(),
            "uptime_s": round(time.time() - self.start_time, 3),
            "version": _version(),
            "max_total_tokens": self.model_runner.max_total_tokens,
            "page_size": self.model_runner.page_size,
            "device": str(self.model_runner.device),
            "tp_size": self.model_runner.tp_size,
            "pp_size": 1 if self.model_runner.pipeline is None else self.model_runner.pipeline.pp_size,
            "pid": os.getpid(),
            # the resolved weight method and KV dtype (docs/quantization.md)
            "quantization": self.model_runner.model_config.quantization,
            "kv_cache_dtype": self.server_args.resolved_kv_dtype,
        }
        if self.model_runner.eplb is not None:  # expert load balancing (docs/parallel.md)
            info["eplb"] = self.model_runner.eplb.stats()
        info.update(self.revision)
        info.update(self._safe_stats())
        return info

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the scheduler thread; open requests get a finished abort chunk."""
        if self._stop_event.is_set():
            return
        self._stop_event.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("scheduler thread did not stop within %.0f s", timeout)
                return
        self.tracer.close()  # the spans of the requests that finished are exported before the process ends
        logger.info("model loop stopped")


class RequestHandle:
    """One submitted request: its chunk queue, metrics timing and abort-on-close."""

    def __init__(self, engine: Engine, req: GenerateRequest, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.req = req
        self.rid = req.rid
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.submitted = False
        self.started = False  # a chunk has arrived
        self.finished = False
        self.closed = False

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        """Yield chunks until the finished one; metrics are observed here."""
        m = self.engine.metrics
        created = self.req.created_time
        first_t: Optional[float] = None
        last_t: Optional[float] = None
        try:
            while not self.finished:
                chunk: TokenChunk = await self.queue.get()
                now = time.time()
                if not self.started:
                    self.started = True
                    if not self.closed:
                        self.engine._mark_started()
                if chunk.token_ids:
                    m.observe_tokens(len(chunk.token_ids), now, first_t, last_t, created)
                    first_t = first_t or now
                    last_t = now
                if chunk.finished:
                    self.finished = True
                    kind = FinishReason.from_wire(chunk.finish_reason).kind
                    m.observe_finished(
                        kind, chunk.prompt_tokens, chunk.cached_tokens, now - created, chunk.spec_accept_length
                    )
                yield chunk
        finally:
            self.close()

    def close(self, reason: str = "abort") -> None:
        """Stop listening; abort the request in the scheduler unless it finished (idempotent).

        ``reason`` labels the request in the metrics when it had not finished.
        """
        if self.closed:
            return
        self.closed = True
        self.engine._unregister(self.rid, self.started)
        if self.submitted and not self.finished and self.engine.is_alive():
            try:
                self.engine.scheduler.abort(self.rid)
            except Exception:  # noqa: BLE001 - abort must never raise into a client path
                logger.exception("abort of %s failed", self.rid)
            self.engine.metrics.observe_finished(
                reason, len(self.req.input_ids), 0, time.time() - self.req.created_time
            )


def _deliver(items: list[tuple[asyncio.Queue, TokenChunk]]) -> None:
    for q, chunk in items:
        q.put_nowait(chunk)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvship")
    except Exception:
        return "unknown"
