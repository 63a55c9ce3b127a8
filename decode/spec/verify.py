"""Acceptance of a verified draft tree.

Both rules walk the tree from the root: at the current slot the target's
next-token choice (greedy) or distribution (sampled) decides which child, if
any, is accepted; the walk continues below an accepted child and stops where
no child is accepted, and there the target supplies one more token (the
*bonus*).  A round therefore emits ``accepted + 1`` tokens, at least one.

* ``accept_greedy``: a child is accepted when its token is the target's
  argmax at its parent.  Output equals non-speculative greedy decoding.
* ``accept_sampled``: the draft candidates are deterministic (n-gram
  continuations, a draft model's top-k), so the lossless rule uses the target
  distribution alone: at a slot with residual distribution ``p`` (initially
  the target's), a child with token ``c`` is accepted with probability
  ``p[c]``; on rejection ``p[c]`` is set to 0 and ``p`` renormalised before the
  next sibling is tried; when every child is rejected the bonus is drawn from
  the residual.  The emitted token at every step is then distributed exactly
  as a draw from the target's distribution (tests check it with a chi-square
  test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvship.decode.spec.tree import DraftTree


@dataclass
class Accepted:
    slots: list[int]  # accepted draft slots, root's child first (their K/V is kept)
    tokens: list[int]  # emitted tokens: the accepted drafts' tokens, then the bonus
    bonus_slot: int  # the slot whose logits gave the bonus token

    @property
    def length(self) -> int:
        """Tokens this round emitted (accepted drafts + the bonus)."""
        return len(self.tokens)


def _walk(tree: DraftTree, pick) -> Accepted:
    first, sibling = tree.first_child(), tree.next_sibling()
    slot, slots, tokens = 0, [], []
    while True:
        child, token = pick(slot, first[slot], sibling)
        if child is None:
            tokens.append(token)
            return Accepted(slots, tokens, slot)
        slots.append(child)
        tokens.append(tree.all_tokens[child])
        slot = child


def accept_greedy(tree: DraftTree, target_ids: list[int]) -> Accepted:
    """``target_ids[s]``: the target's argmax at slot ``s`` (``tree.size`` entries)."""
    toks = tree.all_tokens

    def pick(slot: int, child: int, sibling: list[int]):
        want = target_ids[slot]
        while child != -1:
            if toks[child] == want:
                return child, want
            child = sibling[child]
        return None, want

    return _walk(tree, pick)


def accept_sampled(
    tree: DraftTree, target_probs: torch.Tensor, generator: Optional[torch.Generator] = None
) -> Accepted:
    """``target_probs``: [tree.size, vocab] float, the target's (filtered, tempered) distribution per slot."""
    toks = tree.all_tokens

    def pick(slot: int, child: int, sibling: list[int]):
        p = target_probs[slot].to(torch.float64).clone()
        while child != -1:
            c = toks[child]
            u = torch.rand((), generator=generator, dtype=torch.float64)
            total = p.sum()
            if total > 0 and u * total < p[c]:
                return child, c
            p[c] = 0.0
            child = sibling[child]
        if p.sum() <= 0:  # every token with mass was a rejected candidate: cannot happen unless p was one-hot
            p = target_probs[slot].to(torch.float64)
        return None, int(torch.multinomial(p / p.sum(), 1, generator=generator).item())

    return _walk(tree, pick)
