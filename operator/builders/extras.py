"""ConfigMap (the resolved configuration), HorizontalPodAutoscalers and PodDisruptionBudgets."""

from __future__ import annotations

import json
from typing import Any, Optional

from kvship.operator.builders.common import child_name, instance_labels, metadata, role_labels, role_selector
from kvship.operator.spec import ServiceConfig
from kvship.operator.types import Autoscaling


def config_map(cfg: ServiceConfig, argv: dict[str, list[str]], revision: str) -> dict[str, Any]:
    """``<name>-config``: what the operator resolved from the spec (mode, served name, each role's argv).

    A record for people and tools (``kubectl get cm NAME-config -o yaml``); the pods carry their
    own arguments, so a spec change rolls them through their Deployments.
    """
    data = {
        "mode": cfg.mode,
        "served-model-name": cfg.served_name,
        "model-uri": cfg.spec.model.uri,
        "revision": revision,
        "args.json": json.dumps(argv, indent=2, sort_keys=True),
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(cfg, f"{cfg.name}-config", instance_labels(cfg)),
        "data": data,
    }


def autoscaler(cfg: ServiceConfig, role: str, a: Autoscaling, target: str | None = None) -> dict[str, Any]:
    """autoscaling/v2 HPA ``<name>-<role>`` of the Deployment ``target`` (default: the role's child name;
    PD workers: the current revision's Deployment, so a rollout hands the HPA to the new set)."""
    if a.metric in ("cpu", "memory"):
        metric = {
            "type": "Resource",
            "resource": {"name": a.metric, "target": {"type": "Utilization", "averageUtilization": int(a.target)}},
        }
    else:
        metric = {
            "type": "Pods",
            "pods": {"metric": {"name": a.metric}, "target": {"type": "AverageValue", "averageValue": str(a.target)}},
        }
    name = child_name(cfg, role)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(cfg, name, role_labels(cfg, role)),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target or name},
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [metric],
        },
    }


def disruption_budget(cfg: ServiceConfig, role: str, replicas: int, a: Optional[Autoscaling]) -> Optional[dict]:
    """At most one pod of a multi-pod role is evicted at a time (none for single-pod roles)."""
    most = a.max_replicas if a is not None else replicas
    if most < 2:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(cfg, child_name(cfg, role), role_labels(cfg, role)),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": role_selector(cfg, role)}},
    }
