"""Router children: Deployment, Service, and the RBAC its pod discovery needs.

The router finds workers itself by watching pods with the role selectors
(``--service-discovery --selector ...`` in unified mode, ``--pd
--prefill-selector ... --decode-selector ...`` in PD mode), so scaling a
worker role needs no router restart.  Its ServiceAccount may only get, list
and watch pods in the service's namespace.
"""

from __future__ import annotations

from typing import Any

from kvship.operator.builders import common
from kvship.operator.builders.common import (
    CREDENTIALS_ANNOTATION,
    ROUTER_PORT,
    WORKER_PORT,
    Images,
    Network,
    child_name,
    container_security_context,
    http_probe,
    instance_labels,
    metadata,
    role_labels,
    role_selector,
    secret_env,
)
from kvship.operator.builders.credentials import admin_key_env, worker_key_env
from kvship.operator.builders.groups import grouped, leader_label
from kvship.operator.spec import ServiceConfig

# Requested where the spec names no cpu / memory, so the router is never BestEffort.
DEFAULT_REQUESTS = {"cpu": "250m", "memory": "256Mi"}


def discovery_selector(cfg: ServiceConfig, role: str, network: Network) -> dict[str, str]:
    """The pods the router discovers for ``role``: with worker groups only the leaders (index 0) serve HTTP."""
    selector = role_selector(cfg, role)
    if grouped(cfg, role):
        selector[leader_label(network.leader_worker_set)] = "0"
    return selector


def _selector_args(selector: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in sorted(selector.items())]


def router_args(cfg: ServiceConfig, network: Network = Network()) -> list[str]:
    """The router container's argv after the ``kvship`` entrypoint (flags of ``kvship router``).

    ``POST /workers`` may register only workers of this namespace's Services or of the pod network
    (``--worker-allow-hosts`` / ``--worker-allow-cidrs``); discovered pods are registered by the router's own
    discovery, which the allow-list does not limit (docs/router.md)."""
    r = cfg.spec.router
    args = [
        "router",
        "--host",
        "0.0.0.0",
        "--port",
        str(ROUTER_PORT),
        "--policy",
        r.policy,
        "--cache-threshold",
        repr(float(r.cache_threshold)),
        "--balance-abs-threshold",
        str(r.balance_abs_threshold),
        "--balance-rel-threshold",
        repr(float(r.balance_rel_threshold)),
        "--service-discovery",
        "--namespace",
        cfg.namespace,
        "--service-discovery-port",
        str(WORKER_PORT),
        "--worker-allow-hosts",
        f"*.{cfg.namespace}.svc,*.{cfg.namespace}.svc.cluster.local",
        "--worker-allow-cidrs",
        ",".join(network.worker_allow_cidrs),
    ]
    if cfg.unified:
        args += ["--selector", *_selector_args(discovery_selector(cfg, "unified", network))]
    else:
        args += [
            "--pd",
            "--prefill-selector",
            *_selector_args(discovery_selector(cfg, "prefill", network)),
            "--decode-selector",
            *_selector_args(discovery_selector(cfg, "decode", network)),
        ]
        if r.prefill_policy:
            args += ["--prefill-policy", r.prefill_policy]
        if r.decode_policy:
            args += ["--decode-policy", r.decode_policy]
    args += common.tracing_args(cfg.spec)
    return args + list(r.extra_args)


def router_deployment(
    cfg: ServiceConfig, images: Images, network: Network = Network(), credentials: str | None = None
) -> dict[str, Any]:
    """The router's Deployment: the client key (the user's Secret, optional), the worker key (what it sends to
    workers) and the admin key (``POST`` / ``DELETE /workers``) come from Secrets as env
    (builders/credentials.py); ``credentials`` rolls the pods when those Secrets change."""
    r = cfg.spec.router
    pull = cfg.spec.engine.image_pull_policy or images.pull_policy
    env: list[dict[str, Any]] = []
    if r.api_key_secret_ref is not None:
        env.append(secret_env("KVSHIP_API_KEY", r.api_key_secret_ref))
    env += [worker_key_env(cfg, "KVSHIP_WORKER_API_KEY"), admin_key_env(cfg)]
    env += [dict(e) for e in r.env]
    container: dict[str, Any] = {
        "name": "router",
        "image": r.image or images.router,
        "imagePullPolicy": pull,
        "args": router_args(cfg, network),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "securityContext": container_security_context(),
        "readinessProbe": http_probe("/health", "http", period=5, timeout=3, failures=3),
        "livenessProbe": http_probe("/health", "http", period=15, timeout=5, failures=4),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    container["env"] = env
    container["resources"] = common.with_default_requests(r.resources, DEFAULT_REQUESTS)
    pod: dict[str, Any] = {
        "serviceAccountName": child_name(cfg, "router"),
        "securityContext": common.pod_security_context(),
        "terminationGracePeriodSeconds": 45,
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    common.scheduling(pod, r.node_selector, r.tolerations, r.affinity, cfg.spec.engine.image_pull_secrets)
    replicas = None if r.autoscaling is not None else r.replicas
    return common.deployment(
        cfg,
        "router",
        pod,
        replicas=replicas,
        pod_annotations={CREDENTIALS_ANNOTATION: credentials} if credentials else {},
        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        progress_deadline=600,
    )


def router_service(cfg: ServiceConfig) -> dict[str, Any]:
    svc = cfg.spec.router.service
    port: dict[str, Any] = {"name": "http", "port": svc.port, "targetPort": "http", "protocol": "TCP"}
    if svc.node_port is not None:
        port["nodePort"] = svc.node_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(cfg, child_name(cfg, "router"), role_labels(cfg, "router"), svc.annotations),
        "spec": {"type": svc.type, "selector": role_selector(cfg, "router"), "ports": [port]},
    }


def router_rbac(cfg: ServiceConfig) -> list[dict[str, Any]]:
    """ServiceAccount + Role (pods: get/list/watch) + RoleBinding for the router's discovery."""
    name = child_name(cfg, "router")
    labels = instance_labels(cfg)
    labels["app.kubernetes.io/component"] = "router"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(cfg, name, labels)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": metadata(cfg, name, labels),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata(cfg, name, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": cfg.namespace}],
        },
    ]
