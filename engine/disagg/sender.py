"""Prefill side of the transfer layer: bootstrap server, senders, transfer threads.

Life cycle of a room on prefill::

    Register arrives (decode connection)      create_sender(room) (scheduler)
                  \\                              /
                   +--> both known: WaitingForInput
    send(src_pages, aux) --> queued --> transfer thread:
        Started -> [checksum] -> write KV (one batch) -> write aux (+ in-band done)
        -> Done (control plane, if the backend's done is not in-band) -> Success
    any failure / abort -> Failed (only once no backend call reads the pages)

Layer-wise (``send_layerwise`` right before the forward of the prompt's last
chunk; docs/pd.md, "Layer-wise transfer")::

    send_layerwise(src_pages, ready, progress) --> queued (at once, or once decode's last
    registration arrives: the thread then starts with every layer stored by then) --> transfer thread:
        Started -> pages [0, ready) of every layer -> for each run of stored layers
        (``LayerProgress.wait``): the other pages of those layers
        -> waits for send(src_pages, aux) -> [per-slot features] -> aux (+ done) -> Success

At most ``transfer_threads - 1`` rooms go layer-wise at once (each holds its
thread until its forward ends), so one thread stays free for whole sends.

With tensor parallelism every decode rank registers the room with every
prefill rank (docs/parallel.md); a sender waits for all of decode's ranks
(its tp size comes with the first registration's ``Hello``) and writes each the
KV heads ``tp_slices.head_slice`` assigns it (maybe none), its aux record and done.

Per-slot features (``SlotFeatures``) go in the same batch as the K/V pages to
every decode peer whose layout has features of the same kind, width and dtype
(decided once, at its ``Hello``; otherwise K/V alone, logged).  They are
replicated over tensor-parallel ranks, so decode rank ``d`` takes them from
prefill rank ``d mod prefill tp size``.

Registrations whose sender never appears expire after ``bootstrap_timeout``
(decode is told with ``Fail``).  A decode connection that dies fails every
room it registered.  A ``Abort`` from decode is acknowledged (``AbortAck``)
once nothing for that room is in flight.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Optional, Sequence

import numpy as np
import torch

from kvship.engine.disagg import descriptors as D
from kvship.engine.disagg.base import (
    AuxInfo,
    KVManager,
    KVPoll,
    KVSender,
    KVTransferConfig,
    KVTransferError,
    MemoryRegion,
    SlotFeatures,
    TransferBackend,
    advertise_host,
)
from kvship.engine.disagg.bootstrap import BootstrapServer, FramedConnection
from kvship.engine.disagg.checksum import ALGORITHMS
from kvship.engine.disagg.layerwise import LayerProgress
from kvship.engine.disagg.room_writes import RoomWriter
from kvship.engine.disagg.wire import (
    AUX_RECORD_BYTES,
    Abort,
    AbortAck,
    Fail,
    Hello,
    KVLayout,
    Message,
    Ping,
    Refuse,
    Register,
    Welcome,
)

logger = logging.getLogger(__name__)


class _DecodePeer:
    def __init__(self, peer_id: str, conn: FramedConnection, hello: Hello):
        self.peer_id = peer_id
        self.conn = conn
        self.hello = hello
        self.region_bytes = list(hello.region_bytes)
        self.features = False  # per-slot features travel to this peer (set at the handshake)
        self.alive = True
        self.inflight = 0


class _PendingRegistration:
    def __init__(self, peer: _DecodePeer, reg: Register):
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

    def __init__(self, manager: "PrefillKVManager", room: int):
        self.room = room
        self._m = manager
        self._created = time.monotonic()
        self._state = KVPoll.Bootstrapping
        self._reason: Optional[str] = None
        # decode rank -> (its connection, its registration): every rank of decode registers
        self.targets: dict[int, tuple[_DecodePeer, Register]] = {}
        self.expected: Optional[int] = None  # decode's tp size, from the first registration
        self._payload: Optional[tuple[np.ndarray, AuxInfo]] = None
        self._queued = False
        self._busy = False  # a transfer thread is using the pages
        self._failed: Optional[str] = None  # failure decided while busy
        self._tell_decode: list[tuple[_DecodePeer, Message]] = []  # sent once not busy
        self._ack_after: list[_DecodePeer] = []  # decode ranks whose abort is acknowledged when done
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
    def peers(self) -> list[_DecodePeer]:
        """The connections of the decode ranks that registered so far."""
        return [peer for peer, _ in self.targets.values()]

    @property
    def registered(self) -> bool:
        """Every decode rank has registered the room."""
        return self.expected is not None and len(self.targets) == self.expected

    # -- internals (manager lock held) ---------------------------------
    def _add_target_locked(self, peer: _DecodePeer, reg: Register) -> bool:
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

    def _attach_locked(self, peer: _DecodePeer, reg: Register) -> None:
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
        self, reason: str, tell: bool = False, kind: str = "abort", skip: Optional[_DecodePeer] = None
    ) -> None:
        """Move towards Failed; ``tell`` sends every decode rank (but ``skip``) an Abort/Fail once nothing is in flight."""
        if self._state.is_terminal or self._failed is not None:
            return
        msgs: list[tuple[_DecodePeer, Message]] = []
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


class PrefillKVManager(KVManager):
    """Owns the bootstrap server, the backend (source side) and the transfer threads."""

    role = "prefill"

    def __init__(
        self,
        kv_pool,
        config: KVTransferConfig,
        backend_cls: type[TransferBackend],
        features: Optional[SlotFeatures] = None,
    ):
        self.config = config
        self.pool = kv_pool
        if features is not None:
            features.check(kv_pool)
        self.layout = KVLayout.from_pool(kv_pool, config.tp_size, config.tp_rank, config.total_kv_heads, features)
        self.num_pages = kv_pool.num_slots // kv_pool.page_size
        self.buffers = kv_pool.buffers()
        self.lock = threading.RLock()
        self.prefill_id = f"prefill-{uuid.uuid4().hex[:12]}"
        # one aux staging slot per transfer thread (CPU; backends register it with the KV buffers)
        self._aux_staging = torch.zeros((config.transfer_threads, AUX_RECORD_BYTES), dtype=torch.uint8)
        extra = [features.buffer] if features is not None else []
        self.regions = [MemoryRegion.from_tensor(b) for b in self.buffers + extra] + [
            MemoryRegion.from_tensor(self._aux_staging)
        ]
        self.feature_region = len(self.buffers) if features is not None else None
        self.aux_region = len(self.regions) - 1
        self.backend = backend_cls(config, "prefill", self.regions, self.layout)
        self.writer = RoomWriter(
            self.layout,
            self.backend,
            self.buffers,
            [r.nbytes for r in self.regions],
            self.feature_region,
            self.aux_region,
            self._aux_staging,
            layerwise_writes=config.layerwise_writes,
        )
        self._senders: dict[int, PrefillSender] = {}
        self._pending: dict[int, list[_PendingRegistration]] = {}  # room -> registrations before its sender
        self._peers: dict[str, _DecodePeer] = {}
        self._queue: "queue.Queue[Optional[PrefillSender]]" = queue.Queue()
        self._closed = threading.Event()
        try:
            self.server = BootstrapServer(
                config.host,
                config.bootstrap_port,
                on_hello=self._on_hello,
                on_message=self._on_message,
                on_closed=self._on_closed,
                handshake_timeout=min(config.bootstrap_timeout, 30.0),
            )
        except Exception:
            self.backend.close()
            raise
        # every rank's bootstrap address, rank order (Welcome.ranks); a tensor-parallel worker sets all of them
        self.rank_addresses: list[tuple[str, int]] = [(advertise_host(config.host), self.server.port)]
        self._threads = [
            threading.Thread(target=self._transfer_loop, name=f"kv-transfer-{i}", args=(i,), daemon=True)
            for i in range(config.transfer_threads)
        ]
        self._threads.append(threading.Thread(target=self._housekeeping, name="kv-prefill-housekeeping", daemon=True))
        for t in self._threads:
            t.start()
        logger.info(
            "KV transfer (%s) prefill side ready, bootstrap on %s:%d", backend_cls.name, config.host, self.server.port
        )

    @property
    def bootstrap_port(self) -> int:
        return self.server.port

    # -- scheduler API --------------------------------------------------
    def create_sender(self, room: int) -> PrefillSender:
        with self.lock:
            if room in self._senders:
                raise KVTransferError(f"room {room} already has a sender on this prefill worker")
            s = PrefillSender(self, room)
            self._senders[room] = s
            for pend in self._pending.pop(room, []):
                if pend.peer.alive:
                    s._attach_locked(pend.peer, pend.reg)
                else:
                    s._fail_locked("decode peer disconnected before the transfer", tell=True)
            return s

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.server.close()
        with self.lock:
            for s in list(self._senders.values()):
                s._fail_locked("prefill KV manager shutting down", tell=True)
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self.backend.close()
        logger.info("KV transfer prefill side closed")

    # -- helpers used by senders (lock held) ----------------------------
    def enqueue(self, s: PrefillSender) -> None:
        self._queue.put(s)

    def post(self, peer: Optional[_DecodePeer], msg: Message) -> None:
        if peer is not None and peer.alive:
            peer.conn.send(msg)

    def forget(self, s: PrefillSender) -> None:
        if self._senders.get(s.room) is s:
            del self._senders[s.room]

    def layerwise_rooms(self) -> int:
        """Layer-wise rooms not finished yet (each holds, or will hold, a transfer thread through its forward)."""
        return sum(1 for s in self._senders.values() if s._layers is not None)

    # -- control plane callbacks (connection threads) ----------------------
    def _on_hello(self, conn: FramedConnection, hello: Hello) -> Message:
        if hello.backend != self.backend.name:
            return Refuse(
                reason=f"transfer backend mismatch: decode uses {hello.backend!r}, prefill uses {self.backend.name!r}"
            )
        problem = self.layout.mismatch(hello.layout)
        if problem:
            return Refuse(reason=f"KV layout mismatch (prefill vs decode): {problem}")
        if len(hello.region_bytes) != hello.layout.num_regions:
            return Refuse(
                reason=f"decode registered {len(hello.region_bytes)} regions, its layout has {hello.layout.num_regions}"
            )
        no_features = self.layout.features_mismatch(hello.layout)
        peer_id = hello.peer_id
        with self.lock:
            if peer_id in self._peers:
                return Refuse(reason=f"decode peer id {peer_id} already connected")
        try:
            self.backend.add_peer(peer_id, hello.backend_info)
        except Exception as e:  # noqa: BLE001 - any backend error refuses the peer
            return Refuse(reason=f"prefill cannot reach decode's {self.backend.name} endpoint: {e}")
        peer = _DecodePeer(peer_id, conn, hello)
        peer.features = no_features is None
        with self.lock:
            self._peers[peer_id] = peer
            conn.peer_id = peer_id
        logger.info("decode peer %s connected from %s", peer_id, conn.name)
        if no_features is not None and hello.layout.has_features:
            logger.warning(
                "decode peer %s wants per-slot features (%s) but they cannot travel: %s; "
                "it gets the KV alone (docs/speculative.md, PD)",
                peer_id,
                hello.layout.feature_kind,
                no_features,
            )
        return Welcome(
            prefill_id=self.prefill_id,
            backend=self.backend.name,
            layout=self.layout,
            backend_info=self.backend.local_info(),
            ranks=[[host, port] for host, port in self.rank_addresses],
            fingerprint=self.config.fingerprint,
        )

    def _on_message(self, conn: FramedConnection, msg: Message) -> None:
        with self.lock:
            peer = self._peers.get(conn.peer_id or "")
            if peer is None:
                return
            if isinstance(msg, Register):
                self._register_locked(peer, msg)
            elif isinstance(msg, Abort):
                self._decode_abort_locked(peer, msg)
            elif not isinstance(msg, Ping):
                logger.warning("prefill: unexpected %s from decode %s", msg.TYPE, peer.peer_id)

    def _register_locked(self, peer: _DecodePeer, reg: Register) -> None:
        if reg.checksum is not None and reg.checksum not in ALGORITHMS:
            peer.conn.send(Fail(room=reg.room, reason=f"unknown checksum algorithm {reg.checksum!r}"))
            return
        try:
            D.check_pages(reg.pages, (peer.region_bytes[0] // peer.hello.layout.page_bytes) - 1, "decode")
            if not 0 <= reg.aux_slot < peer.region_bytes[-1] // AUX_RECORD_BYTES:
                raise KVTransferError(f"aux slot {reg.aux_slot} out of range")
        except KVTransferError as e:
            peer.conn.send(Fail(room=reg.room, reason=f"bad registration: {e}"))
            return
        s = self._senders.get(reg.room)
        rank = peer.hello.layout.tp_rank
        pending = self._pending.get(reg.room, [])
        if any(p.peer.hello.layout.tp_rank == rank for p in pending) or (s is not None and rank in s.targets):
            peer.conn.send(Fail(room=reg.room, reason=f"room {reg.room} is already registered on this prefill"))
            return
        if s is None:
            self._pending.setdefault(reg.room, []).append(_PendingRegistration(peer, reg))
        else:
            s._attach_locked(peer, reg)

    def _decode_abort_locked(self, peer: _DecodePeer, msg: Abort) -> None:
        pending = [p for p in self._pending.get(msg.room, []) if p.peer is not peer]
        if msg.room in self._pending:
            if pending:
                self._pending[msg.room] = pending
            else:
                del self._pending[msg.room]
        s = self._senders.get(msg.room)
        if s is not None and peer in s.peers and not s._state.is_terminal:
            s._ack_after.append(peer)  # _finish_locked acks, now or when the transfer thread lets go of the pages
            if s._failed is None:  # the other decode ranks hear of it too
                s._fail_locked(f"aborted by decode: {msg.reason}", tell=True, skip=peer)
            return
        peer.conn.send(AbortAck(room=msg.room))

    def _on_closed(self, conn: FramedConnection, reason: str) -> None:
        with self.lock:
            peer = self._peers.pop(conn.peer_id or "", None)
            if peer is None:
                return
            peer.alive = False
            for room in list(self._pending):
                pending = [p for p in self._pending[room] if p.peer is not peer]
                if pending:
                    self._pending[room] = pending
                else:
                    del self._pending[room]
            for s in list(self._senders.values()):
                if peer in s.peers:
                    s._fail_locked(f"decode peer disconnected: {reason}", tell=True)
            idle = peer.inflight == 0
        logger.log(
            logging.INFO if self._closed.is_set() else logging.WARNING,
            "decode peer %s disconnected: %s",
            peer.peer_id,
            reason,
        )
        if idle:
            self.backend.remove_peer(peer.peer_id)

    # -- transfer threads -------------------------------------------------
    def _transfer_loop(self, index: int) -> None:
        while True:
            s = self._queue.get()
            if s is None:
                return
            with self.lock:
                if s._state.is_terminal or not s._queued:
                    continue
                s._queued = False
                s._busy = True
                targets = sorted(s.targets.items())
                for _, (peer, _reg) in targets:
                    peer.inflight += 1
            error: Optional[str] = None
            w = self.writer

            def cancelled(s: PrefillSender = s) -> bool:
                return self._cancelled(s)

            try:
                if s._layers is not None:
                    peers = [t for _, t in targets]
                    first_token = lambda s=s: self._first_token(s)  # noqa: E731
                    pages, ready, progress = s._layer_pages, s._ready_pages, s._layers
                    error = w.layerwise(index, s.room, s.stamps, peers, pages, ready, progress, cancelled, first_token)
                else:
                    src_pages, aux = s._payload  # type: ignore[misc]
                    for _, (peer, reg) in targets:
                        if cancelled():
                            break
                        error = w.guard(
                            s.room, peer, w.whole, index, s.room, s.stamps, peer, reg, src_pages, aux, cancelled
                        )
                        if error is not None:
                            break
            finally:
                with self.lock:
                    s._busy = False
                    for _, (peer, _reg) in targets:
                        peer.inflight -= 1
                    gone = [peer for _, (peer, _reg) in targets if not peer.alive and peer.inflight == 0]
                    if s._failed is not None:
                        s._finish_locked(KVPoll.Failed, s._failed)
                        for peer, msg in s._tell_decode:
                            self.post(peer, msg)
                    elif error is not None:
                        s._finish_locked(KVPoll.Failed, error)
                        for _, (peer, _reg) in targets:
                            self.post(peer, Fail(room=s.room, reason=error))
                    else:
                        s._finish_locked(KVPoll.Success)
            for peer in gone:
                self.backend.remove_peer(peer.peer_id)

    def _cancelled(self, s: PrefillSender) -> bool:
        with self.lock:
            return s._failed is not None

    def _first_token(self, s: PrefillSender) -> Optional[tuple[np.ndarray, AuxInfo]]:
        """A layer-wise room's transfer thread: wait for ``send()`` (its pages and aux); None once the room failed."""
        with self.lock:
            s._cond.wait_for(lambda: s._payload is not None or s._failed is not None)
            return None if s._failed is not None else s._payload

    # -- housekeeping ------------------------------------------------------
    def _housekeeping(self) -> None:
        cfg = self.config
        step = min(cfg.heartbeat_interval, 1.0)
        while not self._closed.wait(step):
            self.server.tick(cfg.heartbeat_interval, cfg.heartbeat_timeout)
            now = time.monotonic()
            with self.lock:
                for room, pending in list(self._pending.items()):
                    if now - pending[0].at > cfg.bootstrap_timeout:
                        del self._pending[room]
                        for pend in pending:
                            self.post(
                                pend.peer,
                                Fail(
                                    room=room,
                                    reason=f"prefill never received request for room "
                                    f"{room} within {cfg.bootstrap_timeout:g} s",
                                ),
                            )
                for s in list(self._senders.values()):
                    if s._state == KVPoll.Bootstrapping:
                        s.poll()
