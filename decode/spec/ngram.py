"""Prompt-lookup (n-gram) drafting: continuations copied from the request's own tokens.

For the longest ``n`` in ``[min_n, max_n]`` whose last ``n`` tokens of
``prompt + output`` occur earlier in that sequence, the tokens that followed
the most recent earlier occurrences are proposed.  With ``branches == 1`` the
draft is a chain of up to ``num_draft_tokens`` tokens; with more, the
continuations of up to ``branches`` distinct earlier occurrences become
sibling chains (most recent first) sharing the budget.  No model is involved;
an empty draft (no match) is a normal outcome: the round then verifies the
root alone and emits one token.
"""

from __future__ import annotations

from kvship.decode.spec.drafter import SequenceDrafter
from kvship.decode.spec.tree import DraftTree


class NgramDrafter(SequenceDrafter):
    def __init__(self, num_draft_tokens: int = 8, min_n: int = 1, max_n: int = 4, branches: int = 1):
        if num_draft_tokens < 1 or not 1 <= min_n <= max_n or branches < 1:
            raise ValueError("ngram drafter: need num_draft_tokens >= 1, 1 <= min_n <= max_n, branches >= 1")
        self.k = num_draft_tokens
        self.min_n = min_n
        self.max_n = max_n
        self.branches = branches

    def continuations(self, seq: list[int]) -> list[list[int]]:
        """Up to ``branches`` distinct continuations of ``seq``'s longest repeated suffix."""
        L = len(seq)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = seq[L - n :]
            found: list[list[int]] = []
            for start in range(L - n - 1, -1, -1):  # most recent earlier occurrence first
                if seq[start : start + n] == suffix:
                    cont = seq[start + n : start + n + self.k]
                    if cont and cont not in found and not any(f[:1] == cont[:1] for f in found):
                        found.append(cont)
                        if len(found) == self.branches:
                            break
            if found:
                return found
        return []

    def release_missing(self, open_rids: set[str]) -> None:
        """The drafter interface: n-gram drafting keeps no per-request state."""

    def propose_for(self, rid: str, seq: list[int]) -> DraftTree:
        """The drafter interface (``rid`` is unused: n-gram drafting keeps no state)."""
        return self.propose(seq)

    def propose(self, seq: list[int]) -> DraftTree:
        """The draft tree below ``seq[-1]`` (the root)."""
        conts = self.continuations(seq)
        tokens: list[int] = []
        parents: list[int] = []
        budget = self.k
        for cont in conts:
            take = cont[: max(1, budget // max(1, len(conts)))] if len(conts) > 1 else cont[:budget]
            parent = 0
            for t in take:
                if len(tokens) >= self.k:
                    break
                tokens.append(t)
                parents.append(parent)
                parent = len(tokens)
        return DraftTree(seq[-1], tokens, parents)
