"""``mooncake``: KV through Mooncake's TransferEngine (RDMA, or TCP without an RDMA NIC).

Each worker runs one engine, initialized with ``P2PHANDSHAKE`` metadata (no
etcd: peers find each other by ``host:rpc_port``, the *session*), protocol
``rdma`` on ``--disaggregation-ib-device`` or ``tcp`` otherwise.  All local
regions (K/V buffers, aux buffer) are registered once at construction.

Decode's ``local_info`` is its session and the base addresses of its regions
(sent only after the control handshake authenticated prefill; Mooncake's own
RPC and transport listeners cannot be authenticated by kvship: NetworkPolicy
confines them, docs/pd.md "KV plane authentication");
prefill turns descriptors into absolute addresses and calls
``batch_transfer_sync_write`` (which returns once the data is in decode's
memory), so the done signal travels on the control connection afterwards
(``in_band_done = False``).

Mooncake's tcp protocol (0.3.13) overflows its lane queue on a batch of more
than ~2048 descriptors and then fails later batches too, so writes go out in
chunks of at most ``KVSHIP_MOONCAKE_MAX_BATCH`` (default 1024) descriptors,
one chunk at a time per peer.

Packages: ``mooncake-transfer-engine-non-cuda`` on CPU machines (needs Debian's
``libibverbs1``, installed with ``--no-install-recommends``) or
``mooncake-transfer-engine-cuda13`` with CUDA.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np

from kvship.common.envs import ENV
from kvship.engine.disagg.auth import RoomKey
from kvship.engine.disagg.base import (
    KVTransferConfig,
    KVTransferError,
    MemoryRegion,
    TransferBackend,
    TransferDescs,
    advertise_host,
    backend_unavailable,
    register_transfer_backend,
)
from kvship.engine.disagg.wire import KVLayout

logger = logging.getLogger(__name__)

_HINT = (
    "Install `mooncake-transfer-engine-non-cuda` (CPU; needs `apt-get install -y --no-install-recommends "
    "libibverbs1`) or `mooncake-transfer-engine-cuda13` (CUDA 13)."
)


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as e:
        raise backend_unavailable("mooncake", _HINT, e) from e
    return TransferEngine


@register_transfer_backend("mooncake")
class MooncakeBackend(TransferBackend):
    in_band_done = False

    @classmethod
    def check_available(cls) -> None:
        _import_engine()

    def __init__(self, config: KVTransferConfig, role: str, regions: Sequence[MemoryRegion], layout: KVLayout):
        super().__init__(config, role, regions, layout)
        engine_cls = _import_engine()
        self.max_batch = ENV.MOONCAKE_MAX_BATCH
        self.protocol = "rdma" if config.ib_device else "tcp"
        host = advertise_host(config.host)
        self.engine = engine_cls()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", self.protocol, config.ib_device or "")
        if rc != 0:
            raise KVTransferError(
                f"mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', "
                f"{self.protocol!r}, {config.ib_device or ''!r}) failed with rc {rc}"
            )
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._ptrs = np.array([r.ptr for r in regions], dtype=np.int64)
        rc = self.engine.batch_register_memory([r.ptr for r in regions], [r.nbytes for r in regions])
        if rc != 0:
            raise KVTransferError(f"mooncake could not register the KV buffers (rc {rc})")
        self._registered = True
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[str, np.ndarray, threading.Lock]] = {}
        logger.info(
            "mooncake TransferEngine session %s, protocol %s, %d regions registered",
            self.session,
            self.protocol,
            len(regions),
        )

    def local_info(self) -> dict:
        return {"session": self.session, "ptrs": self._ptrs.tolist()}

    def add_peer(self, peer_id: str, info: dict) -> None:
        try:
            session, ptrs = str(info["session"]), np.array(info["ptrs"], dtype=np.int64)
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError(f"bad mooncake endpoint {info!r}") from e
        # the peer's regions may differ from ours in the features region (its Hello's layout says how many)
        if ptrs.ndim != 1 or ptrs.size < 2:
            raise KVTransferError(f"mooncake peer has {ptrs.size} regions, expected the K/V buffers and an aux buffer")
        with self._lock:
            self._peers[peer_id] = (session, ptrs, threading.Lock())

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            self._peers.pop(peer_id, None)

    def write(self, peer_id: str, key: RoomKey, descs: TransferDescs, done: bool = False) -> None:
        room = key.room
        with self._lock:
            peer = self._peers.get(peer_id)
        if peer is None:
            raise KVTransferError(f"mooncake peer {peer_id} is not known")
        session, remote, lock = peer
        src = (self._ptrs[descs.src_region] + descs.src_off).tolist()
        dst = (remote[descs.dst_region] + descs.dst_off).tolist()
        lengths = descs.length.tolist()
        with lock:
            for i in range(0, len(lengths), self.max_batch):
                j = i + self.max_batch
                rc = self.engine.batch_transfer_sync_write(session, src[i:j], dst[i:j], lengths[i:j])
                if rc != 0:
                    raise KVTransferError(
                        f"mooncake batch_transfer_sync_write to {session} failed (rc {rc}) for room {room}"
                    )

    def close(self) -> None:
        if getattr(self, "_registered", False):
            self._registered = False
            try:
                self.engine.batch_unregister_memory([r.ptr for r in self.regions])
            except Exception as e:  # noqa: BLE001 - best effort at shutdown
                logger.debug("mooncake unregister failed: %s", e)
