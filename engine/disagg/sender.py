"""Prefill side of the transfer layer: bootstrap server, senders, transfer threads.

``PrefillKVManager`` lives here; one room's state machine (``PrefillSender``) and the decode connections it
writes to are in ``kvship.engine.disagg.prefill_room``.

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

Room binding (docs/pd.md, "KV plane authentication"): a room is bound to the
first registration (per decode rank) whose tag matches the room token the
router gave this worker (``auth.RoomKey.register_tag``).  A registration that
arrives before the request is held (at most ``max_inflight`` per decode
connection) and checked when ``create_sender`` brings the token; one with a
wrong tag is refused (``Fail`` to its connection alone) and the room stays
open for the real decode.

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
from typing import Optional

import numpy as np
import torch

from kvship.engine.disagg import auth as A
from kvship.engine.disagg import descriptors as D
from kvship.engine.disagg.base import (
    AuxInfo,
    KVManager,
    KVPoll,
    KVTransferConfig,
    KVTransferError,
    MemoryRegion,
    SlotFeatures,
    TransferBackend,
    advertise_host,
)
from kvship.engine.disagg.bootstrap import BootstrapServer, FramedConnection
from kvship.engine.disagg.checksum import ALGORITHMS
from kvship.engine.disagg.prefill_room import DecodePeer, PendingRegistration, PrefillSender
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
    control_frame_cap,
)

logger = logging.getLogger(__name__)


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
        self.layout = KVLayout.from_pool(
            kv_pool, config.tp_size, config.tp_rank, config.total_kv_heads, features, **config.stage_fields
        )
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
        self._pending: dict[int, list[PendingRegistration]] = {}  # room -> registrations before its sender
        self._peers: dict[str, DecodePeer] = {}
        self._queue: "queue.Queue[Optional[PrefillSender]]" = queue.Queue()
        self._closed = threading.Event()
        try:
            self.server = BootstrapServer(
                config.host,
                config.bootstrap_port,
                on_hello=self._on_hello,
                on_message=self._on_message,
                on_closed=self._on_closed,
                secret=None if config.insecure else config.secret,
                handshake_timeout=config.handshake_timeout,
                max_connections=config.max_connections,
                max_handshakes=config.max_handshakes,
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
    def create_sender(self, room: int, token: Optional[str] = None) -> PrefillSender:
        key = self.room_key(room, token)
        with self.lock:
            if room in self._senders:
                raise KVTransferError(f"room {room} already has a sender on this prefill worker")
            s = PrefillSender(self, key)
            self._senders[room] = s
            for pend in self._pending.pop(room, []):
                pend.peer.pending -= 1
                if s._state.is_terminal:
                    pend.peer.conn.send(Fail(room=room, reason=f"room {room} failed: {s._reason}"))
                elif not self._tag_ok(s, pend.peer, pend.reg):
                    continue
                elif pend.peer.alive:
                    s._attach_locked(pend.peer, pend.reg)
                else:
                    s._fail_locked("decode peer disconnected before the transfer", tell=True)
            return s

    def _tag_ok(self, s: PrefillSender, peer: DecodePeer, reg: Register) -> bool:
        """Whether ``reg`` carries the room's register tag and its decode rank has not bound the room yet; if not,
        that registration alone is refused (the room stays open for the real decode)."""
        if not A.same(reg.tag.encode("ascii", "replace"), s.key.register_tag.encode()):
            logger.warning("room %d: registration from decode %s with a wrong room tag refused", s.room, peer.peer_id)
            peer.conn.send(Fail(room=reg.room, reason=f"room {reg.room}: wrong room tag (bootstrap_token)"))
            return False
        if peer.hello.layout.tp_rank in s.targets:
            peer.conn.send(Fail(room=reg.room, reason=f"room {reg.room} is already registered on this prefill"))
            return False
        return True

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

    def post(self, peer: Optional[DecodePeer], msg: Message) -> None:
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
        peer = DecodePeer(peer_id, conn, hello)
        peer.features = no_features is None
        with self.lock:
            self._peers[peer_id] = peer
            conn.peer_id = peer_id
        # a Register names at most every page decode registered (docs/pd.md, "KV plane authentication")
        conn.max_frame = control_frame_cap(hello.region_bytes[0] // max(1, hello.layout.page_bytes))
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

    def _register_locked(self, peer: DecodePeer, reg: Register) -> None:
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
        if s is None:  # held until the request brings the room's token (then checked: create_sender)
            if peer.pending >= self.config.max_inflight:
                peer.conn.send(
                    Fail(room=reg.room, reason=f"too many registrations held (max {self.config.max_inflight})")
                )
                return
            peer.pending += 1
            self._pending.setdefault(reg.room, []).append(PendingRegistration(peer, reg))
        elif self._tag_ok(s, peer, reg):
            s._attach_locked(peer, reg)

    def _decode_abort_locked(self, peer: DecodePeer, msg: Abort) -> None:
        pending = [p for p in self._pending.get(msg.room, []) if p.peer is not peer]
        peer.pending -= len(self._pending.get(msg.room, [])) - len(pending)
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
                    error = w.layerwise(index, s.key, s.stamps, peers, pages, ready, progress, cancelled, first_token)
                else:
                    src_pages, aux = s._payload  # type: ignore[misc]
                    for _, (peer, reg) in targets:
                        if cancelled():
                            break
                        error = w.guard(
                            s.room, peer, w.whole, index, s.key, s.stamps, peer, reg, src_pages, aux, cancelled
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
                            pend.peer.pending -= 1
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
