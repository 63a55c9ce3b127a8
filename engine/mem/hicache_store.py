"""The shared tier of the prefix cache (``--hicache-storage file|mooncake``; docs/cache.md, "Shared tier").

Pages leave a worker's radix cache for good when they are evicted from its
last tier (the host tier, or the device pool when there is none).  With a
shared store they are written there first, and a later prompt whose cached
prefix ends before its pages do asks the store for the next pages, on this
worker or on any other worker of the same model.

* **Keys.**  A page is named by its place in the page hash chain
  (``kvship.engine.mem.hicache_events.page_hashes``: the hash covers every
  token up to the end of the page) and a namespace: the model fingerprint
  (weights, dtypes, page size, engine version) and the rank's shard
  (``tp<T>pp<P>r<rank>``: each rank of a multi-rank worker stores its own
  heads / layers).  Workers of different models or layouts never read each
  other's pages.
* **Value.**  A 16-byte header (magic, payload length, CRC-32 of the payload)
  and the page's raw rows of every layer, in the device pool's dtype (FP8
  pools as bytes): K then V per layer for a ``KVPool``, the one latent row per
  layer for an ``MLAKVPool`` (DeepSeek; docs/deepseek.md).  A value of the
  wrong length or checksum is a miss.
* **No correctness dependence.**  Every store call that raises, times out or
  returns something unusable counts in ``storage_errors`` and acts as a miss
  (reads) or a skipped write: the prompt's pages are computed again.
* **Bandwidth.**  ``--hicache-storage-bandwidth-mb`` caps the bytes per
  second read and (separately) written; a write over the cap is skipped and a
  read stops at the cap (the rest is recomputed).  Nothing waits for budget.
* **Threads.**  Writes are gathered from the pools on the scheduler thread
  (the slots are freed right after) and put by one writer thread through a
  bounded queue (a full queue skips the write).  Reads run on the scheduler
  thread at admission, like the host tier's load-back, except for the pages
  already read ahead.
* **Prefetch.**  When a request joins the waiting queue, the radix cache hands
  the store the hashes of its pages past what the worker holds
  (``prefetch``); a reader thread asks the store which it has and reads the
  leading ones into a bounded staging area in host memory
  (``--hicache-storage-prefetch-mb``; the oldest staged pages go first when it
  is full).  At admission ``lookup`` and ``load`` take staged pages without a
  store call (a staged page leaves the staging area when it is loaded), and
  read only the rest.  A prefetch that finds its queue full is dropped: the
  pages are then read at admission, as without prefetch.

``KVPageStore`` is the backend contract; ``FilePageStore`` (one file per page
in a directory, a shared volume for several workers) and
``MooncakePageStore`` (Mooncake Store: the ``mooncake`` package's
``MooncakeDistributedStore`` client of a ``mooncake_master`` service) are the
two backends.  ``StorageTier`` is what the radix cache talks to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch

from kvship.engine.mem.hicache import buffers_per_layer, layer_buffers

logger = logging.getLogger(__name__)

_MAGIC = b"KVSP"
_HEADER = struct.Struct("<4sIQ")  # magic, crc32, payload length
STORAGE_BACKENDS = ("file", "mooncake")
MIB = 1 << 20


class StoreError(RuntimeError):
    """A store backend could not be set up (bad path, unreachable master): raised at start-up."""


# --- backends ------------------------------------------------------------------------------------------------------


class KVPageStore(ABC):
    """A key -> bytes store.  Methods may raise; ``StorageTier`` turns every failure into a miss."""

    name = "store"

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def get(self, key: str) -> Optional[bytes]:
        """The value, or None when the key is absent."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> None: ...

    def close(self) -> None:
        return None


class FilePageStore(KVPageStore):
    """One file per page under ``root`` (``<root>/<namespace>/<hash>.kv``), at most ``capacity_bytes`` in all.

    Writes are atomic (a temporary file in the same directory, then ``os.replace``), so a reader on
    another worker sees a whole page or none.  A read touches the file's mtime; when the bytes this
    process wrote since the last scan push the directory past the cap, the oldest files by mtime are
    deleted until it holds 90% of the cap (several workers sharing the directory each enforce it).
    """

    name = "file"

    def __init__(self, root: str, capacity_bytes: int):
        if not root:
            raise StoreError("--hicache-storage file needs --hicache-storage-path (a directory)")
        if capacity_bytes <= 0:
            raise StoreError("--hicache-storage-size-gb must be > 0 for the file store")
        self.root = os.path.abspath(root)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise StoreError(f"--hicache-storage-path {root!r}: cannot create the directory: {e}") from e
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreError(f"--hicache-storage-path {root!r} is not writable")
        self.capacity = int(capacity_bytes)
        self._since_scan = self.capacity  # scan on the first write: the directory may hold older pages
        self._lock = threading.Lock()

    def _path(self, key: str) -> str:
        ns, _, name = key.rpartition("/")
        return os.path.join(self.root, ns, name + ".kv")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.exists(self._path(k)) for k in keys]

    def get(self, key: str) -> Optional[bytes]:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass  # deleted by another worker's cap meanwhile: the bytes read are still whole
        return data

    def put(self, key: str, value: bytes) -> None:
        path = self._path(key)
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        with self._lock:
            self._since_scan += len(value)
            if self._since_scan >= self.capacity // 10:
                self._since_scan = 0
                self._enforce_cap()

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _files(self) -> list[tuple[float, int, str]]:
        out = []
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                if not n.endswith(".kv"):
                    continue
                p = os.path.join(dirpath, n)
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                out.append((st.st_mtime, st.st_size, p))
        return out

    def _enforce_cap(self) -> None:
        files = self._files()
        total = sum(s for _, s, _ in files)
        if total <= self.capacity:
            return
        target = self.capacity * 9 // 10
        for _, size, p in sorted(files):
            try:
                os.unlink(p)
            except FileNotFoundError:
                continue
            total -= size
            if total <= target:
                break


def _import_mooncake_store():
    try:
        from mooncake.store import MooncakeDistributedStore
    except (ImportError, OSError) as e:
        raise StoreError(
            f"--hicache-storage mooncake needs the mooncake package's store (mooncake.store): {e}. Install "
            "`mooncake-transfer-engine-non-cuda` (CPU) or `mooncake-transfer-engine-cuda13`."
        ) from e
    return MooncakeDistributedStore


class MooncakePageStore(KVPageStore):
    """Pages in Mooncake Store.

    ``master``: the ``mooncake_master`` RPC address ``host:port``; ``metadata``: its metadata service
    (``http://host:port/metadata`` of the master's ``--enable_http_metadata_server``, or etcd).  This
    worker contributes ``segment_bytes`` of its memory to the store (the store's capacity is the sum of
    its clients' segments; a client's pages go with its segment when it exits) over ``protocol``
    (``tcp``, or ``rdma`` on ``rdma_devices``).
    """

    name = "mooncake"

    def __init__(
        self,
        master: str,
        metadata: str,
        segment_bytes: int,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        rdma_devices: str = "",
        buffer_bytes: int = 64 * MIB,
    ):
        if not master or ":" not in master:
            raise StoreError("--hicache-storage mooncake needs --hicache-storage-master HOST:PORT (mooncake_master)")
        cls = _import_mooncake_store()
        self._store = cls()
        rc = self._store.setup(
            local_hostname, metadata, int(segment_bytes), int(buffer_bytes), protocol, rdma_devices, master
        )
        if rc != 0:
            raise StoreError(
                f"Mooncake Store setup failed (rc {rc}): master {master}, metadata {metadata}; is mooncake_master "
                "running with that RPC port and metadata service? (docs/cache.md, 'Shared tier')"
            )

    def exists(self, keys: Sequence[str]) -> list[bool]:
        res = self._store.batch_is_exist(list(keys))
        if any(r < 0 for r in res):
            raise RuntimeError(f"Mooncake Store batch_is_exist failed: {res}")
        return [r == 1 for r in res]

    def get(self, key: str) -> Optional[bytes]:
        data = self._store.get(key)
        return bytes(data) if data else None

    def put(self, key: str, value: bytes) -> None:
        rc = self._store.put(key, value)
        if rc != 0:
            raise RuntimeError(f"Mooncake Store put of {key} failed with rc {rc}")

    def close(self) -> None:
        self._store.close()


class ReconnectingStore(KVPageStore):
    """A store whose backend connects in the background (a Mooncake client's set-up blocks for about 90 s when
    its master does not answer): until ``connect`` succeeds every page is a miss and every write fails (counted
    by the tier; the pages are recomputed), and a thread retries ``connect``, first at once, then every
    ``retry_s`` seconds, doubling to ``max_retry_s``.  A worker thus starts, and serves, without its store and
    takes the store up once it answers: a store failure costs recompute, never the worker (docs/cache.md,
    "Shared tier")."""

    def __init__(self, name: str, connect: Callable[[], KVPageStore], retry_s: float = 5.0, max_retry_s: float = 60.0):
        self.name = name
        self._connect = connect
        self._store: Optional[KVPageStore] = None
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._lock = threading.Lock()  # the store is taken up or closed, never both at once
        self._thread = threading.Thread(
            target=self._run, args=(retry_s, max_retry_s), name="kvship-hicache-connect", daemon=True
        )
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self._store is not None

    def wait_connected(self, timeout: Optional[float] = None) -> bool:
        return self._connected.wait(timeout)

    def _run(self, delay: float, max_delay: float) -> None:
        wait = 0.0
        while not self._stop.wait(wait):
            try:
                store = self._connect()
            except StoreError as e:
                if wait == 0.0:
                    logger.warning("KV store (%s) unavailable: %s; retrying every %.0f s or more", self.name, e, delay)
                wait = delay if wait == 0.0 else min(2 * wait, max_delay)
                continue
            with self._lock:
                if self._stop.is_set():
                    store.close()
                    return
                self._store = store
            self._connected.set()
            logger.info("KV store (%s) connected", self.name)
            return

    def _backend(self) -> KVPageStore:
        store = self._store
        if store is None:
            raise StoreError(f"the {self.name} store is not connected yet")
        return store

    def exists(self, keys: Sequence[str]) -> list[bool]:
        store = self._store
        return [False] * len(keys) if store is None else store.exists(keys)

    def get(self, key: str) -> Optional[bytes]:
        store = self._store
        return None if store is None else store.get(key)

    def put(self, key: str, value: bytes) -> None:
        self._backend().put(key, value)

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            store, self._store = self._store, None
        if store is not None:
            store.close()
        self._thread.join(timeout=1.0)  # a set-up in progress may block longer: the thread closes its store


def mooncake_metadata_url(master: str, metadata: Optional[str]) -> str:
    """The metadata service: ``metadata`` when given, else the master host's HTTP metadata server on 8080
    (``mooncake_master --enable_http_metadata_server``'s default port)."""
    if metadata:
        return metadata
    host = master.rsplit(":", 1)[0]
    return f"http://{host}:8080/metadata"


# --- the tier ------------------------------------------------------------------------------------------------------


class ByteBudget:
    """A token bucket: ``rate`` bytes/s, bursts up to one second of it (at least ``min_burst``); 0 = no cap."""

    def __init__(self, rate: float, min_burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate = float(rate)
        self.burst = max(self.rate, float(min_burst))
        self.clock = clock
        self.tokens = self.burst
        self.t = clock()
        self._lock = threading.Lock()  # the scheduler and the prefetch thread both read

    def take(self, n: int) -> bool:
        if self.rate <= 0:
            return True
        with self._lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
            self.t = now
            if self.tokens < n:
                return False
            self.tokens -= n
            return True


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class StorageTier:
    """Pages of one rank's KV pool (a ``KVPool`` or an ``MLAKVPool``) in a ``KVPageStore`` (module docstring).

    ``namespace``: the key prefix (fingerprint + shard); ``bandwidth``: bytes/s per direction (0: no cap);
    ``agree``: the smallest of an int over every rank of a multi-rank worker (identity for one rank), so
    all ranks load the same pages and keep scheduling the same slots; ``prefetch_bytes``: the staging area of
    pages read ahead for queued requests (0: no prefetch, no reader thread).
    """

    def __init__(
        self,
        store: KVPageStore,
        device_pool,
        namespace: str,
        bandwidth: float = 0.0,
        agree: Optional[Callable[[int], int]] = None,
        queue_pages: int = 256,
        known_keys: int = 1 << 16,
        prefetch_bytes: int = 0,
        prefetch_jobs: int = 64,
    ):
        self.store = store
        self.pool = device_pool
        self.page_size = device_pool.page_size
        self.namespace = namespace
        self.agree = agree or (lambda n: n)
        elem = torch.empty((), dtype=device_pool.dtype).element_size()
        self.row_shape = (device_pool.num_kv_heads, device_pool.head_dim)
        self.buffers_per_layer = buffers_per_layer(device_pool)  # K and V, or the one latent row
        self.page_bytes = (
            self.buffers_per_layer
            * device_pool.num_layers
            * self.page_size
            * device_pool.num_kv_heads
            * device_pool.head_dim
            * elem
        )
        self.read_budget = ByteBudget(bandwidth, self.page_bytes)
        self.write_budget = ByteBudget(bandwidth, self.page_bytes)
        self._known: OrderedDict[str, None] = OrderedDict()  # keys this worker put or read (skip re-writing them)
        self._known_cap = known_keys
        self._queue: queue.Queue = queue.Queue(maxsize=queue_pages)
        self._lock = threading.Lock()
        self.hit_tokens = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.writes_skipped = 0
        self.errors = 0
        self._last_error_log = 0.0
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kvship-hicache-store", daemon=True)
        self._writer.start()
        # read-ahead: key -> payload, oldest first, at most ``prefetch_bytes`` (whole pages)
        self._staged: OrderedDict[str, bytes] = OrderedDict()
        self.staged_cap = int(prefetch_bytes) // self.page_bytes if self.page_bytes else 0
        self.prefetched = 0  # pages read ahead
        self.prefetch_hits = 0  # pages loaded from the staging area
        self.prefetch_dropped = 0  # prefetches that found the queue full
        self._reader: Optional[threading.Thread] = None
        if self.staged_cap > 0:
            self._prefetch_q: queue.Queue = queue.Queue(maxsize=prefetch_jobs)
            self._reader = threading.Thread(target=self._prefetch_loop, name="kvship-hicache-prefetch", daemon=True)
            self._reader.start()

    # --- keys / values ---------------------------------------------------------------------------------------------
    def key(self, page_hash: int) -> str:
        return f"{self.namespace}/{page_hash & 0xFFFFFFFFFFFFFFFF:016x}"

    def _pack(self, payload: bytes) -> bytes:
        return _HEADER.pack(_MAGIC, zlib.crc32(payload), len(payload)) + payload

    def _unpack(self, data: Optional[bytes]) -> Optional[bytes]:
        if data is None or len(data) != _HEADER.size + self.page_bytes:
            return None
        magic, crc, n = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        if magic != _MAGIC or n != self.page_bytes or zlib.crc32(payload) != crc:
            return None
        return payload

    def _error(self, what: str, e: BaseException) -> None:
        with self._lock:
            self.errors += 1
        now = time.monotonic()
        if now - self._last_error_log > 10.0:
            self._last_error_log = now
            logger.warning("KV store (%s) %s failed: %s (the pages are recomputed)", self.store.name, what, e)

    def _remember(self, key: str) -> None:
        with self._lock:
            self._known[key] = None
            self._known.move_to_end(key)
            while len(self._known) > self._known_cap:
                self._known.popitem(last=False)

    def _is_known(self, key: str) -> bool:
        with self._lock:
            return key in self._known

    # --- writes (eviction) -----------------------------------------------------------------------------------------
    def save(self, hashes: Sequence[int], slots: torch.Tensor, source) -> int:
        """Queue the pages ``hashes`` (whose rows are ``slots`` of ``source``: the device pool or the host
        tier's ``HostKVPool``) for the store; returns how many were queued.  Pages the store already
        holds (put or read by this worker), pages over the write bandwidth and pages that find the queue
        full are skipped."""
        ps = self.page_size
        todo = []
        for i, h in enumerate(hashes):
            key = self.key(h)
            if self._is_known(key):
                continue
            if not self.write_budget.take(self.page_bytes):
                self.writes_skipped += len(hashes) - i - len(todo)
                break
            todo.append((i, key))
        if not todo:
            return 0
        idx = torch.cat([slots[i * ps : (i + 1) * ps] for i, _ in todo]).to(self.pool.device)
        layers = []
        for bufs in layer_buffers(source):
            for b in bufs:
                layers.append(_raw(b).index_select(0, idx.to(b.device)).cpu())
        rows = torch.stack(layers).view(torch.uint8)  # [buffers per layer * layers, pages * ps, heads, dim * elem]
        queued = 0
        for j, (_, key) in enumerate(todo):
            payload = rows[:, j * ps : (j + 1) * ps].contiguous().numpy().tobytes()
            try:
                self._queue.put_nowait((key, self._pack(payload)))
                queued += 1
            except queue.Full:
                self.writes_skipped += 1
        return queued

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, value = item
                try:
                    if not self.store.exists([key])[0]:
                        self.store.put(key, value)
                        with self._lock:
                            self.bytes_written += len(value) - _HEADER.size
                    self._remember(key)
                except Exception as e:  # a failing store costs the page only
                    self._error("write", e)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued write reached the store (or failed)."""
        self._queue.join()

    # --- read-ahead (queued requests) ------------------------------------------------------------------------------
    def prefetch(self, hashes: Sequence[int]) -> bool:
        """Read the pages ``hashes`` (a prompt's pages past what the worker holds, in order) into the staging area
        in the background; False when prefetch is off or its queue is full (the pages are read at admission)."""
        if self._reader is None or not hashes or self._closed:
            return False
        try:
            self._prefetch_q.put_nowait([self.key(h) for h in hashes[: self.staged_cap]])
            return True
        except queue.Full:
            with self._lock:
                self.prefetch_dropped += 1
            return False

    def _prefetch_loop(self) -> None:
        while True:
            keys = self._prefetch_q.get()
            try:
                if keys is None:
                    return
                self._read_ahead(keys)
            except Exception as e:  # a failing store costs the read-ahead only
                self._error("prefetch", e)
            finally:
                self._prefetch_q.task_done()

    def _read_ahead(self, keys: list[str]) -> None:
        """Stage the leading pages of ``keys`` the store holds; stops at the first miss, damaged page or the read
        bandwidth cap."""
        with self._lock:
            todo = [i for i, k in enumerate(keys) if k not in self._staged]
        if not todo:
            return
        present = self.store.exists([keys[i] for i in todo])
        for i, ok in zip(todo, present):
            if not ok:
                return
            key = keys[i]
            with self._lock:
                if key in self._staged:
                    continue
            if not self.read_budget.take(self.page_bytes):
                return
            payload = self._unpack(self.store.get(key))
            if payload is None:
                return
            with self._lock:
                self._staged[key] = payload
                self._staged.move_to_end(key)
                while len(self._staged) > self.staged_cap:
                    self._staged.popitem(last=False)
                self.prefetched += 1

    def _take_staged(self, key: str) -> Optional[bytes]:
        with self._lock:
            payload = self._staged.pop(key, None)
            if payload is not None:
                self.prefetch_hits += 1
            return payload

    def staged_pages(self) -> int:
        with self._lock:
            return len(self._staged)

    def flush_prefetch(self) -> None:
        """Wait until every queued read-ahead is done (tests)."""
        if self._reader is not None:
            self._prefetch_q.join()

    # --- reads (prefix match) --------------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> int:
        """How many leading pages of ``hashes`` are staged or in the store (the store's capped by the read
        bandwidth), agreed by all ranks."""
        keys = [self.key(h) for h in hashes]
        with self._lock:
            staged = 0
            while staged < len(keys) and keys[staged] in self._staged:
                staged += 1
        n = staged
        if n < len(keys):
            try:
                present = self.store.exists(keys[n:])
                while n < len(keys) and present[n - staged]:
                    n += 1
            except Exception as e:
                self._error("lookup", e)
        k = staged  # staged pages were paid for when they were read ahead
        while k < n and self.read_budget.take(self.page_bytes):
            k += 1
        return self.agree(k)

    def load(self, hashes: Sequence[int], gpu_slots: torch.Tensor) -> int:
        """Read the pages ``hashes`` into ``gpu_slots`` (``len(hashes)`` whole pages) in order, stopping at the
        first page that is missing or damaged; returns how many were loaded, agreed by all ranks (a rank
        that loaded more leaves the extra slots unused: the caller frees them)."""
        ps = self.page_size
        payloads = []
        for h in hashes:
            key = self.key(h)
            p = self._take_staged(key)
            if p is None:
                try:
                    p = self._unpack(self.store.get(key))
                except Exception as e:
                    self._error("read", e)
                    p = None
            if p is None:
                break
            payloads.append(p)
            self._remember(key)
        n = self.agree(len(payloads))
        if n:
            heads, dim = self.row_shape
            buf = torch.frombuffer(bytearray(b"".join(payloads[:n])), dtype=torch.uint8)
            # per page [B * layers, ps, heads, dim * elem] -> [B * layers, n * ps, heads, dim * elem], with B the
            # buffers per layer (2: K and V; 1: the latent row)
            nb = self.buffers_per_layer * self.pool.num_layers
            rows = buf.view(n, nb, ps, heads, -1).transpose(0, 1).reshape(nb, n * ps, heads, -1)
            dst = gpu_slots[: n * ps].to(self.pool.device)
            cuda = self.pool.device.type == "cuda"
            for layer, bufs in enumerate(layer_buffers(self.pool)):
                for j, dbuf in enumerate(bufs):
                    src = rows[self.buffers_per_layer * layer + j].view(_raw(dbuf).dtype)
                    if cuda:
                        src = src.pin_memory().to(self.pool.device, non_blocking=True)
                    _raw(dbuf).index_copy_(0, dst, src)
            self.bytes_read += n * self.page_bytes
            self.hit_tokens += n * ps
        return n

    def stats(self) -> dict:
        with self._lock:
            written, errors = self.bytes_written, self.errors
            prefetch = (self.prefetched, self.prefetch_hits, self.prefetch_dropped, len(self._staged))
        return {
            "storage_backend": self.store.name,
            "storage_hit_tokens": self.hit_tokens,
            "storage_bytes_read": self.bytes_read,
            "storage_bytes_written": written,
            "storage_writes_skipped": self.writes_skipped,
            "storage_errors": errors,
            "storage_connected": bool(getattr(self.store, "connected", True)),
            "storage_prefetched_pages": prefetch[0],
            "storage_prefetch_hit_pages": prefetch[1],
            "storage_prefetch_dropped": prefetch[2],
            "storage_staged_pages": prefetch[3],
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=10)
        if self._reader is not None:
            with contextlib.suppress(queue.Full):
                self._prefetch_q.put(None, timeout=10)
            self._reader.join(timeout=10)
        with self._lock:
            self._staged.clear()
        try:
            self.store.close()
        except Exception as e:
            self._error("close", e)


def storage_namespace(server_args, model_runner) -> str:
    """``<fingerprint>/tp<T>pp<P>r<rank>``: the model and the shard this rank's pages belong to."""
    from kvship.engine.fingerprint import fingerprint_for

    groups = model_runner.groups
    rank = 0 if groups is None else groups.world.rank
    return f"{fingerprint_for(server_args).hex}/tp{server_args.tp_size}pp{server_args.pp_size}r{rank}"


def make_page_store(server_args) -> KVPageStore:
    """The backend of ``--hicache-storage`` (raises ``StoreError`` with the reason when it cannot start)."""
    kind = server_args.hicache_storage
    size = int(server_args.hicache_storage_size_gb * (1 << 30))
    if kind == "file":
        return FilePageStore(server_args.hicache_storage_path or "", size)
    if kind == "mooncake":
        from kvship.engine.disagg.base import advertise_host

        _import_mooncake_store()  # a missing package is a set-up error; a master that does not answer is not
        master = server_args.hicache_storage_master or ""
        if not master or ":" not in master:
            raise StoreError("--hicache-storage mooncake needs --hicache-storage-master HOST:PORT (mooncake_master)")
        metadata = mooncake_metadata_url(master, server_args.hicache_storage_metadata)
        # what the other workers' store clients reach this one's segment at: for a wildcard bind the pod IP the
        # operator sets (KVSHIP_ADVERTISE_HOST), never 127.0.0.1, which is each pod's own loopback
        local = advertise_host(server_args.host)
        return ReconnectingStore("mooncake", lambda: MooncakePageStore(master, metadata, size, local_hostname=local))
    raise StoreError(f"unknown --hicache-storage {kind!r} (choose from {STORAGE_BACKENDS})")


def storage_tier_for(server_args, model_runner) -> Optional[StorageTier]:
    """The shared tier of a worker's scheduler (None without ``--hicache-storage``)."""
    if server_args.hicache_storage in ("", "none", None):
        return None
    groups = model_runner.groups
    agree = None if groups is None else groups.world.min_int
    return StorageTier(
        make_page_store(server_args),
        model_runner.kv_pool,
        storage_namespace(server_args, model_runner),
        bandwidth=server_args.hicache_storage_bandwidth_mb * MIB,
        agree=agree,
        prefetch_bytes=int(server_args.hicache_storage_prefetch_mb * MIB),
    )
