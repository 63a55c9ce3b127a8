"""The three Secrets of an InferenceService and how pods get them (docs/operator.md, "Credentials").

=========================  =======  ====================================================================
Secret                     key      given to
=========================  =======  ====================================================================
``<name>-kv-transfer``     secret   prefill and decode pods: mounted read-only at
                                    ``/var/run/kvship/kv-transfer/secret``, ``--kv-transfer-secret-file``
``<name>-worker-key``      key      every worker pod: env ``KVSHIP_API_KEY`` (the key the worker requires);
                                    the router pod: env ``KVSHIP_WORKER_API_KEY``; the operator reads it to
                                    call the router's ``GET /workers`` and ``GET /slo``
``<name>-admin-key``       key      the router pod: env ``KVSHIP_ADMIN_API_KEY`` (``POST`` / ``DELETE /workers``)
=========================  =======  ====================================================================

The values are random and made by the operator (kvship.operator.credentials) the first time; the builders
here only name the Secrets and refer to them, so they stay pure.  The client key is the user's own Secret
(``spec.router.apiKeySecretRef``), given to the router only.
"""

from __future__ import annotations

import base64
from typing import Any

from kvship.operator.builders.common import instance_labels, metadata
from kvship.operator.spec import ServiceConfig

KV_SECRET_KEY = "secret"
API_KEY_KEY = "key"
KV_SECRET_DIR = "/var/run/kvship/kv-transfer"
KV_SECRET_FILE = f"{KV_SECRET_DIR}/{KV_SECRET_KEY}"
KV_SECRET_VOLUME = "kv-transfer"
# Owner-only plus the pod's fsGroup (the worker runs as 1000 with fsGroup 1000): no one else on the node reads it.
SECRET_FILE_MODE = 0o440


def kv_secret_name(cfg: ServiceConfig) -> str:
    return f"{cfg.name}-kv-transfer"


def worker_key_name(cfg: ServiceConfig) -> str:
    return f"{cfg.name}-worker-key"


def admin_key_name(cfg: ServiceConfig) -> str:
    return f"{cfg.name}-admin-key"


def secret_keys(cfg: ServiceConfig) -> list[tuple[str, str]]:
    """``(Secret name, data key)`` of every Secret the operator makes for ``cfg``."""
    return [
        (kv_secret_name(cfg), KV_SECRET_KEY),
        (worker_key_name(cfg), API_KEY_KEY),
        (admin_key_name(cfg), API_KEY_KEY),
    ]


def secret_manifest(cfg: ServiceConfig, name: str, key: str, value: str) -> dict[str, Any]:
    """The Secret ``name`` holding ``value`` under ``key``, owned by the InferenceService."""
    labels = dict(instance_labels(cfg), **{"app.kubernetes.io/component": "credentials"})
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(cfg, name, labels),
        "type": "Opaque",
        "data": {key: base64.b64encode(value.encode()).decode()},
    }


def secret_key_env(env_name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": env_name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def worker_key_env(cfg: ServiceConfig, env_name: str = "KVSHIP_API_KEY") -> dict[str, Any]:
    return secret_key_env(env_name, worker_key_name(cfg), API_KEY_KEY)


def admin_key_env(cfg: ServiceConfig) -> dict[str, Any]:
    return secret_key_env("KVSHIP_ADMIN_API_KEY", admin_key_name(cfg), API_KEY_KEY)


def kv_secret_volume(cfg: ServiceConfig) -> dict[str, Any]:
    return {
        "name": KV_SECRET_VOLUME,
        "secret": {
            "secretName": kv_secret_name(cfg),
            "items": [{"key": KV_SECRET_KEY, "path": KV_SECRET_KEY}],
            "defaultMode": SECRET_FILE_MODE,
        },
    }


def kv_secret_mount() -> dict[str, Any]:
    return {"name": KV_SECRET_VOLUME, "mountPath": KV_SECRET_DIR, "readOnly": True}
