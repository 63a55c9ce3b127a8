"""Messages into the scheduler thread and the queue that carries them.

``submit`` / ``abort`` may be called from any thread (and, on a
tensor-parallel rank 0, the grammar compile pool queues ``GrammarReady``); the scheduler drains
the inbox at the start of each step.  After ``close`` no submit is accepted
(``SchedulerClosedError``); aborts are always accepted (and ignored once the
loop is gone).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Optional, Union

from kvship.engine.io_struct import GenerateRequest


class SchedulerClosedError(RuntimeError):
    """``submit`` after the scheduler loop has exited."""


@dataclass(frozen=True)
class Submit:
    request: GenerateRequest


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class GrammarReady:
    """Tensor-parallel rank 0 to every rank: ``rid``'s grammar compiled (``serialized``) or failed
    (``error``); every rank admits the request at the step that carries it
    (``kvship.engine.grammar.LockstepGrammarQueue``)."""

    rid: str
    serialized: Optional[str] = None
    error: Optional[str] = None


Message = Union[Submit, Abort, GrammarReady]


class _Wake:
    """Queued by ``Inbox.wake`` to end a blocking ``get`` early; never handed to the scheduler."""


_WAKE = _Wake()


class Inbox:
    """A thread-safe FIFO of ``Submit`` / ``Abort`` messages."""

    def __init__(self) -> None:
        self._q: "queue.SimpleQueue[Message]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._wake_pending = False

    def put(self, msg: Message) -> None:
        """Enqueue ``msg``; a ``Submit`` after ``close`` raises ``SchedulerClosedError``."""
        with self._lock:
            if self._closed and isinstance(msg, Submit):
                raise SchedulerClosedError("the scheduler is not running")
            self._q.put(msg)

    def get(self, block_s: float = 0.0) -> Optional[Message]:
        """The next message, waiting up to ``block_s`` seconds; None when there is none (or ``wake`` was called)."""
        try:
            msg = self._q.get(timeout=block_s) if block_s > 0 else self._q.get_nowait()
            while msg is _WAKE:
                self._wake_pending = False
                msg = self._q.get_nowait()
        except queue.Empty:
            return None
        return msg  # type: ignore[return-value]

    def wake(self) -> None:
        """End a blocking ``get`` / ``drain`` now: something the loop polls changed (a KV transfer moved).

        Any thread may call it; wakes that arrive before the loop looks collapse into one.
        """
        if not self._wake_pending:
            self._wake_pending = True
            self._q.put(_WAKE)

    def drain(self, block_s: float = 0.0) -> list[Message]:
        """Every queued message, waiting up to ``block_s`` seconds for the first.

        The scheduler's ``recv`` takes one step's messages with it (a
        tensor-parallel rank's inbox broadcasts them: ``kvship.engine.parallel``).
        """
        out: list[Message] = []
        msg = self.get(block_s)
        while msg is not None:
            out.append(msg)
            msg = self.get(0.0)
        return out

    def empty(self) -> bool:
        n = self._q.qsize()
        return n == 0 or (n == 1 and self._wake_pending)

    def close(self) -> None:
        with self._lock:
            self._closed = True
