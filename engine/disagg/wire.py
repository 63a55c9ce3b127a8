"""Wire types of the prefill <-> decode control plane (version 1).

Control connection: one TCP connection per (decode worker, prefill worker)
pair, opened by decode to prefill's bootstrap port.  Frames are a 4-byte
big-endian length and a UTF-8 JSON object ``{"v": 1, "type": ..., ...}``.
Page lists travel as base64 of little-endian int32.

Authentication comes first (docs/pd.md, "KV plane authentication"; MACs in
``kvship.engine.disagg.auth``); until it is done a frame may have at most
``PREAUTH_MAX_FRAME`` bytes and nothing about either worker is said::

    decode -> prefill   Hello0       auth mode ("hmac-sha256" | "none"), nonce_d (hex)
    prefill -> decode   Challenge    auth mode, nonce_p, mac_p = HMAC(S, "kvship-p|" nonce_d "|" nonce_p)
                        | Refuse     "authentication failed" / the auth modes differ
    decode -> prefill   Auth         mac_d = HMAC(S, "kvship-d|" nonce_p "|" nonce_d)   (mode "none": not sent)

Then (frames up to ``HANDSHAKE_MAX_FRAME``, afterwards up to what the layout
needs: ``control_frame_cap``):

    decode -> prefill   Hello        once: decode's layout, region sizes, backend endpoint,
                                     model fingerprint
    prefill -> decode   Welcome      prefill's layout (page size, KV dtype, layers,
                                     KV heads, head dim, TP layout, per-slot features'
                                     kind / width / dtype) + backend info +
                                     model fingerprint (decode refuses a different one)
                        | Refuse     with the reason (layout, fingerprint or backend mismatch)
    decode -> prefill   Register     per room: destination pages, aux slot, checksum algorithm, tag
                                     (the room token's register tag, ``auth.RoomKey``)
    prefill -> decode   Started      per room, when the write begins
                        Done         per room (backends whose done is not in-band)
                        Fail         per room, with the reason
    both ways           Abort        per room, with the reason
                        AbortAck     prefill -> decode: nothing for that room is or will be in flight
    both ways           Ping         heartbeat (any frame counts as a sign of life)

The aux record is not JSON: it is a fixed 256-byte binary record that prefill
writes into decode's aux buffer at the registered slot, after the KV (record
version 3: the first token, its logprob and up to ``AUX_MAX_TOP_LOGPROBS``
top-k alternatives, so decode answers ``logprobs`` / ``top_logprobs`` for the
first token as a unified worker does, and the room's aux tag, which decode
checks before it accepts the room's done signal).
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar, Optional

import numpy as np
import torch

WIRE_VERSION = 1
PREAUTH_MAX_FRAME = 512  # Hello0 / Challenge / Auth / a pre-auth Refuse
HANDSHAKE_MAX_FRAME = 4 << 20  # Hello / Welcome (NIXL agent metadata, Mooncake region addresses)
CONTROL_MAX_FRAME = 64 << 10  # what prefill sends after Welcome (Started, Done, Fail, Abort, AbortAck, Ping)
MAX_REASON_CHARS = 2000  # reasons are cut to this on the wire
_READ_CHUNK = 64 << 10  # bodies are read in chunks: a claimed length costs nothing until its bytes arrive
_LEN = struct.Struct(">I")


def control_frame_cap(num_pages: int) -> int:
    """Largest frame decode may send prefill once its layout is known: a Register naming every one of its
    ``num_pages`` pages (base64 of int32: 16/3 bytes a page) plus room for the other fields."""
    return CONTROL_MAX_FRAME + 6 * max(0, int(num_pages))


class WireError(ValueError):
    """A frame or record that cannot be decoded (wrong version, garbage, bad field)."""


# --- layout -----------------------------------------------------------------


@dataclass(frozen=True)
class KVLayout:
    """What both sides must agree on before any byte moves.

    The ``feature_*`` fields describe the worker's optional per-slot features
    (``base.SlotFeatures``; empty / 0 when it has none).  They never refuse a
    peer: ``features_mismatch`` says whether the features travel."""

    page_size: int
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0
    total_kv_heads: int = 0  # the model's KV heads (0: ``num_kv_heads``, a peer that predates the field)
    feature_kind: str = ""  # what this worker's per-slot features are ("" = none)
    feature_dim: int = 0
    feature_dtype: str = ""
    # an FP8 pool's per-layer dequantization scales: every layer's k_scale, then every v_scale (() otherwise);
    # the bytes mean the same values on both sides only with equal scales (docs/quantization.md)
    kv_scales: tuple[float, ...] = ()
    # pipeline parallelism (docs/parallel.md, "PD with pipeline parallelism"): this rank's stage holds the
    # model's layers [layer_start, layer_start + num_layers) of ``model_layers`` (0: ``num_layers``, the whole model)
    pp_size: int = 1
    pp_rank: int = 0
    layer_start: int = 0
    model_layers: int = 0
    # MLA (docs/deepseek.md): the pool holds ONE latent row of ``kv_lora_rank + qk_rope_head_dim`` values per
    # token and layer (one buffer per layer, ``num_kv_heads`` 1, ``head_dim`` the row's width), replicated on
    # every TP rank; 0 / 0: per-head K and V buffers (two per layer)
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    @classmethod
    def from_pool(
        cls,
        pool,
        tp_size: int = 1,
        tp_rank: int = 0,
        total_kv_heads: int = 0,
        features=None,
        pp_size: int = 1,
        pp_rank: int = 0,
        layer_start: int = 0,
        model_layers: int = 0,
    ) -> "KVLayout":
        """``features``: the worker's ``base.SlotFeatures`` or None; ``pp_*`` / ``layer_start`` / ``model_layers``:
        the rank's pipeline stage (defaults: the whole model).  An ``MLAKVPool`` gives the MLA layout: its one
        latent "head" is the model's only KV head (every TP rank holds all of it), whatever ``total_kv_heads``."""
        from kvship.engine.mem.mla_pool import MLAKVPool

        mla = isinstance(pool, MLAKVPool)
        return cls(
            page_size=pool.page_size,
            kv_dtype=str(pool.dtype).removeprefix("torch."),
            num_layers=pool.num_layers,
            num_kv_heads=pool.num_kv_heads,
            head_dim=pool.head_dim,
            tp_size=tp_size,
            tp_rank=tp_rank,
            total_kv_heads=1 if mla else (total_kv_heads or pool.num_kv_heads * tp_size),
            feature_kind=features.kind if features is not None else "",
            feature_dim=int(features.buffer.shape[1]) if features is not None else 0,
            feature_dtype=str(features.buffer.dtype).removeprefix("torch.") if features is not None else "",
            kv_scales=tuple(pool.k_scales) + tuple(pool.v_scales) if pool.is_fp8 else (),
            pp_size=pp_size,
            pp_rank=pp_rank,
            layer_start=layer_start,
            model_layers=model_layers if model_layers else layer_start + pool.num_layers,
            kv_lora_rank=pool.kv_lora_rank if mla else 0,
            qk_rope_head_dim=pool.qk_rope_head_dim if mla else 0,
        )

    @property
    def is_mla(self) -> bool:
        """The pool holds MLA latent rows (one buffer per layer), not per-head K and V."""
        return self.kv_lora_rank > 0

    @property
    def kv_planes(self) -> int:
        """Buffers per layer: 2 (K, V) or 1 (MLA's latent rows).  Region ``p * num_layers + i`` is plane ``p``
        (K, then V) of the rank's ``i``-th layer."""
        return 1 if self.is_mla else 2

    def cache_kind(self) -> str:
        """The KV cache kind in words (layout-mismatch messages name both sides' kinds)."""
        if self.is_mla:
            return f"MLA latent rows (kv_lora_rank {self.kv_lora_rank} + qk_rope_head_dim {self.qk_rope_head_dim})"
        return "per-head K/V"

    @property
    def has_features(self) -> bool:
        return bool(self.feature_kind)

    @property
    def num_regions(self) -> int:
        """Registered regions: the K/V buffers, the features buffer (if any), the aux buffer."""
        return self.num_buffers + int(self.has_features) + 1

    @property
    def feature_page_bytes(self) -> int:
        """Bytes of one page of the features buffer (0 without features)."""
        if not self.has_features:
            return 0
        return (
            self.page_size * self.feature_dim * torch.empty((), dtype=getattr(torch, self.feature_dtype)).element_size()
        )

    def features_mismatch(self, other: "KVLayout") -> Optional[str]:
        """None if features travel between this layout and ``other`` (both have them, equal kind, width
        and dtype), else why not (the transfer then moves K/V alone)."""
        if not self.has_features and not other.has_features:
            return "neither side has per-slot features"
        for side, lay in (("this side", self), ("the peer", other)):
            if not lay.has_features:
                return f"{side} has no per-slot features"
        diffs = [
            f"{f} {getattr(self, f)!r} != {getattr(other, f)!r}"
            for f in ("feature_kind", "feature_dim", "feature_dtype")
            if getattr(self, f) != getattr(other, f)
        ]
        return ", ".join(diffs) or None

    @property
    def model_kv_heads(self) -> int:
        """The model's KV heads (``num_kv_heads`` is this rank's share)."""
        return self.total_kv_heads or self.num_kv_heads

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head of one slot."""
        return self.head_dim * self.element_size

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.kv_dtype)).element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one K or V buffer."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def num_buffers(self) -> int:
        return self.kv_planes * self.num_layers

    @property
    def all_layers(self) -> int:
        """The model's decoder layers (``num_layers`` is this rank's stage's share)."""
        return self.model_layers or self.num_layers

    @property
    def layer_end(self) -> int:
        return self.layer_start + self.num_layers

    @property
    def world_rank(self) -> int:
        """This rank's index among its worker's ranks: stage-major (stage ``p`` is ranks ``[p * tp, (p + 1) * tp)``)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def layer_scales(self, start: int, end: int) -> tuple[float, ...]:
        """An FP8 pool's k_scales then v_scales of the model's layers ``[start, end)`` (held by this rank)."""
        if not self.kv_scales:
            return ()
        n, a, b = self.num_layers, start - self.layer_start, end - self.layer_start
        return tuple(self.kv_scales[a:b]) + tuple(self.kv_scales[n + a : n + b])

    def mismatch(self, other: "KVLayout") -> Optional[str]:
        """None if ``other`` can exchange KV with this layout, else what differs.

        Tensor-parallel sizes may differ (each side's heads are sliced, docs/parallel.md), and so may the
        pipeline stages (each rank writes the layers both ranks hold); the model's KV heads, page size, dtype,
        layers and head dim must not, and FP8 scales must agree on the layers both hold."""
        from kvship.engine.disagg.tp_slices import rank_kv_heads

        diffs = []
        if (self.kv_lora_rank, self.qk_rope_head_dim) != (other.kv_lora_rank, other.qk_rope_head_dim):
            # an MLA latent cache never feeds a per-head one, nor one of other MLA dims (docs/pd.md)
            return f"KV cache {self.cache_kind()} != {other.cache_kind()}"
        for f in ("page_size", "kv_dtype", "all_layers", "model_kv_heads", "head_dim"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                diffs.append(f"{'num_layers' if f == 'all_layers' else f} {a} != {b}")
        for side in (self, other):
            if not (0 <= side.layer_start and side.layer_end <= side.all_layers and 0 <= side.pp_rank < side.pp_size):
                diffs.append(
                    f"pipeline stage {side.pp_rank} of {side.pp_size} holds layers [{side.layer_start}, "
                    f"{side.layer_end}) of {side.all_layers}"
                )
        # the layers both hold (a pipeline stage holds some of them): their FP8 scales must agree
        lo, hi = max(self.layer_start, other.layer_start), min(self.layer_end, other.layer_end)
        if not diffs and self.kv_dtype == other.kv_dtype and lo < hi:
            mine, theirs = self.layer_scales(lo, hi), other.layer_scales(lo, hi)
            if mine != theirs:
                diffs.append(f"FP8 KV scales (k_scale per layer, then v_scale) {list(mine)} != "
                             f"{list(theirs)}")  # fmt: skip
        for side in (self, other):
            try:
                _, n = rank_kv_heads(side.model_kv_heads, side.tp_size, side.tp_rank)
            except RuntimeError as e:  # KVTransferError: the heads do not split over that tp size
                diffs.append(str(e))
                continue
            if n != side.num_kv_heads:
                diffs.append(
                    f"rank {side.tp_rank} of tp {side.tp_size} holds {side.num_kv_heads} KV heads, expected {n} "
                    f"of {side.model_kv_heads}"
                )
        return ", ".join(diffs) or None

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        if not isinstance(d, dict) or not isinstance(getattr(torch, str(d.get("kv_dtype")), None), torch.dtype):
            raise WireError(f"bad KV layout {d!r}: kv_dtype must name a torch dtype")
        if d.get("feature_kind") and (
            not isinstance(getattr(torch, str(d.get("feature_dtype")), None), torch.dtype)
            or not isinstance(d.get("feature_dim"), int)
            or d["feature_dim"] < 1
        ):
            raise WireError(f"bad KV layout {d!r}: features need a positive feature_dim and a torch feature_dtype")
        try:
            lay = cls(
                page_size=int(d["page_size"]),
                kv_dtype=str(d["kv_dtype"]),
                num_layers=int(d["num_layers"]),
                num_kv_heads=int(d["num_kv_heads"]),
                head_dim=int(d["head_dim"]),
                tp_size=int(d.get("tp_size", 1)),
                tp_rank=int(d.get("tp_rank", 0)),
                total_kv_heads=int(d.get("total_kv_heads", 0)),
                feature_kind=str(d.get("feature_kind") or ""),
                feature_dim=int(d.get("feature_dim") or 0),
                feature_dtype=str(d.get("feature_dtype") or ""),
                kv_scales=tuple(float(x) for x in d.get("kv_scales") or ()),
                pp_size=int(d.get("pp_size", 1)),
                pp_rank=int(d.get("pp_rank", 0)),
                layer_start=int(d.get("layer_start", 0)),
                model_layers=int(d.get("model_layers", 0)),
                kv_lora_rank=int(d.get("kv_lora_rank") or 0),
                qk_rope_head_dim=int(d.get("qk_rope_head_dim") or 0),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise WireError(f"bad KV layout {d!r}: {e}") from e
        if (
            lay.kv_lora_rank < 0
            or lay.qk_rope_head_dim < 0
            or (lay.is_mla and (lay.num_kv_heads != 1 or lay.kv_lora_rank + lay.qk_rope_head_dim != lay.head_dim))
        ):
            raise WireError(
                f"bad KV layout {d!r}: an MLA layout has one KV head of kv_lora_rank + qk_rope_head_dim values"
            )
        return lay


# --- messages ---------------------------------------------------------------


def encode_pages(pages: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(pages, dtype="<i4").tobytes()).decode("ascii")


def decode_pages(text: str) -> np.ndarray:
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeError) as e:
        raise WireError(f"bad page list: {e}") from e
    if len(raw) % 4:
        raise WireError("bad page list: length not a multiple of 4")
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""


@dataclass(frozen=True)
class Hello0(Message):
    """Decode's first frame: its auth mode and its nonce (hex)."""

    TYPE: ClassVar[str] = "hello0"
    auth: str
    nonce: str


@dataclass(frozen=True)
class Challenge(Message):
    """Prefill's answer to Hello0: its auth mode, its nonce and its proof (hex; empty for mode "none")."""

    TYPE: ClassVar[str] = "challenge"
    auth: str
    nonce: str
    mac: str = ""


@dataclass(frozen=True)
class Auth(Message):
    """Decode's proof (hex)."""

    TYPE: ClassVar[str] = "auth"
    mac: str


@dataclass(frozen=True)
class Hello(Message):
    TYPE: ClassVar[str] = "hello"
    peer_id: str
    backend: str
    layout: KVLayout
    region_bytes: list[int]
    backend_info: dict = field(default_factory=dict)
    fingerprint: str = ""  # decode's model fingerprint (kvship.engine.fingerprint; "" = not reported)


@dataclass(frozen=True)
class Welcome(Message):
    TYPE: ClassVar[str] = "welcome"
    prefill_id: str
    backend: str
    layout: KVLayout
    backend_info: dict = field(default_factory=dict)
    ranks: list = field(default_factory=list)  # [host, port] of every prefill rank's bootstrap server, rank order
    fingerprint: str = ""  # prefill's model fingerprint; decode refuses a different one


@dataclass(frozen=True)
class Refuse(Message):
    TYPE: ClassVar[str] = "refuse"
    reason: str


@dataclass(frozen=True)
class Register(Message):
    TYPE: ClassVar[str] = "register"
    room: int
    pages: np.ndarray = field(compare=False)
    aux_slot: int
    checksum: Optional[str] = None  # algorithm name, None = no checksum
    tag: str = field(default="", repr=False)  # auth.RoomKey.register_tag of the room's token


@dataclass(frozen=True)
class Started(Message):
    TYPE: ClassVar[str] = "started"
    room: int


@dataclass(frozen=True)
class Done(Message):
    TYPE: ClassVar[str] = "done"
    room: int


@dataclass(frozen=True)
class Fail(Message):
    TYPE: ClassVar[str] = "fail"
    room: int
    reason: str


@dataclass(frozen=True)
class Abort(Message):
    TYPE: ClassVar[str] = "abort"
    room: int
    reason: str


@dataclass(frozen=True)
class AbortAck(Message):
    TYPE: ClassVar[str] = "abort_ack"
    room: int


@dataclass(frozen=True)
class Ping(Message):
    TYPE: ClassVar[str] = "ping"


_TYPES: dict[str, type[Message]] = {
    c.TYPE: c
    for c in (Hello0, Challenge, Auth, Hello, Welcome, Refuse, Register, Started, Done, Fail, Abort, AbortAck, Ping)
}
# what each annotated field must hold on the wire (anything else is a WireError, never a later crash)
_FIELD_CHECKS: dict[str, Any] = {
    "str": lambda v: isinstance(v, str),
    "Optional[str]": lambda v: v is None or isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "dict": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "list[int]": lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
}


def _to_dict(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"v": WIRE_VERSION, "type": msg.TYPE}
    for f in fields(msg):
        v = getattr(msg, f.name)
        if f.name == "reason" and isinstance(v, str) and len(v) > MAX_REASON_CHARS:
            v = v[:MAX_REASON_CHARS] + " ..."
        if isinstance(v, KVLayout):
            v = asdict(v)
        elif isinstance(v, np.ndarray):
            v = encode_pages(v)
        out[f.name] = v
    return out


def encode_frame(msg: Message) -> bytes:
    """``msg`` as one length-prefixed frame."""
    body = json.dumps(_to_dict(msg), separators=(",", ":")).encode("utf-8")
    if len(body) > HANDSHAKE_MAX_FRAME:
        raise WireError(f"control frame of {len(body)} bytes exceeds {HANDSHAKE_MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def frame_length(header: bytes, limit: int) -> int:
    """The body length a frame header claims; WireError if it exceeds ``limit`` (the caller's current cap)."""
    (n,) = _LEN.unpack(header)
    if n > limit:
        raise WireError(f"control frame of {n} bytes exceeds {limit} (not a kvship peer?)")
    return n


FRAME_HEADER_BYTES = _LEN.size


def decode_body(body: bytes) -> Message:
    """The message in one frame body; WireError on anything malformed."""
    try:
        d = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"control frame is not JSON: {e}") from e
    if not isinstance(d, dict):
        raise WireError("control frame is not a JSON object")
    if d.get("v") != WIRE_VERSION:
        raise WireError(f"wire version {d.get('v')!r} not supported (this side speaks {WIRE_VERSION})")
    cls = _TYPES.get(d.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise WireError(f"unknown control message type {d.get('type')!r}")
    kwargs = {}
    for f in fields(cls):
        if f.name not in d:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise WireError(f"{cls.TYPE}: missing field {f.name!r}")
        v = d[f.name]
        if f.name == "layout":
            v = KVLayout.from_dict(v)
        elif f.name == "pages":
            if not isinstance(v, str):
                raise WireError(f"{cls.TYPE}: pages must be a base64 string")
            v = decode_pages(v)
        elif f.name in ("room", "aux_slot"):
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 63:
                raise WireError(f"{cls.TYPE}: {f.name} must be a non-negative 63-bit integer")
        else:
            check = _FIELD_CHECKS.get(str(f.type))
            if check is not None and not check(v):
                raise WireError(f"{cls.TYPE}: field {f.name!r} must be {f.type}")
        kwargs[f.name] = v
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise WireError(f"{cls.TYPE}: {e}") from e


# --- aux record -------------------------------------------------------------

AUX_RECORD_BYTES = 256
AUX_MAX_TOP_LOGPROBS = 20  # the HTTP layer's MAX_TOP_LOGPROBS
AUX_TAG_BYTES = 16
_AUX = struct.Struct("<4sHHQqdqqQ16sH")  # 74 bytes + 20 top-k pairs of 8 = 234 <= 256
_AUX_TOP = struct.Struct("<if")  # one top-k alternative: token id, logprob (float32, as sampled)
_AUX_MAGIC = b"KVAX"
_AUX_VERSION = 3
_FLAG_CHECKSUM = 1


@dataclass(frozen=True)
class AuxRecord:
    """The per-request record written after the KV (64 bytes on the wire)."""

    room: int
    first_token_id: int
    first_token_logprob: float
    prompt_len: int
    num_pages: int
    checksum: Optional[int] = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the first token's top-k (id, logprob)
    tag: bytes = field(default=bytes(AUX_TAG_BYTES), repr=False)  # auth.RoomKey.aux_tag of the room

    def pack(self) -> bytes:
        flags = _FLAG_CHECKSUM if self.checksum is not None else 0
        raw = _AUX.pack(
            _AUX_MAGIC,
            _AUX_VERSION,
            flags,
            self.room,
            self.first_token_id,
            float(self.first_token_logprob),
            self.prompt_len,
            self.num_pages,
            (self.checksum or 0) & 0xFFFFFFFFFFFFFFFF,
            bytes(self.tag)[:AUX_TAG_BYTES].ljust(AUX_TAG_BYTES, b"\0"),
            len(self.top_logprobs[:AUX_MAX_TOP_LOGPROBS]),
        )
        raw += b"".join(_AUX_TOP.pack(int(t), float(v)) for t, v in self.top_logprobs[:AUX_MAX_TOP_LOGPROBS])
        return raw + bytes(AUX_RECORD_BYTES - len(raw))

    @classmethod
    def unpack(cls, data: bytes) -> "AuxRecord":
        if len(data) < _AUX.size:
            raise WireError("aux record too short")
        magic, version, flags, room, tok, lp, plen, npages, ck, tag, ntop = _AUX.unpack_from(data)
        if magic != _AUX_MAGIC:
            raise WireError("aux record missing (no magic): the KV did not arrive in full")
        if version != _AUX_VERSION:
            raise WireError(f"aux record version {version} not supported (this worker speaks {_AUX_VERSION})")
        if ntop > AUX_MAX_TOP_LOGPROBS or len(data) < _AUX.size + ntop * _AUX_TOP.size:
            raise WireError(f"aux record claims {ntop} top logprobs")
        tops = tuple(_AUX_TOP.unpack_from(data, _AUX.size + i * _AUX_TOP.size) for i in range(ntop))
        return cls(
            room=room,
            first_token_id=tok,
            first_token_logprob=lp,
            prompt_len=plen,
            num_pages=npages,
            checksum=ck if flags & _FLAG_CHECKSUM else None,
            top_logprobs=tuple((int(t), float(v)) for t, v in tops),
            tag=tag,
        )
