"""Checkpoint tensors read on demand, so a tensor-parallel rank reads only its shard.

A loader yields a ``CheckpointSlice`` instead of a tensor when the model is
sharded; a parallel layer's weight loader ``narrow``s it to the rank's block
and ``load``s only that.  ``take(loaded, dim, start, length)`` and
``materialize(loaded)`` accept a plain tensor too, so weight loaders need not
care which they got.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

Reader = Callable[[tuple[slice, ...]], torch.Tensor]


class CheckpointSlice:
    """A block of one checkpoint tensor; nothing is read until ``load``.

    ``read(ranges)`` must return the tensor's block ``ranges`` (one ``slice``
    per dim, steps of 1) as a torch tensor.  ``then`` (optional) is applied to
    the loaded block (a format's own fix-ups, e.g. GGUF's q/k row order).
    """

    def __init__(
        self,
        shape: Sequence[int],
        read: Reader,
        ranges: Optional[tuple[slice, ...]] = None,
        dtype: Optional[torch.dtype] = None,
        then: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ):
        self._full_shape = tuple(int(s) for s in shape)
        self._read = read
        self._ranges = ranges if ranges is not None else tuple(slice(0, s) for s in self._full_shape)
        self._dtype = dtype
        self._then = then

    @property
    def shape(self) -> torch.Size:
        return torch.Size(r.stop - r.start for r in self._ranges)

    def dim(self) -> int:
        return len(self._ranges)

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointSlice":
        r = self._ranges[dim]
        if start < 0 or length < 0 or r.start + start + length > r.stop:
            raise ValueError(f"narrow({dim}, {start}, {length}) is outside a tensor of shape {tuple(self.shape)}")
        ranges = list(self._ranges)
        ranges[dim] = slice(r.start + start, r.start + start + length)
        return CheckpointSlice(self._full_shape, self._read, tuple(ranges), self._dtype, self._then)

    def to(self, dtype: torch.dtype) -> "CheckpointSlice":
        return CheckpointSlice(self._full_shape, self._read, self._ranges, dtype, self._then)

    def load(self) -> torch.Tensor:
        t = self._read(self._ranges)
        if self._then is not None:
            t = self._then(t)
        return t if self._dtype is None else t.to(self._dtype)


Loaded = Union[torch.Tensor, CheckpointSlice]


def materialize(loaded: Loaded) -> torch.Tensor:
    """The whole of ``loaded`` as a tensor."""
    return loaded.load() if isinstance(loaded, CheckpointSlice) else loaded


def take(loaded: Loaded, dim: int, start: int, length: int) -> torch.Tensor:
    """``loaded.narrow(dim, start, length)`` as a tensor, reading only that block."""
    return materialize(loaded.narrow(dim, start, length))
