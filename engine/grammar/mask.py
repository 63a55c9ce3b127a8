"""Masking the logits of constrained requests with their grammars' next-token bitmasks.

Runs once per step, after the model's forward and before the sampler
(``kvship.engine.scheduler.launch``), so on CUDA it is plain device work
outside the CUDA graph.  The matchers fill an int32 bitmask on the host
(bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed); the mask
goes to the device in one copy and is unpacked there with shifts, and the
disallowed logits of the constrained rows become ``-inf``.  Unconstrained
rows are not touched, so their tokens are the ones they would get without
constrained neighbours.

The fill runs either inline (``fill_bitmask``) or on a ``MaskFiller``'s
worker thread while the scheduler thread does other work; xgrammar's fills
run in C++ without holding the GIL, so the two really run at once.

The logprobs a constrained request returns are computed after the mask
(the distribution it actually samples from).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Container, Optional, Sequence

import torch

from kvship.engine.grammar.backend import GrammarMatcher
from kvship.engine.grammar.deferred import DeferredGrammar

logger = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _constrained(reqs: Sequence[Any], skip: Container[int]) -> tuple[list[int], list[Any]]:
    rows = [j for j, r in enumerate(reqs) if r.grammar is not None and id(r) not in skip]
    return rows, [reqs[j].grammar for j in rows]


def _new_bitmask(n: int, vocab_size: int, pin: bool) -> torch.Tensor:
    # no initial value: every matcher writes whole rows (and a parallel fill_ here would start
    # torch's CPU threads on the scheduler's hot path)
    return torch.empty((n, bitmask_words(vocab_size)), dtype=torch.int32, pin_memory=pin)


def _fill_rows(grammars: list[Any], mask: torch.Tensor) -> None:
    # a deferred grammar that started fills as its matcher (``kvship.engine.grammar.deferred``)
    active = [g.inner if isinstance(g, DeferredGrammar) and g.started else g for g in grammars]
    plain = [i for i, g in enumerate(active) if isinstance(g, GrammarMatcher)]
    batched = set(plain) if len(plain) > 1 else set()
    if plain and len(plain) == len(active):
        GrammarMatcher.fill_many(active, mask)  # xgrammar's threads, several rows at once
        return
    if len(plain) > 1:  # the matchers' rows in one batch fill, the others one by one
        sub = torch.empty((len(plain), mask.shape[1]), dtype=mask.dtype)
        GrammarMatcher.fill_many([active[i] for i in plain], sub)
        mask[plain] = sub
    for i, g in enumerate(active):
        if i not in batched:
            g.fill(mask, i)


def fill_bitmask(reqs: Sequence[Any], vocab_size: int, skip: Container[int] = ()) -> tuple[list[int], torch.Tensor]:
    """(rows of constrained requests, their bitmask [n, words] int32 on the host); requests whose
    ``id`` is in ``skip`` are left out."""
    rows, grammars = _constrained(reqs, skip)
    mask = _new_bitmask(len(rows), vocab_size, pin=False)
    _fill_rows(grammars, mask)
    return rows, mask


class MaskFill:
    """The bitmask of one step's constrained rows, filled inline (done) or on a ``MaskFiller``'s thread."""

    def __init__(self, rows: list[int], mask: torch.Tensor, future: Optional[Future] = None):
        self.rows = rows
        self.mask = mask
        self._future = future

    @property
    def in_flight(self) -> bool:
        """Filled on the worker thread and not waited for yet."""
        return self._future is not None

    def wait(self) -> tuple[list[int], torch.Tensor]:
        """(rows, bitmask) once filled; a fill's error is raised here."""
        if self._future is not None:
            fut, self._future = self._future, None
            fut.result()
        return self.rows, self.mask

    def abandon(self) -> None:
        """Wait for the fill and drop it (its step failed): the matchers are the caller's again."""
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - the step's requests are being failed already
            logger.warning("grammar mask fill of a failed step also failed: %s", e)


def _fill_aside(grammars: list[Any], mask: torch.Tensor, running: threading.Event) -> None:
    running.set()
    _fill_rows(grammars, mask)


class MaskFiller:
    """Fills constrained rows' bitmasks on one worker thread, started on the first fill.

    ``start`` returns once the worker runs the fill: a Python thread that wakes
    up needs the GIL, and would otherwise wait for the caller's Python work to
    give it up (up to ``sys.getswitchinterval()``, 5 ms); inside xgrammar's
    batch fill it holds no GIL.

    Contract: from ``start`` until the returned ``MaskFill``'s ``wait`` (or
    ``abandon``) returns, the matchers of its rows belong to the worker thread:
    the caller neither accepts tokens into them, fills them nor reads their
    ``terminated``.  Their requests may finish meanwhile (their KV freed): the
    fill holds its own references to the matchers, and the caller ignores the
    rows of finished requests.  Fills run one after another in ``start`` order.
    """

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self.started = 0  # fills handed to the worker thread

    def start(self, reqs: Sequence[Any], vocab_size: int, skip: Container[int] = (), pin: bool = False) -> MaskFill:
        """Begin filling the bitmask of ``reqs``' constrained rows (``skip`` as in ``fill_bitmask``);
        ``pin``: allocate it in pinned host memory (it goes to a CUDA device)."""
        rows, grammars = _constrained(reqs, skip)
        mask = _new_bitmask(len(rows), vocab_size, pin)
        if not rows:
            return MaskFill(rows, mask)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvship-mask")
        self.started += 1
        running = threading.Event()
        fill = MaskFill(rows, mask, self._pool.submit(_fill_aside, grammars, mask, running))
        running.wait()
        return fill

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def unpack_bitmask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, words] int32 -> [n, vocab_size] bool (True = allowed), on ``mask``'s device."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
    """Set, in place, ``logits[rows[i], t]`` to ``-inf`` where bit ``t`` of ``mask[i]`` is clear."""
    if not rows:
        return
    vocab = logits.shape[-1]
    if logits.device.type == "cuda":
        mask = (mask if mask.is_pinned() else mask.pin_memory()).to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(mask, vocab)
    if len(rows) == logits.shape[0]:  # every row constrained: mask in place
        logits.masked_fill_(~allowed, float("-inf"))
        return
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[idx] = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))


def apply_grammar_mask(logits: torch.Tensor, reqs: Sequence[Any], skip: Container[int] = ()) -> None:
    """Set, in place, the logits of tokens each constrained row's grammar forbids to ``-inf``.

    ``logits`` is ``[len(reqs), vocab]`` (the model's rows cut to the vocabulary);
    a request is constrained when its ``grammar`` (a ``GrammarMatcher``) is set and
    its ``id`` is not in ``skip`` (requests about to finish; see ``kvship.engine.scheduler.launch``).
    """
    if not any(r.grammar is not None and id(r) not in skip for r in reqs):
        return
    apply_bitmask(logits, *fill_bitmask(reqs, logits.shape[-1], skip))
