"""Compiling grammars (xgrammar) off the scheduler thread, and per-request matchers.

Contract:

* ``GrammarBackend.compile(key)`` may be called from any thread; it returns a
  ``concurrent.futures.Future`` of the compiled grammar, compiled by a small
  thread pool.  Futures are kept in an LRU cache keyed by ``(kind, text)``,
  so the HTTP layer's check (``compile_async``) and the scheduler's compile
  of the same request share one compilation, and a repeated schema costs a
  dict look-up.  A failed compile is cached too (the same text fails the
  same way).
* Failures are ``GrammarError`` (a ValueError) with a user-facing message:
  the compiler's own message for an invalid schema / regex / grammar, or
  that ``xgrammar`` is not installed.
* ``xgrammar`` is imported on the first compile, in the pool, so a worker
  that never sees a constrained request never loads it.
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
from typing import Any, Iterable, Optional

import torch

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str]  # (kind, text); kind: json_schema / regex / ebnf
KINDS = ("json_schema", "regex", "ebnf")
MISSING_MESSAGE = (
    "structured output (json_schema / regex / ebnf / response_format) needs xgrammar: pip install 'kvship[grammar]'"
)

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " (and sometimes a failed-check prefix)
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def grammar_available() -> bool:
    """Whether ``xgrammar`` can be imported here."""
    return importlib.util.find_spec("xgrammar") is not None


class GrammarError(ValueError):
    """A grammar that cannot be used: invalid (the compiler's message) or no xgrammar."""


def compiler_message(exc: BaseException) -> str:
    """The compiler's message without xgrammar's source-location prefix."""
    text = str(exc).strip()
    text = _CPP_PREFIX.sub("", text)
    return _CHECK_PREFIX.sub("", text).strip() or type(exc).__name__


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
        threads: int = 2,
        cache_size: int = 256,
    ):
        self.tokenizer = tokenizer  # kvship's ``Tokenizer`` (its ``hf`` is read on the first compile)
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvship-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._compiler: Any = None
        self.hits = 0
        self.misses = 0

    # ------------------------------------------------------------ compiling
    def compile(self, key: GrammarKey) -> Future:
        """A future of the compiled grammar for ``key`` (cached; failures raise ``GrammarError``)."""
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return fut
            self.misses += 1
            fut = self._pool.submit(self._compile, key)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    async def compile_async(self, key: GrammarKey) -> None:
        """Check ``key`` compiles (the event loop keeps running); raises ``GrammarError``."""
        if not grammar_available():
            raise GrammarError(MISSING_MESSAGE)
        await asyncio.wrap_future(self.compile(key))

    def matcher(self, compiled: Any) -> GrammarMatcher:
        import xgrammar as xgr

        return GrammarMatcher(xgr.GrammarMatcher(compiled))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise GrammarError("structured output needs the model's tokenizer")
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise GrammarError(MISSING_MESSAGE) from None
                info = _tokenizer_info(xgr, self.tokenizer.hf, self.vocab_size, self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, key: GrammarKey) -> Any:
        kind, text = key
        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                # compact separators: a model cannot pad the output with endless whitespace
                return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=_strict(text))
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf":
                return compiler.compile_grammar(text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError subclasses
            raise GrammarError(f"invalid {kind}: {compiler_message(e)}") from None
        raise GrammarError(f"unknown grammar kind {kind!r}; known: {', '.join(KINDS)}")


def _tokenizer_info(xgr: Any, hf: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary, with special tokens (``<unk>``, chat markers...) never allowed
    inside a grammar: their text would otherwise count as literal characters, and the detokenizer drops it."""
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
    special = set(getattr(hf, "all_special_ids", ()) or ()) - set(info.stop_token_ids)
    if not special:
        return info
    vocab = [b"" if i in special else bytes(t) for i, t in enumerate(info.decoded_vocab)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(info.stop_token_ids))


def _strict(schema_text: str) -> bool:
    """xgrammar's strict mode (no properties or items beyond the schema's) except for a bare
    ``{"type": "object"}`` (``response_format: json_object``), which must allow any object."""
    return schema_text.replace(" ", "") != '{"type":"object"}'


class GrammarQueue:
    """Requests waiting for their grammar (scheduler thread): ``add`` then ``poll`` every step.

    ``blocking``: ``poll`` waits for every compile instead of returning the finished ones, so a
    request joins at a step that does not depend on timing.  Tensor-parallel ranks run replicated
    schedulers that must admit the same requests at the same step: they poll blocking.
    """

    def __init__(self, backend: GrammarBackend, blocking: bool = False):
        self.backend = backend
        self.blocking = blocking
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
            if not fut.done() and not self.blocking:
                still.append((req, payload, fut))
                continue
            try:
                req.grammar = self.backend.matcher(fut.result())
                ready.append((req, payload, None))
            except GrammarError as e:
                ready.append((req, payload, str(e)))
            except Exception as e:  # noqa: BLE001 - report, never crash the loop
                ready.append((req, payload, f"grammar compile failed: {type(e).__name__}: {e}"))
        self._waiting = still
        return ready
