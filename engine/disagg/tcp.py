"""``tcp``: KV over plain sockets, for machines with neither Mooncake nor NIXL.

Decode runs a data server (``local_info`` = its address, sent to prefill only
after the control handshake authenticated it); prefill opens one data
connection per decode peer at that handshake.  Each connection starts with a
challenge-response on the KV transfer secret (decode challenges; docs/pd.md,
"KV plane authentication"; ``auth.data_macs``)::

    decode -> prefill   "KVTA" | mode (1 = hmac-sha256, 0 = none) | nonce_d (32)
    prefill -> decode   mode | nonce_p (32) | mac_p (32)
    decode -> prefill   mac_d (32)                 (mode 0: nothing more)

within ``handshake_timeout`` of the connect (a peer that fails is closed).
Then one ``write`` is one frame::

    header   <4s B 3x Q Q 16s>   magic "KVT2", flags (1 = done after this frame), room, n descriptors,
                                 the room's frame tag (``auth.RoomKey.frame_tag``)
    descs    n x <q q q>         destination region, offset, length
    payload  the n byte ranges, in order

Decode refuses a frame whose tag is not its room's by closing that connection
(the room itself goes on), and checks ``n`` against what the room registered
(its pages x page size x paged regions + its aux slots) before it reads the
table, which it reads in chunks.  Aux-region ranges must lie in the room's
own aux slots; a frame with the done flag must write one of them whole.  A
valid-tag frame that breaks these rules fails its room.  At most
``max_connections`` data connections (``max_handshakes`` still authenticating);
a frame that stalls for ``heartbeat_timeout`` closes its connection, and so does
``data_idle_timeout`` without a frame (prefill replaces a connection idle for
half of that before its next frame).

Decode reads each range straight into the destination tensor's memory (CPU
pools; CUDA pools go through a staging buffer).  A frame of many small ranges
(scattered pages: more than 64, under 256 KiB on average) is instead packed
page-wise by prefill and unpacked page-wise by decode (numpy row gathers /
scatters on CPU, torch index_select / index_copy_ on CUDA): the bytes on the
wire are the same, only the copying differs.  Ranges that are one head slice
of many slots (PD between different tensor-parallel sizes, ``tp_slices``: equal
lengths at one column of ``[slots, slot bytes]`` rows) are gathered and
scattered as such a column block in one numpy / torch indexing operation.  Decode first checks that KV ranges
lie on pages registered for that room and that every range is inside its
region (a range may be part of a page: one token's slice of KV heads when the
two workers' tensor-parallel sizes differ, ``tp_slices``); the per-slot
features region (``SlotFeatures``) is paged like a K/V buffer, with its own
page size in bytes.  Frames for a room decode no longer expects (aborted, finished) are
read and dropped, so a late write never lands.  A frame with the done flag
signals ``on_done(room)`` after its bytes are placed: TCP's ordering makes the
done signal follow all of the room's data.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from kvship.engine.disagg import auth as A
from kvship.engine.disagg.base import (
    KVTransferConfig,
    KVTransferError,
    MemoryRegion,
    TransferBackend,
    TransferDescs,
    advertise_host,
    register_transfer_backend,
)
from kvship.engine.disagg.bootstrap import ThrottledLog, recv_exact
from kvship.engine.disagg.tcp_io import (
    DESC,
    gathered,
    page_units,
    read_table,
    readinto_exact,
    segments,
    sendmsg_all,
    strided,
)
from kvship.engine.disagg.wire import AUX_RECORD_BYTES, KVLayout

logger = logging.getLogger(__name__)

_HDR = struct.Struct("<4sB3xQQ16s")
_MAGIC = b"KVT2"
_HELLO = b"KVTA"
_FLAG_DONE = 1
_DISCARD = 1 << 20  # the scratch buffer dropped frames are read into


class _TcpPeer:
    """Prefill's data connection to one decode worker; ``lock`` serializes frames on it.  ``used``: when the last
    frame went (monotonic); a connection idle for half of decode's idle timeout is replaced before the next frame."""

    def __init__(self, sock: socket.socket, address: tuple[str, int]):
        self.sock = sock
        self.address = address
        self.lock = threading.Lock()
        self.used = time.monotonic()


class _Room:
    """Decode: what one expected room may receive (sorted pages, aux slots, frame tag, bounds)."""

    def __init__(self, key: A.RoomKey, pages: np.ndarray, aux_slots: Sequence[int], paged: int, slot_bytes: int):
        self.tag = key.frame_tag
        self.pages = np.sort(pages)
        self.slots = np.array(sorted(set(int(x) for x in aux_slots)), dtype=np.int64)
        # most descriptors a frame of this room can need: one per slot (a head slice) of each paged region
        self.max_descs = int(self.pages.size) * paged + int(self.slots.size)
        self.max_bytes = int(self.pages.size) * slot_bytes + int(self.slots.size) * AUX_RECORD_BYTES


class _Refused(Exception):
    """A data connection broke the protocol: it is closed (the message says why)."""


@register_transfer_backend("tcp")
class TcpBackend(TransferBackend):
    in_band_done = True

    @classmethod
    def check_available(cls) -> None:
        """Plain sockets: always available."""

    def __init__(self, config: KVTransferConfig, role: str, regions: Sequence[MemoryRegion], layout: KVLayout):
        super().__init__(config, role, regions, layout)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._secret = None if config.insecure else config.secret
        # prefill side
        self._peers: dict[str, _TcpPeer] = {}
        # decode side
        self._rooms: dict[int, _Room] = {}
        self._open = self._handshaking = 0  # data connections served / still authenticating
        self.rejected = 0  # connections closed at once for the limits
        self._unauthenticated = ThrottledLog()
        self._on_done: Optional[Callable[[int, Optional[str]], None]] = None
        self._server: Optional[socket.socket] = None
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._num_kv = layout.num_buffers
        # page bytes of each paged region (K/V buffers, then the features buffer if any); 0 = the aux buffer
        self._units = np.zeros(len(regions), dtype=np.int64)
        self._units[: self._num_kv] = layout.page_bytes
        if layout.has_features:
            self._units[self._num_kv] = layout.feature_page_bytes
        self._row = layout.page_bytes // layout.page_size  # one slot's bytes in a K/V buffer
        # numpy views of host regions: slicing them is cheap (no tensor ops per range)
        self._np = [r.bytes_view().numpy() if r.device == "cpu" else None for r in regions]
        self._sizes = np.array([r.nbytes for r in regions], dtype=np.int64)
        # bounds of a frame: paged regions' slots (a head slice is one descriptor per slot), a page's bytes
        self._paged_slots = layout.page_size * (self._num_kv + int(layout.has_features))
        self._page_bytes_all = layout.page_bytes * self._num_kv + layout.feature_page_bytes
        self._max_descs_any = (int(self._sizes[0]) // max(1, layout.page_bytes)) * self._paged_slots + int(
            self._sizes[-1]
        ) // AUX_RECORD_BYTES
        if role == "decode":
            self._server = socket.create_server((config.host if config.host != "localhost" else "127.0.0.1", 0))
            self._port = self._server.getsockname()[1]

    # -- both sides ------------------------------------------------------------
    def local_info(self) -> dict:
        if self._server is None:
            return {}
        return {"host": advertise_host(self.config.host), "port": self._port}

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            socks = [p.sock for p in self._peers.values()] + list(self._conns)
            self._peers.clear()
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept() thread
            except OSError:
                pass
            try:
                self._server.close()
            except OSError:
                pass
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=2)

    # -- prefill side ----------------------------------------------------------
    def add_peer(self, peer_id: str, info: dict) -> None:
        try:
            host, port = str(info["host"]), int(info["port"])
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError(f"bad tcp endpoint {info!r}") from e
        sock = self._connect((host, port))
        with self._lock:
            old = self._peers.pop(peer_id, None)
            self._peers[peer_id] = _TcpPeer(sock, (host, port))
        if old is not None:
            old.sock.close()

    def _connect(self, address: tuple[str, int]) -> socket.socket:
        """A new authenticated data connection to decode's data port."""
        sock = socket.create_connection(address, timeout=self.config.connect_timeout)
        try:
            self._prove(sock, time.monotonic() + self.config.handshake_timeout)
        except (OSError, ConnectionError, KVTransferError) as e:
            sock.close()
            if isinstance(e, KVTransferError):
                raise
            raise KVTransferError(f"tcp data port {address[0]}:{address[1]}: handshake failed: {e}") from e
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return sock

    def _prove(self, sock: socket.socket, deadline: float) -> None:
        """Prefill's half of the data-connection handshake (see the module docstring)."""
        hello = recv_exact(sock, 5 + A.NONCE_BYTES, deadline)
        mode = 0 if self._secret is None else 1
        if hello[:4] != _HELLO:
            raise KVTransferError("the tcp data port is not a kvship decode worker's")
        if hello[4] != mode:
            raise KVTransferError(
                "KV-plane authentication differs between the tcp data port and this worker "
                "(--kv-transfer-insecure must be set on both workers or on neither)"
            )
        if self._secret is None:
            sock.sendall(bytes([mode]) + bytes(2 * A.NONCE_BYTES))
            return
        nonce_d, nonce_p = hello[5:], A.new_nonce()
        mac_p, mac_d = A.data_macs(self._secret, nonce_d, nonce_p)
        sock.sendall(bytes([mode]) + nonce_p + mac_p)
        if not A.same(recv_exact(sock, A.MAC_BYTES, deadline), mac_d):
            raise KVTransferError("tcp data port failed authentication (it does not hold the KV transfer secret)")

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
        if peer is not None:
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            peer.sock.close()

    def write(self, peer_id: str, key: A.RoomKey, descs: TransferDescs, done: bool = False) -> None:
        with self._lock:
            peer = self._peers.get(peer_id)
        if peer is None:
            raise KVTransferError(f"tcp peer {peer_id} is not connected")
        table = np.empty(len(descs), dtype=DESC)
        table["region"], table["off"], table["len"] = descs.dst_region, descs.dst_off, descs.length
        header = _HDR.pack(_MAGIC, _FLAG_DONE if done else 0, key.room, len(descs), key.frame_tag)
        if gathered(table["len"]):
            payload = self._gather(descs)
        else:
            payload = []
            for reg, off, n in zip(descs.src_region.tolist(), descs.src_off.tolist(), descs.length.tolist()):
                view = self._np[reg]
                payload.append(
                    view[off : off + n]
                    if view is not None
                    else self.regions[reg].bytes_view()[off : off + n].cpu().numpy()
                )
        bufs = [header, table.tobytes(), *payload]
        with peer.lock:
            if time.monotonic() - peer.used > self.config.data_idle_timeout / 2:
                # decode closes a connection idle for data_idle_timeout: replace it well before that
                old, peer.sock = peer.sock, self._connect(peer.address)
                old.close()
            try:
                sendmsg_all(peer.sock, bufs)
            except OSError as e:
                raise KVTransferError(f"tcp data connection to decode lost: {e}") from e
            peer.used = time.monotonic()

    def _gather(self, descs: TransferDescs) -> list:
        """Host buffers holding the ranges of ``descs`` in order, packed page-wise per region
        (numpy row gathers on CPU pools, torch index_select on CUDA pools)."""
        out: list = []
        for a, b, reg, paged in segments(descs.src_region, descs.src_off, descs.length, self._units):
            if paged:
                units = page_units(descs.src_off[a:b], descs.length[a:b], int(self._units[reg]))
                if self._np[reg] is not None:
                    out.append(np.take(self._rows(reg), units))
                else:
                    dev = self.regions[reg].tensor.device
                    out.append(self._paged(reg).index_select(0, torch.from_numpy(units).to(dev)).cpu().numpy())
                continue
            block = strided(descs.src_off[a:b], descs.length[a:b], self._row) if reg < self._num_kv else None
            if block is not None:
                rows, col, w = block
                if self._np[reg] is not None:
                    out.append(self._np[reg].reshape(-1, self._row)[rows, col : col + w])
                else:
                    t = self.regions[reg].bytes_view().view(-1, self._row)
                    out.append(t[torch.from_numpy(rows).to(t.device), col : col + w].cpu().numpy())
                continue
            for off, n in zip(descs.src_off[a:b].tolist(), descs.length[a:b].tolist()):
                view = self._np[reg]
                out.append(
                    view[off : off + n]
                    if view is not None
                    else self.regions[reg].bytes_view()[off : off + n].cpu().numpy()
                )
        return out

    def _rows(self, reg: int) -> np.ndarray:
        """A host paged region as a 1-D array of page-sized opaque items (fast row gathers/scatters)."""
        return self._np[reg].view(f"V{int(self._units[reg])}")

    def _paged(self, reg: int) -> torch.Tensor:
        return self.regions[reg].bytes_view().view(-1, int(self._units[reg]))

    # -- decode side -----------------------------------------------------------
    def start_receiving(self, on_done: Callable[[int, Optional[str]], None]) -> None:
        self._on_done = on_done
        t = threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)
        self._threads.append(t)
        t.start()

    def expect_room(self, key: A.RoomKey, dst_pages: np.ndarray, aux_slots: Sequence[int]) -> None:
        room = _Room(key, dst_pages, aux_slots, self._paged_slots, self._page_bytes_all)
        with self._lock:
            self._rooms[key.room] = room

    def forget_room(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._closed.is_set():
            try:
                sock, addr = self._server.accept()
            except OSError:
                return
            cfg = self.config
            with self._lock:
                full = self._open >= cfg.max_connections or self._handshaking >= cfg.max_handshakes
                if full:
                    self.rejected += 1
                else:
                    self._open += 1
                    self._handshaking += 1
            if full:
                sock.close()  # over the limits: closed at once
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t = threading.Thread(target=self._serve, args=(sock,), name=f"kv-tcp-recv-{addr[1]}", daemon=True)
                with self._lock:
                    self._conns.add(sock)
                    self._threads = [x for x in self._threads if x.is_alive()] + [t]
                t.start()
            except Exception:  # noqa: BLE001 - e.g. no thread could be started: drop this connection alone
                logger.exception("tcp data port could not serve a connection from %s", addr)
                with self._lock:
                    self._conns.discard(sock)
                    self._open -= 1
                    self._handshaking -= 1
                sock.close()

    def _challenge(self, sock: socket.socket, deadline: float) -> None:
        """Decode's half of the data-connection handshake; _Refused if the peer fails it."""
        mode = 0 if self._secret is None else 1
        nonce_d = A.new_nonce()
        sock.sendall(_HELLO + bytes([mode]) + nonce_d)
        answer = recv_exact(sock, 1 + A.NONCE_BYTES + A.MAC_BYTES, deadline)
        if answer[0] != mode:
            raise _Refused("KV-plane authentication differs (--kv-transfer-insecure on one side only)")
        if self._secret is None:
            return
        nonce_p, mac_p = answer[1 : 1 + A.NONCE_BYTES], answer[1 + A.NONCE_BYTES :]
        want_p, mac_d = A.data_macs(self._secret, nonce_d, nonce_p)
        if not A.same(mac_p, want_p):
            raise _Refused("authentication failed")
        sock.sendall(mac_d)

    def _serve(self, sock: socket.socket) -> None:
        handshaking = True
        reader = None
        try:
            self._challenge(sock, time.monotonic() + self.config.handshake_timeout)
            with self._lock:
                self._handshaking -= 1
                handshaking = False
            sock.settimeout(None)
            reader = sock.makefile("rb", buffering=256 << 10)
            self._frames(sock, reader)
        except (_Refused, OSError, ConnectionError, KVTransferError) as e:
            if handshaking:  # an unauthenticated peer: throttled
                self._unauthenticated.warning("tcp data connection refused: %s", str(e))
            elif not self._closed.is_set():
                # the text, not the exception: a kept log record must not pin this thread's buffers
                logger.warning("tcp data connection ended: %s", str(e))
        except Exception:  # noqa: BLE001 - malformed input ends this connection, never the worker
            logger.exception("tcp data connection failed")
        finally:
            with self._lock:
                self._conns.discard(sock)
                self._open -= 1
                if handshaking:
                    self._handshaking -= 1
            if reader is not None:
                reader.close()
            sock.close()

    def _frames(self, sock: socket.socket, reader) -> None:
        """Read frames until the peer closes; _Refused / KVTransferError end the connection."""
        scratch = bytearray()  # grown to _DISCARD the first time a frame is dropped
        staging: Optional[torch.Tensor] = None
        stall = self.config.heartbeat_timeout
        idle = self.config.data_idle_timeout
        while True:
            sock.settimeout(idle)  # between frames (prefill replaces a connection idle for half of it)
            try:
                head = reader.read(_HDR.size)
            except TimeoutError:  # prefill never lets a connection it writes on idle this long
                logger.debug("tcp data connection idle for %g s: closed", idle)
                return
            if len(head) < _HDR.size:
                return  # peer closed between frames
            sock.settimeout(stall)  # ... but not inside one
            magic, flags, room, n, tag = _HDR.unpack(head)
            if magic != _MAGIC:
                raise _Refused("bad frame magic")
            with self._lock:
                entry = self._rooms.get(room)
            if entry is None:  # aborted or finished (a late write): read and drop
                if n > self._max_descs_any:
                    raise _Refused(f"frame claims {n} descriptors")
                table = read_table(reader, n)
                length = table["len"]
                if len(table) and (length.min() < 0 or length.max() > self._sizes.max()):
                    raise _Refused("frame with a bad range length")
                self._discard(reader, scratch, int(length.sum()))
                continue
            if not A.same(tag, entry.tag):  # not the room's sender: this connection goes, the room stays
                raise _Refused(f"frame for room {room} with a wrong room tag")
            if n > entry.max_descs:
                self._fail(room, f"tcp: prefill sent {n} descriptors, room {room} registered at most {entry.max_descs}")
                raise _Refused("frame over its room's descriptor bound")
            table = read_table(reader, n)
            problem = self._check_frame(entry, table, bool(flags & _FLAG_DONE))
            if problem is not None:
                self._fail(room, problem)
                total = int(table["len"].sum()) if len(table) and table["len"].min() >= 0 else -1
                if not 0 <= total <= entry.max_bytes:
                    raise _Refused(problem)
                self._discard(reader, scratch, total)
                continue
            if gathered(table["len"]):
                staging = self._scatter(reader, table, staging)
            else:
                for reg, off, length in zip(table["region"].tolist(), table["off"].tolist(), table["len"].tolist()):
                    if self._np[reg] is not None:
                        readinto_exact(reader, memoryview(self._np[reg][off : off + length]))
                        continue
                    if staging is None or staging.numel() < length:
                        staging = torch.empty(max(length, 1 << 20), dtype=torch.uint8)
                    readinto_exact(reader, memoryview(staging[:length].numpy()))
                    self.regions[reg].bytes_view()[off : off + length].copy_(staging[:length])
            if flags & _FLAG_DONE and self._on_done is not None:
                for dev in {r.device_id for r in self.regions if r.device == "cuda"}:
                    torch.cuda.synchronize(dev)  # this thread's current device may be another GPU
                self._on_done(room, None)

    def _fail(self, room: int, problem: str) -> None:
        """A frame with the room's tag broke the rules: the room fails (its later data is dropped)."""
        logger.warning("room %d: %s", room, problem)
        self.forget_room(room)
        if self._on_done is not None:
            self._on_done(room, problem)

    def _scatter(self, reader, table: np.ndarray, staging: Optional[torch.Tensor]) -> torch.Tensor:
        """Read a frame's whole payload into ``staging`` and place it page-wise (index_copy_)."""
        total = int(table["len"].sum())
        if staging is None or staging.numel() < total:
            staging = torch.empty(max(total, 1 << 20), dtype=torch.uint8)
        readinto_exact(reader, memoryview(staging[:total].numpy()))
        region, off, length = table["region"], table["off"], table["len"]
        for a, b, reg, paged in segments(region, off, length, self._units):
            pos = int(length[:a].sum())
            n = int(length[a:b].sum())
            unit = int(self._units[reg])
            if paged and self._np[reg] is not None:
                rows = staging[pos : pos + n].numpy().view(f"V{unit}")
                self._rows(reg)[page_units(off[a:b], length[a:b], unit)] = rows
                continue
            block = None if paged or reg >= self._num_kv else strided(off[a:b], length[a:b], self._row)
            if block is not None:
                idx, col, w = block
                data = staging[pos : pos + n].numpy().reshape(-1, w)
                if self._np[reg] is not None:
                    self._np[reg].reshape(-1, self._row)[idx, col : col + w] = data
                else:
                    t = self.regions[reg].bytes_view().view(-1, self._row)
                    t[torch.from_numpy(idx).to(t.device), col : col + w] = torch.from_numpy(data).to(t.device)
                continue
            dev = self.regions[reg].tensor.device
            data = staging[pos : pos + n].to(dev)
            if paged:
                idx = torch.from_numpy(page_units(off[a:b], length[a:b], unit)).to(dev)
                self._paged(reg).index_copy_(0, idx, data.view(-1, unit))
            else:
                p = 0
                for o, k in zip(off[a:b].tolist(), length[a:b].tolist()):
                    self.regions[reg].bytes_view()[o : o + k].copy_(data[p : p + k])
                    p += k
        return staging

    @staticmethod
    def _discard(reader, scratch: bytearray, length: int) -> None:
        if length > 0 and not scratch:
            scratch.extend(bytes(_DISCARD))
        view = memoryview(scratch)
        while length > 0:
            k = min(length, len(view))
            readinto_exact(reader, view[:k])
            length -= k

    def _check_frame(self, room: "_Room", table: np.ndarray, done: bool) -> Optional[str]:
        """None if the frame may land: every range inside its region and, for paged regions (K/V, features), on
        pages registered for that room; aux ranges inside the room's own aux slots; the payload within what the
        room registered; a done frame writes one of the room's aux records whole.  Else the problem."""
        sizes = self._sizes
        reg, off, length = table["region"], table["off"], table["len"]
        if len(table) and (
            reg.min() < 0
            or reg.max() >= len(sizes)
            or (off < 0).any()
            or (length < 0).any()
            or ((off + length) > sizes[np.clip(reg, 0, len(sizes) - 1)]).any()
        ):
            return "tcp: prefill sent a range outside decode's registered memory"
        if int(length.sum()) > room.max_bytes:
            return "tcp: prefill sent more bytes than the room registered"
        pb = self._units[reg]
        kv = pb > 0
        if kv.any():
            o, n, pb = off[kv], length[kv], pb[kv]
            first = o // pb
            count = (o + n + pb - 1) // pb - first  # pages the range touches (a head slice: part of one)
            inside = np.searchsorted(room.pages, first + count) - np.searchsorted(room.pages, first) == count
            if (n <= 0).any() or not inside.all():
                return "tcp: prefill sent KV for pages this room did not register"
        aux = reg == len(sizes) - 1
        if aux.any():
            o, n = off[aux], length[aux]
            slot = o // AUX_RECORD_BYTES
            if not (np.isin(slot, room.slots) & (o + n <= (slot + 1) * AUX_RECORD_BYTES)).all():
                return "tcp: prefill wrote outside the room's own aux record slot"
        if done:
            whole = aux & (length == AUX_RECORD_BYTES) & (off % AUX_RECORD_BYTES == 0)
            if not whole.any():
                return "tcp: done signal before the room's aux record (empty or early done frame)"
        return None
