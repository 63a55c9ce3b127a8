"""Page copies between the host KV tier and the device pool by the copy engines (``--hicache-io-backend dma``;
docs/cache.md, "Copies").

``copy_pages(dsts, dst_pages, srcs, src_pages, page_rows)`` has ``page_copy.copy_pages``' contract (page
``src_pages[i]`` of every ``srcs[j]`` into page ``dst_pages[i]`` of ``dsts[j]``; a page is ``page_rows``
consecutive rows of a contiguous buffer ``[rows, ...]``), with the page numbers on the host, and moves the bytes
without a kernel:

* The pairs are joined into runs where both page numbers advance by one (``page_runs``): a run is one contiguous
  byte range on each side, in every buffer.
* One descriptor per (buffer, run), (destination address, source address, bytes), checked against both buffers'
  extents before anything moves (``descriptors``).
* On CUDA the descriptors go to the DMA copy engines in one ``cudaMemcpyBatchAsync`` call on the current stream
  (CUDA runtime 12.8 or later), which takes no SMs from the kernels running beside it: the point of this backend,
  a decode beside load-backs that does not notice them.  Off CUDA (tests) each descriptor is a ``memmove``, the
  same plan executed by the CPU.

The bytes move as they are (any dtype, FP8 included).  Nothing here waits for the device.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Optional, Sequence

import numpy as np
import torch

# descriptors per cudaMemcpyBatchAsync call (the API sets no limit; bounded so one call's arrays stay small)
MAX_BATCH = 1 << 16


def page_runs(dst_pages, src_pages) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dst_start, src_start, length)`` of the maximal runs where both page numbers advance by one, in order."""
    dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    src = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    if dst.shape != src.shape:
        raise ValueError(f"copy_pages: {dst.size} destination pages for {src.size} source pages")
    if dst.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    brk = np.ones(dst.size, dtype=bool)
    brk[1:] = (np.diff(dst) != 1) | (np.diff(src) != 1)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, dst.size))
    return dst[starts], src[starts], lengths


def _row_bytes(buf: torch.Tensor) -> int:
    return buf[0].numel() * buf.element_size()


def descriptors(
    dsts: Sequence[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    runs: tuple[np.ndarray, np.ndarray, np.ndarray],
    page_rows: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dst_addr, src_addr, nbytes)`` (uint64) of every (buffer pair, run), buffer by buffer.  Refuses buffers
    that are not contiguous or whose rows differ, and any run past either buffer's end (nothing is moved then)."""
    if len(dsts) != len(srcs) or not dsts:
        raise ValueError(f"copy_pages: {len(dsts)} destination buffers for {len(srcs)} sources")
    if page_rows < 1:
        raise ValueError(f"copy_pages: page_rows must be >= 1, got {page_rows}")
    d0, s0, n = runs
    if d0.size and (int(d0.min()) < 0 or int(s0.min()) < 0):
        raise ValueError("copy_pages: negative page number")
    out_d, out_s, out_n = [], [], []
    for d, s in zip(dsts, srcs):
        if d.dtype != s.dtype or d.shape[1:] != s.shape[1:]:
            raise ValueError(f"copy_pages: rows {tuple(d.shape[1:])} {d.dtype} <- {tuple(s.shape[1:])} {s.dtype}")
        if not (d.is_contiguous() and s.is_contiguous() and d.dim() >= 2):
            raise ValueError("copy_pages: buffers must be contiguous with at least 2 dimensions")
        page = _row_bytes(d) * page_rows
        if d0.size and (
            int((d0 + n).max()) * page > d.numel() * d.element_size()
            or int((s0 + n).max()) * page > s.numel() * s.element_size()
        ):
            raise ValueError(
                f"copy_pages: a page past the end of a buffer ({d.shape[0] // page_rows} / "
                f"{s.shape[0] // page_rows} pages)"
            )
        out_d.append(np.uint64(d.data_ptr()) + (d0 * page).astype(np.uint64))
        out_s.append(np.uint64(s.data_ptr()) + (s0 * page).astype(np.uint64))
        out_n.append((n * page).astype(np.uint64))
    return np.concatenate(out_d), np.concatenate(out_s), np.concatenate(out_n)


class _Attrs(ctypes.Structure):
    """``cudaMemcpyAttributes``: source access order, source / destination location hints, flags."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_type", ctypes.c_int),
        ("src_loc_id", ctypes.c_int),
        ("dst_loc_type", ctypes.c_int),
        ("dst_loc_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: the source is read in stream order
_LOC_DEVICE, _LOC_HOST = 1, 2  # cudaMemLocationTypeDevice / Host
_PREFER_OVERLAP_WITH_COMPUTE = 1  # cudaMemcpyFlagPreferOverlapWithCompute


class _Runtime:
    """The CUDA runtime's batched copy, reached through the ``libcudart`` this process already loaded (torch's)."""

    def __init__(self) -> None:
        lib = _load_cudart()
        version = ctypes.c_int(0)
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            raise RuntimeError("cudaRuntimeGetVersion failed")
        self.version = version.value
        if self.version < 12080:
            raise RuntimeError(f"the CUDA runtime is {self.version}; cudaMemcpyBatchAsync needs 12.8 or later")
        self.fn = lib.cudaMemcpyBatchAsync
        self.fn.restype = ctypes.c_int
        # CUDA 13 dropped the failure-index argument before the stream
        self.fail_idx = self.version < 13000
        self.error_string = lib.cudaGetErrorString
        self.error_string.restype = ctypes.c_char_p

    def batch(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, attrs: _Attrs, stream: int) -> None:
        for lo in range(0, dst.size, MAX_BATCH):
            d = np.ascontiguousarray(dst[lo : lo + MAX_BATCH])
            s = np.ascontiguousarray(src[lo : lo + MAX_BATCH])
            n = np.ascontiguousarray(nbytes[lo : lo + MAX_BATCH])
            idx = (ctypes.c_size_t * 1)(0)
            args = [
                ctypes.c_void_p(d.ctypes.data),
                ctypes.c_void_p(s.ctypes.data),
                ctypes.c_void_p(n.ctypes.data),
                ctypes.c_size_t(d.size),
                ctypes.byref(attrs),
                idx,
                ctypes.c_size_t(1),
            ]
            failed = ctypes.c_size_t(0)
            if self.fail_idx:
                args.append(ctypes.byref(failed))
            args.append(ctypes.c_void_p(stream))
            err = self.fn(*args)
            if err != 0:
                msg = self.error_string(err).decode(errors="replace")
                raise RuntimeError(f"cudaMemcpyBatchAsync failed ({err}: {msg})")


def _load_cudart():
    """The ``libcudart`` loaded in this process (torch links one), else the one the loader finds."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    name = ctypes.util.find_library("cudart")
    if name is None:
        raise RuntimeError("no CUDA runtime library (libcudart) found")
    return ctypes.CDLL(name)


_runtime: Optional[_Runtime] = None
_runtime_lock = threading.Lock()


def _cuda_runtime() -> _Runtime:
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = _Runtime()
        return _runtime


def _location(buf: torch.Tensor) -> tuple[int, int]:
    if buf.device.type == "cuda":
        return _LOC_DEVICE, buf.device.index if buf.device.index is not None else torch.cuda.current_device()
    return _LOC_HOST, 0


def copy_pages(
    dsts: Sequence[torch.Tensor],
    dst_pages,
    srcs: Sequence[torch.Tensor],
    src_pages,
    page_rows: int,
    runs: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None,
) -> int:
    """Page ``src_pages[i]`` of every ``srcs[j]`` into page ``dst_pages[i]`` of ``dsts[j]`` (page numbers on the
    host: int64 tensors or arrays); returns the descriptors issued.  On CUDA (either side on the device; the
    host side pinned) one batched copy-engine call on the current stream, returning at once; on CPU, memmoves."""
    if runs is None:  # ``runs``: ``page_runs`` of these pages, computed once by a caller copying every layer
        runs = page_runs(_host_array(dst_pages), _host_array(src_pages))
    dst, src, nbytes = descriptors(dsts, srcs, runs, page_rows)
    if dst.size == 0:
        return 0
    on_cuda = [b for b in (*dsts, *srcs) if b.device.type == "cuda"]
    if not on_cuda:
        for d, s, n in zip(dst.tolist(), src.tolist(), nbytes.tolist()):
            ctypes.memmove(d, s, n)
        return int(dst.size)
    host = [b for b in (*dsts, *srcs) if b.device.type != "cuda"]
    if any(not b.is_pinned() for b in host):
        raise ValueError("copy_pages: host buffers must be pinned for copy-engine copies")
    st, si = _location(srcs[0])
    dt, di = _location(dsts[0])
    attrs = _Attrs(_SRC_ACCESS_ORDER_STREAM, st, si, dt, di, _PREFER_OVERLAP_WITH_COMPUTE)
    device = on_cuda[0].device
    current = torch.cuda.current_stream(device)
    if current.cuda_stream != 0:
        _cuda_runtime().batch(dst, src, nbytes, attrs, current.cuda_stream)
        return int(dst.size)
    # the legacy default stream, which the batched copy refuses: a side stream in its order, both ways
    side = _side_stream(device)
    side.wait_stream(current)
    _cuda_runtime().batch(dst, src, nbytes, attrs, side.cuda_stream)
    current.wait_stream(side)
    return int(dst.size)


_side_streams: dict = {}


def _side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _runtime_lock:
        if index not in _side_streams:
            _side_streams[index] = torch.cuda.Stream(index)
        return _side_streams[index]


def _host_array(pages) -> np.ndarray:
    if isinstance(pages, torch.Tensor):
        if pages.device.type != "cpu":
            raise ValueError("copy_pages: page numbers must be on the host for copy-engine copies")
        return pages.numpy()
    return np.asarray(pages)
