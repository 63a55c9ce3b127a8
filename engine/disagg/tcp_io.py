"""Byte-moving helpers of the ``tcp`` backend (``kvship.engine.disagg.tcp``): descriptor tables, scatter/gather
plans and exact reads.  Pure functions over numpy arrays and sockets; the frame format and its checks are tcp.py's.
"""

from __future__ import annotations

import socket
from typing import Optional

import numpy as np

TABLE_CHUNK = 1 << 16  # descriptors read at once (1.5 MiB): a claimed count costs nothing until its bytes arrive

DESC = np.dtype([("region", "<i8"), ("off", "<i8"), ("len", "<i8")])
_IOV_MAX = 512
_GATHER_MIN_DESCS = 64
_GATHER_MAX_AVG = 256 << 10


def sendmsg_all(sock: socket.socket, bufs: list) -> None:
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


def readinto_exact(reader, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = reader.readinto(view[got:])
        if not k:
            raise ConnectionError("data connection closed mid-frame")
        got += k


def gathered(lengths: np.ndarray) -> bool:
    """Many small ranges: pack/unpack the payload page-wise with torch instead of one syscall per range."""
    return lengths.size > _GATHER_MIN_DESCS and int(lengths.sum()) < lengths.size * _GATHER_MAX_AVG


def segments(region: np.ndarray, off: np.ndarray, length: np.ndarray, units: np.ndarray):
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


def strided(off: np.ndarray, length: np.ndarray, row: int) -> Optional[tuple[np.ndarray, int, int]]:
    """(row indices, first column, width) when every range is the same column block of a ``[*, row]``
    byte matrix (one head slice per slot), else None."""
    if off.size == 0 or row <= 0:
        return None
    w = int(length[0])
    col = int(off[0] % row)
    if col + w > row or (length != w).any() or ((off - col) % row).any():
        return None
    return (off - col) // row, col, w


def page_units(off: np.ndarray, length: np.ndarray, page_bytes: int) -> np.ndarray:
    """Page indices covered by ranges (``off``, ``length``), in order."""
    first, counts = off // page_bytes, length // page_bytes
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) + np.repeat(first - (np.cumsum(counts) - counts), counts)


def read_table(reader, n: int) -> np.ndarray:
    """``n`` descriptors (``n`` already bounded), read in chunks: memory grows only as bytes arrive."""
    parts = []
    while n > 0:
        k = min(n, TABLE_CHUNK)
        raw = bytearray(k * DESC.itemsize)
        readinto_exact(reader, memoryview(raw))
        parts.append(np.frombuffer(raw, dtype=DESC))
        n -= k
    if not parts:
        return np.empty(0, dtype=DESC)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
