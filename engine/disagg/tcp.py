"""``tcp``: KV over plain sockets, for machines with neither Mooncake nor NIXL.

Decode runs a data server (``local_info`` = its address); prefill opens one
data connection per decode peer at the handshake.  One ``write`` is one frame::

    header   <4s B 3x Q Q>   magic "KVT1", flags (1 = done after this frame), room, n descriptors
    descs    n x <q q q>     destination region, offset, length
    payload  the n byte ranges, in order

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
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from kvship.engine.disagg.base import (
    KVTransferConfig,
    KVTransferError,
    MemoryRegion,
    TransferBackend,
    TransferDescs,
    advertise_host,
    register_transfer_backend,
)
from kvship.engine.disagg.wire import KVLayout

logger = logging.getLogger(__name__)

_HDR = struct.Struct("<4sB3xQQ")
_MAGIC = b"KVT1"
_FLAG_DONE = 1
_DESC = np.dtype([("region", "<i8"), ("off", "<i8"), ("len", "<i8")])
_IOV_MAX = 512
_DISCARD = 1 << 20
_GATHER_MIN_DESCS = 64
_GATHER_MAX_AVG = 256 << 10


def _sendmsg_all(sock: socket.socket, bufs: list) -> None:
    """Send every buffer in ``bufs`` (memoryviews / bytes), batching syscalls."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        sent = sock.sendmsg(batch)
        for v in batch:
            if sent >= len(v):
                sent -= len(v)
                i += 1
            else:
                views[i] = v[sent:]
                break


def _readinto_exact(reader, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = reader.readinto(view[got:])
        if not k:
            raise ConnectionError("data connection closed mid-frame")
        got += k


def _gathered(lengths: np.ndarray) -> bool:
    """Many small ranges: pack/unpack the payload page-wise with torch instead of one syscall per range."""
    return lengths.size > _GATHER_MIN_DESCS and int(lengths.sum()) < lengths.size * _GATHER_MAX_AVG


def _segments(region: np.ndarray, off: np.ndarray, length: np.ndarray, units: np.ndarray):
    """Maximal runs ``[a, b)`` of table entries on one region; ``paged`` when they are ranges of a paged
    region (``units[region]``: its page bytes, 0 = not paged) made of whole pages (then one
    index_select / index_copy_ moves them all)."""
    unit = units[region]
    safe = np.maximum(unit, 1)
    paged = (unit > 0) & (off % safe == 0) & (length % safe == 0)
    n = region.size
    brk = np.flatnonzero((np.diff(region) != 0) | (np.diff(paged.astype(np.int8)) != 0)) + 1
    starts = np.concatenate(([0], brk)).tolist()
    ends = np.concatenate((brk, [n])).tolist()
    return [(a, b, int(region[a]), bool(paged[a])) for a, b in zip(starts, ends)]


def _strided(off: np.ndarray, length: np.ndarray, row: int) -> Optional[tuple[np.ndarray, int, int]]:
    """(row indices, first column, width) when every range is the same column block of a ``[*, row]``
    byte matrix (one head slice per slot), else None."""
    if off.size == 0 or row <= 0:
        return None
    w = int(length[0])
    col = int(off[0] % row)
    if col + w > row or (length != w).any() or ((off - col) % row).any():
        return None
    return (off - col) // row, col, w


def _page_units(off: np.ndarray, length: np.ndarray, page_bytes: int) -> np.ndarray:
    """Page indices covered by ranges (``off``, ``length``), in order."""
    first, counts = off // page_bytes, length // page_bytes
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) + np.repeat(first - (np.cumsum(counts) - counts), counts)


class _TcpPeer:
    """Prefill's data connection to one decode worker; ``lock`` serializes frames on it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()


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
        # prefill side
        self._peers: dict[str, _TcpPeer] = {}
        # decode side
        self._rooms: dict[int, np.ndarray] = {}  # room -> its sorted destination pages
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
        sock = socket.create_connection((host, port), timeout=self.config.connect_timeout)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        with self._lock:
            old = self._peers.pop(peer_id, None)
            self._peers[peer_id] = _TcpPeer(sock)
        if old is not None:
            old.sock.close()

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
        if peer is not None:
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            peer.sock.close()

    def write(self, peer_id: str, room: int, descs: TransferDescs, done: bool = False) -> None:
        with self._lock:
            peer = self._peers.get(peer_id)
        if peer is None:
            raise KVTransferError(f"tcp peer {peer_id} is not connected")
        table = np.empty(len(descs), dtype=_DESC)
        table["region"], table["off"], table["len"] = descs.dst_region, descs.dst_off, descs.length
        header = _HDR.pack(_MAGIC, _FLAG_DONE if done else 0, room, len(descs))
        if _gathered(table["len"]):
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
            try:
                _sendmsg_all(peer.sock, bufs)
            except OSError as e:
                raise KVTransferError(f"tcp data connection to decode lost: {e}") from e

    def _gather(self, descs: TransferDescs) -> list:
        """Host buffers holding the ranges of ``descs`` in order, packed page-wise per region
        (numpy row gathers on CPU pools, torch index_select on CUDA pools)."""
        out: list = []
        for a, b, reg, paged in _segments(descs.src_region, descs.src_off, descs.length, self._units):
            if paged:
                units = _page_units(descs.src_off[a:b], descs.length[a:b], int(self._units[reg]))
                if self._np[reg] is not None:
                    out.append(np.take(self._rows(reg), units))
                else:
                    dev = self.regions[reg].tensor.device
                    out.append(self._paged(reg).index_select(0, torch.from_numpy(units).to(dev)).cpu().numpy())
                continue
            block = _strided(descs.src_off[a:b], descs.length[a:b], self._row) if reg < self._num_kv else None
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

    def expect_room(self, room: int, dst_pages: np.ndarray) -> None:
        with self._lock:
            self._rooms[room] = np.sort(dst_pages)

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
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self._serve, args=(sock,), name=f"kv-tcp-recv-{addr[1]}", daemon=True)
            with self._lock:
                self._conns.add(sock)
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        reader = sock.makefile("rb", buffering=256 << 10)
        scratch = bytearray(_DISCARD)
        staging: Optional[torch.Tensor] = None
        try:
            while True:
                head = reader.read(_HDR.size)
                if len(head) < _HDR.size:
                    return  # peer closed between frames
                magic, flags, room, n = _HDR.unpack(head)
                if magic != _MAGIC:
                    raise KVTransferError("bad frame magic on tcp data connection")
                raw = bytearray(n * _DESC.itemsize)
                _readinto_exact(reader, memoryview(raw))
                table = np.frombuffer(raw, dtype=_DESC)
                ok, problem = self._check_frame(room, table)
                if problem is not None:
                    logger.warning("room %d: %s", room, problem)
                    self.forget_room(room)
                    if self._on_done is not None:
                        self._on_done(room, problem)
                if not ok:
                    self._discard(reader, scratch, int(table["len"].sum()))
                elif _gathered(table["len"]):
                    staging = self._scatter(reader, table, staging)
                else:
                    for reg, off, length in zip(table["region"].tolist(), table["off"].tolist(), table["len"].tolist()):
                        if self._np[reg] is not None:
                            _readinto_exact(reader, memoryview(self._np[reg][off : off + length]))
                            continue
                        if staging is None or staging.numel() < length:
                            staging = torch.empty(max(length, 1 << 20), dtype=torch.uint8)
                        _readinto_exact(reader, memoryview(staging[:length].numpy()))
                        self.regions[reg].bytes_view()[off : off + length].copy_(staging[:length])
                if ok and flags & _FLAG_DONE and self._on_done is not None:
                    for dev in {r.device_id for r in self.regions if r.device == "cuda"}:
                        torch.cuda.synchronize(dev)  # this thread's current device may be another GPU
                    self._on_done(room, None)
        except (OSError, ConnectionError, KVTransferError) as e:
            if not self._closed.is_set():
                logger.warning("tcp data connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(sock)
            reader.close()
            sock.close()

    def _scatter(self, reader, table: np.ndarray, staging: Optional[torch.Tensor]) -> torch.Tensor:
        """Read a frame's whole payload into ``staging`` and place it page-wise (index_copy_)."""
        total = int(table["len"].sum())
        if staging is None or staging.numel() < total:
            staging = torch.empty(max(total, 1 << 20), dtype=torch.uint8)
        _readinto_exact(reader, memoryview(staging[:total].numpy()))
        region, off, length = table["region"], table["off"], table["len"]
        for a, b, reg, paged in _segments(region, off, length, self._units):
            pos = int(length[:a].sum())
            n = int(length[a:b].sum())
            unit = int(self._units[reg])
            if paged and self._np[reg] is not None:
                rows = staging[pos : pos + n].numpy().view(f"V{unit}")
                self._rows(reg)[_page_units(off[a:b], length[a:b], unit)] = rows
                continue
            block = None if paged or reg >= self._num_kv else _strided(off[a:b], length[a:b], self._row)
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
                idx = torch.from_numpy(_page_units(off[a:b], length[a:b], unit)).to(dev)
                self._paged(reg).index_copy_(0, idx, data.view(-1, unit))
            else:
                p = 0
                for o, k in zip(off[a:b].tolist(), length[a:b].tolist()):
                    self.regions[reg].bytes_view()[o : o + k].copy_(data[p : p + k])
                    p += k
        return staging

    @staticmethod
    def _discard(reader, scratch: bytearray, length: int) -> None:
        view = memoryview(scratch)
        while length > 0:
            k = min(length, len(view))
            _readinto_exact(reader, view[:k])
            length -= k

    def _check_frame(self, room: int, table: np.ndarray) -> tuple[bool, Optional[str]]:
        """(accept, problem): the room must still be expected and every range inside
        its region and, for paged regions (K/V, features), on pages registered for that room."""
        with self._lock:
            pages = self._rooms.get(room)
        if pages is None:
            return False, None  # aborted or finished: drop silently
        sizes = np.array([r.nbytes for r in self.regions], dtype=np.int64)
        reg, off, length = table["region"], table["off"], table["len"]
        if len(table) and (
            reg.min() < 0 or reg.max() >= len(sizes) or (off < 0).any() or ((off + length) > sizes[reg]).any()
        ):
            return False, "tcp: prefill sent a range outside decode's registered memory"
        pb = self._units[reg]
        kv = pb > 0
        if kv.any():
            o, n, pb = off[kv], length[kv], pb[kv]
            first = o // pb
            count = (o + n + pb - 1) // pb - first  # pages the range touches (a head slice: part of one)
            inside = np.searchsorted(pages, first + count) - np.searchsorted(pages, first) == count
            if (n <= 0).any() or not inside.all():
                return False, "tcp: prefill sent KV for pages this room did not register"
        return True, None
