"""A grammar that starts later in the output: free tokens first (docs/api.md, "Reasoning").

A request whose ``SamplingParams.grammar_after`` is set gets a ``DeferredGrammar``
around its matcher instead of the matcher.  Until the output has produced the
token ids ``after`` (e.g. a reasoning model's ``</think>``) every token is
allowed and the matcher sees nothing; from the token after them, the matcher
masks and accepts as for any constrained request.  With ``opener`` (one token
id, e.g. ``<think>``) the free part exists only when the output's first token
is ``opener``: the first mask is the grammar's plus ``opener``, and any other
first token goes to the matcher (the answer starts at once).

The scheduler does not know what the ids mean (the serving layer picks them);
it treats the request as constrained from its first token, so every token is
on the host before the next mask (``needs_host_state``), and tensor-parallel
ranks see the same tokens, so their wrappers agree.  Under PD the prefill
worker samples the first token with the same wrapper and decode's wrapper
accepts that token like any other (``Req.append_token``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


def _bit(token_id: int) -> tuple[int, int]:
    """(word, int32 value with token_id's bit set)."""
    v = 1 << (token_id % 32)
    return token_id // 32, v - (1 << 32) if v >= 1 << 31 else v


class DeferredGrammar:
    def __init__(self, inner: Any, after: Sequence[int], opener: Optional[int] = None):
        if not after:
            raise ValueError("a deferred grammar needs the token ids it starts after")
        self.inner = inner
        self.after = tuple(int(t) for t in after)
        self.opener = None if opener is None else int(opener)
        self.started = False
        self._seen = 0
        self._tail: tuple[int, ...] = ()

    def accept(self, token_id: int) -> bool:
        t = int(token_id)
        if self.started:
            return bool(self.inner.accept(t))
        first, self._seen = self._seen == 0, self._seen + 1
        if first and self.opener is not None and t != self.opener:
            self.started = True  # no thinking: this token is the answer's first
            return bool(self.inner.accept(t))
        self._tail = (self._tail + (t,))[-len(self.after) :]
        if self._tail == self.after:
            self.started = True
        return True

    @property
    def terminated(self) -> bool:
        return self.started and bool(self.inner.terminated)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.started:
            self.inner.fill(bitmask, row)
        elif self._seen == 0 and self.opener is not None:
            self.inner.fill(bitmask, row)
            word, value = _bit(self.opener)
            bitmask[row, word] |= value
        else:
            bitmask[row].fill_(-1)  # every token allowed
