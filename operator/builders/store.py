"""The shared KV tier of the workers (``spec.hicache``; docs/operator.md, "Shared KV tier").

* ``storage: file``: every worker mounts the ReadWriteMany claim ``volumeClaim`` at ``/kv-store`` and runs with
  ``--hicache-storage file --hicache-storage-path /kv-store``.
* ``storage: mooncake``: every worker runs with ``--hicache-storage mooncake --hicache-storage-master ADDRESS
  --hicache-storage-metadata P2PHANDSHAKE`` (the store's clients exchange their segment descriptors directly).
  Without ``mooncakeMaster`` the operator runs the master: Deployment ``<name>-mooncake-master`` (one pod,
  ``kvship mooncake-master``, recreated rather than rolled: two masters would split the workers' index) behind
  a ClusterIP Service of the same name, whose DNS name is ADDRESS.  The master's RPC port is not authenticated
  by Mooncake; its NetworkPolicy (builders/network.py) lets only this service's workers reach it.

A master that restarts loses its index; the workers' reads then miss and they recompute (docs/cache.md).
"""

from __future__ import annotations

from typing import Any

from kvship.operator.builders import common
from kvship.operator.builders.common import (
    Images,
    child_name,
    container_security_context,
    metadata,
    role_labels,
    role_selector,
)
from kvship.operator.spec import ServiceConfig
from kvship.operator.types import KV_STORE_MOUNT

MASTER_ROLE = "mooncake-master"
# the store's clients exchange segment descriptors among themselves: no metadata service to run
MOONCAKE_METADATA = "P2PHANDSHAKE"
MASTER_DEFAULT_REQUESTS = {"cpu": "250m", "memory": "512Mi"}
KV_STORE_VOLUME = "kv-store"


def runs_master(cfg: ServiceConfig) -> bool:
    """The operator runs the Mooncake master (storage mooncake and no ``mooncakeMaster`` of the user's)."""
    hc = cfg.spec.hicache
    return hc.storage == "mooncake" and not hc.mooncake_master


def master_address(cfg: ServiceConfig) -> str:
    """``--hicache-storage-master`` of the workers: the user's master, else the operator's Service."""
    hc = cfg.spec.hicache
    if hc.mooncake_master:
        return hc.mooncake_master
    return f"{child_name(cfg, MASTER_ROLE)}.{cfg.namespace}.svc:{hc.master.port}"


def storage_args(cfg: ServiceConfig) -> list[str]:
    """The workers' shared-tier flags (every worker role: a decode worker's pages, the replies included, are
    prefixes of the next turn that a prefill worker then reads)."""
    hc = cfg.spec.hicache
    if hc.storage == "file":
        return ["--hicache-storage", "file", "--hicache-storage-path", KV_STORE_MOUNT]
    if hc.storage == "mooncake":
        return [
            "--hicache-storage",
            "mooncake",
            "--hicache-storage-master",
            master_address(cfg),
            "--hicache-storage-metadata",
            MOONCAKE_METADATA,
        ]
    return []


def storage_volume(cfg: ServiceConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volume mounts) a worker pod adds for the shared tier (storage file: the claim)."""
    hc = cfg.spec.hicache
    if hc.storage != "file" or not hc.volume_claim:
        return [], []
    volume = {"name": KV_STORE_VOLUME, "persistentVolumeClaim": {"claimName": hc.volume_claim}}
    return [volume], [{"name": KV_STORE_VOLUME, "mountPath": KV_STORE_MOUNT}]


def _tcp_probe(period: int, failures: int) -> dict[str, Any]:
    return {"tcpSocket": {"port": "rpc"}, "periodSeconds": period, "timeoutSeconds": 3, "failureThreshold": failures}


def master_deployment(cfg: ServiceConfig, images: Images) -> dict[str, Any]:
    m, eng = cfg.spec.hicache.master, cfg.spec.engine
    container: dict[str, Any] = {
        "name": "mooncake-master",
        "image": m.image or eng.image or images.worker,
        "imagePullPolicy": eng.image_pull_policy or images.pull_policy,
        "args": ["mooncake-master", "--host", "0.0.0.0", "--port", str(m.port)],
        "ports": [{"name": "rpc", "containerPort": m.port, "protocol": "TCP"}],
        "securityContext": container_security_context(),
        "resources": common.with_default_requests(m.resources, MASTER_DEFAULT_REQUESTS),
        "startupProbe": _tcp_probe(2, 60),
        "readinessProbe": _tcp_probe(5, 3),
        "livenessProbe": _tcp_probe(15, 4),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],  # its glog files
    }
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": common.pod_security_context(),
        "terminationGracePeriodSeconds": 10,
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    common.scheduling(pod, m.node_selector, m.tolerations, {}, eng.image_pull_secrets)
    return common.deployment(
        cfg,
        MASTER_ROLE,
        pod,
        replicas=1,
        pod_annotations={},
        strategy={"type": "Recreate"},  # never two masters: each would hold half the workers' index
        progress_deadline=600,
    )


def master_service(cfg: ServiceConfig) -> dict[str, Any]:
    """A ClusterIP Service: its address outlives a restarted master pod (the workers keep theirs)."""
    port = cfg.spec.hicache.master.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(cfg, child_name(cfg, MASTER_ROLE), role_labels(cfg, MASTER_ROLE)),
        "spec": {
            "type": "ClusterIP",
            "selector": role_selector(cfg, MASTER_ROLE),
            "ports": [{"name": "rpc", "port": port, "targetPort": "rpc", "protocol": "TCP"}],
        },
    }
