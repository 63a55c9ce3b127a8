"""Multi-node worker groups as the controller sees them (docs/operator.md, "Multi-node worker groups").

Pure functions over live objects (no I/O):

* :func:`group_summary` turns a role's LeaderWorkerSet, or its StatefulSets (one per group), into the
  Deployment-shaped counts the status and the rollout read, counted in **groups**: a group is ready only when
  all its pods are (a LeaderWorkerSet's ``readyReplicas`` already counts groups; a StatefulSet group is ready
  when its ``readyReplicas`` equals its size).
* :func:`group_restarts` is the StatefulSet fallback's ``RecreateGroupOnPodRestart``: the operator records
  each group's pods (uid and container restarts) while the group is whole, in the StatefulSet's
  ``kvship.io/group-pods`` annotation; when a recorded pod is gone, replaced or restarted, every pod of the
  group is deleted (the StatefulSet recreates them, and the worker forms its world again from scratch).
* :func:`leader_of` names the leader pod of a group member, whose in-rotation gate the member follows
  (only leaders are in the router's discovery).
* :func:`planned_groups` reads the SLO planner's group counts (the InferenceService's
  :data:`PLANNED_GROUPS_ANNOTATION`, ``{"<role>": <groups>}``): the planner scales a grouped role by writing
  it, and the builders make that many groups (a LeaderWorkerSet's ``replicas``, or that many StatefulSets), so
  a scale-down removes whole groups (the last ones), never pods of a group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from kvship.operator.builders.groups import (
    GROUP_LABEL,
    GROUP_PODS_ANNOTATION,
    LWS_KIND,
    LWS_WORKER_INDEX_LABEL,
    STS_POD_INDEX_LABEL,
)

GROUP_KINDS = (LWS_KIND, "StatefulSet")
PLANNED_GROUPS_ANNOTATION = "kvship.io/planned-groups"
MAX_PLANNED_ANNOTATION_BYTES = 256


def planned_groups(body: dict) -> dict[str, int]:
    """The planner's group count per role from the InferenceService ``body`` (empty when it made none; a
    malformed annotation counts as none, and the builders start the role at ``minReplicas`` again)."""
    raw = ((body.get("metadata") or {}).get("annotations") or {}).get(PLANNED_GROUPS_ANNOTATION)
    if not isinstance(raw, str) or len(raw) > MAX_PLANNED_ANNOTATION_BYTES:
        return {}
    try:
        parsed = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(parsed, dict):
        return {}
    return {
        role: n
        for role, n in parsed.items()
        if role in ("prefill", "decode") and isinstance(n, int) and not isinstance(n, bool) and n >= 0
    }


def planned_groups_patch(body: dict, role: str, groups: int) -> dict:
    """The merge patch of the InferenceService that records ``groups`` for ``role`` (others kept)."""
    counts = dict(planned_groups(body), **{role: groups})
    text = json.dumps(dict(sorted(counts.items())), separators=(",", ":"))
    return {"metadata": {"annotations": {PLANNED_GROUPS_ANNOTATION: text}}}


def _ready_condition(pod: dict) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def lws_summary(lws: dict) -> dict[str, Any]:
    """A LeaderWorkerSet's group counts, shaped like a Deployment (``spec.replicas``, ``status.*``)."""
    spec, st = lws.get("spec") or {}, lws.get("status") or {}
    desired = int(spec.get("replicas", 1))
    ready, updated = int(st.get("readyReplicas") or 0), int(st.get("updatedReplicas") or 0)
    done = ready >= desired and updated >= desired and int(st.get("replicas") or 0) <= desired
    return _shaped(lws, desired, ready, updated, int(st.get("replicas") or 0), done, current=True)


def statefulset_groups_summary(groups: list[dict]) -> dict[str, Any]:
    """The group counts of a role's StatefulSets (one per group), shaped like a Deployment."""
    ready = updated = 0
    current = True
    for sts in groups:
        spec, st = sts.get("spec") or {}, sts.get("status") or {}
        size = int(spec.get("replicas", 1))
        gen = int((sts.get("metadata") or {}).get("generation") or 0)
        current = current and int(st.get("observedGeneration") or 0) >= gen
        ready += int(st.get("readyReplicas") or 0) >= size
        updated += int(st.get("updatedReplicas") or 0) >= size
    n = len(groups)
    return _shaped(groups[0], n, ready, updated, n, ready >= n and updated >= n, current)


def _shaped(obj: dict, desired: int, ready: int, updated: int, total: int, done: bool, current: bool) -> dict:
    meta = obj.get("metadata") or {}
    gen = int(meta.get("generation") or 0)
    return {
        "kind": obj.get("kind"),
        "metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {}), "generation": gen},
        "spec": {"replicas": desired},
        "status": {
            "observedGeneration": gen if current else 0,
            "replicas": total,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "conditions": [
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable" if done else "Updating"}
            ],
        },
    }


def role_workload(children: dict[tuple[str, str], dict], name: str) -> Optional[dict]:
    """The workload named ``name`` (a Deployment, a LeaderWorkerSet, or StatefulSets ``name-g<i>``), as a
    Deployment-shaped dict; None when none exists."""
    dep = children.get(("Deployment", name))
    if dep is not None:
        return dep
    lws = children.get((LWS_KIND, name))
    if lws is not None:
        return lws_summary(lws)
    groups = [obj for (kind, n), obj in sorted(children.items()) if kind == "StatefulSet" and _is_group_of(n, name)]
    return statefulset_groups_summary(groups) if groups else None


def _is_group_of(sts_name: str, base: str) -> bool:
    prefix = base + "-g"
    return sts_name.startswith(prefix) and sts_name[len(prefix) :].isdigit()


def group_base(kind: str, name: str) -> str:
    """The Deployment-equivalent name of a group workload (a StatefulSet ``X-g3`` belongs to ``X``)."""
    if kind == "StatefulSet" and "-g" in name and name.rsplit("-g", 1)[1].isdigit():
        return name.rsplit("-g", 1)[0]
    return name


# ------------------------------------------------------------------------------- leaders
def pod_index(pod: dict) -> Optional[str]:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(LWS_WORKER_INDEX_LABEL, labels.get(STS_POD_INDEX_LABEL))


def leader_of(pod: dict) -> Optional[str]:
    """The name of the leader pod of ``pod``'s group; None when ``pod`` is a leader or in no group.

    LeaderWorkerSet pods are named ``<lws>-<group>`` (leader) and ``<lws>-<group>-<index>``; StatefulSet pods
    ``<sts>-<ordinal>``, the leader being ordinal 0."""
    index = pod_index(pod)
    if index in (None, "0"):
        return None
    name = (pod.get("metadata") or {}).get("name") or ""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    base = name.rsplit("-", 1)[0]
    return f"{base}-0" if STS_POD_INDEX_LABEL in labels and LWS_WORKER_INDEX_LABEL not in labels else base


# ------------------------------------------------------------------------------- restarts
def _restarts(pod: dict) -> int:
    return sum(int(c.get("restartCount") or 0) for c in (pod.get("status") or {}).get("containerStatuses") or [])


def pod_record(pods: list[dict]) -> str:
    """``uid:restarts`` of each pod, sorted: what :data:`GROUP_PODS_ANNOTATION` holds."""
    return ",".join(sorted(f"{p['metadata']['uid']}:{_restarts(p)}" for p in pods))


@dataclass(frozen=True)
class GroupAction:
    """On StatefulSet ``statefulset``: set its record to ``record`` (None: remove it) and delete ``delete``."""

    statefulset: str
    record: Optional[str]
    delete: tuple[str, ...] = ()
    reason: str = ""


def group_restarts(statefulsets: list[dict], pods: list[dict]) -> list[GroupAction]:
    """What the operator does to each StatefulSet group on this pass (module docstring)."""
    out = []
    for sts in statefulsets:
        meta = sts.get("metadata") or {}
        name = meta.get("name")
        size = int((sts.get("spec") or {}).get("replicas", 1))
        members = [
            p
            for p in pods
            if ((p.get("metadata") or {}).get("labels") or {}).get(GROUP_LABEL) == name
            and not (p.get("metadata") or {}).get("deletionTimestamp")
        ]
        recorded = (meta.get("annotations") or {}).get(GROUP_PODS_ANNOTATION)
        now = pod_record(members)
        whole = len(members) == size and all(_ready_condition(p) or _running(p) for p in members)
        if recorded:
            if set(recorded.split(",")) <= set(now.split(",")) and len(members) == size:
                continue  # the group is as recorded
            lost = sorted(set(recorded.split(",")) - set(now.split(",")))
            out.append(
                GroupAction(
                    name,
                    None,
                    tuple(sorted(p["metadata"]["name"] for p in members)),
                    f"group {name}: pod {'/'.join(lost)} was lost or restarted; restarting the whole group",
                )
            )
        elif whole:
            out.append(GroupAction(name, now, (), f"group {name}: all {size} pods running"))
    return out


def _running(pod: dict) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "ContainersReady" and c.get("status") == "True" for c in st.get("conditions") or []
    )
