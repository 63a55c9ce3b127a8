"""Multi-node worker groups: a role whose ``nodesPerReplica`` N > 1 (docs/operator.md, "Multi-node worker groups").

Each replica of the role is one worker spanning N pods ("nodes"): pod ``k`` of a group runs
``kvship serve ... --nnodes N --node-rank k --dist-init-addr <pod 0's stable DNS name>:29500``
(docs/parallel.md, "Launching").  Pod 0 (the leader) serves HTTP; only leaders are in the router's
discovery (its selector adds the leader's index label).  Two shapes, chosen by what the cluster serves:

* ``leaderworkerset.x-k8s.io/v1`` installed: one **LeaderWorkerSet** per role (and revision) with
  ``replicas`` = groups and ``leaderWorkerTemplate.size`` = N.  The LWS controller injects
  ``LWS_LEADER_ADDRESS`` / ``LWS_WORKER_INDEX`` into every container (the argv refers to them as
  ``$(VAR)``, which the kubelet expands), counts a group ready when all its pods are, and with
  ``restartPolicy: RecreateGroupOnPodRestart`` recreates a whole group when one of its pods restarts.
* otherwise: one **StatefulSet** of N pods per group (``<workload>-g<i>``), governed by the role's headless
  Service (``publishNotReadyAddresses``, so pods find the leader before they are ready).  The rank is the
  pod's ``apps.kubernetes.io/pod-index`` label (downward API); the operator itself restarts a group whose
  pod was replaced or restarted (kvship.operator.groups) and counts groups from the StatefulSets.

The number of groups is ``replicas`` of the role, or, for a role the SLO planner scales (``spec.autoscaling.mode:
slo``), the planner's count (the InferenceService's ``kvship.io/planned-groups`` annotation, within the role's
``[minReplicas, maxReplicas]``; ``minReplicas`` before its first decision): the planner changes whole groups,
never the pods of one.

Pure builders: the same input always gives the same output.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from kvship.operator.builders.common import REVISION_LABEL, child_name, metadata
from kvship.operator.spec import ServiceConfig, slo_mode

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
STS_POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
# The group a StatefulSet-fallback pod belongs to (its StatefulSet), and the operator's record of the group's
# pods (uid:restarts of each) the last time the group was whole (kvship.operator.groups).
GROUP_LABEL = "kvship.io/group"
GROUP_PODS_ANNOTATION = "kvship.io/group-pods"
DIST_INIT_PORT = 29500
RANK_ENV = "GROUP_NODE_RANK"  # a pod env var the container args substitute, not read by kvship


def nodes_per_replica(cfg: ServiceConfig, role: str) -> int:
    r = cfg.spec.prefill if role == "prefill" else cfg.spec.decode
    return r.nodes_per_replica


def grouped(cfg: ServiceConfig, role: str) -> bool:
    return nodes_per_replica(cfg, role) > 1


def any_grouped(cfg: ServiceConfig) -> bool:
    roles = ("decode",) if cfg.unified else ("prefill", "decode")
    return any(grouped(cfg, role) for role in roles)


def group_count(cfg: ServiceConfig, role: str, deployment: dict[str, Any], planned: Optional[int]) -> Optional[int]:
    """The role's number of groups (module docstring); None: the role's Deployment leaves it unset."""
    r = cfg.spec.prefill if role == "prefill" else cfg.spec.decode
    if r.autoscaling is not None and slo_mode(cfg.spec):
        a = r.autoscaling
        return a.min_replicas if planned is None else min(max(planned, a.min_replicas), a.max_replicas)
    replicas = deployment["spec"].get("replicas")
    return None if replicas is None else int(replicas)


def leader_label(leader_worker_set: bool) -> str:
    """The label whose value is a pod's index in its group (``"0"`` on leaders)."""
    return LWS_WORKER_INDEX_LABEL if leader_worker_set else STS_POD_INDEX_LABEL


def group_flags(n: int, rank: str, leader: str) -> list[str]:
    return ["--nnodes", str(n), "--node-rank", rank, "--dist-init-addr", f"{leader}:{DIST_INIT_PORT}"]


def _with_group_container(pod: dict[str, Any], flags: list[str], env: list[dict[str, Any]]) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    container = pod["containers"][0]
    container["args"] = list(container["args"]) + flags
    container["ports"] = list(container["ports"]) + [
        {"name": "dist-init", "containerPort": DIST_INIT_PORT, "protocol": "TCP"}
    ]
    container["env"] = env + list(container["env"])
    return pod


def leader_worker_set(
    cfg: ServiceConfig, role: str, deployment: dict[str, Any], planned: Optional[int] = None
) -> dict[str, Any]:
    """The role's LeaderWorkerSet, made from the Deployment it replaces (same name, labels and pod template);
    ``planned``: the SLO planner's group count, if it made one."""
    n = nodes_per_replica(cfg, role)
    tpl = deployment["spec"]["template"]
    flags = group_flags(n, "$(LWS_WORKER_INDEX)", "$(LWS_LEADER_ADDRESS)")
    template = {"metadata": copy.deepcopy(tpl["metadata"]), "spec": _with_group_container(tpl["spec"], flags, [])}
    spec: dict[str, Any] = {
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
        },
        "leaderWorkerTemplate": {
            "size": n,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "workerTemplate": template,
        },
    }
    groups = group_count(cfg, role, deployment, planned)
    if groups is not None:
        spec["replicas"] = groups
    meta = copy.deepcopy(deployment["metadata"])
    return {"apiVersion": LWS_API_VERSION, "kind": LWS_KIND, "metadata": meta, "spec": spec}


def group_statefulsets(
    cfg: ServiceConfig, role: str, deployment: dict[str, Any], planned: Optional[int] = None
) -> list[dict[str, Any]]:
    """One StatefulSet of ``nodesPerReplica`` pods per group: ``<deployment name>-g<i>``."""
    n = nodes_per_replica(cfg, role)
    base = deployment["metadata"]["name"]
    groups = group_count(cfg, role, deployment, planned)
    replicas = 1 if groups is None else groups
    service = child_name(cfg, role)
    out = []
    for i in range(replicas):
        name = f"{base}-g{i}"
        leader = f"{name}-0.{service}.{cfg.namespace}.svc"
        env = [
            {"name": RANK_ENV, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{STS_POD_INDEX_LABEL}']"}}}
        ]
        tpl = deployment["spec"]["template"]
        labels = dict(tpl["metadata"]["labels"], **{GROUP_LABEL: name})
        selector = dict(deployment["spec"]["selector"]["matchLabels"], **{GROUP_LABEL: name})
        pod = _with_group_container(tpl["spec"], group_flags(n, f"$({RANK_ENV})", leader), env)
        meta_labels = dict(deployment["metadata"]["labels"], **{GROUP_LABEL: name})
        out.append(
            {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "metadata": metadata(cfg, name, meta_labels),
                "spec": {
                    "replicas": n,
                    "serviceName": service,
                    # every pod of a group starts at once: node 0 waits for the others at the rendezvous
                    "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": selector},
                    "updateStrategy": {"type": "RollingUpdate"},
                    "template": {
                        "metadata": {"labels": labels, "annotations": dict(tpl["metadata"].get("annotations") or {})},
                        "spec": pod,
                    },
                },
            }
        )
    return out


def group_workloads(
    cfg: ServiceConfig,
    role: str,
    deployment: dict[str, Any],
    use_leader_worker_set: bool,
    planned: Optional[int] = None,
) -> list[dict[str, Any]]:
    """What replaces a grouped role's Deployment: one LeaderWorkerSet, or a StatefulSet per group;
    ``planned``: the SLO planner's group count for the role, if it made one."""
    if use_leader_worker_set:
        return [leader_worker_set(cfg, role, deployment, planned)]
    return group_statefulsets(cfg, role, deployment, planned)


def workload_revision(obj: dict[str, Any]) -> str:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(REVISION_LABEL, "")
