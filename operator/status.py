"""Status of an InferenceService, computed from what exists (pure; level-based).

``compute_status`` takes the parse result, the live Deployments/Services,
the previous status and what was read from the router, and returns the whole
new ``status``: phase, the conditions (a condition keeps its
``lastTransitionTime`` while its status stays the same), per-role replica
counts of the current revision, every live revision with its counts
(``revisions``), the router URL and the router's live figures (``slo``).

Phase, first match wins::

    Failed       the spec is invalid, or a child could not be applied
    Ready        every role has all its replicas ready on the current spec
    Pending      a role's Deployment does not exist yet
    Progressing  a rollout is under way (new pods starting, old ones leaving, an old revision draining)
    Degraded     rollouts are done (or stuck past their deadline) but a role lacks ready pods
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Optional

from kvship.operator.builders.common import child_name, deployment_name, worker_roles
from kvship.operator.builders.store import MASTER_ROLE, runs_master
from kvship.operator.groups import role_workload
from kvship.operator.rollout import RolloutPlan, SyncSummary, revision_sets
from kvship.operator.router_client import RouterView
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


@dataclass(frozen=True)
class Observed:
    """What the controller learnt on this pass besides the children.

    ``revision``: the spec's worker revision.  ``router``: the router's answer, ``None`` when it was not
    read on this pass (a child event): then the router-derived parts of the status (``slo``, the
    RouterSynced and SLOMet conditions, each revision's ``serving`` / ``inFlight``) are carried over.
    """

    revision: Optional[str] = None
    router: Optional[RouterView] = None
    sync: Optional[SyncSummary] = None
    plan: Optional[RolloutPlan] = None


SLO_FIELDS = {  # status.slo field <- GET /slo key, digits kept
    "ttftP50Ms": ("ttft_p50_ms", 1),
    "ttftP90Ms": ("ttft_p90_ms", 1),
    "itlP50Ms": ("itl_p50_ms", 2),
    "requestsPerSecond": ("requests_per_second", 2),
    "outputTokensPerSecond": ("output_tokens_per_second", 1),
    "kvTransferGBps": ("kv_transfer_gbps", 4),
}


def slo_status(slo: dict, now: str) -> dict[str, Any]:
    """``status.slo`` from the router's ``GET /slo`` answer (figures without a sample are left out)."""
    window = slo.get("window_s")
    out: dict[str, Any] = {
        "window": f"{window:g}s" if isinstance(window, (int, float)) else "60s",
        "requests": int(slo.get("requests") or 0),
    }
    for name, (key, digits) in SLO_FIELDS.items():
        value = slo.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = round(float(value), digits)
    out["observedAt"] = now
    return out


def slo_condition(targets: Any, slo: Optional[dict]) -> tuple[Optional[bool], str, str]:
    """SLOMet from ``spec.slo`` targets and ``status.slo`` figures: the message gives each figure and target."""
    if slo is None:
        return None, "NoFigures", "the router's figures could not be read"
    checks = [
        ("ttft p90", slo.get("ttftP90Ms"), targets.ttft_p90_ms),
        ("itl p50", slo.get("itlP50Ms"), targets.itl_p50_ms),
    ]
    checks = [(n, v, t) for n, v, t in checks if t is not None]
    if not checks:
        return None, "NoTargets", "spec.slo sets no target"
    if any(v is None for _, v, _ in checks):
        return None, "NoSamples", f"no requests in the last {slo.get('window', '60s')}"
    parts = [f"{n} {v:g} ms {'<=' if v <= t else '>'} target {t:g} ms" for n, v, t in checks]
    missed = [p for p, (_, v, t) in zip(parts, checks) if v > t]
    if missed:
        return False, "TargetMissed", "; ".join(parts)
    return True, "TargetsMet", "; ".join(parts)


def revisions_status(
    children: dict[tuple[str, str], dict], target: str, router: Optional[RouterView], previous: list[dict]
) -> list[dict[str, Any]]:
    """``status.revisions``: each live revision's ready counts, newest (the current one) first."""
    prev = {r.get("revision"): r for r in previous or []}
    out = []
    sets = revision_sets(children)
    for rev in sorted(sets, key=lambda r: (r != target, r)):
        rs = sets[rev]
        entry: dict[str, Any] = {"revision": rev or "unlabelled", "current": rev == target}
        for role, key in (("prefill", "prefill"), ("decode", "decode"), ("unified", "decode")):
            if role in rs.deployments:
                ready, desired = rs.counts(role)
                entry[key] = f"{ready}/{desired}"
        entry.setdefault("prefill", "0/0")
        entry.setdefault("decode", "0/0")
        if router is not None and router.reachable:
            entry["serving"] = rev in router.serving()
            entry["inFlight"] = router.in_flight(rev)
        elif router is None and entry["revision"] in prev:
            for key in ("serving", "inFlight"):
                if key in prev[entry["revision"]]:
                    entry[key] = prev[entry["revision"]][key]
        out.append(entry)
    return out


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


def now_precise() -> str:
    """RFC 3339 with milliseconds: when the router's figures were read (their window ends then)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


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
    observed: Optional[Observed] = None,
) -> dict[str, Any]:
    """The full ``status`` of the InferenceService ``body`` (see the module docstring).

    ``observed.revision`` picks the worker Deployments the role counts come from (those of the current
    revision); without it they are the unrevisioned ``<name>-<role>`` ones.
    """
    now = now or now_rfc3339()
    observed = observed or Observed()
    previous_status = body.get("status") or {}
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

    rev = observed.revision

    def dep_name(role: str) -> str:
        return deployment_name(cfg, role, rev) if rev is not None else child_name(cfg, role)

    states = {
        role: role_state(role, role_workload(children, dep_name(role))) for role in worker_roles(cfg) + ("router",)
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
    plan = observed.plan
    if phase == "Ready" and plan is not None and plan.keep:  # the new set is up; the old one still drains
        phase = "Progressing"
    conditions += [ready, role_conds["PrefillReady"], role_conds["DecodeReady"], role_conds["RouterReady"]]
    router = observed.router
    if observed.sync is not None:
        conditions.append(cond("RouterSynced", observed.sync.ok, observed.sync.reason, observed.sync.message))
    elif "RouterSynced" in previous:
        conditions.append(previous["RouterSynced"])
    # A pass that could not read the router keeps the last figures (observedAt says how old they are).
    fresh = router is not None and router.reachable
    slo: Optional[dict] = None
    if fresh:
        slo = slo_status(router.slo, now_precise()) if router.slo is not None else None
    else:
        slo = previous_status.get("slo")
    if cfg.spec.slo is not None:
        if not fresh and "SLOMet" in previous:
            conditions.append(previous["SLOMet"])
        else:
            conditions.append(cond("SLOMet", *slo_condition(cfg.spec.slo, slo)))
    decode_state = states["unified" if cfg.unified else "decode"]

    def role_status(state: RoleState, nodes: int) -> dict[str, Any]:  # counts are groups when nodes > 1
        return dict(state.as_status(), nodesPerReplica=nodes) if nodes > 1 else state.as_status()

    out: dict[str, Any] = {
        "phase": phase,
        "mode": cfg.mode,
        "conditions": conditions,
        "prefill": empty if cfg.unified else role_status(states["prefill"], cfg.spec.prefill.nodes_per_replica),
        "decode": role_status(decode_state, cfg.spec.decode.nodes_per_replica),
        "router": states["router"].as_status(),
        "url": url,
        "observedGeneration": generation,
    }
    if runs_master(cfg):  # informational: the workers serve without it (docs/operator.md, "Shared KV tier")
        master = role_state(MASTER_ROLE, role_workload(children, child_name(cfg, MASTER_ROLE)))
        out["storeMaster"] = master.as_status()
    if rev is not None:
        out["revision"] = rev
        out["revisions"] = revisions_status(children, rev, router, previous_status.get("revisions") or [])
    if slo is not None:
        out["slo"] = slo
    return out


def status_changed(old: Optional[dict], new: dict) -> bool:
    """Whether writing ``new`` would change anything (ignores nothing: conditions keep their times)."""
    return (old or {}) != new
