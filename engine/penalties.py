"""Frequency, presence and repetition penalties applied to a batch of logits.

Conventions (the same as OpenAI and Hugging Face):

* frequency / presence (OpenAI): over the *generated* tokens only,
  ``logit[t] -= frequency * count(t) + presence * (count(t) > 0)``.
* repetition (Hugging Face ``RepetitionPenaltyLogitsProcessor``): over the
  prompt *and* the generated tokens, ``logit[t] /= r`` where positive and
  ``logit[t] *= r`` where negative.  Applied before frequency/presence.

Tensors are built on the logits' device from the requests' token lists each
step (dense ``[bs, vocab]``), only when some request of the batch asks for a
penalty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def _token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[bs, vocab]`` float32 counts of each token id per row."""
    bs = len(token_lists)
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros((bs, vocab_size + 1), dtype=torch.float32, device=device)
    if width == 0:
        return counts[:, :vocab_size]
    ids = torch.full((bs, width), vocab_size, dtype=torch.int64)
    for i, toks in enumerate(token_lists):
        if toks:
            ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.int64).clamp_(0, vocab_size)
    ids = ids.to(device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


@dataclass
class PenaltyInfo:
    frequency: Optional[torch.Tensor]  # [bs, 1]
    presence: Optional[torch.Tensor]  # [bs, 1]
    repetition: Optional[torch.Tensor]  # [bs, 1]
    output_counts: Optional[torch.Tensor]  # [bs, vocab] counts of generated tokens
    seen: Optional[torch.Tensor]  # [bs, vocab] bool, token in prompt or output

    @classmethod
    def build(
        cls,
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        frequency: Sequence[float],
        presence: Sequence[float],
        repetition: Sequence[float],
        vocab_size: int,
        device: torch.device | str,
    ) -> Optional["PenaltyInfo"]:
        """None when no row has a penalty (the common case costs nothing)."""
        device = torch.device(device)
        use_fp = any(f != 0.0 for f in frequency) or any(p != 0.0 for p in presence)
        use_rep = any(r != 1.0 for r in repetition)
        if not (use_fp or use_rep):
            return None

        def col(values: Sequence[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        out_counts = _token_counts(output_ids, vocab_size, device) if use_fp else None
        seen = None
        if use_rep:
            both = [list(p) + list(o) for p, o in zip(prompt_ids, output_ids)]
            seen = _token_counts(both, vocab_size, device) > 0
        return cls(
            frequency=col(frequency) if use_fp else None,
            presence=col(presence) if use_fp else None,
            repetition=col(repetition) if use_rep else None,
            output_counts=out_counts,
            seen=seen,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalised copy of ``logits`` (``[bs, vocab]`` float32)."""
        logits = logits.clone()
        if self.repetition is not None and self.seen is not None:
            penalised = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(self.seen, penalised, logits)
        if self.output_counts is not None:
            assert self.frequency is not None and self.presence is not None
            logits -= self.frequency * self.output_counts + self.presence * (self.output_counts > 0).float()
        return logits
