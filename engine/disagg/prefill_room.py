"""One request's KV on its way out of a prefill worker: ``PrefillSender`` (the room's state machine, see
``kvship.engine.disagg.sender`` for the life cycle) and the decode connections it writes to.

Every method whose name ends in ``_locked`` runs with the manager's lock held; the manager
(``sender.PrefillKVManager``) owns the threads that move the bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from kvship.engine.disagg import auth as A
from kvship.engine.disagg import descriptors as D
from kvship.engine.disagg.base import AuxInfo, KVPoll, KVSender, KVTransferError
from kvship.engine.disagg.bootstrap import FramedConnection
from kvship.engine.disagg.layerwise import LayerProgress
from kvship.engine.disagg.wire import Abort, AbortAck, Fail, Hello, Message, Register

if TYPE_CHECKING:
    from kvship.engine.disagg.sender import PrefillKVManager

logger = logging.getLogger(__name__)


class DecodePeer:
    """Prefill's view of one decode connection (after its Hello): what it registered, what is in flight."""

    def __init__(self, peer_id: str, conn: FramedConnection, hello: Hello):
        self.peer_id = peer_id
        self.conn = conn
        self.hello = hello
        self.region_bytes = list(hello.region_bytes)
        self.features = False  # per-slot features travel to this peer (set at the handshake)
        self.alive = True
        self.inflight = 0
        self.pending = 0  # its registrations held for a request this worker does not have yet


class PendingRegistration:
    """A Register that arrived before its request: held until ``create_sender`` can check its tag."""

    def __init__(self, peer: DecodePeer, reg: Register):
        self.peer = peer
        self.reg = reg
        self.at = time.monotonic()


class PrefillSender(KVSender):
    """One request's KV on its way out (see kvship.engine.disagg.base for the contract).

    ``stamps`` holds the wall-clock times (``time.time()``) of the room's steps on this side, for the
    request's trace (docs/pd.md, "Reading a request's trace"): ``registered`` (decode's destination
    known), ``transfer_start`` / ``transfer_end`` (a transfer thread took the room / wrote its last byte
    and done signal); layer-wise also ``layers_first`` / ``layers_last`` (the write of the first / last
    run of stored layers began) and ``tail_start`` (the aux record was there: the features, aux and done
    go next).
    """

    def __init__(self, manager: "PrefillKVManager", key: A.RoomKey):
        self.room = key.room
        self.key = key
        self._m = manager
        self._created = time.monotonic()
        self._state = KVPoll.Bootstrapping
        self._reason: Optional[str] = None
        # decode rank -> (its connection, its registration): every rank of decode registers
        self.targets: dict[int, tuple[DecodePeer, Register]] = {}
        self.expected: Optional[int] = None  # decode's tp size, from the first registration
        self._payload: Optional[tuple[np.ndarray, AuxInfo]] = None
        self._queued = False
        self._busy = False  # a transfer thread is using the pages
        self._failed: Optional[str] = None  # failure decided while busy
        self._tell_decode: list[tuple[DecodePeer, Message]] = []  # sent once not busy
        self._ack_after: list[DecodePeer] = []  # decode ranks whose abort is acknowledged when done
        # layer-wise (send_layerwise): the forward's progress, the pages and how many were complete before it
        self._layers: Optional[LayerProgress] = None
        self._layer_pages: Optional[np.ndarray] = None
        self._ready_pages = 0
        self._cond = threading.Condition(manager.lock)  # the transfer thread waits here for send() or a failure
        self.stamps: dict[str, float] = {}

    # -- scheduler API --------------------------------------------------
    def poll(self) -> KVPoll:
        with self._m.lock:
            if (
                self._state == KVPoll.Bootstrapping
                and time.monotonic() - self._created > self._m.config.bootstrap_timeout
            ):
                self._fail_locked(
                    f"decode did not register room {self.room} within "
                    f"{self._m.config.bootstrap_timeout:g} s (bootstrap timeout)"
                )
            return self._state

    def send(self, src_pages: Sequence[int], aux: AuxInfo) -> None:
        pages = D.as_pages(src_pages)
        with self._m.lock:
            if self._payload is not None:
                raise KVTransferError(f"room {self.room}: send() called twice")
            self._payload = (pages, aux)
            if self._state.is_terminal:
                return
            if self._layers is not None:  # layer-wise: the transfer thread waits for the aux record
                if not np.array_equal(pages, self._layer_pages):
                    self._fail_locked(
                        f"room {self.room}: send() names other pages than send_layerwise()", tell=True, kind="fail"
                    )
                self._cond.notify_all()
                return
            try:
                D.check_pages(pages, self._m.num_pages, "prefill")
            except KVTransferError as e:
                self._fail_locked(str(e), tell=True, kind="fail")
                return
            if self.registered:
                self._enqueue_locked()

    def send_layerwise(self, src_pages: Sequence[int], ready_pages: int, progress: LayerProgress) -> bool:
        pages = D.as_pages(src_pages)
        m = self._m
        with m.lock:
            if (
                not m.config.layerwise
                or self._state not in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
                or self._payload is not None
                or self._layers is not None
                or not self._layerwise_fits_locked(pages.size)
                or m.layerwise_rooms() >= m.config.transfer_threads - 1
            ):
                return False
            try:
                D.check_pages(pages, m.num_pages, "prefill")
            except KVTransferError:
                return False  # send() fails the room with the reason
            self._layers, self._layer_pages = progress, pages
            self._ready_pages = max(0, min(int(ready_pages), pages.size))
            if self.registered:
                self._start_layerwise_locked()
            # else: deferred until decode's last registration (_attach_locked) starts it with every layer
            # stored by then (docs/pd.md, "Layer-wise transfer")
            return True

    def _layerwise_fits_locked(self, n_pages: int) -> bool:
        """Whether the registrations so far allow a layer-wise send of ``n_pages`` pages (no checksum: it is
        computed over the whole KV; decode's page count equal to prefill's)."""
        return all(reg.checksum is None and reg.pages.size == n_pages for _, reg in self.targets.values())

    def _start_layerwise_locked(self) -> None:
        self._state = KVPoll.Transferring
        self._queued = True
        self._m.enqueue(self)

    def abort(self, reason: str = "aborted") -> None:
        with self._m.lock:
            self._fail_locked(f"aborted on prefill: {reason}", tell=True)

    @property
    def failure_reason(self) -> Optional[str]:
        with self._m.lock:
            return self._reason if self._state == KVPoll.Failed else None

    @property
    def peers(self) -> list[DecodePeer]:
        """The connections of the decode ranks that registered so far."""
        return [peer for peer, _ in self.targets.values()]

    @property
    def registered(self) -> bool:
        """Every decode rank has registered the room."""
        return self.expected is not None and len(self.targets) == self.expected

    # -- internals (manager lock held) ---------------------------------
    def _add_target_locked(self, peer: DecodePeer, reg: Register) -> bool:
        """Record one decode rank's registration; False (and the room failed) if it does not fit."""
        layout = peer.hello.layout
        if self.expected is None:
            self.expected = layout.tp_size
        if layout.tp_size != self.expected or layout.tp_rank in self.targets:
            reason = f"room {self.room}: registrations from decode ranks of different workers or twice from one rank"
            peer.conn.send(Fail(room=self.room, reason=reason))
            self._fail_locked(reason, tell=True, kind="fail")
            return False
        self.targets[layout.tp_rank] = (peer, reg)
        return True

    def _attach_locked(self, peer: DecodePeer, reg: Register) -> None:
        if not self._add_target_locked(peer, reg):
            return
        self.stamps["registered"] = time.time()
        if self._state == KVPoll.Bootstrapping and self.registered:
            self._state = KVPoll.WaitingForInput
            self._m.progressed()
            if self._layers is not None:  # a deferred layer-wise send (send_layerwise before the registration)
                assert self._layer_pages is not None
                if self._layerwise_fits_locked(self._layer_pages.size):
                    self._start_layerwise_locked()
                    return
                # decode asked for a checksum, or other pages: the whole send after the forward, which
                # send() brings (or brought: its pages were checked against send_layerwise's)
                self._layers = self._layer_pages = None
            if self._payload is not None:
                self._enqueue_locked()

    def _enqueue_locked(self) -> None:
        assert self.registered and self._payload is not None
        for _, reg in self.targets.values():
            if self._payload[0].size != reg.pages.size:
                self._fail_locked(
                    f"page count mismatch for room {self.room}: prefill has {self._payload[0].size} "
                    f"pages, decode registered {reg.pages.size}",
                    tell=True,
                    kind="fail",
                )
                return
        self._state = KVPoll.Transferring
        self._queued = True
        self._m.enqueue(self)

    def _fail_locked(
        self, reason: str, tell: bool = False, kind: str = "abort", skip: Optional[DecodePeer] = None
    ) -> None:
        """Move towards Failed; ``tell`` sends every decode rank (but ``skip``) an Abort/Fail once nothing is in flight."""
        if self._state.is_terminal or self._failed is not None:
            return
        msgs: list[tuple[DecodePeer, Message]] = []
        if tell:
            msg = Abort(room=self.room, reason=reason) if kind == "abort" else Fail(room=self.room, reason=reason)
            msgs = [(peer, msg) for peer in self.peers if peer.alive and peer is not skip]
        if self._busy:
            self._failed = reason
            self._tell_decode = msgs
            self._cond.notify_all()  # a layer-wise thread waiting for send() or a layer stops at once
            if self._layers is not None:
                self._layers.poke()
            return
        self._finish_locked(KVPoll.Failed, reason)
        for peer, msg in msgs:
            self._m.post(peer, msg)

    def _finish_locked(self, state: KVPoll, reason: Optional[str] = None) -> None:
        self._state = state
        self._reason = reason
        self._m.forget(self)
        self._m.progressed()
        if state == KVPoll.Failed:
            logger.info("KV sender room %d failed: %s", self.room, reason)
        for peer in self._ack_after:
            self._m.post(peer, AbortAck(room=self.room))
