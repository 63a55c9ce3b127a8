"""Prefill side of the transfer layer: bootstrap server, senders, transfer threads.

Life cycle of a room on prefill::

    Register arrives (decode connection)      create_sender(room) (scheduler)
                  \\                              /
                   +--> both known: WaitingForInput
    send(src_pages, aux) --> queued --> transfer thread:
        Started -> [checksum] -> write KV (one batch) -> write aux (+ in-band done)
        -> Done (control plane, if the backend's done is not in-band) -> Success
    any failure / abort -> Failed (only once no backend call reads the pages)

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
    TransferBackend,
)
from kvship.engine.disagg.bootstrap import BootstrapServer, FramedConnection
from kvship.engine.disagg.checksum import ALGORITHMS, kv_checksum
from kvship.engine.disagg.wire import (
    AUX_RECORD_BYTES,
    Abort,
    AbortAck,
    AuxRecord,
    Done,
    Fail,
    Hello,
    KVLayout,
    Message,
    Ping,
    Refuse,
    Register,
    Started,
    Welcome,
)

logger = logging.getLogger(__name__)


class _DecodePeer:
    def __init__(self, peer_id: str, conn: FramedConnection, hello: Hello):
        self.peer_id = peer_id
        self.conn = conn
        self.hello = hello
        self.region_bytes = list(hello.region_bytes)
        self.alive = True
        self.inflight = 0


class _PendingRegistration:
    def __init__(self, peer: _DecodePeer, reg: Register):
        self.peer = peer
        self.reg = reg
        self.at = time.monotonic()


class PrefillSender(KVSender):
    """One request's KV on its way out (see kvship.engine.disagg.base for the contract)."""

    def __init__(self, manager: "PrefillKVManager", room: int):
        self.room = room
        self._m = manager
        self._created = time.monotonic()
        self._state = KVPoll.Bootstrapping
        self._reason: Optional[str] = None
        self.peer: Optional[_DecodePeer] = None
        self.reg: Optional[Register] = None
        self._payload: Optional[tuple[np.ndarray, AuxInfo]] = None
        self._queued = False
        self._busy = False  # a transfer thread is using the pages
        self._failed: Optional[str] = None  # failure decided while busy
        self._tell_decode: Optional[Message] = None  # sent once not busy
        self._ack_after = False

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
            try:
                D.check_pages(pages, self._m.num_pages, "prefill")
            except KVTransferError as e:
                self._fail_locked(str(e), tell=True, kind="fail")
                return
            if self.reg is not None:
                self._enqueue_locked()

    def abort(self, reason: str = "aborted") -> None:
        with self._m.lock:
            self._fail_locked(f"aborted on prefill: {reason}", tell=True)

    @property
    def failure_reason(self) -> Optional[str]:
        with self._m.lock:
            return self._reason if self._state == KVPoll.Failed else None

    # -- internals (manager lock held) ---------------------------------
    def _attach_locked(self, peer: _DecodePeer, reg: Register) -> None:
        self.peer, self.reg = peer, reg
        if self._state == KVPoll.Bootstrapping:
            self._state = KVPoll.WaitingForInput
            if self._payload is not None:
                self._enqueue_locked()

    def _enqueue_locked(self) -> None:
        assert self.reg is not None and self._payload is not None
        if self._payload[0].size != self.reg.pages.size:
            self._fail_locked(
                f"page count mismatch for room {self.room}: prefill has {self._payload[0].size} "
                f"pages, decode registered {self.reg.pages.size}",
                tell=True,
                kind="fail",
            )
            return
        self._state = KVPoll.Transferring
        self._queued = True
        self._m.enqueue(self)

    def _fail_locked(self, reason: str, tell: bool = False, kind: str = "abort") -> None:
        """Move towards Failed; ``tell`` sends decode an Abort/Fail once nothing is in flight."""
        if self._state.is_terminal or self._failed is not None:
            return
        msg: Optional[Message] = None
        if tell and self.peer is not None and self.peer.alive:
            msg = Abort(room=self.room, reason=reason) if kind == "abort" else Fail(room=self.room, reason=reason)
        if self._busy:
            self._failed = reason
            self._tell_decode = msg
            return
        self._finish_locked(KVPoll.Failed, reason)
        if msg is not None:
            self._m.post(self.peer, msg)

    def _finish_locked(self, state: KVPoll, reason: Optional[str] = None) -> None:
        self._state = state
        self._reason = reason
        self._m.forget(self)
        if state == KVPoll.Failed:
            logger.info("KV sender room %d failed: %s", self.room, reason)
        if self._ack_after and self.peer is not None:
            self._m.post(self.peer, AbortAck(room=self.room))


class PrefillKVManager(KVManager):
    """Owns the bootstrap server, the backend (source side) and the transfer threads."""

    role = "prefill"

    def __init__(self, kv_pool, config: KVTransferConfig, backend_cls: type[TransferBackend]):
        self.config = config
        self.pool = kv_pool
        self.layout = KVLayout.from_pool(kv_pool, config.tp_size, config.tp_rank)
        self.num_pages = kv_pool.num_slots // kv_pool.page_size
        self.buffers = kv_pool.buffers()
        self.lock = threading.RLock()
        self.prefill_id = f"prefill-{uuid.uuid4().hex[:12]}"
        # one aux staging slot per transfer thread (CPU; backends register it with the KV buffers)
        self._aux_staging = torch.zeros((config.transfer_threads, AUX_RECORD_BYTES), dtype=torch.uint8)
        self.regions = [MemoryRegion.from_tensor(b) for b in self.buffers] + [
            MemoryRegion.from_tensor(self._aux_staging)
        ]
        self.aux_region = len(self.buffers)
        self.backend = backend_cls(config, "prefill", self.regions, self.layout)
        self._senders: dict[int, PrefillSender] = {}
        self._pending: dict[int, _PendingRegistration] = {}
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
            pend = self._pending.pop(room, None)
            if pend is not None:
                if pend.peer.alive:
                    s._attach_locked(pend.peer, pend.reg)
                else:
                    s._fail_locked("decode peer disconnected before the transfer")
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

    # -- control plane callbacks (connection threads) ----------------------
    def _on_hello(self, conn: FramedConnection, hello: Hello) -> Message:
        if hello.backend != self.backend.name:
            return Refuse(
                reason=f"transfer backend mismatch: decode uses {hello.backend!r}, prefill uses {self.backend.name!r}"
            )
        problem = self.layout.mismatch(hello.layout)
        if problem:
            return Refuse(reason=f"KV layout mismatch (prefill vs decode): {problem}")
        if len(hello.region_bytes) != len(self.regions):
            return Refuse(reason=f"decode registered {len(hello.region_bytes)} regions, expected {len(self.regions)}")
        peer_id = hello.peer_id
        with self.lock:
            if peer_id in self._peers:
                return Refuse(reason=f"decode peer id {peer_id} already connected")
        try:
            self.backend.add_peer(peer_id, hello.backend_info)
        except Exception as e:  # noqa: BLE001 - any backend error refuses the peer
            return Refuse(reason=f"prefill cannot reach decode's {self.backend.name} endpoint: {e}")
        with self.lock:
            self._peers[peer_id] = _DecodePeer(peer_id, conn, hello)
            conn.peer_id = peer_id
        logger.info("decode peer %s connected from %s", peer_id, conn.name)
        return Welcome(
            prefill_id=self.prefill_id,
            backend=self.backend.name,
            layout=self.layout,
            backend_info=self.backend.local_info(),
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
            D.check_pages(reg.pages, (peer.region_bytes[0] // self.layout.page_bytes) - 1, "decode")
            if not 0 <= reg.aux_slot < peer.region_bytes[-1] // AUX_RECORD_BYTES:
                raise KVTransferError(f"aux slot {reg.aux_slot} out of range")
        except KVTransferError as e:
            peer.conn.send(Fail(room=reg.room, reason=f"bad registration: {e}"))
            return
        s = self._senders.get(reg.room)
        if reg.room in self._pending or (s is not None and s.reg is not None):
            peer.conn.send(Fail(room=reg.room, reason=f"room {reg.room} is already registered on this prefill"))
            return
        if s is None:
            self._pending[reg.room] = _PendingRegistration(peer, reg)
        else:
            s._attach_locked(peer, reg)

    def _decode_abort_locked(self, peer: _DecodePeer, msg: Abort) -> None:
        pend = self._pending.get(msg.room)
        if pend is not None and pend.peer is peer:
            del self._pending[msg.room]
        s = self._senders.get(msg.room)
        if s is not None and s.peer is peer and not s._state.is_terminal:
            s._ack_after = True  # _finish_locked acks, now or when the transfer thread lets go of the pages
            s._fail_locked(f"aborted by decode: {msg.reason}")
            return
        peer.conn.send(AbortAck(room=msg.room))

    def _on_closed(self, conn: FramedConnection, reason: str) -> None:
        with self.lock:
            peer = self._peers.pop(conn.peer_id or "", None)
            if peer is None:
                return
            peer.alive = False
            for room in [r for r, p in self._pending.items() if p.peer is peer]:
                del self._pending[room]
            for s in list(self._senders.values()):
                if s.peer is peer:
                    s._fail_locked(f"decode peer disconnected: {reason}")
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
                peer, reg, (src_pages, aux) = s.peer, s.reg, s._payload  # type: ignore[misc]
                peer.inflight += 1  # type: ignore[union-attr]
            error: Optional[str] = None
            try:
                self._transfer(index, s, peer, reg, src_pages, aux)  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - every failure fails the room cleanly
                error = f"transfer to decode {peer.peer_id} failed: {e}"  # type: ignore[union-attr]
                if not isinstance(e, KVTransferError):
                    logger.exception("KV transfer for room %d failed", s.room)
            with self.lock:
                s._busy = False
                peer.inflight -= 1  # type: ignore[union-attr]
                remove_peer = not peer.alive and peer.inflight == 0  # type: ignore[union-attr]
                if s._failed is not None:
                    s._finish_locked(KVPoll.Failed, s._failed)
                    if s._tell_decode is not None:
                        self.post(peer, s._tell_decode)
                elif error is not None:
                    s._finish_locked(KVPoll.Failed, error)
                    self.post(peer, Fail(room=s.room, reason=error))
                else:
                    s._finish_locked(KVPoll.Success)
            if remove_peer:
                self.backend.remove_peer(peer.peer_id)  # type: ignore[union-attr]

    def _cancelled(self, s: PrefillSender) -> bool:
        with self.lock:
            return s._failed is not None

    def _transfer(
        self, index: int, s: PrefillSender, peer: _DecodePeer, reg: Register, src_pages: np.ndarray, aux: AuxInfo
    ) -> None:
        layout = self.layout
        peer.conn.send(Started(room=s.room))
        runs = D.page_runs(src_pages, reg.pages)
        checksum = None
        if reg.checksum is not None:
            checksum = kv_checksum(self.buffers, src_pages, layout.page_size, reg.checksum)
        descs = D.kv_descs(runs, layout.num_buffers, layout.page_bytes)
        D.check_descs(descs, [r.nbytes for r in self.regions], peer.region_bytes)
        if self._cancelled(s):
            return
        self.backend.write(peer.peer_id, s.room, descs)
        if self._cancelled(s):
            return
        record = AuxRecord(
            room=s.room,
            first_token_id=int(aux.first_token_id),
            first_token_logprob=float(aux.first_token_logprob),
            prompt_len=int(aux.prompt_len),
            num_pages=int(src_pages.size),
            checksum=checksum,
            top_logprobs=tuple(aux.first_token_top_logprobs),
        )
        self._aux_staging[index].copy_(torch.frombuffer(bytearray(record.pack()), dtype=torch.uint8))
        in_band = self.backend.in_band_done
        self.backend.write(
            peer.peer_id,
            s.room,
            D.aux_descs(self.aux_region, index, len(peer.region_bytes) - 1, reg.aux_slot, AUX_RECORD_BYTES),
            done=in_band,
        )
        if not in_band and not peer.conn.send(Done(room=s.room)):
            raise KVTransferError(f"decode connection lost before the done signal: {peer.conn.close_reason}")

    # -- housekeeping ------------------------------------------------------
    def _housekeeping(self) -> None:
        cfg = self.config
        step = min(cfg.heartbeat_interval, 1.0)
        while not self._closed.wait(step):
            self.server.tick(cfg.heartbeat_interval, cfg.heartbeat_timeout)
            now = time.monotonic()
            with self.lock:
                for room, pend in list(self._pending.items()):
                    if now - pend.at > cfg.bootstrap_timeout:
                        del self._pending[room]
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
