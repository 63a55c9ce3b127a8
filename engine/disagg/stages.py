"""Stage plumbing the prefill and decode roles share (PD disaggregation).

* ``make_kv_manager``: the worker's KV transfer layer for its role, built from
  ``ServerArgs``; a start-up failure (port taken, backend package missing)
  becomes a ``RuntimeError`` whose message names the flag to change.
* ``request_pages``: the page indices of a request's prompt, in prompt order,
  read from its slots (what ``KVSender.send`` and ``KVReceiver.init`` take).
* ``PDEntry``: one request inside a stage queue (the request, its sender or
  receiver, and the abort asked for while a transfer was in flight).
* ``PDStageQueue``: the entries of one stage, keyed by request id, in arrival
  order.  A queue never frees KV slots; the role does.
* ``TransferPollBackoff``: how long an otherwise idle scheduler loop blocks on
  its inbox while transfers are pending: ``PD_POLL_S`` after any progress,
  doubling up to ``PD_POLL_MAX_S`` while nothing moves.  New requests and
  aborts still wake the loop at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from kvship.engine.config import ServerArgs
from kvship.engine.disagg import BackendUnavailableError, KVManager, KVPoll, KVTransferConfig, create_kv_manager
from kvship.engine.disagg.auth import room_token_problem  # noqa: F401 - the roles import it from here
from kvship.engine.disagg.base import SlotFeatures
from kvship.engine.schedule_batch import Req

# Seconds an otherwise idle scheduler blocks on its inbox between two polls of pending transfers.
PD_POLL_S = 0.002
PD_POLL_MAX_S = 0.008

# Largest bootstrap_room a request may carry (rooms are unsigned 63-bit integers).
MAX_ROOM = (1 << 63) - 1


class TransferPollBackoff:
    """The inbox wait between polls: short right after progress, longer while nothing moves."""

    def __init__(self) -> None:
        self.wait_s = PD_POLL_S

    def progressed(self, moved: bool) -> None:
        self.wait_s = PD_POLL_S if moved else min(PD_POLL_MAX_S, self.wait_s * 2)


def make_kv_manager(
    role: str,
    server_args: ServerArgs,
    kv_pool: Any,
    config: Optional[KVTransferConfig] = None,
    tp: Any = None,
    total_kv_heads: int = 0,
    features: Optional[SlotFeatures] = None,
    pipeline: Any = None,
) -> KVManager:
    """The ``role`` ("prefill" | "decode") transfer layer over ``kv_pool``.

    ``config`` overrides what ``ServerArgs`` would give (tests use it for short
    timeouts).  ``tp`` (a TP ``Communicator``): this rank's manager,
    wrapped so that every rank's ``poll()`` agrees (``tp_sync.TPKVManager``); rank r
    of a prefill worker binds ``--disaggregation-bootstrap-port`` + r.  ``total_kv_heads``:
    the model's KV heads (the pool holds this rank's share).  ``features``: the worker's per-slot
    features buffer (``base.SlotFeatures``), registered with the K/V buffers.  ``pipeline``: the rank's
    ``StageLink`` when the worker has pipeline stages (docs/parallel.md, "PD with pipeline parallelism"): the
    layout names the stage's layers, and the polls agree over every rank of the worker (its world), whose rank
    r binds the bootstrap port + r (stage-major, like the addresses rank 0's ``Welcome`` lists).
    Raises ``RuntimeError`` with a user-facing message on failure.
    """
    cfg = config or KVTransferConfig.from_server_args(server_args)
    ranks = tp  # every rank of the worker: they agree on each poll
    if tp is not None:
        cfg = dataclasses.replace(cfg, tp_size=tp.size, tp_rank=tp.rank)
    if pipeline is not None:
        r = pipeline.layers
        cfg = dataclasses.replace(
            cfg, pp_size=pipeline.pp_size, pp_rank=pipeline.stage, layer_start=r.start, model_layers=r.num_layers
        )
        ranks = pipeline.world
    if ranks is not None:
        port = cfg.bootstrap_port + ranks.rank if cfg.bootstrap_port else 0
        cfg = dataclasses.replace(cfg, bootstrap_port=port)
    if total_kv_heads:
        cfg = dataclasses.replace(cfg, total_kv_heads=total_kv_heads)
    try:
        manager = create_kv_manager(role, kv_pool, cfg, features)
        if ranks is None:
            return manager
        from kvship.engine.disagg.tp_sync import TPKVManager

        return TPKVManager(manager, ranks)
    except BackendUnavailableError as e:
        raise RuntimeError(f"--disaggregation-transfer-backend {cfg.backend}: {e}") from e
    except OSError as e:
        raise RuntimeError(
            f"cannot start the KV transfer layer ({role}, backend {cfg.backend}): {e}; "
            f"pick another --disaggregation-bootstrap-port"
        ) from e


def request_pages(slots: torch.Tensor, page_size: int) -> np.ndarray:
    """Page indices of ``slots`` (a request's KV slots in position order, position 0 first).

    A request's position ``p`` lives in slot ``page * page_size + p % page_size``
    (see ``kvship.engine.mem.pools``), so every ``page_size``-th slot names one page.
    """
    flat = slots.reshape(-1).to("cpu", torch.int64)
    return (flat[::page_size] // page_size).numpy().astype(np.int64)


def room_problem(room: Any) -> Optional[str]:
    """Why ``room`` is not a valid bootstrap room, or None."""
    if not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        return f"bootstrap_room must be an integer in [0, 2^63), got {room!r}"
    return None


def nan_if_none(value: Optional[float]) -> float:
    return float("nan") if value is None else float(value)


@dataclass
class PDEntry:
    """A request while it sits in one of the PD stage queues.

    ``transfer`` is the request's ``KVSender`` (prefill) or ``KVReceiver``
    (decode).  ``abort_reason`` is set when an abort arrived while the transfer
    layer may still touch the request's pages: the entry then stays queued until
    ``poll()`` reports a terminal state, and only then are its slots freed and
    its finished chunk sent.
    """

    req: Req
    transfer: Any
    room: int
    abort_reason: Optional[str] = None
    extra: dict = field(default_factory=dict)

    @property
    def rid(self) -> str:
        return self.req.rid

    def failure(self) -> str:
        """The reason to finish this entry with when its transfer did not succeed."""
        if self.abort_reason is not None:
            return self.abort_reason
        return f"KV transfer failed: {self.transfer.failure_reason or 'unknown reason'}"


class PDStageQueue:
    """The entries of one PD stage, keyed by request id, in arrival order."""

    def __init__(self) -> None:
        self.entries: dict[str, PDEntry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, entry: PDEntry) -> PDEntry:
        self.entries[entry.rid] = entry
        return entry

    def get(self, rid: str) -> Optional[PDEntry]:
        return self.entries.get(rid)

    def remove(self, rid: str) -> Optional[PDEntry]:
        return self.entries.pop(rid, None)

    def reqs(self) -> list[Req]:
        return [e.req for e in self.entries.values()]

    def pop_all(self) -> list[PDEntry]:
        out = list(self.entries.values())
        self.entries.clear()
        return out

    def pop_failed(self) -> list[PDEntry]:
        """Entries whose transfer is ``Failed`` (removed from the queue), for stages that hold no pages the
        transfer layer touches: their requests are aborted like any other."""
        failed = []
        for rid, entry in list(self.entries.items()):
            if entry.transfer.poll() == KVPoll.Failed:
                del self.entries[rid]
                failed.append(entry)
        return failed

    def pop_done(self) -> list[tuple[PDEntry, KVPoll]]:
        """Entries whose transfer reached ``Success`` or ``Failed``, with that state, removed from the queue."""
        done = []
        for rid, entry in list(self.entries.items()):
            state = entry.transfer.poll()
            if state.is_terminal:
                del self.entries[rid]
                done.append((entry, state))
        return done
