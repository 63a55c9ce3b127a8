"""NetworkPolicies (networking.k8s.io/v1) of an InferenceService's pods (docs/operator.md, "Network policies").

``<name>-worker`` selects the worker pods (prefill + decode, or unified) and lets in

* PD only: every port from this service's prefill and decode pods (the bootstrap port, the tcp transfer
  port and the Mooncake / NIXL listeners, whose ports are chosen at run time);
* the HTTP port (30000) from this service's router pods, from the operator's pods (by their labels; in the
  operator's namespace when it runs in another one) and from ``spec.networkPolicy.workerHttpFrom``.

Unified workers in groups (``nodesPerReplica`` > 1) also let in every port from the service's worker pods (the
group's rendezvous and collectives), and so do unified workers sharing a Mooncake KV store (``spec.hicache``:
each reads pages from the others' segments, on ports chosen at run time).

``<name>-mooncake-master`` (``spec.hicache.storage: mooncake`` with the operator's master) lets in the master's
RPC port from this service's worker pods only: Mooncake does not authenticate it.

``<name>-router`` selects the router pods and lets anyone reach the router port: it is the endpoint.

Only ingress is restricted (egress stays open: workers download weights, routers reach the API server).
``spec.networkPolicy.enabled: false`` makes none, for clusters without a policy controller.
"""

from __future__ import annotations

from typing import Any

from kvship.operator.builders.common import (
    MANAGED_BY,
    ROLE_LABEL,
    ROUTER_PORT,
    WORKER_PORT,
    Network,
    child_name,
    instance_labels,
    metadata,
    role_selector,
)
from kvship.operator.builders.groups import any_grouped
from kvship.operator.builders.store import MASTER_ROLE, runs_master
from kvship.operator.spec import ServiceConfig

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def _pods_of(cfg: ServiceConfig, roles: list[str]) -> dict[str, Any]:
    return {
        "matchLabels": {"app.kubernetes.io/instance": cfg.name, "app.kubernetes.io/managed-by": MANAGED_BY},
        "matchExpressions": [{"key": ROLE_LABEL, "operator": "In", "values": roles}],
    }


def operator_peer(cfg: ServiceConfig, network: Network) -> dict[str, Any]:
    """The operator's pods as a NetworkPolicyPeer (a podSelector alone means the policy's own namespace)."""
    peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(network.operator_pod_labels)}}
    if network.operator_namespace and network.operator_namespace != cfg.namespace:
        peer["namespaceSelector"] = {"matchLabels": {NAMESPACE_NAME_LABEL: network.operator_namespace}}
    return peer


def _policy(cfg: ServiceConfig, name: str, selector: dict[str, Any], ingress: list[dict]) -> dict[str, Any]:
    labels = dict(instance_labels(cfg), **{"app.kubernetes.io/component": "network-policy"})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(cfg, name, labels),
        "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def network_policies(cfg: ServiceConfig, network: Network) -> list[dict[str, Any]]:
    """The service's NetworkPolicies (none when ``spec.networkPolicy.enabled`` is false)."""
    np = cfg.spec.network_policy
    if not np.enabled:
        return []
    workers = ["unified"] if cfg.unified else ["prefill", "decode"]
    http_from = [{"podSelector": {"matchLabels": role_selector(cfg, "router")}}, operator_peer(cfg, network)]
    http_from += [dict(p) for p in np.worker_http_from]
    ingress: list[dict[str, Any]] = []
    if not cfg.unified:
        ingress.append({"from": [{"podSelector": _pods_of(cfg, ["prefill", "decode"])}]})
    elif any_grouped(cfg) or cfg.spec.hicache.storage == "mooncake":
        # a worker group's pods reach each other on every port (rendezvous, gloo / NCCL), and so do the clients
        # of one Mooncake store (page reads from each other's segments)
        ingress.append({"from": [{"podSelector": _pods_of(cfg, workers)}]})
    ingress.append({"from": http_from, "ports": [{"protocol": "TCP", "port": WORKER_PORT}]})
    policies = []
    if runs_master(cfg):
        rpc = [{"protocol": "TCP", "port": cfg.spec.hicache.master.port}]
        policies.append(
            _policy(
                cfg,
                child_name(cfg, MASTER_ROLE),
                {"matchLabels": role_selector(cfg, MASTER_ROLE)},
                [{"from": [{"podSelector": _pods_of(cfg, workers)}], "ports": rpc}],
            )
        )
    return policies + [
        _policy(cfg, child_name(cfg, "unified"), _pods_of(cfg, workers), ingress),
        _policy(
            cfg,
            child_name(cfg, "router"),
            {"matchLabels": role_selector(cfg, "router")},
            [{"ports": [{"protocol": "TCP", "port": ROUTER_PORT}]}],
        ),
    ]
