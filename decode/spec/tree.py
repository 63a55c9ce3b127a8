"""``DraftTree``: one request's draft for a verify forward.

Layout: slot 0 is the root (the request's newest token, not yet in the KV
cache); slots ``1..n`` are the draft nodes.  ``parents[i]`` is the slot of node
``i``'s parent (0 for the root's children; ``parents[0] == -1``).  Nodes are
stored parents-first (``parents[i] < i``), and siblings keep the drafter's
preference order (the verifier tries them in that order).

Derived arrays (all over the ``n + 1`` slots):

* ``depths``: 0 for the root, parent's depth + 1 for a node; a slot's position
  in the sequence is ``seq_len + depth`` where ``seq_len`` is the number of
  tokens whose K/V is already cached.
* ``mask()``: ``mask[i, j]`` is True when slot ``i`` attends to slot ``j``
  (``j`` is ``i`` or one of its ancestors); every slot also attends to the
  whole cached prefix.
* ``first_child`` / ``next_sibling``: the walk arrays the verifier uses
  (-1 = none).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    root: int
    tokens: list[int] = field(default_factory=list)  # draft tokens of slots 1..n
    parents: list[int] = field(default_factory=list)  # parent slot of slots 1..n (0 = the root)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a draft tree needs one parent per token")
        for i, p in enumerate(self.parents, start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come first")

    @classmethod
    def chain(cls, root: int, tokens: list[int]) -> "DraftTree":
        """A linear draft: each token follows the previous one."""
        return cls(root, list(tokens), list(range(len(tokens))))

    @property
    def size(self) -> int:
        """Slots in the verify forward (root + nodes)."""
        return len(self.tokens) + 1

    @property
    def all_tokens(self) -> list[int]:
        return [self.root, *self.tokens]

    @property
    def all_parents(self) -> list[int]:
        return [-1, *self.parents]

    def depths(self) -> list[int]:
        d = [0]
        for p in self.parents:
            d.append(d[p] + 1)
        return d

    def positions(self, seq_len: int) -> list[int]:
        return [seq_len + d for d in self.depths()]

    def mask(self) -> torch.Tensor:
        n = self.size
        m = torch.zeros((n, n), dtype=torch.bool)
        parents = self.all_parents
        for i in range(n):
            j = i
            while j >= 0:
                m[i, j] = True
                j = parents[j]
        return m

    def first_child(self) -> list[int]:
        out = [-1] * self.size
        for i in range(self.size - 1, 0, -1):  # the earliest child wins
            out[self.parents[i - 1]] = i
        return out

    def next_sibling(self) -> list[int]:
        out = [-1] * self.size
        last: dict[int, int] = {}
        for i, p in enumerate(self.parents, start=1):
            if p in last:
                out[last[p]] = i
            last[p] = i
        return out

    def padded(self, size: int) -> "DraftTree":
        """This tree with extra children of the root (carrying the root's token) up to ``size`` slots.

        Extra candidates never change what is accepted: a candidate is taken only
        when the target's choice (or its lossless draw) is that token anyway.
        """
        if self.size > size:
            return DraftTree(self.root, self.tokens[: size - 1], self.parents[: size - 1])
        extra = size - self.size
        return DraftTree(self.root, self.tokens + [self.root] * extra, self.parents + [0] * extra)

    def path_to(self, slot: int) -> list[int]:
        """Slots from the root's first child down to ``slot`` (empty for the root)."""
        parents = self.all_parents
        path = []
        while slot > 0:
            path.append(slot)
            slot = parents[slot]
        return path[::-1]
