"""Layer 2: pure builders, a :class:`~kvship.operator.spec.ServiceConfig` -> child manifests.

``build_children(cfg, images)`` returns every object an InferenceService owns,
as plain dicts ready for the API (owner reference, labels, namespace set).
No I/O: the same input always gives the same output, which is what
tests/test_operator_builders.py checks against the official Kubernetes
schemas.

Children (unified mode has ``worker`` instead of ``prefill`` + ``decode``)::

    ConfigMap        <name>-config
    Deployment       <name>-prefill-<rev>, <name>-decode-<rev> | <name>-worker, <name>-router
                     (nodesPerReplica > 1: a LeaderWorkerSet of that name, or StatefulSets NAME-g<i>)
    Service          same names (workers: headless; router: clients call it)
    ServiceAccount   <name>-router   + Role + RoleBinding (pods get/list/watch)
    HPA              <name>-<role>   when the role has autoscaling (worker roles: not in slo mode)
    PDB              <name>-<role>   when the role can have 2+ pods
    NetworkPolicy    <name>-worker, <name>-router   unless spec.networkPolicy.enabled is false
    Deployment       <name>-mooncake-master (+ Service, + NetworkPolicy)   spec.hicache.storage mooncake
                     without a mooncakeMaster of the user's (builders/store.py)

The Secrets (``<name>-kv-transfer``, ``<name>-worker-key``, ``<name>-admin-key``) are not built here: their
values are random and made once (kvship.operator.credentials); the pods only refer to them by name.
"""

from __future__ import annotations

from typing import Any

from kvship.operator.builders.common import (
    IN_ROTATION_GATE,
    MANAGED_BY,
    REVISION_LABEL,
    ROLE_LABEL,
    Images,
    Network,
    child_name,
    deployment_name,
    instance_labels,
    role_selector,
    worker_roles,
)
from kvship.operator.builders.extras import autoscaler, config_map, disruption_budget
from kvship.operator.builders.groups import LWS_API_VERSION, LWS_KIND, group_workloads, grouped
from kvship.operator.builders.network import network_policies
from kvship.operator.builders.router import router_args, router_deployment, router_rbac, router_service
from kvship.operator.builders.store import master_deployment, master_service, runs_master
from kvship.operator.builders.workers import role_spec, worker_args, worker_deployment, worker_service
from kvship.operator.revision import compute_revision
from kvship.operator.spec import ServiceConfig, slo_mode

# Every kind an InferenceService may own, in the order they are applied.
CHILD_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ConfigMap"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("apps/v1", "StatefulSet"),
    (LWS_API_VERSION, LWS_KIND),  # listed only where the cluster serves it (apply.prune skips a 404)
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)


def build_children(
    cfg: ServiceConfig,
    images: Images,
    network: Network = Network(),
    credentials: str | None = None,
    planned_groups: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Every child of the service, in apply order (config, RBAC and network policies before the pods).

    Worker Deployments are those of the spec's current revision (:func:`worker_revision`); Deployments of
    older revisions are kept or removed by the rollout (kvship.operator.rollout), not here.  ``credentials``:
    a digest of the service's Secrets (kvship.operator.credentials), put on the pod templates so that a
    rotated Secret rolls the pods.  ``planned_groups``: the SLO planner's group count per grouped role
    (builders/groups.py).
    """
    revision = worker_revision(cfg, images)
    deployments = [worker_deployment(cfg, role, images, revision, credentials) for role in worker_roles(cfg)]
    deployments.append(router_deployment(cfg, images, network, credentials))
    workloads: list[dict[str, Any]] = []
    for d in deployments:  # a role of multi-node workers runs as groups of pods instead (builders/groups.py)
        role = _role_of(d)
        if role != "router" and grouped(cfg, role):
            workloads += group_workloads(cfg, role, d, network.leader_worker_set, (planned_groups or {}).get(role))
        else:
            workloads.append(d)
    argv = {_role_of(w): _pod_spec(w)["containers"][0]["args"] for w in workloads}
    out: list[dict[str, Any]] = [config_map(cfg, argv, revision)]
    out += router_rbac(cfg)
    out += network_policies(cfg, network)
    out += [worker_service(cfg, role) for role in worker_roles(cfg)]
    out.append(router_service(cfg))
    if runs_master(cfg):  # before the workers: they connect to it as they start
        out += [master_service(cfg), master_deployment(cfg, images)]
    out += workloads
    # groups are scaled by their spec (autoscaling is refused for them) and have no per-pod PDB
    scaled = [(role, role_spec(cfg, role)) for role in worker_roles(cfg) if not grouped(cfg, role)]
    scaled.append(("router", cfg.spec.router))
    for role, r in scaled:
        # slo mode: the operator's planner sets the worker roles' replicas (kvship.operator.planner), no HPA
        if r.autoscaling is not None and not (role != "router" and slo_mode(cfg.spec)):
            out.append(autoscaler(cfg, role, r.autoscaling, deployment_name(cfg, role, revision)))
    for role, r in scaled:
        pdb = disruption_budget(cfg, role, r.replicas, r.autoscaling)
        if pdb is not None:
            out.append(pdb)
    return out


def worker_revision(cfg: ServiceConfig, images: Images) -> str:
    """The revision of the spec's workers (kvship.operator.revision)."""
    return compute_revision(cfg, images.worker)


def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec = workload["spec"]
    return (spec["leaderWorkerTemplate"]["workerTemplate"] if "leaderWorkerTemplate" in spec else spec["template"])[
        "spec"
    ]


def _role_of(obj: dict[str, Any]) -> str:
    return obj["metadata"]["labels"][ROLE_LABEL]


__all__ = [
    "build_children",
    "CHILD_KINDS",
    "Images",
    "Network",
    "MANAGED_BY",
    "ROLE_LABEL",
    "REVISION_LABEL",
    "IN_ROTATION_GATE",
    "child_name",
    "deployment_name",
    "worker_revision",
    "instance_labels",
    "role_selector",
    "worker_roles",
    "worker_args",
    "router_args",
]
