"""``LayerRange``: the part of a decoder one process builds (a pipeline stage; docs/parallel.md).

A model class built with ``layers=LayerRange(start, end, num_layers)`` holds
decoder layers ``[start, end)`` only (keeping their checkpoint indices), the
token embedding when ``start == 0`` and the final norm and LM head when
``end == num_layers`` (with tied embeddings the last range also holds the
embedding matrix, which its LM head reads).  Its attention layers address
the KV pool by their index inside the range, so the pool holds ``end -
start`` layers.  Checkpoint tensors of other ranges are skipped unread.

The model knows nothing of how ranges are chosen or how hidden states
travel between them (``kvship.engine.distributed.pipeline``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class LayerRange:
    start: int
    end: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.num_layers:
            raise ValueError(f"layer range [{self.start}, {self.end}) is not a non-empty part of {self.num_layers}")

    @classmethod
    def whole(cls, num_layers: int) -> "LayerRange":
        return cls(0, num_layers, num_layers)

    @property
    def first(self) -> bool:
        """Holds the token embedding (takes token ids)."""
        return self.start == 0

    @property
    def last(self) -> bool:
        """Holds the final norm and the LM head (produces logits)."""
        return self.end == self.num_layers

    @property
    def is_whole(self) -> bool:
        return self.first and self.last

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, layer_id: object) -> bool:
        return isinstance(layer_id, int) and self.start <= layer_id < self.end

    def holds_checkpoint_tensor(self, name: str, tied_embeddings: bool) -> bool:
        """Whether the checkpoint tensor ``name`` (Hugging Face naming) has a parameter in this range."""
        m = _LAYER_RE.search(name)
        if m is not None:
            return int(m.group(1)) in self
        if "embed_tokens." in name:
            return self.first or (self.last and tied_embeddings)
        if name.startswith(("lm_head.", "model.norm.")):
            return self.last
        return True
