"""The Secrets of an InferenceService: made once with random values, read back, rotated on request.

``ensure_credentials(client, cfg)`` runs on every reconcile pass, before the children are applied:

* a Secret that does not exist is created with ``secrets.token_urlsafe(32)`` under its key, owned by the
  InferenceService (the garbage collector deletes it with the service);
* a Secret that exists is never overwritten, whoever made it: creating ``<name>-worker-key`` (etc.) yourself
  before the InferenceService sets your own value;
* rotation: delete the Secret, or annotate it ``kvship.io/rotate`` (any value): the next pass writes a new
  random value (and drops the annotation); a key that is missing or empty is filled the same way.

Pods read the keys at start (env) and the KV secret once (a mounted file), so the pod templates carry
:attr:`Credentials.digest`, a hash of the three values: a rotation rolls every pod of the service
(docs/operator.md, "Credentials").  The worker key is also what the operator sends to the router
(``GET /workers``, ``GET /slo``).  Values are never logged.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import secrets
from dataclasses import dataclass, field
from typing import Optional

from kvship.operator.builders.credentials import secret_keys, secret_manifest, worker_key_name
from kvship.operator.kube import KubeApiError, KubeClient
from kvship.operator.spec import ServiceConfig

log = logging.getLogger(__name__)
ROTATE_ANNOTATION = "kvship.io/rotate"
SECRET_BYTES = 32


@dataclass(frozen=True)
class Credentials:
    """What one pass found.  With ``errors`` the other fields are unusable and nothing should be applied."""

    worker_key: Optional[str] = field(default=None, repr=False)
    digest: Optional[str] = None
    errors: list[str] = field(default_factory=list)


def new_value() -> str:
    return secrets.token_urlsafe(SECRET_BYTES)


async def _ensure(client: KubeClient, cfg: ServiceConfig, name: str, key: str) -> str:
    """The base64 data of ``key`` in Secret ``name``, after creating or rotating it as the module says."""
    live = await client.get("v1", "Secret", cfg.namespace, name)
    if live is None:
        manifest = secret_manifest(cfg, name, key, new_value())
        try:
            await client.create(manifest)
            log.info("%s/%s: created Secret %s", cfg.namespace, cfg.name, name)
            return manifest["data"][key]
        except KubeApiError as e:
            if e.status != 409:
                raise
        live = await client.get("v1", "Secret", cfg.namespace, name)
        if live is None:  # created and deleted meanwhile: the next pass makes it again
            raise KubeApiError(404, "NotFound", f"Secret {name} vanished while being created")
    annotations = (live.get("metadata") or {}).get("annotations") or {}
    raw = (live.get("data") or {}).get(key)
    if ROTATE_ANNOTATION in annotations or not raw:
        data = base64.b64encode(new_value().encode()).decode()
        patch = {"metadata": {"annotations": {ROTATE_ANNOTATION: None}}, "data": {key: data}}
        await client.merge_patch("v1", "Secret", cfg.namespace, name, patch)
        why = "rotation asked" if raw else f"key {key} was missing"
        log.info("%s/%s: wrote a new value into Secret %s (%s)", cfg.namespace, cfg.name, name, why)
        return data
    return raw


async def ensure_credentials(client: KubeClient, cfg: ServiceConfig) -> Credentials:
    """Create / rotate / read the service's Secrets; never raises on API errors (they are in ``errors``)."""
    data: dict[str, str] = {}
    errors: list[str] = []
    for name, key in secret_keys(cfg):
        try:
            data[name] = await _ensure(client, cfg, name, key)
        except KubeApiError as e:
            errors.append(f"Secret {name}: {e.status} {e.reason}: {e.message}")
    if errors:
        return Credentials(errors=errors)
    try:
        worker_key = base64.b64decode(data[worker_key_name(cfg)], validate=True).decode("ascii")
    except (binascii.Error, UnicodeDecodeError):
        worker_key = ""
    if not worker_key or not worker_key.isprintable() or any(c.isspace() for c in worker_key):
        # it travels as an HTTP header (Authorization: Bearer KEY) and an env value: printable, no spaces
        return Credentials(errors=[f"Secret {worker_key_name(cfg)}: key must be printable ASCII without spaces"])
    digest = hashlib.sha256("\n".join(f"{n}={data[n]}" for n, _ in secret_keys(cfg)).encode()).hexdigest()[:16]
    return Credentials(worker_key=worker_key, digest=digest)
