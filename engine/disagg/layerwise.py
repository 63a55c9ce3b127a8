"""Layer-wise KV transfer: the per-layer progress of one prefill forward (docs/pd.md, "Layer-wise transfer").

The prefill role makes one ``LayerProgress`` for an extend forward in which a
prompt's last chunk computes and decode's destination is already registered,
hands it to the room's sender (``KVSender.send_layerwise``) and its
``layer_done`` to the model (``ForwardBatch.layer_done``).  The forward's
thread signals each layer as its attention stored the new K/V; the transfer
threads ``wait`` for a layer before writing it, so early layers travel while
later ones compute and after the forward only the last layers, the aux record
and the done signal remain.

* CPU: the forward is synchronous, so a signalled layer is stored.
* CUDA: ``layer_done`` records a ``torch.cuda.Event`` on the forward's stream;
  ``wait`` synchronizes on it (the layer's kernels have run) before the bytes
  are read.
* ``finish()`` (the model returned) marks every layer signalled, so a model
  that skips the hook for some layer still ends well; ``abandon()`` (the model
  raised) wakes every waiter with nothing; ``poke()`` wakes them to look at
  their cancellation (an abort).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import torch

# Longest a waiting transfer thread sleeps between looks at its cancellation (``poke`` wakes it at once).
_WAIT_S = 0.05


class LayerProgress:
    """Which layers of one forward have stored their K/V (see the module docstring)."""

    def __init__(self, num_layers: int, device: torch.device | str):
        self.num_layers = num_layers
        self._cuda = torch.device(device).type == "cuda"
        self._cond = threading.Condition()
        self._done = 0  # layers [0, _done) are signalled, in order
        self._events: list[Any] = []  # CUDA: one event per signalled layer
        self._abandoned = False
        self.last_layer_at: Optional[float] = None  # time.time() the last layer was signalled

    def layer_done(self, layer_id: int) -> None:
        """The forward's thread: layer ``layer_id``'s K/V are stored (CUDA: queued on the current stream).
        Layers are expected in order; any other id is ignored (``finish`` covers it)."""
        if layer_id != self._done:
            return
        event = self._record()
        with self._cond:
            self._events.append(event)
            self._done += 1
            if self._done == self.num_layers:
                self.last_layer_at = time.time()
            self._cond.notify_all()

    def finish(self) -> None:
        """The model returned: every layer is stored (CUDA: queued before one more event)."""
        with self._cond:
            left = self.num_layers - self._done
        if left <= 0:
            return
        event = self._record()
        with self._cond:
            self._events += [event] * left
            self._done = self.num_layers
            self.last_layer_at = time.time()
            self._cond.notify_all()

    def abandon(self) -> None:
        """The model raised: layers not signalled yet never will be."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()

    def poke(self) -> None:
        """Wake the waiters so that they look at their cancellation now."""
        with self._cond:
            self._cond.notify_all()

    def wait(self, layer: int, cancelled: Callable[[], bool]) -> int:
        """A transfer thread: block until layer ``layer`` is stored; return ``end`` > ``layer`` such that
        layers ``[layer, end)`` are all stored (as many as are, at least one), or 0 when the forward was
        abandoned first or ``cancelled()`` (called without any lock of this object held) turned true."""
        while True:
            with self._cond:
                if self._done > layer:
                    events = self._events[layer : self._done]
                    break
                if self._abandoned:
                    return 0
                self._cond.wait(_WAIT_S)
            if cancelled():
                return 0
        if not self._cuda:
            return layer + len(events)
        events[0].synchronize()
        end = layer + 1
        for event in events[1:]:
            if not event.query():
                break
            end += 1
        return end

    def _record(self) -> Any:
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event
