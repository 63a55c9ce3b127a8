"""Layer 3, the glue: one reconcile pass of an InferenceService.

``reconcile`` = parse + validate -> make/read the Secrets -> build -> apply -> observe -> ask the router
-> retire drained revisions -> set the pods' in-rotation gates -> write status.
It is level-based and idempotent: the kopf create/update/resume handlers, the
resync timer and the child-event handler may all call it at any time.  Only
``reconcile`` reads the router (``router_url`` set); ``refresh_status``, run on
child events, carries the router-derived status over.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Optional

from kvship.operator.apply import ApplyResult, apply_children, merged_with_nulls, observe_children, removed_fields
from kvship.operator.builders import Images, Network, build_children, instance_labels, worker_revision
from kvship.operator.builders.common import ROLE_LABEL
from kvship.operator.builders.groups import GROUP_PODS_ANNOTATION, LWS_API_VERSION, LWS_KIND, any_grouped
from kvship.operator.credentials import ensure_credentials
from kvship.operator.groups import GROUP_KINDS, group_restarts, planned_groups
from kvship.operator.kube import KubeApiError, KubeClient
from kvship.operator.revision import REVISION_LABEL
from kvship.operator.rollout import (
    LEGACY,
    RolloutPlan,
    gate_patch,
    gate_updates,
    plan_rollout,
    revision_sets,
    router_synced,
)
from kvship.operator.router_client import RouterView, read_router
from kvship.operator.spec import ServiceConfig, SpecError, parse_service
from kvship.operator.status import Observed, compute_status, now_rfc3339, role_state

log = logging.getLogger(__name__)
API = ("kvship.io/v1alpha1", "InferenceService")


@dataclass
class Outcome:
    """What one pass found and did."""

    config: Optional[ServiceConfig] = None
    spec_errors: list[str] = field(default_factory=list)
    applied: ApplyResult = field(default_factory=ApplyResult)
    status: dict = field(default_factory=dict)
    status_written: bool = False
    revision: Optional[str] = None
    router: Optional[RouterView] = None
    plan: Optional[RolloutPlan] = None
    retired: list[str] = field(default_factory=list)  # revisions whose Deployments were deleted on this pass
    gates: list[str] = field(default_factory=list)  # "pod=True|False" for every gate condition set
    group_restarts: list[str] = field(default_factory=list)  # StatefulSet groups restarted on this pass


@dataclass(frozen=True)
class RouterAccess:
    """How the operator reaches each service's router (``url``: a template with {name}, {namespace}, {port})."""

    url: str
    timeout: float = 5.0

    def url_of(self, cfg: ServiceConfig) -> str:
        return self.url.format(name=cfg.name, namespace=cfg.namespace, port=cfg.spec.router.service.port).rstrip("/")


async def write_status(client: KubeClient, body: dict, status: dict) -> bool:
    """Patch ``status`` onto the object when it differs; False if nothing changed or it is gone."""
    if (body.get("status") or {}) == status:
        return False
    meta = body["metadata"]
    # conditions is a list: a merge patch replaces it whole, which is what we want; fields the new status
    # lacks (a figure of status.slo without samples now) are nulled, so no stale value stays behind
    patch = merged_with_nulls(status, removed_fields(body.get("status") or {}, status))
    try:
        await client.merge_patch(*API, meta.get("namespace"), meta["name"], {"status": patch}, "status")
    except KubeApiError as e:
        if e.status == 404:
            return False
        raise
    return True


def old_worker_revisions(cfg: ServiceConfig, revision: str, children: dict[tuple[str, str], dict]) -> list[str]:
    """Live PD worker revisions other than ``revision`` (none in unified mode: its one Deployment rolls in place)."""
    if cfg.unified:
        return []
    return [r for r, rs in revision_sets(children).items() if r != revision and set(rs.deployments) - {"unified"}]


async def serves_leader_worker_set(client: KubeClient) -> bool:
    """Whether the cluster serves ``leaderworkerset.x-k8s.io/v1`` LeaderWorkerSets (its CRD is installed)."""
    try:
        found = await client.request("GET", f"/apis/{LWS_API_VERSION}")
    except KubeApiError as e:
        if e.status in (404, 503):
            return False
        raise
    return any(r.get("kind") == LWS_KIND for r in (found or {}).get("resources") or [])


async def restart_groups(client: KubeClient, cfg: ServiceConfig, children: dict, out: "Outcome") -> None:
    """The StatefulSet fallback's RecreateGroupOnPodRestart (kvship.operator.groups.group_restarts)."""
    statefulsets = [obj for (kind, _), obj in children.items() if kind == "StatefulSet"]
    if not statefulsets:
        return
    selector = ",".join(f"{k}={v}" for k, v in sorted(instance_labels(cfg).items()))
    pods = await client.list("v1", "Pod", cfg.namespace, selector)
    for action in group_restarts(statefulsets, pods):
        note = {"metadata": {"annotations": {GROUP_PODS_ANNOTATION: action.record}}}
        await client.merge_patch("apps/v1", "StatefulSet", cfg.namespace, action.statefulset, note)
        for pod in action.delete:
            try:
                await client.delete("v1", "Pod", cfg.namespace, pod)
            except KubeApiError as e:
                if e.status != 404:
                    raise
        if action.delete:
            log.info("%s/%s: %s", cfg.namespace, cfg.name, action.reason)
            out.group_restarts.append(action.statefulset)


def keeps_old_revision(cfg: ServiceConfig, revision: str):
    """The predicate that spares other revisions' PD worker Deployments from pruning (the rollout owns them)."""

    def keep(kind: str, obj: dict) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return (
            not cfg.unified
            and kind in ("Deployment",) + GROUP_KINDS
            and labels.get(ROLE_LABEL) in ("prefill", "decode")
            and labels.get(REVISION_LABEL, LEGACY) != revision
        )

    return keep


async def retire(client: KubeClient, cfg: ServiceConfig, revision: str, children: dict) -> None:
    """Delete both worker Deployments of an old ``revision`` in one request (its set never goes half away)."""
    labels = dict(instance_labels(cfg))
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    if revision == LEGACY:
        for (kind, name), obj in list(children.items()):
            obj_labels = (obj.get("metadata") or {}).get("labels") or {}
            if (
                kind == "Deployment"
                and obj_labels.get(ROLE_LABEL) in ("prefill", "decode")
                and not obj_labels.get(REVISION_LABEL)
            ):
                await client.delete("apps/v1", "Deployment", cfg.namespace, name)
    else:
        kinds = {key[0] for key, obj in children.items() if key[0] in GROUP_KINDS}
        for api_version, kind in [("apps/v1", "Deployment")] + [
            (LWS_API_VERSION if kind == LWS_KIND else "apps/v1", kind) for kind in sorted(kinds)
        ]:
            await client.delete_collection(api_version, kind, cfg.namespace, f"{selector},{REVISION_LABEL}={revision}")
    for key, obj in list(children.items()):
        labels_of = (obj.get("metadata") or {}).get("labels") or {}
        if (
            key[0] in ("Deployment",) + GROUP_KINDS
            and labels_of.get(ROLE_LABEL) in ("prefill", "decode")
            and labels_of.get(REVISION_LABEL, LEGACY) == revision
        ):
            del children[key]


async def sync_gates(client: KubeClient, cfg: ServiceConfig, router: Optional[RouterView], out: Outcome) -> list[dict]:
    """Set each worker pod's in-rotation condition from the router's view; returns the pods (after the patches)."""
    selector = ",".join(f"{k}={v}" for k, v in sorted(instance_labels(cfg).items()))
    pods = await client.list("v1", "Pod", cfg.namespace, selector)
    now = now_rfc3339()
    by_name = {p["metadata"]["name"]: p for p in pods}
    for update in gate_updates(pods, router):
        try:
            by_name[update.pod] = await client.strategic_patch(
                "v1", "Pod", cfg.namespace, update.pod, gate_patch(update, now), "status"
            )
            out.gates.append(f"{update.pod}={update.status}")
        except KubeApiError as e:
            if e.status != 404:  # a pod deleted meanwhile needs no gate
                raise
    return list(by_name.values())


async def reconcile(
    client: KubeClient,
    body: dict,
    images: Images,
    router_access: Optional[RouterAccess] = None,
    network: Network = Network(),
) -> Outcome:
    """One full pass; raises only on API failures of the status write itself.

    Without ``router_access`` the router is not read: no gates are set and old revisions are kept.  While
    the service's Secrets cannot be made or read, nothing is applied (the pods could not start) and the
    router is not read; the errors go to status like a failed apply.
    """
    out = Outcome()
    try:
        out.config = parse_service(body, images.allowed_prefixes)
    except SpecError as e:
        out.spec_errors = e.errors
        out.status = compute_status(body, None, e.errors, [], {})
        out.status_written = await write_status(client, body, out.status)
        return out
    cfg = out.config
    out.revision = revision = worker_revision(cfg, images)
    creds = await ensure_credentials(client, cfg)
    if creds.errors:
        out.applied = ApplyResult(errors=list(creds.errors))
    else:
        if any_grouped(cfg):  # worker groups: LeaderWorkerSets where the cluster serves them, else StatefulSets
            network = replace(network, leader_worker_set=await serves_leader_worker_set(client))
        desired = build_children(cfg, images, network, creds.digest, planned_groups(body))
        out.applied = await apply_children(client, cfg, desired, keep=keeps_old_revision(cfg, revision))
    children = await observe_children(client, cfg)
    try:
        await restart_groups(client, cfg, children, out)
    except KubeApiError as e:
        out.applied.errors.append(f"restarting worker groups: {e.status} {e.reason}: {e.message}")
    router_dep = children.get(("Deployment", f"{cfg.name}-router"))
    router_ready = role_state("router", router_dep).ready > 0
    if router_access is not None and router_ready and creds.worker_key:
        out.router = await read_router(router_access.url_of(cfg), router_access.timeout, api_key=creds.worker_key)
    elif router_access is not None:
        reason = "no router pod is ready" if creds.worker_key else "the worker key Secret could not be read"
        out.router = RouterView(router_access.url_of(cfg), False, reason)
    old = old_worker_revisions(cfg, revision, children)
    out.plan = plan_rollout(revision, old, out.router)
    for rev in out.plan.remove:
        try:
            await retire(client, cfg, rev, children)
            out.retired.append(rev)
        except KubeApiError as e:
            out.applied.errors.append(f"removing revision {rev or '(unlabelled)'}: {e.status} {e.reason}: {e.message}")
    sync = None
    if router_access is not None:
        try:
            pods = await sync_gates(client, cfg, out.router, out)
        except KubeApiError as e:
            out.applied.errors.append(f"setting readiness gates: {e.status} {e.reason}: {e.message}")
            pods = []
        sync = router_synced(pods, revision, out.router, router_ready)
    observed = Observed(revision=revision, router=out.router, sync=sync, plan=out.plan)
    out.status = compute_status(body, cfg, [], out.applied.errors, children, observed=observed)
    out.status_written = await write_status(client, body, out.status)
    return out


async def refresh_status(client: KubeClient, namespace: str, name: str, images: Images) -> Optional[dict]:
    """Recompute the status of one InferenceService from its children, without applying anything.

    Used when a child changes.  Leaves the status alone while the spec is invalid or the last apply
    failed (the next reconcile owns those messages).  Returns the status written, if any.
    """
    body = await client.get(*API, namespace, name)
    if body is None:
        return None
    ready = next((c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
    if ready.get("reason") in ("ApplyFailed", "InvalidSpec"):
        return None
    try:
        cfg = parse_service(body, images.allowed_prefixes)
    except SpecError:
        return None
    children = await observe_children(client, cfg)
    revision = worker_revision(cfg, images)
    plan = plan_rollout(revision, old_worker_revisions(cfg, revision, children), None)
    status = compute_status(body, cfg, [], [], children, observed=Observed(revision=revision, plan=plan))
    return status if await write_status(client, body, status) else None
