"""Masking the logits of constrained requests with their grammars' next-token bitmasks.

Runs once per step, after the model's forward and before the sampler
(``kvship.engine.scheduler.launch``), so on CUDA it is plain device work
outside the CUDA graph.  The matchers fill an int32 bitmask on the host
(bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed); the mask
goes to the device in one copy and is unpacked there with shifts, and the
disallowed logits of the constrained rows become ``-inf``.  Unconstrained
rows are not touched, so their tokens are the ones they would get without
constrained neighbours.

The logprobs a constrained request returns are computed after the mask
(the distribution it actually samples from).
"""

from __future__ import annotations

from typing import Any, Container, Sequence

import torch

from kvship.engine.grammar.backend import GrammarMatcher


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(reqs: Sequence[Any], vocab_size: int, skip: Container[int] = ()) -> tuple[list[int], torch.Tensor]:
    """(rows of constrained requests, their bitmask [n, words] int32 on the host); requests whose
    ``id`` is in ``skip`` are left out."""
    rows = [j for j, r in enumerate(reqs) if r.grammar is not None and id(r) not in skip]
    mask = torch.full((len(rows), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    grammars = [reqs[j].grammar for j in rows]
    if all(isinstance(g, GrammarMatcher) for g in grammars):
        GrammarMatcher.fill_many(grammars, mask)  # xgrammar's threads, several rows at once
    else:
        for i, g in enumerate(grammars):
            g.fill(mask, i)
    return rows, mask


def unpack_bitmask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, words] int32 -> [n, vocab_size] bool (True = allowed), on ``mask``'s device."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_mask(logits: torch.Tensor, reqs: Sequence[Any], skip: Container[int] = ()) -> None:
    """Set, in place, the logits of tokens each constrained row's grammar forbids to ``-inf``.

    ``logits`` is ``[len(reqs), vocab]`` (the model's rows cut to the vocabulary);
    a request is constrained when its ``grammar`` (a ``GrammarMatcher``) is set and
    its ``id`` is not in ``skip`` (requests about to finish; see ``kvship.engine.scheduler.launch``).
    """
    if not any(r.grammar is not None and id(r) not in skip for r in reqs):
        return
    vocab = logits.shape[-1]
    rows, mask = fill_bitmask(reqs, vocab, skip)
    if logits.device.type == "cuda":
        mask = mask.pin_memory().to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(mask, vocab)
    if len(rows) == logits.shape[0]:  # every row constrained: mask in place
        logits.masked_fill_(~allowed, float("-inf"))
        return
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[idx] = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
