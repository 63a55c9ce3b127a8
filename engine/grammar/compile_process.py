"""Compiling grammars in child processes that can be killed (docs/api.md, "Structured output").

A grammar compile is C++ work inside xgrammar that no thread can interrupt,
and some grammars within the size and depth limits still take minutes.  So
compiles run in ``python -m kvship.engine.grammar.compile_child VOCAB_FILE
MAX_REQUEST_BYTES`` children, where VOCAB_FILE holds the worker's vocabulary
(``TokenizerInfo.serialize_json``, written once by the pool):

    parent  -- frame {"kind", "text"} -->  child (xgrammar GrammarCompiler of the worker's vocabulary)
    parent  <-- frame {"ok": serialized CompiledGrammar} or {"error": message} --  child

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON.
The peer is always our own child over its stdin/stdout pipes (nothing else
can reach them); a request frame holds at most MAX_REQUEST_BYTES (the
grammar byte limit, JSON-escaped) and a reply at most ``MAX_REPLY_BYTES``;
a frame claiming more ends that child.
The child's first frame is {"ready": true} once xgrammar and the vocabulary
are loaded; the compile timeout starts when the request is sent, so a
child's start-up never counts against a grammar.  A killed child's
replacement starts at once, in the background, and so does a spare once two
compiles overlap, so the next compile finds a child ready.

``CompilePool.compile(kind, text)`` takes an idle child (starting one when
none is idle and fewer than ``processes`` run), sends the grammar and waits
for the reply up to ``timeout_s``; past it the child is killed (SIGKILL) and
``CompileTimeout`` raised.  A child that dies is replaced on the next use.
The compiled grammar crosses the pipe as xgrammar's
``CompiledGrammar.serialize_json`` text; the parent rebuilds it with
``deserialize_json`` (about 2 ms for a 150 KB grammar on SmolLM2's 49k
vocabulary, measured in docs/api.md).  Thread-safe: each call holds its child
alone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Optional

logger = logging.getLogger(__name__)

MAX_REPLY_BYTES = 256 << 20  # a serialized compiled grammar (token masks of a large vocabulary)
START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in a fresh child
_HEADER = struct.Struct(">I")
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " (and sometimes a failed-check prefix)
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")


class CompileTimeout(Exception):
    """The compile did not finish within the timeout; its child was killed."""


class CompileFailed(Exception):
    """The compiler refused the grammar (its message) or the child failed."""


# ------------------------------------------------------------------ framing
def _write_frame(fd: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, n: int, deadline: Optional[float]) -> bytes:
    """``n`` bytes from ``fd``; raises ``CompileTimeout`` past ``deadline`` and EOFError on a closed pipe."""
    chunks: list[bytes] = []
    while n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise CompileTimeout()
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("pipe closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, max_bytes: int, deadline: Optional[float] = None) -> Any:
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    if n > max_bytes:
        raise ValueError(f"frame of {n} bytes exceeds {max_bytes}")
    return json.loads(_read_exact(fd, n, deadline))


# ------------------------------------------------------------------ the child
def compiler_message(exc: BaseException) -> str:
    """The compiler's message without xgrammar's source-location prefix."""
    text = str(exc).strip()
    text = _CPP_PREFIX.sub("", text)
    return _CHECK_PREFIX.sub("", text).strip() or type(exc).__name__


def compile_with(compiler: Any, kind: str, text: str) -> Any:
    """``text`` compiled by an xgrammar ``GrammarCompiler`` (shared by the child and in-process use)."""
    if kind == "json_schema":
        # compact separators: a model cannot pad the output with endless whitespace
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=_strict(text))
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def _strict(schema_text: str) -> bool:
    """xgrammar's strict mode (no properties or items beyond the schema's) except for a bare
    ``{"type": "object"}`` (``response_format: json_object``), which must allow any object."""
    return schema_text.replace(" ", "") != '{"type":"object"}'


def request_cap(max_text_bytes: int) -> int:
    """Largest request frame for grammars of ``max_text_bytes``: JSON escapes a byte in at most 6."""
    return 6 * max_text_bytes + 1024


def child_main(vocab_file: str, max_request_bytes: int) -> None:
    """Serve compiles on stdin/stdout until stdin closes (the parent is gone or closed it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the worker's to handle; it closes our stdin
    rfd, wfd = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the frames
    import xgrammar as xgr

    with open(vocab_file, encoding="utf-8") as f:
        info = xgr.TokenizerInfo.deserialize_json(f.read())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write_frame(wfd, {"ready": True})
    while True:
        try:
            req = _read_frame(rfd, max_request_bytes)
        except EOFError:
            return
        try:
            compiled = compile_with(compiler, req["kind"], req["text"])
            _write_frame(wfd, {"ok": compiled.serialize_json()})
        except Exception as e:  # noqa: BLE001 - the compiler's message goes back to the client
            _write_frame(wfd, {"error": compiler_message(e)})


# ------------------------------------------------------------------ the parent
class _Child:
    """One compile process (owned by one caller at a time)."""

    def __init__(self, vocab_file: str, max_request_bytes: int, registry: set):
        self._registry = registry
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvship.engine.grammar.compile_child", vocab_file, str(max_request_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # compiling needs no GPU
        )
        self.ready = False
        registry.add(self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def compile(self, kind: str, text: str, timeout_s: float) -> str:
        rfd = self.proc.stdout.fileno()
        if not self.ready:
            try:
                self.ready = bool(_read_frame(rfd, 1024, time.monotonic() + START_TIMEOUT_S).get("ready"))
            except CompileTimeout:
                raise CompileFailed(f"the grammar compile process did not start in {START_TIMEOUT_S:g} s") from None
        _write_frame(self.proc.stdin.fileno(), {"kind": kind, "text": text})
        reply = _read_frame(rfd, MAX_REPLY_BYTES, time.monotonic() + timeout_s)
        if "error" in reply:
            raise CompileFailed(str(reply["error"]))
        return reply["ok"]

    def kill(self) -> None:
        self._registry.discard(self)
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


class CompilePool:
    """Up to ``processes`` compile children for one vocabulary (see the module docstring)."""

    def __init__(self, tokenizer_info_json: str, processes: int, timeout_s: float, max_text_bytes: int):
        fd, self._vocab_file = tempfile.mkstemp(prefix="kvship-grammar-vocab-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tokenizer_info_json)
        self._max_request = request_cap(max_text_bytes)
        self._children: set[_Child] = set()  # every live child, idle or busy
        # children and the vocabulary file go with the pool even when nobody calls close (or at exit)
        self._finalizer = weakref.finalize(self, _kill_all, self._children, self._vocab_file)
        self.processes = processes
        self.timeout_s = timeout_s
        self._idle: list[_Child] = []
        self._running = 0
        self._cond = threading.Condition()
        self._closed = False

    def compile(self, kind: str, text: str) -> str:
        """The serialized compiled grammar; raises ``CompileTimeout`` or ``CompileFailed``."""
        child = self._take()
        ok = False
        try:
            result = child.compile(kind, text, self.timeout_s)
            ok = True
            return result
        except CompileFailed:
            ok = True  # the child answered: it is fine
            raise
        except (EOFError, OSError, ValueError) as e:
            raise CompileFailed(f"grammar compile process failed: {e}") from None
        finally:
            self._give_back(child, ok)

    def _take(self) -> _Child:
        """An idle child (waiting while ``processes`` are busy).  Once two compiles overlap and none is
        idle, a spare starts too."""
        with self._cond:
            while True:
                if self._closed:
                    raise CompileFailed("the grammar compiler is shut down")
                child = None
                while self._idle and child is None:
                    # a child that has answered before (ready), else the oldest: the nearest to ready
                    child = self._idle.pop(next((i for i, c in enumerate(self._idle) if c.ready), 0))
                    if not child.alive():
                        child = None
                        self._running -= 1
                if child is None and self._running < self.processes:
                    self._running += 1
                    child = self._start()
                if child is not None:
                    busy = self._running - len(self._idle)  # this one included
                    if busy >= 2 and not self._idle and self._running < self.processes:
                        # compiles overlap: a spare loads xgrammar now, so the next caller finds one ready
                        self._running += 1
                        spare = self._start()
                        if spare is not None:
                            self._idle.append(spare)
                    return child
                self._cond.wait()

    def _start(self) -> Optional[_Child]:
        """A new child (the caller counted it in ``_running``; uncounted again when it cannot start)."""
        try:
            return _Child(self._vocab_file, self._max_request, self._children)
        except OSError as e:
            self._running -= 1
            logger.warning("could not start a grammar compile process: %s", e)
            if not self._idle and self._running == 0:
                raise CompileFailed(f"could not start a grammar compile process: {e}") from None
            return None

    def _give_back(self, child: _Child, ok: bool) -> None:
        if not ok:
            child.kill()
            if self._closed:
                return
            try:  # its replacement loads xgrammar while nobody waits for it
                child = _Child(self._vocab_file, self._max_request, self._children)
            except OSError as e:
                logger.warning("could not start a grammar compile process: %s", e)
                with self._cond:
                    self._running -= 1
                    self._cond.notify()
                return
        with self._cond:
            if not self._closed:
                self._idle.append(child)
                self._cond.notify()
                return
        child.kill()

    def close(self) -> None:
        """Kill every child (a busy one's caller gets ``CompileFailed``) and remove the vocabulary file."""
        with self._cond:
            self._closed = True
            self._idle = []
            self._cond.notify_all()
        self._finalizer()


def _kill_all(children: set, vocab_file: str) -> None:
    for child in list(children):
        child.kill()
    try:
        os.unlink(vocab_file)
    except OSError:
        pass
