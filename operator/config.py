"""``OperatorConfig``: the operator's frozen configuration, one field per ``kvship operator`` flag.

Importing this module never imports torch or the engine (the argparse
helpers come from ``kvship.common.cli_args``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional

from kvship.common.cli_args import add_dataclass_arguments, dataclass_from_namespace, opt

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
    log_level: str = opt("info", "Log level", choices=("debug", "info", "warning", "error"))

    @property
    def clusterwide(self) -> bool:
        return self.all_namespaces

    def with_namespace_default(self, own_namespace: Optional[str]) -> "OperatorConfig":
        """Namespaced by default: without --namespace / --all-namespaces, watch ``own_namespace``."""
        if self.all_namespaces or self.namespace:
            return self
        return dataclasses.replace(self, namespace=[own_namespace or "default"])

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

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_arguments(parser, cls)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "OperatorConfig":
        return dataclass_from_namespace(cls, ns)
