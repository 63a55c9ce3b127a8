"""The KV transfer contract between a prefill worker and a decode worker.

* One :class:`KVManager` per worker process (per TP rank) owns the transfer
  backend, the registered ``KVPool`` buffers and the control plane; it is built
  by ``kvship.engine.disagg.create_kv_manager``.
* One :class:`KVSender` per request on prefill, one :class:`KVReceiver` per
  request on decode, both named by the router's random 63-bit
  ``bootstrap_room``.  Their class docstrings give each side's life cycle.
* Both planes are authenticated (docs/pd.md, "KV plane authentication";
  :mod:`kvship.engine.disagg.auth`): control and tcp data connections start with
  an HMAC challenge-response on the KV transfer secret (``KVTransferConfig.secret``),
  and each room carries the tags of its ``bootstrap_token`` (``create_sender`` /
  ``create_receiver`` take it; required unless ``KVTransferConfig.insecure``).
* :class:`TransferBackend` is the data plane (how bytes move), looked up by name
  (``tcp``, ``mooncake``, ``nixl``) in a registry that imports its module
  lazily; a missing package raises :class:`BackendUnavailableError` naming it.

Invariants every implementation keeps:

* **A terminal state (Success or Failed) means the transfer layer no longer
  touches that request's pages on this side.**  The scheduler frees (or caches)
  them as soon as ``poll()`` returns one, and must not free them before.
* Every path ends in a terminal state (peer death, timeouts, layout or
  page-count mismatch, checksum mismatch, backend errors, aborts on either
  side); ``failure_reason`` then says why.
* ``poll()`` never blocks on the network.  ``poll()``, ``send()``, ``init()``
  and ``abort()`` are called from one thread (normally the scheduler's); the
  manager's own threads update the objects under a lock.
* Page lists are KV **page indices** (``slot // page_size``) of each side's own
  pool, in prompt order; both sides' lists have the same length and never name
  page 0 (the padding page).  Whole pages travel.
* A worker may register one :class:`SlotFeatures` buffer (a vector per KV
  slot, e.g. an EAGLE head's features, docs/speculative.md "PD").  Its
  pages travel with the K/V pages when both sides registered features of the
  same ``kind``, width and dtype; otherwise the transfer moves K/V alone and
  each side logs why (never a failure: the features only speed drafting up).
"""

from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar, Optional, Sequence

import numpy as np
import torch

from kvship.common.cli_args import opt

if TYPE_CHECKING:
    from kvship.engine.disagg.auth import RoomKey
    from kvship.engine.disagg.layerwise import LayerProgress
    from kvship.engine.disagg.wire import AuxRecord, KVLayout


class KVPoll(enum.IntEnum):
    """Transfer state of one request, as ``poll()`` reports it."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def is_terminal(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


class KVTransferError(RuntimeError):
    """A transfer could not be carried out (the message says why)."""


class BackendUnavailableError(ImportError):
    """The requested transfer backend's package is not installed or cannot load."""


@dataclass(frozen=True)
class KVTransferConfig:
    """Settings of one worker's KV transfer layer (derived from ``ServerArgs``)."""

    backend: str = opt("tcp", "Transfer backend", choices=("tcp", "mooncake", "nixl"))
    host: str = opt("127.0.0.1", "Address this worker advertises (and binds) for bootstrap and transfer")
    bootstrap_port: int = opt(8998, "Prefill: bootstrap server port (0 picks a free one)")
    ib_device: Optional[str] = opt(None, "Mooncake: RDMA device(s); protocol rdma when set, tcp otherwise")
    bootstrap_timeout: float = opt(300.0, "Seconds until a room must be registered / the handshake done")
    waiting_timeout: float = opt(300.0, "Decode: seconds from registration until the KV must have arrived")
    heartbeat_interval: float = opt(5.0, "Seconds between control-connection pings")
    heartbeat_timeout: float = opt(20.0, "A control connection silent this long is declared dead")
    abort_ack_timeout: float = opt(30.0, "Decode: most seconds an abort waits for prefill's acknowledgement")
    connect_timeout: float = opt(10.0, "Decode: TCP connect timeout to a prefill bootstrap server")
    checksum: bool = opt(False, "Decode asks for a per-request KV checksum and verifies it")
    transfer_threads: int = opt(2, "Prefill: threads that run transfers")
    layerwise: bool = opt(
        True, "Prefill: write a prompt's KV layer by layer while its last chunk computes (docs/pd.md, Layer-wise)"
    )
    layerwise_writes: int = opt(
        4,
        "Prefill: a layer-wise send writes a prompt's layers in about this many groups, each once its last layer "
        "is stored (fewer transfer calls competing with the forward's thread); 0 = one write per stored layer",
    )
    max_inflight: int = opt(4096, "Decode: most receivers at once (aux slots)")
    tp_size: int = opt(1, "Tensor-parallel size of this worker (the peer's may differ: heads are sliced)")
    tp_rank: int = opt(0, "Tensor-parallel rank of this worker")
    total_kv_heads: int = opt(0, "The model's KV heads (0: this pool's heads times tp_size)")
    pp_size: int = opt(
        1, "Pipeline-parallel size of this worker (its ranks are stage-major: pp_rank * tp_size + tp_rank)"
    )
    pp_rank: int = opt(0, "Pipeline stage of this rank")
    layer_start: int = opt(0, "First model layer this rank's pool holds (its pipeline stage's)")
    model_layers: int = opt(0, "The model's layers (0: this pool's layers, the whole model)")
    fingerprint: str = opt("", "Model fingerprint (kvship.engine.fingerprint) sent in Hello/Welcome; '' = unchecked")
    # KV-plane authentication (docs/pd.md, "KV plane authentication"; kvship.engine.disagg.auth)
    secret: Optional[bytes] = field(
        default=None, repr=False, metadata={"cli": False, "help": "The KV transfer secret (never shown)"}
    )
    insecure: bool = opt(False, "No KV-plane authentication (both sides must agree); measurement / trusted hosts only")
    handshake_timeout: float = opt(
        5.0, "Seconds a peer has, from connecting, to finish authenticating (bootstrap and tcp data ports)"
    )
    data_idle_timeout: float = opt(
        600.0,
        "tcp: decode closes a data connection idle this long between frames; prefill replaces one idle for half "
        "of it before its next frame",
    )
    max_connections: int = opt(256, "Most concurrent connections on the bootstrap port and on the tcp data port each")
    max_handshakes: int = opt(32, "Of those, most still authenticating; a connection over either limit is closed")

    @property
    def auth_mode(self) -> str:
        """What this side's handshake says: ``hmac-sha256`` (authentication on) or ``none``."""
        return "none" if self.insecure else "hmac-sha256"

    @property
    def tag_secret(self) -> bytes:
        """The secret room tags are derived from (empty without authentication)."""
        return b"" if self.insecure or self.secret is None else self.secret

    def validate(self) -> None:
        if self.backend not in _BACKEND_PATHS and self.backend not in _REGISTERED:
            raise ValueError(
                f"unknown KV transfer backend {self.backend!r}; known: {sorted(set(_BACKEND_PATHS) | set(_REGISTERED))}"
            )
        for name in (
            "bootstrap_timeout",
            "waiting_timeout",
            "heartbeat_interval",
            "heartbeat_timeout",
            "abort_ack_timeout",
            "connect_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not self.insecure:
            from kvship.engine.disagg.auth import SECRET_HELP, check_secret

            if self.secret is None:
                raise ValueError(f"a prefill or decode worker needs a KV transfer secret: {SECRET_HELP}")
            check_secret(self.secret, "the transfer config")
        if self.handshake_timeout <= 0 or self.data_idle_timeout <= 0:
            raise ValueError("handshake_timeout and data_idle_timeout must be > 0")
        if not 1 <= self.max_handshakes <= self.max_connections:
            raise ValueError("need 1 <= max_handshakes <= max_connections")
        if self.transfer_threads < 1 or self.max_inflight < 1:
            raise ValueError("transfer_threads and max_inflight must be >= 1")
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError("bootstrap_port must be in 0..65535")

    @property
    def stage_fields(self) -> dict:
        """This rank's pipeline stage as ``KVLayout.from_pool`` keywords."""
        return {
            "pp_size": self.pp_size,
            "pp_rank": self.pp_rank,
            "layer_start": self.layer_start,
            "model_layers": self.model_layers,
        }

    @classmethod
    def from_server_args(cls, args, **overrides) -> "KVTransferConfig":
        """Map ``ServerArgs`` (``--disaggregation-*``, ``--kv-transfer-*``) to a config.

        Loads the KV transfer secret (``--kv-transfer-secret-file``, else ``KVSHIP_KV_TRANSFER_SECRET``);
        ValueError naming both ways when there is none and ``--kv-transfer-insecure`` is off."""
        from kvship.engine.disagg.auth import load_kv_secret

        values = dict(
            backend=args.disaggregation_transfer_backend,
            host=args.host,
            bootstrap_port=args.disaggregation_bootstrap_port,
            ib_device=args.disaggregation_ib_device,
            bootstrap_timeout=args.disaggregation_bootstrap_timeout,
            waiting_timeout=args.disaggregation_waiting_timeout,
            checksum=args.kv_transfer_checksum,
            layerwise=args.disaggregation_layerwise,
            layerwise_writes=args.disaggregation_layerwise_writes,
            max_inflight=max(4096, 2 * args.max_running_requests),
            insecure=args.kv_transfer_insecure,
        )
        if "secret" not in overrides:
            values["secret"] = load_kv_secret(args.kv_transfer_secret_file, args.kv_transfer_insecure)
        try:
            from kvship.engine.fingerprint import fingerprint_for

            values["fingerprint"] = fingerprint_for(args).hex
        except FileNotFoundError:  # no model files: the model loader reports that itself
            pass
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True)
class AuxInfo:
    """What prefill hands decode besides the KV: the first sampled token (and its logprobs)."""

    first_token_id: int
    first_token_logprob: float
    prompt_len: int
    first_token_top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SlotFeatures:
    """A per-KV-slot buffer that travels with the prompt's K/V (see the module docstring).

    ``buffer`` is ``[kv pool rows, dim]`` (rows = ``num_slots + page_size``, the
    K/V buffers' rows; slot ``s`` is row ``s``), contiguous, on the pool's device.
    ``kind`` names what the vectors are: two workers exchange features only when
    their kinds, widths and dtypes are equal.  Tensor parallelism: every rank
    holds the whole vectors (replicated), so a decode rank takes them from one
    prefill rank.
    """

    kind: str
    buffer: torch.Tensor = field(repr=False, compare=False)

    def check(self, kv_pool) -> None:
        """ValueError unless ``buffer`` fits ``kv_pool`` (one contiguous row per KV slot, same device)."""
        rows = kv_pool.num_slots + kv_pool.page_size
        b = self.buffer
        if not self.kind:
            raise ValueError("slot features need a kind")
        if b.dim() != 2 or b.shape[0] != rows or not b.is_contiguous():
            raise ValueError(f"slot features must be a contiguous [{rows}, dim] tensor, got {tuple(b.shape)}")
        if b.device != kv_pool.device:
            raise ValueError(f"slot features live on {b.device}, the KV pool on {kv_pool.device}")


@dataclass(frozen=True)
class MemoryRegion:
    """One registered buffer: a contiguous tensor's bytes."""

    ptr: int
    nbytes: int
    device: str  # "cpu" or "cuda"
    device_id: int  # CUDA ordinal, 0 for cpu
    tensor: torch.Tensor = field(repr=False, compare=False)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "MemoryRegion":
        if not t.is_contiguous():
            raise ValueError("registered KV buffers must be contiguous")
        dev = t.device
        return cls(
            ptr=t.data_ptr(),
            nbytes=t.numel() * t.element_size(),
            device=dev.type,
            device_id=(dev.index or 0) if dev.type == "cuda" else 0,
            tensor=t,
        )

    def bytes_view(self) -> torch.Tensor:
        """The region as a flat uint8 tensor (same memory)."""
        return self.tensor.view(-1).view(torch.uint8)


@dataclass(frozen=True)
class TransferDescs:
    """A batch of writes: ``length`` bytes from local region/offset to remote region/offset.

    Regions are indices into each side's region list (KV buffers in
    ``KVPool.buffers()`` order, then the ``SlotFeatures`` buffer when that side
    has one, then the aux buffer).  Arrays are int64, equal length.
    """

    src_region: np.ndarray
    src_off: np.ndarray
    dst_region: np.ndarray
    dst_off: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


class TransferBackend(ABC):
    """The data plane of one worker: moves bytes between registered regions.

    Built once per manager with the local regions (registered at construction:
    the K/V buffers in ``KVPool.buffers()`` order, then the ``SlotFeatures``
    buffer when the layout has features, then the aux buffer) and the pool's
    layout.  A peer's region list may differ in its features region only.
    Prefill calls ``add_peer`` when a decode worker's handshake arrives (``info``
    is that decode's ``local_info()``), ``write`` from its transfer threads (any
    number concurrently, to the same or different peers), and ``remove_peer``
    when the control connection is gone and no write to it is in flight.
    Decode calls ``start_receiving`` once; ``expect_room`` / ``forget_room``
    bracket each registered room.

    ``write(peer, key, descs, done=True)`` on a backend with ``in_band_done``
    delivers the done signal for ``key.room`` to the peer's ``on_done`` callback
    strictly after that write's data has landed.  Backends without it return from ``write`` only
    once the data has landed, and the control plane sends the done message.

    Rooms travel as ``auth.RoomKey`` (the room number and its tags) where a backend may need the tags:
    the tcp backend marks every frame with ``key.frame_tag`` and decode drops the connection of a frame
    whose tag is not its room's.  A peer's endpoint (``local_info``) is only ever sent after the control
    handshake authenticated it (docs/pd.md, "KV plane authentication").
    """

    name: ClassVar[str] = ""
    in_band_done: ClassVar[bool] = False

    def __init__(self, config: KVTransferConfig, role: str, regions: Sequence[MemoryRegion], layout: "KVLayout"):
        self.config = config
        self.role = role
        self.regions = list(regions)
        self.layout = layout

    @classmethod
    def check_available(cls) -> None:
        """Raise BackendUnavailableError (naming the package to install) if this backend cannot load."""

    @abstractmethod
    def local_info(self) -> dict:
        """JSON-serializable description a peer needs to reach this side."""

    @abstractmethod
    def add_peer(self, peer_id: str, info: dict) -> None:
        """Prefill: make ``info`` (a decode's ``local_info()``) writable as ``peer_id``."""

    @abstractmethod
    def remove_peer(self, peer_id: str) -> None:
        """Prefill: forget a peer (no write to it is in flight)."""

    @abstractmethod
    def write(self, peer_id: str, key: "RoomKey", descs: TransferDescs, done: bool = False) -> None:
        """Prefill: carry out ``descs`` (all for room ``key.room``) into the peer; raise KVTransferError on failure."""

    def peer_takes_aux_in_done(self, peer_id: str) -> bool:
        """Prefill: whether ``send_aux_done`` replaces the aux write and the done signal for this peer (a
        backend that can, to a peer whose ``local_info`` says ``"aux_in_done": true``)."""
        return False

    def send_aux_done(self, peer_id: str, key: "RoomKey", aux_slot: int, record: bytes) -> None:
        """Prefill (where ``peer_takes_aux_in_done``): the aux record for ``aux_slot`` and the done signal of
        ``key.room`` in one message after the KV, sent once every write of the room has completed; decode's
        ``on_done(room, None, (aux_slot, record))`` gets it once that KV has landed."""
        raise KVTransferError(f"the {self.name} backend sends the aux record as a write")

    def start_receiving(self, on_done: Callable[..., None]) -> None:
        """Decode: deliver in-band done signals as ``on_done(room, None)`` (``on_done(room, None, (aux_slot,
        record))`` when the aux record rides in it); a backend that detects a bad write for a room reports
        ``on_done(room, reason)`` instead (and drops that room's later data).  The manager checks the room's
        aux record (its tag) before it counts a done signal."""

    def expect_room(self, key: "RoomKey", dst_pages: np.ndarray, aux_slots: Sequence[int]) -> None:
        """Decode: room ``key.room`` may now be written into ``dst_pages`` and its aux record into ``aux_slots``
        (one per prefill rank; called again when the room learns more ranks)."""

    def forget_room(self, room: int) -> None:
        """Decode: ``room`` is finished; late data for it must not land."""

    def close(self) -> None:
        """Release the engine and its registrations (idempotent)."""


# --- registry -------------------------------------------------------------

_BACKEND_PATHS: dict[str, str] = {
    "tcp": "kvship.engine.disagg.tcp:TcpBackend",
    "mooncake": "kvship.engine.disagg.mooncake:MooncakeBackend",
    "nixl": "kvship.engine.disagg.nixl:NixlBackend",
}
_REGISTERED: dict[str, type[TransferBackend]] = {}


def register_transfer_backend(name: str) -> Callable[[type[TransferBackend]], type[TransferBackend]]:
    """Class decorator adding a backend under ``name`` (overrides a lazy entry)."""

    def deco(cls: type[TransferBackend]) -> type[TransferBackend]:
        cls.name = name
        _REGISTERED[name] = cls
        return cls

    return deco


def get_transfer_backend(name: str) -> type[TransferBackend]:
    """The backend class for ``name``; BackendUnavailableError if its package is missing."""
    if name in _REGISTERED:
        cls = _REGISTERED[name]
    elif name in _BACKEND_PATHS:
        module_name, cls_name = _BACKEND_PATHS[name].split(":")
        cls = getattr(importlib.import_module(module_name), cls_name)
    else:
        raise ValueError(
            f"unknown KV transfer backend {name!r}; known: {sorted(set(_BACKEND_PATHS) | set(_REGISTERED))}"
        )
    cls.check_available()  # every lookup: a registered backend's package may still be missing
    return cls


def available_transfer_backends() -> list[str]:
    """Backends whose packages can be imported here, best first (mooncake, nixl, tcp)."""
    out = []
    for name in ("mooncake", "nixl", "tcp"):
        try:
            get_transfer_backend(name)
        except BackendUnavailableError:
            continue
        out.append(name)
    return out


class KVSender(ABC):
    """Prefill side of one request: ``manager.create_sender(room, token)``.

    Life cycle (scheduler thread)::

        s = manager.create_sender(room, token)   # Bootstrapping until decode registered the room
        s.poll()                          # -> WaitingForInput: decode's pages are known
        ... run the prompt's extends, sample the first token, synchronize the device ...
        s.send_layerwise(src_pages, ready, progress)   # optional, right before the last chunk's forward
        s.send(src_pages, AuxInfo(first_token_id, logprob, prompt_len))   # -> Transferring
        s.poll()                          # -> Success | Failed, then free or cache the pages
        s.abort(reason)                   # any time

    ``send()`` may be called while still Bootstrapping; the transfer starts when
    decode registers.  Before ``send()`` on CUDA the caller has synchronized the
    stream that wrote the KV (sampling the first token on the host does).  After
    ``abort()`` the sender stays Transferring until no backend call reads its
    pages any more.  ``bootstrap_timeout`` counts from ``create_sender`` until
    decode's registration; once registered, the sender has no timeout of its
    own (decode's waiting timeout ends it): abort every sender you give up on.
    """

    room: int

    @abstractmethod
    def poll(self) -> KVPoll:
        """Current state; checks the bootstrap timeout.  Never blocks."""

    @abstractmethod
    def send(self, src_pages: Sequence[int], aux: AuxInfo) -> None:
        """Ship these pages (prompt order) and the aux record.  Call once."""

    def send_layerwise(self, src_pages: Sequence[int], ready_pages: int, progress: "LayerProgress") -> bool:
        """Start shipping ``src_pages`` while the forward that computes their last chunk runs.

        Call right before that forward (its KV slots allocated); ``progress`` hears of each
        layer's K/V as the forward stores them.  The first ``ready_pages`` pages were complete
        before it (earlier chunks, cached prefix) and may go at once; the others go layer by
        layer.  ``send(src_pages, aux)`` with the same pages still follows the forward (the
        aux record and done signal go after every layer).  A room not every decode rank has
        registered yet starts once the last registration arrives, with every layer stored by then
        (or, if that registration asks for a checksum, goes whole after ``send``).  False (nothing
        started, nothing changed) where it cannot apply: a checksum was asked for, layer-wise is
        off, or no transfer thread can be spared; ``send`` then ships the whole request as usual.
        Aborts and failures behave as for ``send``; an abandoned ``progress`` (the forward raised)
        fails the room.  A room whose layers went (at least partly) this way gets a ``layers_first``
        stamp.
        """
        return False

    @abstractmethod
    def abort(self, reason: str = "aborted") -> None:
        """Stop the transfer; decode is told.  Idempotent."""

    @property
    @abstractmethod
    def failure_reason(self) -> Optional[str]:
        """Why the state is Failed (None otherwise)."""


class KVReceiver(ABC):
    """Decode side of one request: ``manager.create_receiver(bootstrap_host, bootstrap_port, room, token)``.

    Life cycle (scheduler thread)::

        r = manager.create_receiver(host, port, room, token)   # Bootstrapping
        r.init(dst_pages)     # after allocating the prompt's KV pages on decode
                              # -> registers {room, dst pages, aux slot} with prefill
        r.poll()              # Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed
        r.aux                 # after Success: first token id, its logprob, prompt length
        r.abort(reason)       # any time (client gone, router cancel); then poll() until Failed

    Prefill writes every layer's K and V of the pages into decode's registered
    buffers, then the aux record, then the done signal; ``poll()`` reads the aux
    record and verifies the optional checksum on arrival.  After ``abort()`` the
    receiver keeps its state until prefill has acknowledged the abort (no write
    to the pages is in flight or will start), the connection is gone, or
    ``abort_ack_timeout`` passes.  ``bootstrap_timeout`` counts from
    ``create_receiver`` until the handshake is done and the registration sent;
    ``waiting_timeout`` from the registration until the done signal (it aborts
    the room on prefill too).
    """

    room: int

    @abstractmethod
    def init(self, dst_pages: Sequence[int]) -> None:
        """Register the destination pages (prompt order) with prefill.  Call once."""

    @abstractmethod
    def poll(self) -> KVPoll:
        """Current state; checks timeouts, reads aux and verifies the checksum on arrival."""

    @property
    @abstractmethod
    def aux(self) -> Optional["AuxRecord"]:
        """The aux record once Success (first token id, logprob, prompt length, room)."""

    @abstractmethod
    def abort(self, reason: str = "aborted") -> None:
        """Give up on this request; prefill is told.  Idempotent."""

    @property
    @abstractmethod
    def failure_reason(self) -> Optional[str]:
        """Why the state is Failed (None otherwise)."""


class KVManager(ABC):
    """One worker's transfer layer: backend, registered pool, control plane, threads.

    It registers the pool's K/V buffers with the backend once, at construction;
    the pool must outlive it.  On prefill it runs the bootstrap server
    (``--disaggregation-bootstrap-port``) and the transfer threads; on decode it
    keeps one control connection per prefill worker it talks to.
    """

    role: str
    config: KVTransferConfig

    @property
    def bootstrap_port(self) -> Optional[int]:
        """Prefill: the bootstrap port actually bound (``bootstrap_port=0`` picks one); decode: None."""
        return None

    def create_sender(self, room: int, token: Optional[str] = None) -> KVSender:
        """``token``: the request's ``bootstrap_token`` (required unless ``config.insecure``)."""
        raise KVTransferError(f"a {self.role} KV manager cannot create senders")

    def create_receiver(
        self, bootstrap_host: str, bootstrap_port: int, room: int, token: Optional[str] = None
    ) -> KVReceiver:
        """``token``: the request's ``bootstrap_token`` (required unless ``config.insecure``)."""
        raise KVTransferError(f"a {self.role} KV manager cannot create receivers")

    _progress_hook: Optional[Callable[[], None]] = None

    def set_progress_hook(self, hook: Optional[Callable[[], None]]) -> None:
        """``hook()`` runs on the manager's threads whenever a sender's or receiver's ``poll()`` may report
        something new (decode registered a room, the KV arrived, a terminal state).  It must not block (the
        manager's lock may be held); the scheduler wakes its loop with it instead of polling on a timer."""
        self._progress_hook = hook

    def room_key(self, room: int, token: Optional[str]) -> "RoomKey":
        """The room's key for this worker (KVTransferError when authentication is on and ``token`` is missing or
        malformed)."""
        from kvship.engine.disagg.auth import RoomKey, token_problem

        if token is not None or not self.config.insecure:
            problem = token_problem(token)
            if problem is not None:
                raise KVTransferError(f"room {room}: {problem} (KV-plane authentication is on)")
        return RoomKey(room, token, self.config.tag_secret)

    def progressed(self) -> None:
        hook = self._progress_hook
        if hook is not None:
            hook()

    @abstractmethod
    def close(self) -> None:
        """Stop threads, close connections, release the backend (idempotent)."""

    def __enter__(self) -> "KVManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def backend_unavailable(name: str, package_hint: str, err: BaseException) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"KV transfer backend {name!r} is not available: {type(err).__name__}: {err}. {package_hint}"
    )


def advertise_host(host: str) -> str:
    """The address peers should use to reach a socket bound on ``host``.

    For a wildcard bind: ``KVSHIP_ADVERTISE_HOST`` (the operator sets it to the pod IP), else the
    host name's address (which on Kubernetes may be a Service or a stale /etc/hosts entry)."""
    if host in ("", "0.0.0.0", "::"):
        from kvship.common.envs import ENV

        if ENV.ADVERTISE_HOST:
            return ENV.ADVERTISE_HOST
        import socket

        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    if host == "localhost":
        return "127.0.0.1"
    return host
