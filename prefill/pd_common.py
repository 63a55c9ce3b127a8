"""Pieces the prefill and decode schedulers share (PD disaggregation).

* ``make_kv_manager``: the worker's KV transfer layer for its role, built from
  ``ServerArgs`` (``--disaggregation-*``, ``--kv-transfer-checksum``); any
  start-up failure (port taken, backend package missing) becomes a
  ``RuntimeError`` whose message names the flag to change.
* ``request_pages``: the KV page indices of a request's prompt, in prompt
  order, read from its ``req_to_token`` row (what ``KVSender.send`` and
  ``KVReceiver.init`` take).
* ``PDEntry``: one request inside a PD stage queue (the request, its sender or
  receiver, and the abort asked for while a transfer was in flight).
* ``TransferPollBackoff``: how long an otherwise idle scheduler loop blocks on
  its inbox while transfers are pending (they progress on the transfer
  layer's threads; the scheduler only polls them): ``PD_POLL_S`` after any
  progress, doubling up to ``PD_POLL_MAX_S`` while nothing moves.  New
  requests and aborts still wake the loop at once (they arrive on the inbox).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from kvship.engine.config import ServerArgs
from kvship.engine.disagg import BackendUnavailableError, KVManager, KVTransferConfig, create_kv_manager
from kvship.engine.schedule_batch import Req

logger = logging.getLogger(__name__)

# Seconds an otherwise idle scheduler blocks on its inbox between two polls of pending transfers.
PD_POLL_S = 0.002
PD_POLL_MAX_S = 0.008


class TransferPollBackoff:
    """The inbox wait between polls: short right after progress, longer while nothing moves."""

    def __init__(self) -> None:
        self.wait_s = PD_POLL_S

    def progressed(self, moved: bool) -> None:
        self.wait_s = PD_POLL_S if moved else min(PD_POLL_MAX_S, self.wait_s * 2)


def make_kv_manager(role: str, server_args: ServerArgs, kv_pool: Any,
                    config: Optional[KVTransferConfig] = None) -> KVManager:
    """The ``role`` ("prefill" | "decode") transfer layer over ``kv_pool``.

    ``config`` overrides what ``ServerArgs`` would give (tests use it for short
    timeouts).  Raises ``RuntimeError`` with a user-facing message on failure.
    """
    cfg = config or KVTransferConfig.from_server_args(server_args)
    try:
        return create_kv_manager(role, kv_pool, cfg)
    except BackendUnavailableError as e:
        raise RuntimeError(f"--disaggregation-transfer-backend {cfg.backend}: {e}") from e
    except OSError as e:
        raise RuntimeError(f"cannot start the KV transfer layer ({role}, backend {cfg.backend}): {e}; "
                           f"pick another --disaggregation-bootstrap-port") from e


def request_pages(slots: torch.Tensor, page_size: int) -> np.ndarray:
    """Page indices of ``slots`` (a request's KV slots in position order, position 0 first).

    A request's position ``p`` lives in slot ``page * page_size + p % page_size``
    (see ``kvship.engine.mem.pools``), so every ``page_size``-th slot names one page.
    """
    flat = slots.reshape(-1).to("cpu", torch.int64)
    return (flat[::page_size] // page_size).numpy().astype(np.int64)


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


def nan_if_none(value: Optional[float]) -> float:
    return float("nan") if value is None else float(value)
