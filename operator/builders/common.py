"""Names, labels, owner references and hardened pod pieces shared by every builder.

Child names are deterministic (``<name>-prefill``, ``<name>-decode``,
``<name>-worker`` for unified workers, ``<name>-router``,
``<name>-config``), so a restarted operator finds what it made before
instead of making it twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from kvship.operator.revision import REVISION_LABEL
from kvship.operator.spec import ServiceConfig
from kvship.operator.types import API_VERSION, KIND

MANAGED_BY = "kvship-operator"
IN_ROTATION_GATE = "kvship.io/in-rotation"
APP_NAME = "kvship"
ROLE_LABEL = "kvship.io/role"
PORT_ANNOTATION = "kvship.io/port"
WORKER_PORT = 30000
ROUTER_PORT = 8000
RUN_AS = 1000
ROLES = ("prefill", "decode", "unified", "router")


# Where a worker may be registered from (router --worker-allow-cidrs): the private ranges pods get addresses in.
DEFAULT_WORKER_ALLOW_CIDRS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8", "fd00::/8")
# The operator's pods, as the chart labels them (allowed to reach the workers' HTTP port).
DEFAULT_OPERATOR_POD_LABELS = (("app.kubernetes.io/name", "kvship-operator"),)
CREDENTIALS_ANNOTATION = "kvship.io/credentials"


@dataclass(frozen=True)
class Network:
    """The operator's network settings (its flags) that shape the children.

    ``operator_namespace`` None: the operator's pods are looked for in the service's own namespace only.
    """

    worker_allow_cidrs: tuple[str, ...] = DEFAULT_WORKER_ALLOW_CIDRS
    operator_pod_labels: tuple[tuple[str, str], ...] = DEFAULT_OPERATOR_POD_LABELS
    operator_namespace: Optional[str] = None
    # The cluster serves leaderworkerset.x-k8s.io/v1 (the operator asks the API): worker groups are
    # LeaderWorkerSets, else StatefulSets (builders/groups.py).
    leader_worker_set: bool = False


@dataclass(frozen=True)
class Images:
    """Images used when the spec names none (the operator's --worker-image / --router-image)."""

    worker: str
    router: str
    pull_policy: str = "IfNotPresent"
    # --allowed-image-prefixes: images a spec may name (empty = any); kvship.operator.spec.image_errors
    allowed_prefixes: tuple[str, ...] = ()


def child_name(cfg: ServiceConfig, role: str) -> str:
    """``unified`` workers live in ``<name>-worker``; other roles in ``<name>-<role>``."""
    return f"{cfg.name}-{'worker' if role == 'unified' else role}"


def deployment_name(cfg: ServiceConfig, role: str, revision: str) -> str:
    """PD worker Deployments carry their revision (``<name>-prefill-<rev>``): a new revision is a new pair of
    Deployments beside the old one (docs/operator.md, "Revisions and lockstep rollouts").  Unified workers and
    the router keep one Deployment each, patched in place."""
    if role in ("prefill", "decode"):
        return f"{child_name(cfg, role)}-{revision}"
    return child_name(cfg, role)


def worker_roles(cfg: ServiceConfig) -> tuple[str, ...]:
    return ("unified",) if cfg.unified else ("prefill", "decode")


def instance_labels(cfg: ServiceConfig) -> dict[str, str]:
    """Labels every child carries; the operator lists its children with them."""
    return {
        "app.kubernetes.io/name": APP_NAME,
        "app.kubernetes.io/instance": cfg.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def role_selector(cfg: ServiceConfig, role: str) -> dict[str, str]:
    """The (immutable) Deployment selector of a role; also what the router discovers pods by."""
    return {"app.kubernetes.io/instance": cfg.name, "app.kubernetes.io/managed-by": MANAGED_BY, ROLE_LABEL: role}


def role_labels(cfg: ServiceConfig, role: str) -> dict[str, str]:
    labels = instance_labels(cfg)
    labels["app.kubernetes.io/component"] = "worker" if role == "unified" else role
    labels[ROLE_LABEL] = role
    return labels


def owner_reference(cfg: ServiceConfig) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": cfg.name,
        "uid": cfg.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(
    cfg: ServiceConfig, name: str, labels: dict[str, str], annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": cfg.namespace,
        "labels": dict(labels),
        "ownerReferences": [owner_reference(cfg)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        # Re-chown a volume only when its root is not ours yet: a shared model cache is not walked at every start.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(add_capabilities: tuple[str, ...] = ()) -> dict[str, Any]:
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if add_capabilities:
        caps["add"] = list(add_capabilities)
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": caps,
    }


def with_default_requests(resources: dict[str, Any], defaults: dict[str, str]) -> dict[str, Any]:
    """``resources`` (copied) with ``defaults`` requested where neither requests nor limits name the resource,
    so no pod runs BestEffort (first evicted under node pressure)."""
    out = {k: dict(v) for k, v in resources.items()}
    named = set(out.get("requests") or {}) | set(out.get("limits") or {})
    missing = {k: v for k, v in defaults.items() if k not in named}
    if missing:
        out.setdefault("requests", {}).update(missing)
    return out


def http_probe(path: str, port: str, *, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def startup_failures(timeout_seconds: int, period: int = 10) -> int:
    return max(1, math.ceil(timeout_seconds / period))


def secret_env(name: str, ref: Any) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def deployment(
    cfg: ServiceConfig,
    role: str,
    pod_spec: dict[str, Any],
    *,
    replicas: int | None,
    pod_annotations: dict[str, str],
    strategy: dict[str, Any],
    progress_deadline: int,
    revision: str | None = None,
) -> dict[str, Any]:
    """A Deployment of one role; ``replicas=None`` leaves the count to an HPA.

    With a ``revision`` its pods carry the ``kvship.io/revision`` label; PD worker Deployments are also named
    and selected by it (:func:`deployment_name`).
    """
    labels = role_labels(cfg, role)
    selector = role_selector(cfg, role)
    name = child_name(cfg, role)
    if revision is not None:
        labels[REVISION_LABEL] = revision
        name = deployment_name(cfg, role, revision)
        if name != child_name(cfg, role):
            selector[REVISION_LABEL] = revision
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector},
        "revisionHistoryLimit": 3,
        "progressDeadlineSeconds": progress_deadline,
        "strategy": strategy,
        "template": {"metadata": {"labels": labels, "annotations": dict(pod_annotations)}, "spec": pod_spec},
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(cfg, name, labels),
        "spec": spec,
    }


def scheduling(
    pod: dict[str, Any], node_selector: dict, tolerations: list, affinity: dict, pull_secrets: list[str]
) -> dict[str, Any]:
    """Adds the pass-through scheduling fields that are set."""
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod["tolerations"] = [dict(t) for t in tolerations]
    if affinity:
        pod["affinity"] = dict(affinity)
    if pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in pull_secrets]
    return pod


def tracing_args(spec: Any) -> list[str]:
    """``--otlp-traces-endpoint`` / ``--otlp-traces-sample-ratio`` of ``spec.tracing`` (every pod, router and
    workers, takes the same two flags; docs/observability.md), or nothing when tracing is off."""
    t = spec.tracing
    if t is None:
        return []
    return ["--otlp-traces-endpoint", t.otlp_endpoint, "--otlp-traces-sample-ratio", repr(float(t.sample_ratio))]
