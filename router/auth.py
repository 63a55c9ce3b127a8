"""The router's credentials and the allow-list of worker URLs the admin API may register.

Three kinds of key (docs/router.md, "Authentication"):

* **client keys** (``--api-key``, a comma-separated list, plus ``--api-keys-file``): what clients send as
  ``Authorization: Bearer <key>`` on the serving routes.  None configured = the serving routes are open.
* **admin key** (``--admin-api-key``): the only key ``POST`` / ``DELETE /workers`` accept.  None configured =
  the admin API is off (403).
* **worker key** (``--worker-api-key``): the Bearer the router sends to workers; it also opens the operator's
  reads (``GET /workers``, ``GET /slo``, ``GET /metrics``) beside the admin key.

A presented key is compared with every configured one in constant time (SHA-256 digests of equal length
through ``hmac.compare_digest``, no early exit), so neither a key's bytes nor its length leak through timing.

``WorkerAllowList``: ``POST /workers`` registers a URL only when its host is an IP literal inside one of
``--worker-allow-cidrs`` or a name matching one of ``--worker-allow-hosts`` (exact, or ``*.suffix``).  Names
are never resolved here: a DNS answer can change between the check and the connection, so a name is allowed
only by a name pattern.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from typing import Iterable, Optional
from urllib.parse import urlsplit

__all__ = ["CLIENT", "ADMIN", "WORKER", "Credentials", "WorkerAllowList", "bearer_token", "key_id"]

CLIENT, ADMIN, WORKER = "client", "admin", "worker"

# The allow-list without --worker-allow-cidrs / --worker-allow-hosts: this host only (`kvship local`).
DEFAULT_ALLOW_CIDRS = ("127.0.0.0/8", "::1/128")
DEFAULT_ALLOW_HOSTS = ("localhost",)

MAX_KEYS_FILE_BYTES = 1024 * 1024


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


def key_id(key: str) -> str:
    """A short, non-reversible name of a key for limits and logs (never the key itself)."""
    return "key:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def bearer_token(authorization: Optional[str]) -> Optional[str]:
    """The token of an ``Authorization: Bearer <token>`` header value, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def split_keys(value: Optional[str]) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [k.strip() for k in (value or "").split(",") if k.strip()]


def read_keys_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with ``#`` are skipped.  ValueError naming the flag
    when the file cannot be read, is larger than 1 MiB or holds no key."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_KEYS_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"--api-keys-file {path}: {e.strerror or e}") from None
    if len(raw) > MAX_KEYS_FILE_BYTES:
        raise ValueError(f"--api-keys-file {path}: larger than {MAX_KEYS_FILE_BYTES} bytes")
    keys = []
    for line in raw.decode("utf-8", "replace").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    if not keys:
        raise ValueError(f"--api-keys-file {path}: no key in it (one key per line)")
    return keys


@dataclass(frozen=True)
class Presented:
    """What a request's ``Authorization`` header proved: ``kind`` (CLIENT / ADMIN / WORKER) or None (no
    header, or a key that matches nothing), and ``token`` (the raw bearer token, or None)."""

    kind: Optional[str]
    token: Optional[str]

    @property
    def sent_a_key(self) -> bool:
        return self.token is not None


class Credentials:
    """The configured keys and the rule of which kind a presented key is."""

    def __init__(self, client_keys: Iterable[str], admin_key: Optional[str], worker_key: Optional[str]):
        self._client = [_digest(k) for k in dict.fromkeys(client_keys)]
        self._admin = _digest(admin_key) if admin_key else None
        self._worker = _digest(worker_key) if worker_key else None
        if self._admin is not None and self._admin in self._client:
            raise ValueError("--admin-api-key must differ from every client key (--api-key / --api-keys-file)")
        if self._worker is not None and self._worker in self._client:
            raise ValueError("--worker-api-key must differ from every client key (--api-key / --api-keys-file)")
        if self._admin is not None and self._admin == self._worker:
            raise ValueError("--admin-api-key must differ from --worker-api-key")

    @property
    def has_client_keys(self) -> bool:
        return bool(self._client)

    @property
    def has_admin_key(self) -> bool:
        return self._admin is not None

    @property
    def has_worker_key(self) -> bool:
        return self._worker is not None

    @property
    def any(self) -> bool:
        return self.has_client_keys or self.has_admin_key or self.has_worker_key

    def classify(self, authorization: Optional[str]) -> Presented:
        """Which kind of key the header carries (constant time in the configured keys)."""
        token = bearer_token(authorization)
        if token is None:
            return Presented(None, None)
        got = _digest(token)
        kind: Optional[str] = None
        for want in self._client:
            if hmac.compare_digest(got, want):
                kind = CLIENT
        if self._admin is not None and hmac.compare_digest(got, self._admin):
            kind = ADMIN
        if self._worker is not None and hmac.compare_digest(got, self._worker):
            kind = WORKER
        return Presented(kind, token)


def _host_of(url: str) -> str:
    try:
        host = urlsplit(url).hostname
    except ValueError:
        host = None
    if not host:
        raise ValueError(f"worker URL {url!r} has no host")
    return host.lower().rstrip(".")


class WorkerAllowList:
    """Which worker URLs ``POST /workers`` may register (see the module docstring)."""

    def __init__(self, cidrs: Iterable[str], hosts: Iterable[str]):
        self.networks = []
        for c in cidrs:
            try:
                self.networks.append(ipaddress.ip_network(c.strip(), strict=False))
            except ValueError:
                raise ValueError(f"--worker-allow-cidrs: {c!r} is not a CIDR (e.g. 10.0.0.0/8)") from None
        self.hosts = []
        for h in hosts:
            h = h.strip().lower().rstrip(".")
            if not h or "/" in h or ":" in h or ("*" in h and not (h.startswith("*.") and "*" not in h[2:])):
                raise ValueError(f"--worker-allow-hosts: {h!r} is not a host name or a *.suffix pattern")
            self.hosts.append(h)

    @classmethod
    def from_flags(cls, cidrs: str, hosts: str) -> "WorkerAllowList":
        """Both flags empty -> this host only (``DEFAULT_ALLOW_CIDRS``, ``DEFAULT_ALLOW_HOSTS``)."""
        c, h = split_keys(cidrs), split_keys(hosts)
        if not c and not h:
            return cls(DEFAULT_ALLOW_CIDRS, DEFAULT_ALLOW_HOSTS)
        return cls(c, h)

    def refusal(self, url: str) -> Optional[str]:
        """None when ``url`` may be registered, else why not (for the 403 body)."""
        host = _host_of(url)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None:
            if any(ip in net for net in self.networks if net.version == ip.version):
                return None
            allowed = ", ".join(str(n) for n in self.networks) or "none"
            return f"worker address {host} is outside --worker-allow-cidrs ({allowed})"
        for pattern in self.hosts:
            if pattern.startswith("*.") and host.endswith(pattern[1:]) and len(host) > len(pattern) - 1:
                return None
            if host == pattern:
                return None
        allowed = ", ".join(self.hosts) or "none"
        return f"worker host {host} matches no --worker-allow-hosts pattern ({allowed})"
