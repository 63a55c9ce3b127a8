"""Lockstep PD rollouts and the in-rotation readiness gate, decided from what the cluster and the router say.

Pure functions (no I/O); the controller applies what they decide.

**Rollout** (PD mode; docs/operator.md, "Revisions and lockstep rollouts").  Worker Deployments are
named and labelled by revision, so a spec change that changes the revision creates the new
revision's prefill *and* decode Deployments side by side with the old ones, each at the spec's
replica count: every revision's set keeps the spec's P:D ratio at every step.  The router pairs
prefill and decode only within one revision and moves new requests to the newest revision that has
both roles ready.  A non-current revision is removed (both of its Deployments in one delete) when
the router, read on this pass,

* is reachable,
* serves some other revision (so removing this one takes no capacity the router still uses),
* does not serve this one, and
* counts no request in flight on this revision's workers (it has drained).

Otherwise it is kept: with the router unreachable, or while the new set is not serving yet (pods
still loading, or a broken new revision), the old set stays and keeps serving.

**Readiness gate** ``kvship.io/in-rotation``: a worker pod's condition is True while the router lists
the pod in rotation (matched by pod name or by ``http://podIP:port``), False otherwise; nothing
changes while the router cannot be read.  The kubelet marks a pod Ready only when its containers are
ready *and* every readiness gate is True, so "Ready" means "receiving requests".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kvship.operator.builders.common import IN_ROTATION_GATE, PORT_ANNOTATION, ROLE_LABEL, WORKER_PORT
from kvship.operator.groups import GROUP_KINDS, group_base, leader_of, role_workload
from kvship.operator.revision import REVISION_LABEL
from kvship.operator.router_client import RouterView

WORKER_ROLES = ("prefill", "decode", "unified")
LEGACY = ""  # worker Deployments made before revisions existed carry no revision label


@dataclass
class RevisionSet:
    """The worker Deployments of one revision, by role."""

    revision: str
    deployments: dict[str, dict] = field(default_factory=dict)

    def counts(self, role: str) -> tuple[int, int]:
        """(ready, desired) pods of ``role``."""
        dep = self.deployments.get(role)
        if dep is None:
            return 0, 0
        desired = int((dep.get("spec") or {}).get("replicas", 1))
        return int((dep.get("status") or {}).get("readyReplicas") or 0), desired


def revision_sets(children: dict[tuple[str, str], dict]) -> dict[str, RevisionSet]:
    """Live worker Deployments grouped by their ``kvship.io/revision`` label."""
    out: dict[str, RevisionSet] = {}
    for (kind, name), obj in children.items():
        labels = (obj.get("metadata") or {}).get("labels") or {}
        role = labels.get(ROLE_LABEL)
        if kind not in ("Deployment",) + GROUP_KINDS or role not in WORKER_ROLES:
            continue
        rev = labels.get(REVISION_LABEL, LEGACY)
        # worker groups (LeaderWorkerSet / StatefulSets) count in groups, shaped like a Deployment (groups.py)
        workload = obj if kind == "Deployment" else role_workload(children, group_base(kind, name))
        out.setdefault(rev, RevisionSet(rev)).deployments[role] = workload
    return out


@dataclass
class RolloutPlan:
    """Which non-current revisions stay and which go, with a reason for each."""

    target: str
    keep: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)

    @property
    def rolling(self) -> bool:
        return bool(self.keep or self.remove)


def plan_rollout(target: str, old: list[str], router: Optional[RouterView]) -> RolloutPlan:
    """Decide for each revision in ``old`` (live, not ``target``) whether it is removed now (module docstring)."""
    plan = RolloutPlan(target)
    for rev in sorted(old):
        name = rev or "(unlabelled)"
        if router is None or not router.reachable:
            plan.keep.append(rev)
            plan.why[rev] = f"revision {name} kept: the router cannot be read" + (
                f" ({router.error})" if router is not None and router.error else ""
            )
            continue
        serving = router.serving()
        if rev in serving:
            plan.keep.append(rev)
            plan.why[rev] = f"revision {name} still serving: the router waits for revision {target} to be ready"
        elif not serving:
            plan.keep.append(rev)
            plan.why[rev] = f"revision {name} kept: the router serves no revision yet"
        elif router.in_flight(rev) > 0:
            plan.keep.append(rev)
            plan.why[rev] = f"revision {name} draining: {router.in_flight(rev)} requests in flight"
        else:
            plan.remove.append(rev)
            plan.why[rev] = f"revision {name} drained: the router serves {', '.join(sorted(serving))}"
    return plan


# ------------------------------------------------------------------------------------------- gate
def has_gate(pod: dict) -> bool:
    return any(g.get("conditionType") == IN_ROTATION_GATE for g in (pod.get("spec") or {}).get("readinessGates") or [])


def pod_condition(pod: dict, ctype: str) -> Optional[dict]:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == ctype), None)


def pod_url(pod: dict) -> Optional[str]:
    """``http://podIP:port`` as the router's discovery registers the pod (port from the kvship.io/port annotation)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(PORT_ANNOTATION)
    try:
        port = int(raw) if raw is not None else WORKER_PORT
    except ValueError:
        port = WORKER_PORT
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


@dataclass(frozen=True)
class GateUpdate:
    """Set the pod's in-rotation condition to ``status`` ("True" / "False")."""

    pod: str
    status: str
    reason: str
    message: str


def gate_updates(pods: list[dict], router: Optional[RouterView]) -> list[GateUpdate]:
    """The gate conditions that differ from what the router says (none while the router cannot be read)."""
    if router is None or not router.reachable:
        return []
    out = []
    by_name = {(p.get("metadata") or {}).get("name"): p for p in pods}
    for pod in pods:
        meta = pod.get("metadata") or {}
        if not has_gate(pod) or meta.get("deletionTimestamp"):
            continue
        # a worker group's other pods serve no HTTP: they are in rotation through their leader (groups.py)
        leader = by_name.get(leader_of(pod)) if leader_of(pod) else None
        if leader_of(pod) and leader is None:
            entry = None
        else:
            target = leader if leader is not None else pod
            entry = router.in_rotation(target["metadata"]["name"], pod_url(target))
        want = "True" if entry is not None else "False"
        current = (pod_condition(pod, IN_ROTATION_GATE) or {}).get("status")
        if current == want:
            continue
        if entry is not None:
            reason, msg = "InRotation", f"the router dispatches to {entry.get('url')}"
        else:
            reason, msg = "NotInRotation", "the router does not list this pod in rotation"
        out.append(GateUpdate(meta["name"], want, reason, msg))
    return out


def gate_patch(update: GateUpdate, now: str) -> dict[str, Any]:
    """Strategic merge patch of a pod's ``status`` setting the gate condition (merged by ``type``)."""
    return {
        "status": {
            "conditions": [
                {
                    "type": IN_ROTATION_GATE,
                    "status": update.status,
                    "reason": update.reason,
                    "message": update.message,
                    "lastTransitionTime": now,
                }
            ]
        }
    }


@dataclass(frozen=True)
class SyncSummary:
    """How the current revision's pods stand with the router (for the RouterSynced condition)."""

    ok: Optional[bool]
    reason: str
    message: str


def router_synced(pods: list[dict], target: str, router: Optional[RouterView], router_ready: bool) -> SyncSummary:
    """True when the router could be read and every running worker pod of revision ``target`` is in rotation."""
    if not router_ready:
        return SyncSummary(False, "RouterNotReady", "no router pod is ready")
    if router is None or not router.reachable:
        return SyncSummary(False, "RouterUnreachable", router.error if router is not None else "not read yet")
    running = [
        p
        for p in pods
        if has_gate(p)
        and ((p.get("metadata") or {}).get("labels") or {}).get(REVISION_LABEL) == target
        and not (p.get("metadata") or {}).get("deletionTimestamp")
        and (pod_condition(p, "ContainersReady") or {}).get("status") == "True"
    ]
    running = [p for p in running if leader_of(p) is None]  # group members are in rotation through their leader
    missing = [p["metadata"]["name"] for p in running if router.in_rotation(p["metadata"]["name"], pod_url(p)) is None]
    if missing:
        return SyncSummary(
            False,
            "PodsNotInRotation",
            f"{len(missing)}/{len(running)} running pods not in rotation: {', '.join(missing)}",
        )
    if not running:
        return SyncSummary(False, "NoRunningPods", f"no worker pod of revision {target} is running yet")
    return SyncSummary(True, "InRotation", f"all {len(running)} running worker pods of revision {target} in rotation")
