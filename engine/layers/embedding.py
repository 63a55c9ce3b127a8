"""Token embedding and the LM head (which may share the embedding's weight).

Both own a quantization method (``quant_method``; unquantized unless given):
the embedding's looks rows up (``embed``), the head's is a linear ``apply``.
A tied head applies its embedding's method to the embedding (whose ``weight``
is a ``[vocab, hidden]`` linear weight without bias).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvship.engine.layers.linear import load_checked, unquantized_or
from kvship.engine.layers.quantization import QuantMethod


class VocabEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        quant_method: Optional[QuantMethod] = None,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.quant_method = unquantized_or(quant_method)
        self.bias = None  # used as a tied LM head's linear weight: no bias
        self.quant_method.create_weights(self, {"weight": (vocab_size, hidden_size)}, dtype, self._load_whole)

    def _load_whole(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter of shape {tuple(param.shape)} is not stacked; got shard {shard_id!r}")
        load_checked(self, "weight", param.data, loaded, "shape mismatch")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.quant_method.embed(self, input_ids)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits.

    With ``tied`` set it owns no parameter and uses the embedding's weight.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        tied: VocabEmbedding | None = None,
        quant_method: Optional[QuantMethod] = None,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        # a plain attribute (not a submodule) so the tied weight is not registered twice
        self._tied = [tied] if tied is not None else []
        self.bias = None
        if tied is None:
            self.quant_method = unquantized_or(quant_method)
            self.quant_method.create_weights(self, {"weight": (vocab_size, hidden_size)}, dtype, self._load_whole)
        else:  # the embedding's weights, kept by the embedding's method
            self.quant_method = tied.quant_method

    def _load_whole(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter of shape {tuple(param.shape)} is not stacked; got shard {shard_id!r}")
        load_checked(self, "weight", param.data, loaded, "shape mismatch")

    @property
    def tied(self) -> bool:
        return bool(self._tied)

    def get_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied else self.weight

    def weight_holder(self) -> nn.Module:
        """The module whose parameters this head's method reads: the tied embedding, else the head itself."""
        return self._tied[0] if self._tied else self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 (the matmul runs in the model dtype)."""
        return self.quant_method.apply(self.weight_holder(), hidden).float()
