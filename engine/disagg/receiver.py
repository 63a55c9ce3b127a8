"""Decode side of the transfer layer: links to prefill workers, receivers, aux slots.

Life cycle of a room on decode::

    create_receiver(host, port, room)             Bootstrapping
    init(dst_pages): take an aux slot, open (or reuse) the link to that prefill,
        send Register once the handshake is done   -> WaitingForInput
    Started from prefill                           -> Transferring
    done signal (in-band from the backend, or Done on the control link)
    poll(): read the aux record, check room / page count / checksum -> Success
    Fail / Abort from prefill, link death, timeouts, checksum mismatch -> Failed

With a tensor-parallel prefill (docs/parallel.md) the bootstrap address is
prefill's rank 0; its ``Welcome`` lists every rank's address, and the room is
registered with each rank (one aux slot each).  The KV has arrived when every
rank's done signal has; each rank's aux record is checked.

Per-slot features (``SlotFeatures``): registered after the K/V buffers when
the worker has them; a prefill whose features differ (or that has none) is
logged once per link and sends the K/V alone (docs/speculative.md, "PD").

Authentication (docs/pd.md, "KV plane authentication"): every link starts
with the HMAC challenge-response on the KV transfer secret; each Register
carries the room token's register tag; a done signal from the data plane
counts only once the room's aux slot holds a record with the room's aux tag
(a stale or foreign record, or a done before the record, is ignored and
logged), and ``poll()`` checks every record's tag again.

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

from kvship.engine.disagg import auth as A
from kvship.engine.disagg import descriptors as D
from kvship.engine.disagg.base import (
    KVManager,
    KVPoll,
    KVReceiver,
    KVTransferConfig,
    KVTransferError,
    MemoryRegion,
    SlotFeatures,
    TransferBackend,
)
from kvship.engine.disagg.bootstrap import BootstrapLink
from kvship.engine.disagg.checksum import default_algorithm, kv_checksum_heads
from kvship.engine.disagg.tp_slices import head_slice, layer_buffers, shared_layers
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


class _Source:
    """One prefill rank a room is registered with: its link and the aux slot it writes."""

    def __init__(self, rank: int, link: BootstrapLink, aux_slot: int):
        self.rank = rank
        self.link = link
        self.aux_slot = aux_slot
        self.registered = False
        self.ended = False  # this rank no longer writes the room's pages (done, failed, acknowledged, gone)


class DecodeReceiver(KVReceiver):
    """One request's KV on its way in (see kvship.engine.disagg.base for the contract).

    ``stamps`` holds the wall-clock times (``time.time()``) of the room's steps on this side, for the
    request's trace (docs/pd.md, "Reading a request's trace"): ``registered`` (the last Register sent),
    ``started`` (prefill's Started arrived), ``arrived`` (the done signal: every byte has landed).
    """

    def __init__(self, manager: "DecodeKVManager", host: str, port: int, key: A.RoomKey):
        self.room = key.room
        self.key = key
        self.bootstrap_addr = (host, int(port))
        self._m = manager
        self._created = time.monotonic()
        self._state = KVPoll.Bootstrapping
        self._reason: Optional[str] = None
        self.pages: Optional[np.ndarray] = None
        self.aux_slot: Optional[int] = None
        self.link: Optional[BootstrapLink] = None  # to prefill rank 0 (the bootstrap address)
        self.sources: list[_Source] = []  # every prefill rank, rank order, once rank 0's Welcome said how many
        self.prefill_tp = 1
        self._registered_at: Optional[float] = None
        self._done = False
        self._dones = 0  # done signals so far (one per prefill rank)
        self._aborting: Optional[str] = None
        self._abort_at = 0.0
        self._aux: Optional[AuxRecord] = None
        self.stamps: dict[str, float] = {}

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
            m.backend.expect_room(self.key, pages, [self.aux_slot])
            self.link = m.link_for(*self.bootstrap_addr)
            self.sources = [_Source(0, self.link, self.aux_slot)]
            if self.link.ready:
                self._on_link_ready_locked(self.link)
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
            pages, sources = self.pages, list(self.sources)
        # Data complete: nothing else moves this receiver now, so verify outside the lock.
        state, reason, aux = self._verify(pages, sources)  # type: ignore[arg-type]
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
    def _source_for(self, link: BootstrapLink) -> Optional[_Source]:
        for src in self.sources:
            if src.link is link:
                return src
        return None

    def _on_link_ready_locked(self, link: BootstrapLink) -> None:
        """``link``'s handshake is done: learn prefill's ranks (rank 0's link), register with that rank."""
        src = self._source_for(link)
        welcome = link.welcome
        if src is None or welcome is None or src.registered or self._aborting is not None:
            return
        if welcome.layout.world_rank != src.rank:
            self._abort_locked(f"prefill {link.address} is rank {welcome.layout.world_rank}, not {src.rank}")
            return
        lay = welcome.layout
        if src.rank == 0 and len(self.sources) == 1 and lay.tp_size * lay.pp_size > 1:
            if not self._add_sources_locked(lay.tp_size, lay.pp_size, welcome.ranks):
                return
        self._register_locked(src)

    def _add_sources_locked(self, tp_size: int, pp_size: int, ranks: list) -> bool:
        """Prefill rank 0 told us its ``tp_size x pp_size`` ranks' addresses (stage-major): open the links, take
        their aux slots.  Every rank writes the layers of its stage that this rank holds (maybe none), the aux
        record and its done signal."""
        m = self._m
        try:
            addrs = [(str(h), int(p)) for h, p in ranks]
        except (TypeError, ValueError):
            addrs = []
        if len(addrs) != tp_size * pp_size:
            self._abort_locked(
                f"prefill rank 0 sent {len(ranks)} rank addresses for tp size {tp_size} x pp size {pp_size}"
            )
            return False
        self.prefill_tp = tp_size
        added: list[_Source] = []
        for rank in range(1, tp_size * pp_size):
            if not m.aux_free:
                self._abort_locked(f"too many KV transfers in flight on this decode worker (max {m.num_aux_slots})")
                return False
            slot = m.aux_free.pop()
            m.aux_buffer[slot].zero_()
            src = _Source(rank, m.link_for(*addrs[rank]), slot)
            self.sources.append(src)
            added.append(src)
        # the backend must accept every rank's aux slot before any of those ranks hears of the room: a rank
        # whose link is up writes as soon as its Register arrives
        m.backend.expect_room(self.key, self.pages, [s.aux_slot for s in self.sources])
        for src in added:
            if self._state.is_terminal or self._aborting is not None:
                break
            if src.link.ready:
                self._register_locked(src)
            else:
                m.waiters.setdefault(src.link, []).append(self)
        return not self._state.is_terminal and self._aborting is None

    def _register_locked(self, src: _Source) -> None:
        assert self.pages is not None
        algo = default_algorithm(self._m.pool_device) if self._m.config.checksum else None
        self.stamps["registered"] = time.time()  # before the send: prefill may act on it before send() returns
        reg = Register(
            room=self.room, pages=self.pages, aux_slot=src.aux_slot, checksum=algo, tag=self.key.register_tag
        )
        if not src.link.send(reg):
            src.ended = True
            self._abort_locked(f"lost the link to prefill {src.link.address} while registering")
            return
        src.registered = True
        if not all(s.registered for s in self.sources):
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
        if self._done:
            self._finish_locked(KVPoll.Failed, reason)  # prefill is done with our pages
            return
        pending = False  # a prefill rank that may still write our pages must acknowledge first
        for src in self.sources:
            if src.registered and not src.ended:
                if src.link.send(Abort(room=self.room, reason=reason)):
                    pending = True
                else:
                    src.ended = True
        if pending:
            self._aborting = reason
            self._abort_at = time.monotonic()
        else:
            self._finish_locked(KVPoll.Failed, reason)

    def _source_ended_locked(self, src: _Source, reason: str) -> None:
        """Prefill rank ``src`` stopped writing without finishing: fail the room once no rank writes any more."""
        src.ended = True
        if self._state.is_terminal:
            return
        if self._aborting is None:
            self._abort_locked(reason)
        elif not any(s.registered and not s.ended for s in self.sources):
            self._finish_locked(KVPoll.Failed, self._aborting)

    def _on_message_locked(self, link: BootstrapLink, msg: Message) -> None:
        src = self._source_for(link)
        if src is None:
            return
        if isinstance(msg, Started):
            self.stamps.setdefault("started", time.time())  # a notice that lost the race to the data: ignored
            if self._state == KVPoll.WaitingForInput:
                self._state = KVPoll.Transferring
        elif isinstance(msg, Done):
            src.ended = True
            self._set_done_locked()
        elif isinstance(msg, Fail):
            self._source_ended_locked(src, f"prefill failed the transfer: {msg.reason}")
        elif isinstance(msg, Abort):
            self._source_ended_locked(src, f"aborted by prefill: {msg.reason}")
        elif isinstance(msg, AbortAck) and self._aborting is not None:
            self._source_ended_locked(src, self._aborting)

    def _verify(self, pages: np.ndarray, sources: list[_Source]) -> tuple[KVPoll, Optional[str], Optional[AuxRecord]]:
        """Read and check every prefill rank's aux record (and checksum); runs without the lock."""
        first: Optional[AuxRecord] = None
        for src in sources:
            state, reason, aux = self._verify_one(pages, src)
            if state != KVPoll.Success:
                return state, reason, None
            if first is None:
                first = aux
            elif (aux.first_token_id, aux.prompt_len) != (first.first_token_id, first.prompt_len):  # type: ignore
                return KVPoll.Failed, f"prefill ranks 0 and {src.rank} sent different first tokens", None
        return KVPoll.Success, None, first

    def _verify_one(self, pages: np.ndarray, src: _Source) -> tuple[KVPoll, Optional[str], Optional[AuxRecord]]:
        m = self._m
        try:
            aux = AuxRecord.unpack(bytes(m.aux_buffer[src.aux_slot].numpy()))
        except WireError as e:
            return KVPoll.Failed, f"bad aux record: {e}", None
        if aux.room != self.room:
            return KVPoll.Failed, f"aux record is for room {aux.room}, expected {self.room} (corrupted transfer)", None
        if not A.same(aux.tag, self.key.aux_tag):
            return KVPoll.Failed, f"aux record of room {self.room} has a wrong room tag (stale or foreign record)", None
        if aux.num_pages != pages.size:
            return KVPoll.Failed, f"aux record says {aux.num_pages} pages, decode registered {pages.size}", None
        if m.config.checksum:
            if aux.checksum is None:
                return KVPoll.Failed, "checksum requested but prefill sent none", None
            lay, theirs = m.layout, src.link.welcome.layout if src.link.welcome is not None else None
            if theirs is None:
                return KVPoll.Failed, f"prefill rank {src.rank} sent an aux record before its welcome", None
            part = head_slice(lay.model_kv_heads, theirs.tp_size, theirs.tp_rank, lay.tp_size, lay.tp_rank)
            shared = shared_layers(theirs, lay)  # the layers that rank wrote (its pipeline stage's, ours too)
            got = 0
            if part is not None and shared is not None:
                algo = default_algorithm(m.pool_device)
                bufs = layer_buffers(m.buffers, lay, *shared)
                got = kv_checksum_heads(bufs, pages, lay.page_size, part.dst_head, part.num_heads, algo)
            if got != aux.checksum:
                return (
                    KVPoll.Failed,
                    f"KV checksum mismatch for room {self.room}: prefill {aux.checksum:#x}, "
                    f"decode {got:#x} (corrupted page)",
                    None,
                )
        return KVPoll.Success, None, aux

    def record_ok(self, record: bytes) -> bool:
        """Whether ``record`` is an aux record of this room with its tag (a done signal may count)."""
        try:
            aux = AuxRecord.unpack(record)
        except WireError:
            return False
        return aux.room == self.room and A.same(aux.tag, self.key.aux_tag)

    def _set_done_locked(self) -> None:
        """Every byte of the room has landed: ``poll()`` verifies it next (wake the scheduler for that)."""
        self._dones += 1
        if self._dones < len(self.sources):  # one done signal per prefill rank
            return
        self._done = True
        self.stamps["arrived"] = time.time()
        # the start notice rides the bootstrap link, the bytes the backend's channel: when the bytes won the race
        # this receiver saw the whole transfer at once (docs/observability.md, "KV-transfer metrics")
        self.stamps.setdefault("started", self.stamps["arrived"])
        self._m.progressed()

    def _finish_locked(self, state: KVPoll, reason: Optional[str]) -> None:
        if self._state.is_terminal:
            return
        m = self._m
        self._state = state
        self._reason = reason
        m.progressed()
        if m.active.get(self.room) is self:
            del m.active[self.room]
            m.backend.forget_room(self.room)
        if self.aux_slot is not None:
            m.aux_free.extend(src.aux_slot for src in self.sources)
            self.aux_slot = None
        for src in self.sources:
            waiting = m.waiters.get(src.link)
            if waiting and self in waiting:
                waiting.remove(self)
        if state == KVPoll.Failed:
            logger.info("KV receiver room %d failed: %s", self.room, reason)


class DecodeKVManager(KVManager):
    """Owns the destination registration, the links to prefill workers and aux slots."""

    role = "decode"

    def __init__(
        self,
        kv_pool,
        config: KVTransferConfig,
        backend_cls: type[TransferBackend],
        features: Optional[SlotFeatures] = None,
    ):
        self.config = config
        self.pool = kv_pool
        self.pool_device = kv_pool.device
        if features is not None:
            features.check(kv_pool)
        self.layout = KVLayout.from_pool(
            kv_pool, config.tp_size, config.tp_rank, config.total_kv_heads, features, **config.stage_fields
        )
        self.num_pages = kv_pool.num_slots // kv_pool.page_size
        self.buffers = kv_pool.buffers()
        self.lock = threading.RLock()
        self.num_aux_slots = max(1, min(config.max_inflight, self.num_pages))
        self.aux_buffer = torch.zeros((self.num_aux_slots, AUX_RECORD_BYTES), dtype=torch.uint8)
        self.aux_free = list(range(self.num_aux_slots - 1, -1, -1))
        extra = [features.buffer] if features is not None else []
        self.regions = [MemoryRegion.from_tensor(b) for b in self.buffers + extra] + [
            MemoryRegion.from_tensor(self.aux_buffer)
        ]
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
    def create_receiver(
        self, bootstrap_host: str, bootstrap_port: int, room: int, token: Optional[str] = None
    ) -> DecodeReceiver:
        if self._closed.is_set():
            raise KVTransferError("decode KV manager is closed")
        return DecodeReceiver(self, bootstrap_host, bootstrap_port, self.room_key(room, token))

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
            secret=None if self.config.insecure else self.config.secret,
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
        problem = fingerprint_mismatch(w.fingerprint, self.config.fingerprint)
        if problem is None and self.layout.has_features:
            why = self.layout.features_mismatch(w.layout)
            if why is not None:
                logger.warning(
                    "prefill %s (tp rank %d) sends no %s features (%s): drafting starts without the prompt's "
                    "features, still lossless (docs/speculative.md, PD)",
                    w.prefill_id,
                    w.layout.tp_rank,
                    self.layout.feature_kind,
                    why.replace("this side", "decode").replace("the peer", "prefill"),
                )
        return problem

    def _on_ready(self, link: BootstrapLink) -> None:
        with self.lock:
            for r in self.waiters.pop(link, []):
                if not r._state.is_terminal:
                    r._on_link_ready_locked(link)

    def _on_message(self, link: BootstrapLink, msg: Message) -> None:
        if isinstance(msg, Ping):
            return
        room = getattr(msg, "room", None)
        with self.lock:
            r = self.active.get(room) if room is not None else None
            if r is not None:
                r._on_message_locked(link, msg)

    def _on_closed(self, link: BootstrapLink, reason: str) -> None:
        with self.lock:
            if self._links.get((link.host, link.port)) is link:
                del self._links[(link.host, link.port)]
            self.waiters.pop(link, None)
            for r in list(self.active.values()):
                src = r._source_for(link)
                if src is not None and not r._done:
                    r._source_ended_locked(src, reason)
        if not self._closed.is_set():
            logger.warning("KV link to prefill %s closed: %s", link.address, reason)

    def _on_backend_done(self, room: int, error: Optional[str] = None, aux: Optional[tuple[int, bytes]] = None) -> None:
        with self.lock:
            r = self.active.get(room)
            if r is None or r._state.is_terminal:
                return
            if error is None and aux is not None:  # the aux record rode in the done signal: place it in its slot
                slot, record = aux
                if (
                    slot not in {src.aux_slot for src in r.sources}
                    or not 0 < len(record) <= AUX_RECORD_BYTES
                    or not r.record_ok(record)
                ):  # not this room's record (stale, foreign, cut short): refused, the room goes on
                    logger.warning("room %d: done signal with a bad aux record (slot %s) ignored", room, slot)
                    return
                self.aux_buffer[slot].zero_()
                self.aux_buffer[slot, : len(record)] = torch.frombuffer(bytearray(record), dtype=torch.uint8)
            elif error is None:  # the record was written before: a done counts once one more slot holds it
                good = sum(r.record_ok(bytes(self.aux_buffer[src.aux_slot].numpy())) for src in r.sources)
                if good <= r._dones:
                    logger.warning("room %d: done signal before the room's aux record ignored", room)
                    return
            if error is None:
                r._set_done_locked()
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
