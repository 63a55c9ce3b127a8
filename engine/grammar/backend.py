"""Compiling grammars (xgrammar) off the scheduler thread, and per-request matchers.

Contract:

* ``GrammarBackend.compile(key)`` may be called from any thread; it returns a
  ``concurrent.futures.Future`` of the compiled grammar.  ``GrammarLimits``
  are checked first, at once (text bytes, JSON-schema nesting depth); the
  compile itself runs in a child process that is killed when it takes longer
  than ``GrammarLimits.timeout_s`` (``kvship.engine.grammar.compile_process``),
  driven by a thread pool of the same size.  Futures are kept in an LRU cache
  keyed by ``(kind, text)``, so the HTTP layer's check (``compile_async``) and
  the scheduler's compile of the same request share one compilation, and a
  repeated schema costs a dict look-up.  A refused grammar is cached too (the
  same text fails the same way); a timed-out one never is (``GrammarTimeout``:
  the next request compiles it again).
* Failures are ``GrammarError`` (a ValueError) with a user-facing message:
  the compiler's own message for an invalid schema / regex / grammar, a
  limit, a timeout, or that ``xgrammar`` is not installed.
* ``xgrammar`` is imported on the first compile, in the pool, so a worker
  that never sees a constrained request never loads it (nor starts a compile
  process).
* A ``GrammarMatcher`` belongs to one request and is used by one thread at a
  time: the scheduler thread, except while a mask fill it was handed to is in
  flight (``kvship.engine.grammar.mask.MaskFiller``), when only the filler's
  thread touches it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from kvship.engine.grammar.compile_process import CompileFailed, CompilePool, CompileTimeout
from kvship.engine.grammar.deferred import DeferredGrammar

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str]  # (kind, text); kind: json_schema / regex / ebnf
KINDS = ("json_schema", "regex", "ebnf")
MISSING_MESSAGE = (
    "structured output (json_schema / regex / ebnf / response_format) needs xgrammar: pip install 'kvship[grammar]'"
)


def grammar_available() -> bool:
    """Whether ``xgrammar`` can be imported here."""
    return importlib.util.find_spec("xgrammar") is not None


class GrammarError(ValueError):
    """A grammar that cannot be used: invalid (the compiler's message), over a limit, or no xgrammar."""

    code = "invalid_grammar"


class GrammarTimeout(GrammarError):
    """The compile took longer than ``GrammarLimits.timeout_s`` (never cached)."""

    code = "grammar_compile_timeout"


@dataclass(frozen=True)
class GrammarLimits:
    """What a grammar may cost (``--max-grammar-bytes``, ``--max-schema-depth``, ``--grammar-compile-timeout``,
    ``--grammar-compile-processes``)."""

    max_bytes: int = 32768
    max_schema_depth: int = 32
    timeout_s: float = 10.0
    processes: int = 4

    def check(self, kind: str, text: str) -> None:
        """Raise ``GrammarError`` when ``text`` is too long or (a JSON schema) nested too deep; costs O(len)."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise GrammarError(f"{kind} is {size} bytes; at most {self.max_bytes} are accepted (--max-grammar-bytes)")
        if kind == "json_schema":
            depth = json_depth(text)
            if depth > self.max_schema_depth:
                raise GrammarError(
                    f"json_schema nests {depth} levels of objects and arrays; at most {self.max_schema_depth} "
                    "are accepted (--max-schema-depth)"
                )


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """Deepest nesting of objects and arrays in JSON ``text`` (brackets inside strings do not count);
    never recurses, so any depth is measured safely."""
    depth = deepest = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


class GrammarMatcher:
    """One request's position in its grammar (one thread at a time, see the module docstring)."""

    def __init__(self, matcher: Any):
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False when the grammar does not allow it (the state is unchanged)."""
        return bool(self._m.accept_token(int(token_id)))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into every word of ``bitmask[row]`` (int32, 32 tokens a word)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may be generated."""
        return bool(self._m.is_terminated())

    @staticmethod
    def accept_many(matchers: list["GrammarMatcher"], tokens: list[int]) -> list[tuple[bool, bool]]:
        """``(accepted, terminated)`` for ``matchers[i].accept(tokens[i])``, every ``i`` in one call into
        xgrammar: a refused token leaves that matcher's state unchanged (terminated is then False)."""
        if len(matchers) == 1:  # the batch call's conversions cost more than one accept
            accepted = matchers[0].accept(tokens[0])
            return [(accepted, accepted and matchers[0].terminated)]
        if not matchers:
            return []
        import xgrammar as xgr

        accepted = xgr.BatchGrammarMatcher.batch_accept_token([m._m for m in matchers], [int(t) for t in tokens])
        return [(bool(a), bool(a) and m.terminated) for m, a in zip(matchers, accepted)]

    @staticmethod
    def fill_many(matchers: list["GrammarMatcher"], bitmask: torch.Tensor) -> None:
        """Row ``i`` of ``bitmask`` for ``matchers[i]``, filled in parallel by xgrammar's own threads
        (a row costs up to ~1 ms inside a JSON string on a 50k vocabulary)."""
        if len(matchers) == 1:
            matchers[0].fill(bitmask, 0)
            return
        _batch_filler().batch_fill_next_token_bitmask([m._m for m in matchers], bitmask)


_fillers = threading.local()


def _batch_filler() -> Any:
    """xgrammar's batch filler of the calling thread (the scheduler's and the mask filler's threads
    each have their own, so two fills never share one)."""
    filler = getattr(_fillers, "filler", None)
    if filler is None:
        import xgrammar as xgr

        filler = _fillers.filler = xgr.BatchGrammarMatcher(max_threads="auto")
    return filler


class GrammarBackend:
    """Compiles grammars for one tokenizer (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        limits: GrammarLimits = GrammarLimits(),
        cache_size: int = 256,
    ):
        self.tokenizer = tokenizer  # kvship's ``Tokenizer`` (its ``hf`` is read on the first compile)
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.limits = limits
        self.cache_size = cache_size
        # each thread waits on one compile process
        self._pool = ThreadPoolExecutor(max_workers=limits.processes, thread_name_prefix="kvship-grammar")
        self._lock = threading.RLock()
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._info: Any = None
        self._processes: Optional[CompilePool] = None
        self.hits = 0
        self.misses = 0
        self.timeouts = 0  # compiles that ran past the timeout (their processes were killed)

    # ------------------------------------------------------------ compiling
    def compile(self, key: GrammarKey) -> Future:
        """A future of the compiled grammar for ``key`` (cached; failures raise ``GrammarError``)."""
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:  # only grammars within the limits are cached
                self._cache.move_to_end(key)
                self.hits += 1
                return fut
        try:
            self.limits.check(*key)
        except GrammarError as e:  # refused before any work: nothing to cache
            fut = Future()
            fut.set_exception(e)
            return fut
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:  # another thread submitted it meanwhile
                self._cache.move_to_end(key)
                self.hits += 1
                return fut
            self.misses += 1
            fut = self._pool.submit(self._compile, key)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f: self._forget_timeout(key, f))
        return fut

    def _forget_timeout(self, key: GrammarKey, fut: Future) -> None:
        """A timed-out compile leaves the cache: the next request with ``key`` compiles it again."""
        if not fut.cancelled() and isinstance(fut.exception(), GrammarTimeout):
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]

    async def compile_async(self, key: GrammarKey) -> None:
        """Check ``key`` compiles (the event loop keeps running); raises ``GrammarError``."""
        if not grammar_available():
            raise GrammarError(MISSING_MESSAGE)
        await asyncio.wrap_future(self.compile(key))

    def matcher(self, compiled: Any) -> GrammarMatcher:
        import xgrammar as xgr

        return GrammarMatcher(xgr.GrammarMatcher(compiled))

    def serialize(self, compiled: Any) -> str:
        """``compiled`` as text another process with the same vocabulary can load (``deserialize``)."""
        return compiled.serialize_json()

    def deserialize(self, text: str) -> Any:
        """A compiled grammar from ``serialize``'s text (about 2 ms for a 150 KB grammar; no compile)."""
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(text, self._tokenizer_info())

    def warm(self) -> None:
        """Load xgrammar and the vocabulary now (in the pool), so a later ``deserialize`` does not."""
        if grammar_available() and self.tokenizer is not None:
            self._pool.submit(self._tokenizer_info)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            processes, self._processes = self._processes, None
        if processes is not None:
            processes.close()

    def _tokenizer_info(self) -> Any:
        with self._lock:
            if self._info is None:
                if self.tokenizer is None:
                    raise GrammarError("structured output needs the model's tokenizer")
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise GrammarError(MISSING_MESSAGE) from None
                self._info = _tokenizer_info(xgr, self.tokenizer.hf, self.vocab_size, self.stop_token_ids)
            return self._info

    def _compile_pool(self) -> CompilePool:
        info = self._tokenizer_info()
        with self._lock:
            if self._processes is None:
                lim = self.limits
                self._processes = CompilePool(info.serialize_json(), lim.processes, lim.timeout_s, lim.max_bytes)
            return self._processes

    def _compile(self, key: GrammarKey) -> Any:
        kind, text = key
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}; known: {', '.join(KINDS)}")
        try:
            return self.deserialize(self._compile_pool().compile(kind, text))
        except CompileTimeout:
            self.timeouts += 1
            raise GrammarTimeout(
                f"grammar compile timed out after {self.limits.timeout_s:g} s (--grammar-compile-timeout)"
            ) from None
        except CompileFailed as e:
            raise GrammarError(f"invalid {kind}: {e}") from None


def _tokenizer_info(xgr: Any, hf: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary, with special tokens (``<unk>``, chat markers...) never allowed
    inside a grammar: their text would otherwise count as literal characters, and the detokenizer drops it."""
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
    special = set(getattr(hf, "all_special_ids", ()) or ()) - set(info.stop_token_ids)
    if not special:
        return info
    vocab = [b"" if i in special else bytes(t) for i, t in enumerate(info.decoded_vocab)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(info.stop_token_ids))


class GrammarQueue:
    """Requests waiting for their grammar (scheduler thread): ``add`` then ``poll`` every step.

    ``poll`` returns the requests whose compile ended and never waits for one.  Tensor-parallel
    ranks, which must admit the same requests at the same step, use ``LockstepGrammarQueue``."""

    def __init__(self, backend: GrammarBackend):
        self.backend = backend
        self._waiting: list[tuple[Any, Any, Future]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, req: Any, payload: Any) -> None:
        """``req`` (its ``sampling_params.grammar_key`` set) waits; ``payload`` comes back with it."""
        self._waiting.append((req, payload, self.backend.compile(req.sampling_params.grammar_key)))

    def poll(self) -> list[tuple[Any, Any, Optional[str]]]:
        """``(req, payload, error)`` for every compile that ended; ``req.grammar`` is set when error is None.
        Requests finished meanwhile (aborted) are dropped."""
        ready, still = [], []
        for req, payload, fut in self._waiting:
            if req.finished:
                continue
            if not fut.done():
                still.append((req, payload, fut))
                continue
            ready.append((req, payload, _take_grammar(self.backend, req, fut.result)))
        self._waiting = still
        return ready

    def resolve(self, rid: str, serialized: Optional[str], error: Optional[str]) -> None:
        """Only ``LockstepGrammarQueue`` is told when a grammar is ready."""
        raise TypeError("a grammar-ready message reached a scheduler that is not tensor-parallel")


def _take_grammar(backend: GrammarBackend, req: Any, compiled: Any) -> Optional[str]:
    """Set ``req.grammar`` from ``compiled()``; the error message instead when that raises."""
    try:
        matcher = backend.matcher(compiled())
        sp = getattr(req, "sampling_params", None)
        if sp is not None and sp.grammar_after:  # free tokens until the answer starts (docs/api.md, "Reasoning")
            matcher = DeferredGrammar(matcher, sp.grammar_after, sp.grammar_opener)
        req.grammar = matcher
        return None
    except GrammarError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - report, never crash the loop
        return f"grammar compile failed: {type(e).__name__}: {e}"


class LockstepGrammarQueue(GrammarQueue):
    """The grammar queue of a tensor-parallel rank (``kvship.engine.scheduler.io``).

    Only rank 0 compiles.  When its compile ends (in the compile pool's thread, or at once for a
    cached grammar), ``publish(rid, serialized, error)`` hands the serialized grammar or the error
    to rank 0's inbox (``kvship.engine.scheduler.inbox.GrammarReady``); the inbox broadcast delivers
    it to every rank at the same step, where ``resolve`` makes the request ready (rank 0 from its
    own compile, the others by ``deserialize``, ~2 ms).  No rank ever waits for a compile, and all
    admit the request at the same step."""

    def __init__(
        self,
        backend: GrammarBackend,
        leader: bool,
        publish: Callable[[str, Optional[str], Optional[str]], None],
    ):
        super().__init__(backend)
        self.leader = leader
        self._publish = publish
        self._resolved: list[tuple[Any, Any, Optional[str]]] = []
        if not leader:
            backend.warm()  # xgrammar and the vocabulary load before the first GrammarReady needs them

    def __len__(self) -> int:
        return len(self._waiting) + len(self._resolved)

    def add(self, req: Any, payload: Any) -> None:
        if not self.leader:
            self._waiting.append((req, payload, None))
            return
        fut = self.backend.compile(req.sampling_params.grammar_key)
        self._waiting.append((req, payload, fut))
        rid = req.rid
        fut.add_done_callback(lambda f: self._publish(rid, *self._outcome(f)))

    def _outcome(self, fut: Future) -> tuple[Optional[str], Optional[str]]:
        try:
            return self.backend.serialize(fut.result()), None
        except GrammarError as e:
            return None, str(e)
        except Exception as e:  # noqa: BLE001 - report, never crash the loop
            return None, f"grammar compile failed: {type(e).__name__}: {e}"

    def resolve(self, rid: str, serialized: Optional[str], error: Optional[str]) -> None:
        """Make ``rid`` ready (every rank handles the same message at the same step)."""
        for i, (req, payload, fut) in enumerate(self._waiting):
            if req.rid != rid:
                continue
            del self._waiting[i]
            if req.finished:
                return
            if error is None and fut is not None:
                error = _take_grammar(self.backend, req, fut.result)
            elif error is None:
                error = _take_grammar(self.backend, req, lambda: self.backend.deserialize(serialized))
            self._resolved.append((req, payload, error))
            return

    def poll(self) -> list[tuple[Any, Any, Optional[str]]]:
        ready, self._resolved = [r for r in self._resolved if not r[0].finished], []
        self._waiting = [w for w in self._waiting if not w[0].finished]
        return ready
