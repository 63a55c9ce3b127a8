"""The SLO planner in the operator: after each resync pass, scale the worker roles of slo-mode services.

``PlannerLoop.plan(client, cfg, revision, router)`` (called by the resync loop with what the pass read):

1. keeps one :class:`~kvship.operator.planner.Planner` per InferenceService (by uid; rebuilt when the
   service's autoscaling settings or targets change, dropped when it leaves slo mode);
2. reads the replicas of the *current* revision's worker Deployments (a draining revision is never
   scaled: its Deployments are left to the rollout, kvship.operator.rollout); for a role of multi-node
   groups (``nodesPerReplica`` > 1) its number of **groups**: the planner's last count (the
   InferenceService's ``kvship.io/planned-groups`` annotation, kvship.operator.groups), else the live
   LeaderWorkerSet's ``replicas`` or the number of its StatefulSets;
3. turns the router's ``GET /slo`` and ``GET /workers`` answers into figures, asks the planner, patches
   ``spec.replicas`` of each Deployment it changes (for groups: the annotation, from which the next reconcile
   sets the LeaderWorkerSet's ``replicas`` or adds / removes whole StatefulSets, the last groups first) and
   posts a Kubernetes Event on the InferenceService with the decision's reason (``ScaledUp`` /
   ``ScaledDown``) and the figures behind it (``kubectl describe``).

Nothing is decided while the router cannot be read.  The planner's memory (learnt capacities, recent
wants, cooldowns) lives in the operator process; after a restart it starts again from the profile.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional

from kvship.operator.builders.common import REVISION_LABEL, ROLE_LABEL, deployment_name, instance_labels, worker_roles
from kvship.operator.builders.groups import LWS_API_VERSION, LWS_KIND, grouped, nodes_per_replica
from kvship.operator.builders.workers import role_spec
from kvship.operator.controller import serves_leader_worker_set
from kvship.operator.groups import planned_groups, planned_groups_patch
from kvship.operator.kube import KubeApiError, KubeClient
from kvship.operator.planner import Decision, Planner, PlannerSettings, RoleTarget, figures_from_router
from kvship.operator.router_client import RouterView
from kvship.operator.spec import ServiceConfig, slo_mode
from kvship.operator.status import now_rfc3339
from kvship.operator.types import API_VERSION, KIND

log = logging.getLogger(__name__)
COMPONENT = "kvship-operator"


def planner_setup(cfg: ServiceConfig) -> tuple[PlannerSettings, list[RoleTarget]]:
    """The planner's settings and scaled roles from an slo-mode spec (validated by kvship.operator.spec)."""
    a = cfg.spec.autoscaling
    assert a is not None and cfg.spec.slo is not None
    settings = PlannerSettings(
        utilization=a.utilization,
        scale_up_window_s=a.scale_up_stabilization_seconds,
        scale_down_window_s=a.scale_down_stabilization_seconds,
        cooldown_s=a.cooldown_seconds,
        max_step_up=a.max_scale_up_step,
        max_step_down=a.max_scale_down_step,
    )
    profile = a.profile
    targets = []
    for role in worker_roles(cfg):
        r = role_spec(cfg, role)
        if r.autoscaling is None:
            continue
        ttft = cfg.spec.slo.ttft_p90_ms if role in ("prefill", "unified") else None
        itl = cfg.spec.slo.itl_p50_ms if role in ("decode", "unified") else None
        targets.append(
            RoleTarget(
                role=role,
                min_replicas=r.autoscaling.min_replicas,
                max_replicas=r.autoscaling.max_replicas,
                ttft_ms=ttft,
                itl_ms=itl,
                profile_rps=profile.prefill_requests_per_second if profile and ttft is not None else None,
                profile_concurrency=profile.decode_concurrency if profile and itl is not None else None,
            )
        )
    return settings, targets


def scale_event(cfg: ServiceConfig, decision: Decision, now: str) -> dict:
    """A core/v1 Event on the InferenceService recording one planner decision."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{cfg.name}.", "namespace": cfg.namespace},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": cfg.name,
            "namespace": cfg.namespace,
            "uid": cfg.uid,
        },
        "reason": decision.reason,
        "message": decision.message[:1000],
        "type": "Normal",
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


class PlannerLoop:
    """The planners of every slo-mode service this operator manages (one process, one event loop)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._planners: dict[str, tuple[tuple, Planner]] = {}

    def planner_for(self, cfg: ServiceConfig) -> Optional[Planner]:
        """The service's planner (made or remade when its settings changed); None outside slo mode."""
        if not slo_mode(cfg.spec):
            self._planners.pop(cfg.uid, None)
            return None
        settings, targets = planner_setup(cfg)
        key = (settings, tuple(targets))
        held = self._planners.get(cfg.uid)
        if held is None or held[0] != key:
            held = (key, Planner(settings, targets))
            self._planners[cfg.uid] = held
        return held[1]

    async def plan(
        self, client: KubeClient, cfg: ServiceConfig, revision: str, router: Optional[RouterView]
    ) -> list[Decision]:
        """One planner pass for ``cfg`` (see the module docstring); returns every decision, applied or held."""
        planner = self.planner_for(cfg)
        if planner is None or router is None or not router.reachable:
            return []
        current: dict[str, int] = {}
        body: Optional[dict] = None
        for role in planner.targets:
            if grouped(cfg, role):
                body = body or await client.get(API_VERSION, KIND, cfg.namespace, cfg.name)
                groups = await self._groups(client, cfg, role, revision, body or {})
                if groups is None:
                    return []
                current[role] = groups
                continue
            dep = await client.get("apps/v1", "Deployment", cfg.namespace, deployment_name(cfg, role, revision))
            if dep is None:
                return []  # the current revision's workers are not made yet
            current[role] = int((dep.get("spec") or {}).get("replicas", 1))
        now = self.clock()
        figures = figures_from_router(router.slo, router.workers, revision)
        decisions = planner.step(figures, current, now)
        for d in decisions:
            if not d.changed:
                log.debug("%s/%s planner: %s", cfg.namespace, cfg.name, d.message)
                continue
            name = deployment_name(cfg, d.role, revision)
            try:
                if grouped(cfg, d.role):  # whole groups: the builders make the planned count (module docstring)
                    name = f"the groups of {name}"
                    body = await client.merge_patch(
                        API_VERSION, KIND, cfg.namespace, cfg.name, planned_groups_patch(body or {}, d.role, d.desired)
                    )
                    n = nodes_per_replica(cfg, d.role)
                    d = dataclasses.replace(d, message=f"{d.message}; groups of {n} pods, scaled whole")
                else:
                    await client.merge_patch(
                        "apps/v1", "Deployment", cfg.namespace, name, {"spec": {"replicas": d.desired}}
                    )
            except KubeApiError as e:
                log.warning("%s/%s planner: scaling %s failed: %s", cfg.namespace, cfg.name, name, e)
                continue
            planner.applied(d, now)
            log.info("%s/%s planner %s: %s", cfg.namespace, cfg.name, d.reason, d.message)
            try:
                await client.create(scale_event(cfg, d, now_rfc3339()))
            except KubeApiError as e:
                log.warning("%s/%s planner: posting the %s event failed: %s", cfg.namespace, cfg.name, d.reason, e)
        return decisions

    @staticmethod
    async def _groups(client: KubeClient, cfg: ServiceConfig, role: str, revision: str, body: dict) -> Optional[int]:
        """The current revision's number of groups of ``role`` (module docstring); None while none exist."""
        name = deployment_name(cfg, role, revision)
        lws = (
            await client.get(LWS_API_VERSION, LWS_KIND, cfg.namespace, name)
            if await serves_leader_worker_set(client)
            else None
        )
        if lws is None:
            labels = dict(instance_labels(cfg), **{ROLE_LABEL: role, REVISION_LABEL: revision})
            selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            sets = await client.list("apps/v1", "StatefulSet", cfg.namespace, selector)
            if not sets:
                return None  # the current revision's groups are not made yet
            live = len(sets)
        else:
            live = int((lws.get("spec") or {}).get("replicas", 1))
        return planned_groups(body).get(role, live)
