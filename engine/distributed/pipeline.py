"""Pipeline parallelism: which layers each stage holds, and the channels between the stages.

``stage_layers(num_layers, pp_size, partition)`` splits a decoder's layers
into ``pp_size`` consecutive ``LayerRange``s (``kvship.engine.models.stage``):
``partition`` (``--pp-layer-partition``) gives each stage's count, else the
split is even with the first ``num_layers % pp_size`` stages one layer
longer (the last stage also runs the LM head).  Stage ``p`` is the ranks
``[p * tp, (p + 1) * tp)`` (``Topology``).

``StageLink`` is one rank's end of the pipeline, built by the model runner
from its ``ProcessGroups`` and shared with the scheduler's I/O.  Its
channels (every send is non-blocking, so a stage never waits for a later
one to be ready; every receive blocks):

* hidden states: stage ``p`` sends ``[2, tokens, hidden]`` (hidden and
  residual) to the rank of stage ``p + 1`` with its TP rank, over the PP
  communicator's device group (NCCL on CUDA, gloo on CPU);
* the step's inbox: the leader (global rank 0) sends each step's message
  list to every other rank, over the world's host group;
* sampled tokens: each rank of the last stage sends every step's results
  (ids, logprobs, top logprobs) to the ranks of the earlier stages with its
  TP rank, over the PP communicator's host group;
* sampled ids on the device: each rank of the last stage sends a decode
  step's ids ``[n] int64`` to the rank of stage 0 with its TP rank as soon
  as it sampled them, and stage 0 posts the matching receive when it
  launches that step, so its next decode of the same requests reads them as
  input ids without the host (``kvship.engine.scheduler.pipeline``).  On
  NCCL this is a device group of its own (``ProcessGroups.pp_ids``): on the
  PP group it would share the hidden states' NCCL stream, where stage 0's
  receive of step i's ids would queue behind its send of step i + 1's
  hidden states, which the last stage receives only after sending i's ids.

On gloo the four share groups and are kept apart by tags; on CUDA hidden
states are the only traffic of the PP device group (NCCL ignores tags).
Contract: every rank makes the same sends and receives in the same order
(the replicated scheduler guarantees it), and a send's buffers live until
its handle completes (``StageLink`` keeps them).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from kvship.common.envs import ENV
from kvship.engine.models.stage import LayerRange

if TYPE_CHECKING:
    from kvship.engine.distributed.groups import ProcessGroups

logger = logging.getLogger(__name__)

TAG_INBOX = 11
TAG_RESULTS = 12
TAG_HIDDEN = 13
TAG_IDS = 14
MAX_OUTSTANDING_SENDS = 256  # beyond this many unfinished sends, wait for the oldest


def stage_layers(num_layers: int, pp_size: int, partition: Optional[Sequence[int]] = None) -> list[LayerRange]:
    """Each stage's layers (module docstring); ValueError with one line when they cannot be split so."""
    if pp_size < 1:
        raise ValueError(f"--pp-size must be >= 1, got {pp_size}")
    if pp_size > num_layers:
        raise ValueError(
            f"--pp-size {pp_size} is more than the model's {num_layers} layers (each stage needs at least one)"
        )
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (1 if p < extra else 0) for p in range(pp_size)]
    else:
        counts = [int(c) for c in partition]
        if len(counts) != pp_size or min(counts) < 1:
            raise ValueError(f"--pp-layer-partition {counts} must give {pp_size} positive layer counts")
        if sum(counts) != num_layers:
            raise ValueError(
                f"--pp-layer-partition {','.join(map(str, counts))} sums to {sum(counts)} layers, "
                f"the model has {num_layers}"
            )
    out, start = [], 0
    for c in counts:
        out.append(LayerRange(start, start + c, num_layers))
        start += c
    return out


class StageLink:
    """This rank's channels to the other stages (module docstring)."""

    def __init__(self, groups: "ProcessGroups", layers: Sequence[LayerRange]):
        topo = groups.topology
        if topo.pp_size < 2 or groups.pp is None:
            raise ValueError("a StageLink needs --pp-size > 1")
        if len(layers) != topo.pp_size:
            raise ValueError(f"{len(layers)} layer ranges for {topo.pp_size} stages")
        self.topology = topo
        self.world = groups.world
        self.pp = groups.pp  # group rank = stage index
        self.ids = groups.pp_ids if groups.pp_ids is not None else groups.pp  # the device ids' channel
        self.pp_size = topo.pp_size
        self.stage = topo.me.pp_rank
        self.layers = layers[self.stage]
        self.all_layers = tuple(layers)
        self._sends: deque[tuple[Any, Any]] = deque()  # (work, buffer) not known to be complete
        self.stopped = False  # the leader said stop (set by the scheduler's inbox)
        # chained decodes (KVSHIP_PP_CHAIN) only where every rank has them on: a stage 0 waiting for ids that no
        # last stage sends would hang; every rank builds its link at startup, so the agreement is a collective
        self.chain = bool(self.world.min_int(int(ENV.PP_CHAIN)))
        if ENV.PP_CHAIN and not self.chain:
            logger.warning("KVSHIP_PP_CHAIN is off on another rank: no chained pipeline decodes on any rank")

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp_size - 1

    @property
    def is_leader(self) -> bool:
        return self.topology.is_leader

    def describe(self) -> str:
        r = self.layers
        return f"pipeline stage {self.stage}/{self.pp_size} (layers {r.start}..{r.end - 1} of {r.num_layers})"

    # --- sends in flight -----------------------------------------------------
    def _keep(self, handles: list[tuple[Any, Any]]) -> None:
        self._sends.extend(handles)
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()
        while len(self._sends) > MAX_OUTSTANDING_SENDS:
            self._sends.popleft()[0].wait()

    def flush(self) -> None:
        """Wait for every send of this rank to complete."""
        while self._sends:
            self._sends.popleft()[0].wait()

    # --- hidden states (the model runner) ------------------------------------
    def send_hidden(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Start sending this stage's output to the next stage (not on the last stage)."""
        buf = torch.stack([hidden, residual])
        self._keep([(self.pp.isend(buf, self.stage + 1, TAG_HIDDEN), buf)])

    def recv_hidden(self, num_tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's ``[2, num_tokens, width]`` (hidden, residual) of the current batch."""
        buf = torch.empty((2, num_tokens, width), dtype=dtype, device=device)
        return self.pp.recv(buf, self.stage - 1, TAG_HIDDEN)

    # --- sampled ids on the device (the pipeline loop) -------------------------
    def send_ids(self, ids: torch.Tensor) -> None:
        """The last stage: start sending a decode step's sampled ids to stage 0 (module docstring)."""
        buf = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.to(torch.int64).contiguous()
        self._keep([(self.ids.isend(buf, 0, TAG_IDS), buf)])

    def recv_ids(self, n: int, device: torch.device) -> tuple[torch.Tensor, Any]:
        """Stage 0: post the receive of a decode step's ``n`` sampled ids; (buffer, work): ``work.wait()``
        before a forward reads the buffer."""
        buf = torch.empty(n, dtype=torch.int64, device=device)
        return buf, self.ids.irecv(buf, self.pp_size - 1, TAG_IDS)

    # --- the leader's inbox (the scheduler) -----------------------------------
    def send_inbox(self, msgs: Any) -> None:
        """The leader: start sending this step's messages to every other rank."""
        handles: list[tuple[Any, Any]] = []
        for r in range(1, self.world.size):
            handles += self.world.isend_object(msgs, r, TAG_INBOX)
        self._keep(handles)

    def recv_inbox(self) -> Any:
        """A rank other than the leader: the leader's messages of this step."""
        return self.world.recv_object(0, TAG_INBOX)

    # --- sampled tokens (the scheduler) ---------------------------------------
    def send_results(self, results: Any) -> None:
        """The last stage: start sending a step's results to the earlier stages' ranks of its TP rank."""
        handles: list[tuple[Any, Any]] = []
        for p in range(self.pp_size - 1):
            handles += self.pp.isend_object(results, p, TAG_RESULTS)
        self._keep(handles)

    def recv_results(self) -> Any:
        """An earlier stage: the last stage's results of the oldest step not received yet."""
        return self.pp.recv_object(self.pp_size - 1, TAG_RESULTS)
