"""``nixl``: KV through a NIXL agent with the UCX backend.

Each worker runs one agent (a unique name per process).  Local regions are
registered once, as ``VRAM`` (CUDA pools) or ``DRAM`` (CPU pools and the aux
buffer).  Decode's ``local_info`` carries its agent metadata (base64), so the
bootstrap handshake is the metadata exchange: prefill ``add_remote_agent``s it
and writes with ``WRITE`` transfers built from (address, length, device)
descriptors.  After a room's last KV write has completed, one standalone
notification ``kvship-aux:<room>:<aux slot>:<aux record>`` carries the aux
record and the done signal (``send_aux_done``): decode's notification thread
puts the record in its aux slot and signals done.  To a peer that does not
advertise ``aux_in_done`` (an older worker) the aux record is a write whose
notification ``kvship-done:<room>`` NIXL delivers after that transfer's data
(``in_band_done = True``).

Authentication (docs/pd.md, "KV plane authentication"): decode's agent
metadata goes to prefill only after the control handshake authenticated it,
but UCX's own listener cannot be authenticated by kvship (NetworkPolicy
confines it).  A notification counts as a room's done signal only when the
aux record it carries (or the one already in the room's slot) has the room's
aux tag; anything else is ignored.

On CPU, UCX moves the bytes through shared memory.  Debian's
``ibverbs-providers`` makes UCX crash at process exit: keep it uninstalled or
run with ``UCX_MODULES=^ib``.  Packages: ``nixl`` (pulls ``nixl-cu12`` /
``nixl-cu13``; the CPU path needs no GPU).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from typing import Callable, Optional, Sequence

import numpy as np

from kvship.common.envs import ENV
from kvship.engine.disagg.auth import RoomKey
from kvship.engine.disagg.base import (
    KVTransferConfig,
    KVTransferError,
    MemoryRegion,
    TransferBackend,
    TransferDescs,
    backend_unavailable,
    register_transfer_backend,
)
from kvship.engine.disagg.wire import KVLayout

logger = logging.getLogger(__name__)

_HINT = "Install `nixl` (it pulls `nixl-cu12`/`nixl-cu13`; on CPU it runs over UCX shared memory)."
_NOTIF_PREFIX = b"kvship-done:"
_AUX_PREFIX = b"kvship-aux:"
_BUSY_POLL_S = 100e-6  # polling interval cap while a transfer is in flight / expected
_IDLE_POLL_S = 5e-3  # decode's notification polling with no room expected
_PUMP_S = 0.5  # prefill: progress the agent this long after an untracked notification ...
_PUMP_POLL_S = 1e-3  # ... this often (a queued message is rare: a lane still being wired up)


def _import_nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except (ImportError, OSError) as e:
        raise backend_unavailable("nixl", _HINT, e) from e
    try:
        from nixl._api import nixl_thread_sync_t

        strict = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    except ImportError:  # older releases: agent calls are serialized by our own lock anyway
        strict = None
    return nixl_agent, nixl_agent_config, strict


def _mem_type(region: MemoryRegion) -> str:
    return "VRAM" if region.device == "cuda" else "DRAM"


class _Peer:
    def __init__(self, agent_name: str, ptrs: np.ndarray, mem: list[str], dev: np.ndarray, aux_in_done: bool):
        self.agent_name = agent_name
        self.ptrs = ptrs
        self.mem = mem
        self.dev = dev
        self.aux_in_done = aux_in_done


def parse_notif(msg: bytes) -> Optional[tuple[int, Optional[tuple[int, bytes]]]]:
    """``(room, None)`` for ``kvship-done:<room>``, ``(room, (aux slot, record))`` for
    ``kvship-aux:<room>:<slot>:<record>``, None for anything else."""
    try:
        if msg.startswith(_NOTIF_PREFIX):
            return int(msg[len(_NOTIF_PREFIX) :]), None
        if msg.startswith(_AUX_PREFIX):
            room, slot, record = msg[len(_AUX_PREFIX) :].split(b":", 2)
            return int(room), (int(slot), bytes(record))
    except ValueError:  # a malformed message (not ours, or cut short): ignored like any foreign one
        return None
    return None


@register_transfer_backend("nixl")
class NixlBackend(TransferBackend):
    in_band_done = True

    @classmethod
    def check_available(cls) -> None:
        _import_nixl()

    def __init__(self, config: KVTransferConfig, role: str, regions: Sequence[MemoryRegion], layout: KVLayout):
        super().__init__(config, role, regions, layout)
        agent_cls, conf_cls, strict = _import_nixl()
        self.agent_name = f"kvship-{role}-{uuid.uuid4().hex[:16]}"
        # NIXL's UCX progress thread busy-polls a whole core per agent, even idle.  Both our sides poll
        # anyway (prefill checks its transfers, decode fetches notifications), which drives UCX progress,
        # so it stays off unless KVSHIP_NIXL_PROGRESS_THREAD=1.
        kwargs = {"backends": ["UCX"], "enable_prog_thread": ENV.NIXL_PROGRESS_THREAD}
        if strict is not None:
            kwargs["sync_mode"] = strict
        conf = conf_cls(**kwargs)
        self.agent = agent_cls(self.agent_name, conf)
        self._api_lock = threading.Lock()  # NIXL calls are short; serialize them
        self._ptrs = np.array([r.ptr for r in regions], dtype=np.int64)
        self._mem = [_mem_type(r) for r in regions]
        self._dev = np.array([r.device_id for r in regions], dtype=np.int64)
        self._reg_handles = []
        for mem in sorted(set(self._mem)):
            items = [(r.ptr, r.nbytes, r.device_id, "") for r, m in zip(regions, self._mem) if m == mem]
            self._reg_handles.append(self.agent.register_memory(items, mem))
        self._peers: dict[str, _Peer] = {}
        self._agent_refs: dict[str, int] = {}
        self._closed = threading.Event()
        self._notif_thread: Optional[threading.Thread] = None
        self._expected: set[int] = set()  # decode: rooms whose done notification may arrive
        self._wake = threading.Event()
        self._pump_thread: Optional[threading.Thread] = None  # prefill: see ``_pump``
        self._pump_wake = threading.Event()
        self._pump_until = 0.0

    def local_info(self) -> dict:
        return {
            "agent": self.agent_name,
            "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "ptrs": self._ptrs.tolist(),
            "mem": self._mem,
            "dev": self._dev.tolist(),
            "aux_in_done": True,
        }

    # -- prefill side ----------------------------------------------------------
    def add_peer(self, peer_id: str, info: dict) -> None:
        try:
            meta = base64.b64decode(info["metadata"])
            ptrs, mem = np.array(info["ptrs"], dtype=np.int64), [str(m) for m in info["mem"]]
            dev = np.array(info["dev"], dtype=np.int64)
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError(f"bad nixl endpoint: {e}") from e
        # the peer's regions may differ from ours in the features region (its Hello's layout says how many)
        if not (ptrs.ndim == 1 and ptrs.size == len(mem) == dev.size and ptrs.size >= 2):
            raise KVTransferError(f"nixl peer has {ptrs.size} regions, expected the K/V buffers and an aux buffer")
        with self._api_lock:
            name = str(info.get("agent", ""))
            if self._agent_refs.get(name, 0) == 0:
                got = self.agent.add_remote_agent(meta)
                name = got.decode() if isinstance(got, bytes) else str(got)
            self._agent_refs[name] = self._agent_refs.get(name, 0) + 1
            self._peers[peer_id] = _Peer(name, ptrs, mem, dev, info.get("aux_in_done") is True)

    def remove_peer(self, peer_id: str) -> None:
        with self._api_lock:
            peer = self._peers.pop(peer_id, None)
            if peer is None:
                return
            self._agent_refs[peer.agent_name] -= 1
            if self._agent_refs[peer.agent_name] == 0:
                del self._agent_refs[peer.agent_name]
                try:
                    self.agent.remove_remote_agent(peer.agent_name)
                except Exception as e:  # noqa: BLE001 - the peer is gone either way
                    logger.debug("nixl remove_remote_agent(%s): %s", peer.agent_name, e)

    def peer_takes_aux_in_done(self, peer_id: str) -> bool:
        with self._api_lock:
            peer = self._peers.get(peer_id)
        return peer is not None and peer.aux_in_done

    def send_aux_done(self, peer_id: str, key: RoomKey, aux_slot: int, record: bytes) -> None:
        room = key.room
        with self._api_lock:
            peer = self._peers.get(peer_id)
            if peer is None:
                raise KVTransferError(f"nixl peer {peer_id} is not known")
            try:
                self.agent.send_notif(peer.agent_name, _AUX_PREFIX + f"{room}:{aux_slot}:".encode() + record)
                # the room's writes were flushed before (a transfer is DONE once its data is remote), so this
                # lands after their data, as a transfer's own notification does.  The send is not tracked: a
                # message the transport queued (e.g. while its lane is wired up) leaves as the agent progresses,
                # so progress now and keep the pump progressing for a while (this side receives no
                # notifications: nothing is lost by fetching them)
                self.agent.get_new_notifs()
            except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
                raise KVTransferError(
                    f"nixl notification to {peer.agent_name} for room {room} failed: {type(e).__name__}: {e}"
                ) from e
            self._pump_until = time.monotonic() + _PUMP_S
            if self._pump_thread is None:
                self._pump_thread = threading.Thread(target=self._pump, name="kv-nixl-pump", daemon=True)
                self._pump_thread.start()
        self._pump_wake.set()

    def _pump(self) -> None:
        """Prefill: progress the agent for ``_PUMP_S`` after each untracked notification (``send_aux_done``)."""
        while not self._closed.is_set():
            if time.monotonic() >= self._pump_until:
                self._pump_wake.wait()
                self._pump_wake.clear()
                continue
            with self._api_lock:
                self.agent.get_new_notifs()
            time.sleep(_PUMP_POLL_S)

    def write(self, peer_id: str, key: RoomKey, descs: TransferDescs, done: bool = False) -> None:
        room = key.room
        with self._api_lock:
            peer = self._peers.get(peer_id)
        if peer is None:
            raise KVTransferError(f"nixl peer {peer_id} is not known")
        # one NIXL transfer per (local mem type, remote mem type) group; the notification rides on the last
        src_mem = np.array([self._mem[i] for i in descs.src_region.tolist()])
        dst_mem = np.array([peer.mem[i] for i in descs.dst_region.tolist()])
        groups = sorted(set(zip(src_mem.tolist(), dst_mem.tolist())))
        for gi, (sm, dm) in enumerate(groups):
            sel = (src_mem == sm) & (dst_mem == dm)
            local = np.stack(
                [
                    self._ptrs[descs.src_region[sel]] + descs.src_off[sel],
                    descs.length[sel],
                    self._dev[descs.src_region[sel]],
                ],
                axis=1,
            )
            remote = np.stack(
                [
                    peer.ptrs[descs.dst_region[sel]] + descs.dst_off[sel],
                    descs.length[sel],
                    peer.dev[descs.dst_region[sel]],
                ],
                axis=1,
            )
            notif = _NOTIF_PREFIX + str(room).encode() if done and gi == len(groups) - 1 else b""
            self._run_xfer(peer.agent_name, local, sm, remote, dm, notif, room)

    def _run_xfer(
        self, agent_name: str, local: np.ndarray, sm: str, remote: np.ndarray, dm: str, notif: bytes, room: int
    ) -> None:
        handle = None
        try:
            with self._api_lock:
                ldesc = self.agent.get_xfer_descs(local, sm)
                rdesc = self.agent.get_xfer_descs(remote, dm)
                handle = self.agent.initialize_xfer("WRITE", ldesc, rdesc, agent_name, notif)
                state = self.agent.transfer(handle, notif)
            delay = 0.0
            while state == "PROC":
                time.sleep(delay)
                delay = min(delay * 2 or 10e-6, _BUSY_POLL_S)
                with self._api_lock:
                    state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise KVTransferError(f"nixl WRITE to {agent_name} for room {room} ended in state {state}")
        except KVTransferError:
            raise
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types (e.g. remote disconnect)
            raise KVTransferError(f"nixl WRITE to {agent_name} for room {room} failed: {type(e).__name__}: {e}") from e
        finally:
            if handle is not None:
                with self._api_lock:
                    try:
                        self.agent.release_xfer_handle(handle)
                    except Exception as e:  # noqa: BLE001
                        logger.debug("nixl release_xfer_handle: %s", e)

    # -- decode side -----------------------------------------------------------
    def start_receiving(self, on_done: Callable[..., None]) -> None:
        def loop() -> None:
            idle = 0.0
            while not self._closed.is_set():
                with self._api_lock:
                    notifs = self.agent.get_new_notifs()
                got = False
                for msgs in notifs.values():
                    for msg in msgs:
                        parsed = parse_notif(msg)
                        if parsed is None:
                            continue
                        got = True
                        on_done(parsed[0], None, parsed[1])
                # poll fast while some room is expected (the notification is the done signal), slowly when idle
                cap = _BUSY_POLL_S if self._expected else _IDLE_POLL_S
                idle = 0.0 if got else min(idle * 2 or 10e-6, cap)
                if idle and cap == _IDLE_POLL_S:
                    self._wake.wait(idle)  # expect_room() wakes it early
                    self._wake.clear()
                elif idle:
                    time.sleep(idle)

        self._notif_thread = threading.Thread(target=loop, name="kv-nixl-notifs", daemon=True)
        self._notif_thread.start()

    def expect_room(self, key: RoomKey, dst_pages: np.ndarray, aux_slots: Sequence[int]) -> None:
        with self._api_lock:
            self._expected.add(key.room)
        self._wake.set()

    def forget_room(self, room: int) -> None:
        with self._api_lock:
            self._expected.discard(room)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        self._pump_wake.set()
        for t in (self._notif_thread, self._pump_thread):
            if t is not None:
                t.join(timeout=5)
        with self._api_lock:
            for name in list(self._agent_refs):
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001
                    pass
            self._agent_refs.clear()
            self._peers.clear()
            for h in self._reg_handles:
                try:
                    self.agent.deregister_memory(h)
                except Exception as e:  # noqa: BLE001
                    logger.debug("nixl deregister_memory: %s", e)
            self._reg_handles.clear()
