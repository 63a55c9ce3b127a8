"""Status of an InferenceService, computed from what exists (pure; level-based).

``compute_status`` takes the parse result, the live Deployments/Services and
the previous status, and returns the whole new ``status``: phase, the five
conditions (a condition keeps its ``lastTransitionTime`` while its status
stays the same), per-role replica counts and the router URL.

Phase, first match wins::

    Failed       the spec is invalid, or a child could not be applied
    Ready        every role has all its replicas ready on the current spec
    Pending      a role's Deployment does not exist yet
    Progressing  a rollout is under way (new pods starting or old ones leaving)
    Degraded     rollouts are done (or stuck past their deadline) but a role lacks ready pods
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Optional

from kvship.operator.builders.common import child_name, worker_roles
from kvship.operator.spec import ServiceConfig

ROLE_CONDITION = {"prefill": "PrefillReady", "decode": "DecodeReady", "unified": "DecodeReady", "router": "RouterReady"}


@dataclass(frozen=True)
class RoleState:
    """One role's Deployment, summarised."""

    role: str
    exists: bool
    desired: int = 0
    ready: int = 0
    updated: int = 0
    total: int = 0
    current: bool = False  # the controller has seen the latest spec
    deadline_exceeded: bool = False
    rollout_done: bool = False  # its Progressing condition says NewReplicaSetAvailable

    @property
    def all_ready(self) -> bool:
        return self.exists and self.current and self.ready >= self.desired and self.updated >= self.desired

    @property
    def rolling(self) -> bool:
        return (
            not self.current
            or self.updated < self.desired
            or self.total > self.desired
            or (self.ready < self.desired and not self.rollout_done)
        )

    def as_status(self) -> dict[str, Any]:
        return {
            "replicas": self.desired,
            "readyReplicas": self.ready,
            "updatedReplicas": self.updated,
            "ready": f"{self.ready}/{self.desired}",
        }


def role_state(role: str, deployment: Optional[dict]) -> RoleState:
    if deployment is None:
        return RoleState(role=role, exists=False)
    spec, st = deployment.get("spec") or {}, deployment.get("status") or {}
    gen = int((deployment.get("metadata") or {}).get("generation") or 0)
    conds = {c.get("type"): c for c in st.get("conditions") or []}
    progressing = conds.get("Progressing") or {}
    return RoleState(
        role=role,
        exists=True,
        desired=int(spec.get("replicas", 1)),
        ready=int(st.get("readyReplicas") or 0),
        updated=int(st.get("updatedReplicas") or 0),
        total=int(st.get("replicas") or 0),
        current=int(st.get("observedGeneration") or 0) >= gen,
        deadline_exceeded=progressing.get("reason") == "ProgressDeadlineExceeded",
        rollout_done=progressing.get("reason") == "NewReplicaSetAvailable",
    )


def router_url(cfg: ServiceConfig, service: Optional[dict]) -> str:
    port = cfg.spec.router.service.port
    ingress = (((service or {}).get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    if cfg.spec.router.service.type == "LoadBalancer" and ingress:
        host = ingress[0].get("ip") or ingress[0].get("hostname")
        if host:
            return f"http://{host}:{port}"
    return f"http://{child_name(cfg, 'router')}.{cfg.namespace}.svc:{port}"


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(
    ctype: str, ok: Optional[bool], reason: str, message: str, generation: int, previous: dict[str, dict], now: str
) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    prev = previous.get(ctype)
    when = (
        prev["lastTransitionTime"] if prev and prev.get("status") == status and prev.get("lastTransitionTime") else now
    )
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": when,
        "observedGeneration": generation,
    }


def _role_condition(s: RoleState, what: str) -> tuple[bool, str, str]:
    if not s.exists:
        return False, "DeploymentMissing", f"the {what} Deployment does not exist yet"
    msg = f"{s.ready}/{s.desired} {what} pods ready, {s.updated} on the current spec"
    if s.all_ready:
        return True, "AllReplicasReady", msg
    if s.deadline_exceeded:
        return False, "ProgressDeadlineExceeded", msg + "; the rollout is stuck (check the pods' events)"
    return False, ("RollingOut" if s.rolling else "ReplicasNotReady"), msg


def compute_status(
    body: dict,
    cfg: Optional[ServiceConfig],
    spec_errors: list[str],
    apply_errors: list[str],
    children: dict[tuple[str, str], dict],
    now: Optional[str] = None,
) -> dict[str, Any]:
    """The full ``status`` of the InferenceService ``body`` (see the module docstring)."""
    now = now or now_rfc3339()
    generation = int((body.get("metadata") or {}).get("generation") or 0)
    previous = {c.get("type"): c for c in ((body.get("status") or {}).get("conditions") or [])}

    def cond(ctype: str, ok: Optional[bool], reason: str, message: str) -> dict[str, Any]:
        return _condition(ctype, ok, reason, message, generation, previous, now)

    empty = {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0, "ready": "0/0"}
    if cfg is None:  # invalid spec: no children are made
        message = "; ".join(spec_errors)
        conditions = [
            cond("Valid", False, "InvalidSpec", message),
            cond("Ready", False, "InvalidSpec", "fix the spec: " + message),
        ]
        conditions += [
            cond(t, None, "InvalidSpec", "not evaluated: the spec is invalid")
            for t in ("PrefillReady", "DecodeReady", "RouterReady")
        ]
        return {
            "phase": "Failed",
            "conditions": conditions,
            "prefill": empty,
            "decode": empty,
            "router": empty,
            "observedGeneration": generation,
        }

    states = {
        role: role_state(role, children.get(("Deployment", child_name(cfg, role))))
        for role in worker_roles(cfg) + ("router",)
    }
    conditions = [cond("Valid", True, "SpecValid", f"{cfg.mode} mode, serving {cfg.served_name}")]
    role_conds = {}
    if cfg.unified:
        role_conds["PrefillReady"] = cond(
            "PrefillReady", True, "Unified", "prefill.replicas is 0: unified workers, no prefill role"
        )
    for role, s in states.items():
        what = "unified worker" if role == "unified" else role
        ok, reason, msg = _role_condition(s, what)
        role_conds[ROLE_CONDITION[role]] = cond(ROLE_CONDITION[role], ok, reason, msg)
    url = router_url(cfg, children.get(("Service", child_name(cfg, "router"))))
    all_ready = all(s.all_ready for s in states.values())
    if apply_errors:
        phase, ready = "Failed", cond("Ready", False, "ApplyFailed", "; ".join(apply_errors))
    elif all_ready:
        phase, ready = "Ready", cond("Ready", True, "ServiceReady", f"serving {cfg.served_name} at {url}")
    else:
        missing = [s for s in states.values() if not s.exists]
        rolling = [s for s in states.values() if s.rolling and not s.deadline_exceeded]
        phase = "Pending" if missing else ("Progressing" if rolling else "Degraded")
        waiting = [ROLE_CONDITION[r] for r, s in states.items() if not s.all_ready]
        ready = cond("Ready", False, phase, "waiting for " + ", ".join(dict.fromkeys(waiting)))
    conditions += [ready, role_conds["PrefillReady"], role_conds["DecodeReady"], role_conds["RouterReady"]]
    decode_state = states["unified" if cfg.unified else "decode"]
    return {
        "phase": phase,
        "mode": cfg.mode,
        "conditions": conditions,
        "prefill": empty if cfg.unified else states["prefill"].as_status(),
        "decode": decode_state.as_status(),
        "router": states["router"].as_status(),
        "url": url,
        "observedGeneration": generation,
    }


def status_changed(old: Optional[dict], new: dict) -> bool:
    """Whether writing ``new`` would change anything (ignores nothing: conditions keep their times)."""
    return (old or {}) != new
