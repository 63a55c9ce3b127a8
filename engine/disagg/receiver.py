"""Decode side of the transfer layer: links to prefill workers, receivers, aux slots.

Life cycle of a room on decode::

    create_receiver(host, port, room)             Bootstrapping
    init(dst_pages): take an aux slot, open (or reuse) the link to that prefill,
        send Register once the handshake is done   -> WaitingForInput
    Started from prefill                           -> Transferring
    done signal (in-band from the backend, or Done on the control link)
    poll(): read the aux record, check room / page count / checksum -> Success
    Fail / Abort from prefill, link death, timeouts, checksum mismatch -> Failed

A receiver's abort (local, or a timeout) sends ``Abort`` and reaches Failed
when prefill acknowledges, the link dies, or ``abort_ack_timeout`` passes, so
the pages are never freed while a write into them may still land.  A receiver
whose data is already complete ignores the link dying afterwards.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Optional, Sequence

import numpy as np
import torch

from kvship.engine.disagg import descriptors as D
from kvship.engine.disagg.base import (
    KVManager,
    KVPoll,
    KVReceiver,
    KVTransferConfig,
    KVTransferError,
    MemoryRegion,
    TransferBackend,
)
from kvship.engine.disagg.bootstrap import BootstrapLink
from kvship.engine.disagg.checksum import default_algorithm, kv_checksum
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
    Register,
    Started,
    Welcome,
    WireError,
)
from kvship.engine.fingerprint import fingerprint_mismatch

logger = logging.getLogger(__name__)


class DecodeReceiver(KVReceiver):
    """One request's KV on its way in (see kvship.engine.disagg.base for the contract)."""

    def __init__(self, manager: "DecodeKVManager", host: str, port: int, room: int):
        self.room = room
        self.bootstrap_addr = (host, int(port))
        self._m = manager
        self._created = time.monotonic()
        self._state = KVPoll.Bootstrapping
        self._reason: Optional[str] = None
        self.pages: Optional[np.ndarray] = None
        self.aux_slot: Optional[int] = None
        self.link: Optional[BootstrapLink] = None
        self._registered_at: Optional[float] = None
        self._done = False
        self._aborting: Optional[str] = None
        self._abort_at = 0.0
        self._aux: Optional[AuxRecord] = None

    # -- scheduler API --------------------------------------------------
    def init(self, dst_pages: Sequence[int]) -> None:
        pages = D.as_pages(dst_pages)
        m = self._m
        with m.lock:
            if self.pages is not None:
                raise KVTransferError(f"room {self.room}: init() called twice")
            self.pages = pages
            if self._state.is_terminal:
                return
            try:
                D.check_pages(pages, m.num_pages, "decode")
            except KVTransferError as e:
                self._finish_locked(KVPoll.Failed, str(e))
                return
            if self.room in m.active:
                self._finish_locked(KVPoll.Failed, f"room {self.room} already has a receiver on this decode worker")
                return
            if not m.aux_free:
                self._finish_locked(
                    KVPoll.Failed, f"too many KV transfers in flight on this decode worker (max {m.num_aux_slots})"
                )
                return
            self.aux_slot = m.aux_free.pop()
            m.aux_buffer[self.aux_slot].zero_()
            m.active[self.room] = self
            m.backend.expect_room(self.room, pages)
            self.link = m.link_for(*self.bootstrap_addr)
            if self.link.ready:
                self._register_locked()
            else:
                m.waiters.setdefault(self.link, []).append(self)

    def poll(self) -> KVPoll:
        m = self._m
        with m.lock:
            if self._state.is_terminal:
                return self._state
            if not (self._done and self._aborting is None):
                self._check_timeouts_locked(time.monotonic())
                return self._state
            pages, slot = self.pages, self.aux_slot
        # Data complete: nothing else moves this receiver now, so verify outside the lock.
        state, reason, aux = self._verify(pages, slot)  # type: ignore[arg-type]
        with m.lock:
            if not self._state.is_terminal:
                self._aux = aux
                self._finish_locked(state, reason)
            return self._state

    @property
    def aux(self) -> Optional[AuxRecord]:
        return self._aux if self._state == KVPoll.Success else None

    def abort(self, reason: str = "aborted") -> None:
        with self._m.lock:
            if not self._state.is_terminal and self._aborting is None:
                self._abort_locked(f"aborted on decode: {reason}")

    @property
    def failure_reason(self) -> Optional[str]:
        with self._m.lock:
            return self._reason if self._state == KVPoll.Failed else None

    # -- internals (manager lock held unless noted) ------------------------
    def _register_locked(self) -> None:
        assert self.link is not None and self.pages is not None and self.aux_slot is not None
        algo = default_algorithm(self._m.pool_device) if self._m.config.checksum else None
        if not self.link.send(Register(room=self.room, pages=self.pages, aux_slot=self.aux_slot, checksum=algo)):
            self._finish_locked(KVPoll.Failed, f"lost the link to prefill {self.link.address} while registering")
            return
        self._registered_at = time.monotonic()
        self._state = KVPoll.WaitingForInput

    def _check_timeouts_locked(self, now: float) -> None:
        cfg = self._m.config
        if self._aborting is not None:
            if now - self._abort_at > cfg.abort_ack_timeout:
                logger.warning(
                    "room %d: prefill did not acknowledge the abort within %g s; freeing anyway",
                    self.room,
                    cfg.abort_ack_timeout,
                )
                self._finish_locked(KVPoll.Failed, self._aborting + " (prefill never acknowledged)")
        elif self._state == KVPoll.Bootstrapping and now - self._created > cfg.bootstrap_timeout:
            where = f"prefill {self.bootstrap_addr[0]}:{self.bootstrap_addr[1]}"
            self._abort_locked(
                f"bootstrap timeout: no handshake/registration with {where} within {cfg.bootstrap_timeout:g} s"
            )
        elif self._registered_at is not None and not self._done and now - self._registered_at > cfg.waiting_timeout:
            self._abort_locked(f"waiting timeout: no KV from prefill within {cfg.waiting_timeout:g} s")

    def _abort_locked(self, reason: str) -> None:
        if self._registered_at is None or self._done:
            self._finish_locked(KVPoll.Failed, reason)  # prefill never had our pages, or it is done with them
            return
        if self.link is not None and self.link.send(Abort(room=self.room, reason=reason)):
            self._aborting = reason
            self._abort_at = time.monotonic()
        else:
            self._finish_locked(KVPoll.Failed, reason)

    def _on_message_locked(self, msg: Message) -> None:
        if isinstance(msg, Started):
            if self._state == KVPoll.WaitingForInput:
                self._state = KVPoll.Transferring
        elif isinstance(msg, Done):
            self._done = True
        elif isinstance(msg, Fail):
            self._finish_locked(KVPoll.Failed, f"prefill failed the transfer: {msg.reason}")
        elif isinstance(msg, Abort):
            self._finish_locked(KVPoll.Failed, f"aborted by prefill: {msg.reason}")
        elif isinstance(msg, AbortAck) and self._aborting is not None:
            self._finish_locked(KVPoll.Failed, self._aborting)

    def _verify(self, pages: np.ndarray, slot: int) -> tuple[KVPoll, Optional[str], Optional[AuxRecord]]:
        """Read and check the aux record (and checksum); runs without the lock."""
        m = self._m
        try:
            aux = AuxRecord.unpack(bytes(m.aux_buffer[slot].numpy()))
        except WireError as e:
            return KVPoll.Failed, f"bad aux record: {e}", None
        if aux.room != self.room:
            return KVPoll.Failed, f"aux record is for room {aux.room}, expected {self.room} (corrupted transfer)", None
        if aux.num_pages != pages.size:
            return KVPoll.Failed, f"aux record says {aux.num_pages} pages, decode registered {pages.size}", None
        if m.config.checksum:
            if aux.checksum is None:
                return KVPoll.Failed, "checksum requested but prefill sent none", None
            got = kv_checksum(m.buffers, pages, m.layout.page_size, default_algorithm(m.pool_device))
            if got != aux.checksum:
                return (
                    KVPoll.Failed,
                    f"KV checksum mismatch for room {self.room}: prefill {aux.checksum:#x}, "
                    f"decode {got:#x} (corrupted page)",
                    None,
                )
        return KVPoll.Success, None, aux

    def _finish_locked(self, state: KVPoll, reason: Optional[str]) -> None:
        if self._state.is_terminal:
            return
        m = self._m
        self._state = state
        self._reason = reason
        if m.active.get(self.room) is self:
            del m.active[self.room]
            m.backend.forget_room(self.room)
        if self.aux_slot is not None:
            m.aux_free.append(self.aux_slot)
            self.aux_slot = None
        if self.link is not None:
            waiting = m.waiters.get(self.link)
            if waiting and self in waiting:
                waiting.remove(self)
        if state == KVPoll.Failed:
            logger.info("KV receiver room %d failed: %s", self.room, reason)


class DecodeKVManager(KVManager):
    """Owns the destination registration, the links to prefill workers and aux slots."""

    role = "decode"

    def __init__(self, kv_pool, config: KVTransferConfig, backend_cls: type[TransferBackend]):
        self.config = config
        self.pool = kv_pool
        self.pool_device = kv_pool.device
        self.layout = KVLayout.from_pool(kv_pool, config.tp_size, config.tp_rank)
        self.num_pages = kv_pool.num_slots // kv_pool.page_size
        self.buffers = kv_pool.buffers()
        self.lock = threading.RLock()
        self.num_aux_slots = max(1, min(config.max_inflight, self.num_pages))
        self.aux_buffer = torch.zeros((self.num_aux_slots, AUX_RECORD_BYTES), dtype=torch.uint8)
        self.aux_free = list(range(self.num_aux_slots - 1, -1, -1))
        self.regions = [MemoryRegion.from_tensor(b) for b in self.buffers] + [MemoryRegion.from_tensor(self.aux_buffer)]
        self.backend = backend_cls(config, "decode", self.regions, self.layout)
        self.decode_id = f"decode-{uuid.uuid4().hex[:12]}"
        self.active: dict[int, DecodeReceiver] = {}
        self.waiters: dict[BootstrapLink, list[DecodeReceiver]] = {}
        self._links: dict[tuple[str, int], BootstrapLink] = {}
        self._link_seq = 0
        self._closed = threading.Event()
        self.backend.start_receiving(self._on_backend_done)
        self._housekeeper = threading.Thread(target=self._housekeeping, name="kv-decode-housekeeping", daemon=True)
        self._housekeeper.start()
        logger.info("KV transfer (%s) decode side ready", backend_cls.name)

    # -- scheduler API --------------------------------------------------
    def create_receiver(self, bootstrap_host: str, bootstrap_port: int, room: int) -> DecodeReceiver:
        if self._closed.is_set():
            raise KVTransferError("decode KV manager is closed")
        return DecodeReceiver(self, bootstrap_host, bootstrap_port, room)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with self.lock:
            for r in list(self.active.values()):
                r._finish_locked(KVPoll.Failed, "decode KV manager shutting down")
            links = list(self._links.values())
        for link in links:
            link.close("decode KV manager shutting down")
        self._housekeeper.join(timeout=5)
        self.backend.close()

    # -- links --------------------------------------------------------------
    def link_for(self, host: str, port: int) -> BootstrapLink:
        """The live link to prefill ``host:port`` (lock held); opens one if needed."""
        key = (host, port)
        link = self._links.get(key)
        if link is not None and not link.dead:
            return link
        self._link_seq += 1
        hello = Hello(
            peer_id=f"{self.decode_id}-{self._link_seq}",
            backend=self.backend.name,
            layout=self.layout,
            region_bytes=[r.nbytes for r in self.regions],
            backend_info=self.backend.local_info(),
            fingerprint=self.config.fingerprint,
        )
        link = BootstrapLink(
            host,
            port,
            hello,
            connect_timeout=self.config.connect_timeout,
            handshake_timeout=min(self.config.bootstrap_timeout, 30.0),
            check_welcome=self._check_welcome,
            on_ready=self._on_ready,
            on_message=self._on_message,
            on_closed=self._on_closed,
        )
        self._links[key] = link
        return link

    def _check_welcome(self, w: Welcome) -> Optional[str]:
        if w.backend != self.backend.name:
            return f"transfer backend mismatch: prefill uses {w.backend!r}, decode uses {self.backend.name!r}"
        problem = w.layout.mismatch(self.layout)
        if problem:
            return f"KV layout mismatch (prefill vs decode): {problem}"
        return fingerprint_mismatch(w.fingerprint, self.config.fingerprint)

    def _on_ready(self, link: BootstrapLink) -> None:
        with self.lock:
            for r in self.waiters.pop(link, []):
                if not r._state.is_terminal:
                    r._register_locked()

    def _on_message(self, link: BootstrapLink, msg: Message) -> None:
        if isinstance(msg, Ping):
            return
        room = getattr(msg, "room", None)
        with self.lock:
            r = self.active.get(room) if room is not None else None
            if r is not None and r.link is link:
                r._on_message_locked(msg)

    def _on_closed(self, link: BootstrapLink, reason: str) -> None:
        with self.lock:
            if self._links.get((link.host, link.port)) is link:
                del self._links[(link.host, link.port)]
            self.waiters.pop(link, None)
            for r in list(self.active.values()):
                if r.link is link and not r._done:
                    r._finish_locked(KVPoll.Failed, reason)
        if not self._closed.is_set():
            logger.warning("KV link to prefill %s closed: %s", link.address, reason)

    def _on_backend_done(self, room: int, error: Optional[str] = None) -> None:
        with self.lock:
            r = self.active.get(room)
            if r is None or r._state.is_terminal:
                return
            if error is None:
                r._done = True
            else:  # the backend already drops this room's later data
                r._finish_locked(KVPoll.Failed, error)

    def _housekeeping(self) -> None:
        cfg = self.config
        step = min(cfg.heartbeat_interval, 0.5)
        while not self._closed.wait(step):
            with self.lock:
                links = list(self._links.values())
                now = time.monotonic()
                for r in list(self.active.values()):
                    r._check_timeouts_locked(now)
                for r in [r for rs in self.waiters.values() for r in rs]:
                    r._check_timeouts_locked(now)
            for link in links:
                link.tick(cfg.heartbeat_interval, cfg.heartbeat_timeout)
