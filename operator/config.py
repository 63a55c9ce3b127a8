"""``OperatorConfig``: the operator's frozen configuration, one field per ``kvship operator`` flag.

Importing this module never imports torch or the engine (the argparse
helpers come from ``kvship.common.cli_args``).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
from dataclasses import dataclass
from typing import Optional

from kvship.common.cli_args import add_dataclass_arguments, dataclass_from_namespace, opt
from kvship.operator.builders.common import DEFAULT_OPERATOR_POD_LABELS, DEFAULT_WORKER_ALLOW_CIDRS, Network

DEFAULT_WORKER_IMAGE = "ghcr.io/kvship/worker:0.1.0"
DEFAULT_ROUTER_IMAGE = "ghcr.io/kvship/router:0.1.0"
# The router's Service inside the cluster (the operator runs there too).
DEFAULT_ROUTER_URL = "http://{name}-router.{namespace}.svc:{port}"


@dataclass(frozen=True)
class OperatorConfig:
    """Configuration of the operator process (``kvship operator``)."""

    kubeconfig: Optional[str] = opt(
        None, "kubeconfig file (default: in-cluster service account, then $KUBECONFIG / ~/.kube/config)"
    )
    namespace: list[str] = opt(
        [],
        "Watch these namespaces (one or more after the flag); default: the operator's own namespace "
        "(its service account's in a pod, else the kubeconfig context's)",
        nargs="+",
    )
    all_namespaces: bool = opt(False, "Watch InferenceServices in every namespace (needs cluster-wide RBAC)")
    worker_image: str = opt(DEFAULT_WORKER_IMAGE, "Worker image when spec.engine.image is not set")
    router_image: str = opt(DEFAULT_ROUTER_IMAGE, "Router image when spec.router.image is not set")
    image_pull_policy: str = opt(
        "IfNotPresent",
        "Pull policy when spec.engine.imagePullPolicy is not set",
        choices=("Always", "IfNotPresent", "Never"),
    )
    liveness_port: int = opt(8080, "Port of the liveness endpoint GET /healthz (0 = off)")
    resync_interval: float = opt(
        30.0,
        "Seconds between level-based reconciles of each InferenceService "
        "(re-applies drifted children, refreshes status)",
    )
    watch_timeout: float = opt(300.0, "Seconds one watch request lasts before it is renewed")
    router_url: str = opt(
        DEFAULT_ROUTER_URL,
        "Where the operator reaches each InferenceService's router (GET /workers for the in-rotation readiness "
        "gate and rollouts, GET /slo for status.slo); {name}, {namespace} and {port} are filled in",
    )
    router_timeout: float = opt(5.0, "Seconds one request to a router may take")
    allowed_image_prefixes: str = opt(
        "",
        "Comma-separated prefixes an image named by an InferenceService (spec.engine.image, spec.router.image) "
        "must start with, e.g. registry.example.com/kvship/; a spec naming another image is refused. "
        "Empty: any image",
    )
    worker_allow_cidrs: str = opt(
        ",".join(DEFAULT_WORKER_ALLOW_CIDRS),
        "Comma-separated CIDRs given to each router as --worker-allow-cidrs (addresses POST /workers may "
        "register; the pod network)",
    )
    operator_pod_labels: str = opt(
        ",".join(f"{k}={v}" for k, v in DEFAULT_OPERATOR_POD_LABELS),
        "Labels of the operator's own pods (KEY=VALUE,...), allowed by the NetworkPolicies to reach workers",
    )
    operator_namespace: Optional[str] = opt(
        None,
        "Namespace the operator's pods run in, for the NetworkPolicies (default: the operator's own: its "
        "service account's, else the kubeconfig context's)",
    )
    log_level: str = opt("info", "Log level", choices=("debug", "info", "warning", "error"))

    @property
    def clusterwide(self) -> bool:
        return self.all_namespaces

    def with_namespace_default(self, own_namespace: Optional[str]) -> "OperatorConfig":
        """Namespaced by default: without --namespace / --all-namespaces, watch ``own_namespace``."""
        if self.all_namespaces or self.namespace:
            return self
        return dataclasses.replace(self, namespace=[own_namespace or "default"])

    def with_operator_namespace_default(self, own_namespace: Optional[str]) -> "OperatorConfig":
        """Without --operator-namespace, the NetworkPolicies expect the operator in ``own_namespace``."""
        if self.operator_namespace:
            return self
        return dataclasses.replace(self, operator_namespace=own_namespace)

    @property
    def image_prefixes(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.allowed_image_prefixes.split(",") if p.strip())

    @property
    def network(self) -> Network:
        """What the builders need of these settings."""
        return Network(
            worker_allow_cidrs=tuple(c.strip() for c in self.worker_allow_cidrs.split(",") if c.strip()),
            operator_pod_labels=tuple(_labels(self.operator_pod_labels).items()),
            operator_namespace=self.operator_namespace or None,
        )

    def router_url_of(self, name: str, namespace: str, port: int) -> str:
        """The URL of InferenceService ``namespace/name``'s router (``port``: its Service port)."""
        return self.router_url.format(name=name, namespace=namespace, port=port).rstrip("/")

    @property
    def liveness_endpoint(self) -> Optional[str]:
        return f"http://0.0.0.0:{self.liveness_port}/healthz" if self.liveness_port else None

    def validate(self) -> None:
        """Raise ValueError naming the flag for inconsistent settings."""
        if self.all_namespaces and self.namespace:
            raise ValueError("--all-namespaces and --namespace are mutually exclusive")
        if not 0 <= self.liveness_port < 65536:
            raise ValueError("--liveness-port must be in 0..65535")
        if self.resync_interval <= 0 or self.watch_timeout <= 0:
            raise ValueError("--resync-interval and --watch-timeout must be > 0")
        if self.router_timeout <= 0:
            raise ValueError("--router-timeout must be > 0")
        try:
            url = self.router_url_of("name", "namespace", 8000)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"--router-url: only {{name}}, {{namespace}} and {{port}} may be filled in ({e})"
            ) from None
        if not url.startswith(("http://", "https://")):
            raise ValueError("--router-url must start with http:// or https://")
        if not self.worker_image or not self.router_image:
            raise ValueError("--worker-image and --router-image must not be empty")
        for cidr in self.network.worker_allow_cidrs:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"--worker-allow-cidrs: {cidr!r} is not a CIDR (e.g. 10.0.0.0/8)") from None
        if not self.network.worker_allow_cidrs:
            raise ValueError("--worker-allow-cidrs must name at least one CIDR (the pod network)")
        _labels(self.operator_pod_labels)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_arguments(parser, cls)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "OperatorConfig":
        return dataclass_from_namespace(cls, ns)


LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def _labels(text: str) -> dict[str, str]:
    """``KEY=VALUE,...`` -> labels; ValueError naming --operator-pod-labels when malformed or empty."""
    out = {}
    for item in (i.strip() for i in text.split(",")):
        key, eq, value = item.partition("=")
        if not item or not eq or not LABEL_KEY.match(key) or not LABEL_VALUE.match(value):
            raise ValueError(f"--operator-pod-labels: {item!r} is not KEY=VALUE with a valid label key and value")
        out[key] = value
    return out
