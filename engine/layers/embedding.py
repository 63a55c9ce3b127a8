"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvship.engine.layers.linear import _param, linear_forward


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = _param((vocab_size, hidden_size), dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits.

    With ``tied`` set it owns no parameter and uses the embedding's weight.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32, tied: VocabEmbedding | None = None
    ):
        super().__init__()
        self.vocab_size = vocab_size
        # a plain attribute (not a submodule) so the tied weight is not registered twice
        self._tied = [tied] if tied is not None else []
        if tied is None:
            self.weight = _param((vocab_size, hidden_size), dtype)

    @property
    def tied(self) -> bool:
        return bool(self._tied)

    def get_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied else self.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 (the matmul runs in the model dtype)."""
        return linear_forward(hidden, self.get_weight()).float()
