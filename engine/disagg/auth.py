"""KV-plane authentication: the shared secret, the handshake MACs and the per-room tags (docs/pd.md,
"KV plane authentication").

Two credentials protect the prefill <-> decode planes:

* the **KV transfer secret** ``S`` (one per InferenceService; ``--kv-transfer-secret-file`` or
  ``KVSHIP_KV_TRANSFER_SECRET``, at least ``MIN_SECRET_BYTES`` bytes).  Every control connection
  (bootstrap port) and every tcp data connection starts with a mutual HMAC-SHA256 challenge-response on
  it; a peer that fails it learns nothing but "authentication failed".
* the **room token** (``bootstrap_token``, drawn by the router per request with ``secrets``).  From
  ``S`` and the token both workers derive a room key; its tags bind a decode's ``Register`` to the room
  (prefill binds a room to the first registration with the right tag), mark every tcp data frame of the
  room, and sign the room's aux record (checked by decode on done, for every backend).

With ``--kv-transfer-insecure`` both sides skip the challenge-response (both must agree) and the tags are
derived from an empty secret (they still catch stale and foreign records, not forgeries).

Nothing here logs or reprs a secret or a token.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

MIN_SECRET_BYTES = 16
NONCE_BYTES = 32
MAC_BYTES = 32
TAG_BYTES = 16
# a room token: the router's secrets.token_urlsafe(24) (32 characters) or a choice's derived token
TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{16,128}")

# labels keep every MAC of one secret distinct (no answer of one kind serves as another)
_CONTROL_P, _CONTROL_D = b"kvship-p", b"kvship-d"
_DATA_P, _DATA_D = b"kvship-tcp-p", b"kvship-tcp-d"

SECRET_HELP = (
    "give the KV transfer secret with --kv-transfer-secret-file PATH or the environment variable "
    "KVSHIP_KV_TRANSFER_SECRET (the same value on every prefill and decode worker of the service, at least "
    f"{MIN_SECRET_BYTES} bytes), or turn KV-plane authentication off with --kv-transfer-insecure (for measurement "
    "and trusted single-host setups only)"
)


def check_secret(value: bytes, where: str) -> bytes:
    """``value`` stripped of surrounding whitespace; ValueError if it is too short to be a secret."""
    value = value.strip()
    if len(value) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the KV transfer secret from {where} has {len(value)} bytes, at least {MIN_SECRET_BYTES} are needed"
        )
    return value


def load_kv_secret(secret_file: Optional[str], insecure: bool) -> Optional[bytes]:
    """The worker's KV transfer secret (None with ``insecure``); ValueError naming both ways to give one."""
    if insecure:
        return None
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                raw = f.read(1 << 16)
        except OSError as e:
            raise ValueError(f"cannot read --kv-transfer-secret-file {secret_file}: {e}") from None
        return check_secret(raw, f"--kv-transfer-secret-file {secret_file}")
    from kvship.common.envs import ENV

    env = ENV.KV_TRANSFER_SECRET
    if env:
        return check_secret(env.encode(), "KVSHIP_KV_TRANSFER_SECRET")
    raise ValueError(f"a prefill or decode worker needs a KV transfer secret: {SECRET_HELP}")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"|" + b"|".join(parts), hashlib.sha256).digest()


def control_macs(secret: bytes, nonce_d: bytes, nonce_p: bytes) -> tuple[bytes, bytes]:
    """(prefill's proof, decode's proof) of the control handshake for these nonces."""
    return _mac(secret, _CONTROL_P, nonce_d, nonce_p), _mac(secret, _CONTROL_D, nonce_p, nonce_d)


def data_macs(secret: bytes, nonce_d: bytes, nonce_p: bytes) -> tuple[bytes, bytes]:
    """(prefill's proof, decode's proof) of the tcp data-connection handshake (decode challenges)."""
    return _mac(secret, _DATA_P, nonce_d, nonce_p), _mac(secret, _DATA_D, nonce_p, nonce_d)


def same(a: bytes, b: bytes) -> bool:
    """Constant-time comparison."""
    return hmac.compare_digest(a, b)


# --- room tokens -------------------------------------------------------------------------------------


def token_problem(token: object) -> Optional[str]:
    """Why ``token`` is not a valid ``bootstrap_token`` (None if it is)."""
    if not isinstance(token, str) or TOKEN_RE.fullmatch(token) is None:
        return "bootstrap_token must be a string of 16 to 128 characters from [A-Za-z0-9_-]"
    return None


def room_token_problem(token: object, insecure: bool) -> Optional[str]:
    """Why ``token`` (a request's ``bootstrap_token``) cannot open a room on a prefill or decode worker, or None:
    required while KV-plane authentication is on."""
    if token is None:
        if insecure:
            return None
        return (
            "bootstrap_token is required: KV-plane authentication is on (the router sends it; "
            "send requests through `kvship router --pd`)"
        )
    return token_problem(token)


def choice_token(token: Optional[str], index: int) -> Optional[str]:
    """The room token of request ``index`` of a body (choice ``i`` of ``n``, batch item), derived the same way
    on the prefill and the decode worker as its room (``room + index``): the body's token for index 0,
    else ``base64url(HMAC-SHA256(token, "choice|<index>"))`` (43 characters)."""
    if token is None or index == 0:
        return token
    import base64

    digest = hmac.new(token.encode(), f"choice|{index}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


@dataclass(frozen=True)
class RoomKey:
    """One room's identity on the KV planes: its number and the tags its token gives.

    ``key = HMAC(S, "kvship-room|" + token)`` (``S`` empty without authentication, token "" when none was
    given); each tag is ``HMAC(key, label + "|" + room as 8 big-endian bytes)`` cut to ``TAG_BYTES``:
    ``register`` (decode's Register, hex), ``frame`` (every tcp data frame) and ``aux`` (the aux record).
    """

    room: int
    token: Optional[str] = field(default=None, repr=False, compare=False)
    secret: bytes = field(default=b"", repr=False, compare=False)

    @cached_property
    def _key(self) -> bytes:
        return hmac.new(self.secret, b"kvship-room|" + (self.token or "").encode(), hashlib.sha256).digest()

    def _tag(self, label: bytes) -> bytes:
        msg = label + b"|" + (self.room & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")
        return hmac.new(self._key, msg, hashlib.sha256).digest()[:TAG_BYTES]

    @cached_property
    def register_tag(self) -> str:
        return self._tag(b"register").hex()

    @cached_property
    def frame_tag(self) -> bytes:
        return self._tag(b"tcp")

    @cached_property
    def aux_tag(self) -> bytes:
        return self._tag(b"aux")

    def __str__(self) -> str:
        return str(self.room)
