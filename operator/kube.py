"""A small async Kubernetes API client for the operator (httpx, plain JSON).

Credentials come from the pod's service account (in-cluster) or a kubeconfig
file, loaded by the official ``kubernetes`` package so that exec plugins and
auth providers work; the same credentials log kopf in
(:func:`connection_info`).  Only the kinds the operator manages are known
(:data:`KINDS`); objects stay plain dicts.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import httpx

log = logging.getLogger(__name__)

# (apiVersion, kind) -> (plural, namespaced)
KINDS: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Secret"): ("secrets", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networkpolicies", True),
    ("v1", "Service"): ("services", True),
    ("v1", "ServiceAccount"): ("serviceaccounts", True),
    ("v1", "Pod"): ("pods", True),
    ("v1", "Event"): ("events", True),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("apps/v1", "StatefulSet"): ("statefulsets", True),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): ("leaderworkersets", True),
    ("rbac.authorization.k8s.io/v1", "Role"): ("roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rolebindings", True),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): ("horizontalpodautoscalers", True),
    ("policy/v1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("kvship.io/v1alpha1", "InferenceService"): ("inferenceservices", True),
}
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class KubeApiError(Exception):
    """The API answered ``status`` >= 400; ``reason`` and ``message`` come from its Status object."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


@dataclass(frozen=True)
class KubeAuth:
    """Where the API server is and how to authenticate to it."""

    server: str
    token: Optional[str] = None
    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    verify: bool = True
    default_namespace: Optional[str] = None


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(os.path.join(SA_DIR, "token"))


def load_auth(kubeconfig: Optional[str] = None) -> KubeAuth:
    """In-cluster service account when no kubeconfig is given and one exists; else the kubeconfig.

    Called again on 401 so that rotated service-account tokens are picked up.
    """
    import kubernetes.client
    import kubernetes.config

    cfg = kubernetes.client.Configuration()
    namespace = None
    if kubeconfig is None and in_cluster():
        kubernetes.config.load_incluster_config(client_configuration=cfg)
        with open(os.path.join(SA_DIR, "namespace"), encoding="utf-8") as f:
            namespace = f.read().strip() or None
    else:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        try:
            _, ctx = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
            namespace = (ctx or {}).get("context", {}).get("namespace")
        except Exception:  # a kubeconfig without contexts still authenticates
            namespace = None
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    token = header.split(" ", 1)[-1] if header else None
    return KubeAuth(
        server=cfg.host.rstrip("/"),
        token=token,
        ca_file=cfg.ssl_ca_cert or None,
        cert_file=cfg.cert_file or None,
        key_file=cfg.key_file or None,
        verify=bool(cfg.verify_ssl),
        default_namespace=namespace,
    )


def connection_info(auth: KubeAuth) -> Any:
    """The same credentials as kopf's ``ConnectionInfo`` (for ``@kopf.on.login``)."""
    import kopf

    return kopf.ConnectionInfo(
        server=auth.server,
        token=auth.token,
        scheme="Bearer" if auth.token else None,
        ca_path=auth.ca_file,
        insecure=not auth.verify,
        certificate_path=auth.cert_file,
        private_key_path=auth.key_file,
        default_namespace=auth.default_namespace,
    )


def resource_path(
    api_version: str, kind: str, namespace: Optional[str], name: Optional[str] = None, subresource: Optional[str] = None
) -> str:
    try:
        plural, namespaced = KINDS[(api_version, kind)]
    except KeyError:
        raise ValueError(f"the operator does not manage {api_version} {kind}") from None
    base = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
    if namespaced and namespace is not None:  # namespace None: a list across all namespaces
        base += f"/namespaces/{namespace}"
    path = f"{base}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class KubeClient:
    """Async JSON calls to the API server; 404 on get -> ``None``, other errors -> :class:`KubeApiError`."""

    def __init__(self, auth_loader: Callable[[], KubeAuth], timeout: float = 30.0):
        self._load = auth_loader
        self._timeout = timeout
        self._auth: Optional[KubeAuth] = None
        self._http: Optional[httpx.AsyncClient] = None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._auth = self._load()
            a = self._auth
            verify: Any = (a.ca_file or True) if a.verify else False
            cert = (a.cert_file, a.key_file) if a.cert_file and a.key_file else None
            headers = {"Authorization": f"Bearer {a.token}"} if a.token else {}
            headers["User-Agent"] = "kvship-operator"
            self._http = httpx.AsyncClient(
                base_url=a.server, verify=verify, cert=cert, headers=headers, timeout=self._timeout
            )
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Optional[dict] = None,
        content_type: str = "application/json",
    ) -> Any:
        for attempt in (1, 2):
            client = self._client()
            resp = await client.request(
                method,
                path,
                params=params,
                json=body,
                headers={"Content-Type": content_type, "Accept": "application/json"},
            )
            if resp.status_code == 401 and attempt == 1:  # token rotated: log in again once
                await self.aclose()
                continue
            break
        if resp.status_code >= 400:
            try:
                data = resp.json()
            except ValueError:
                data = {}
            raise KubeApiError(
                resp.status_code,
                str(data.get("reason") or resp.reason_phrase),
                str(data.get("message") or resp.text[:500]),
            )
        return resp.json() if resp.content else None

    async def get(self, api_version: str, kind: str, namespace: Optional[str], name: str) -> Optional[dict]:
        try:
            return await self.request("GET", resource_path(api_version, kind, namespace, name))
        except KubeApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, api_version: str, kind: str, namespace: Optional[str], label_selector: str = "") -> list[dict]:
        params = {"labelSelector": label_selector} if label_selector else None
        data = await self.request("GET", resource_path(api_version, kind, namespace), params=params)
        return list((data or {}).get("items") or [])

    async def create(self, obj: dict) -> dict:
        meta = obj["metadata"]
        return await self.request(
            "POST", resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj
        )

    async def merge_patch(
        self,
        api_version: str,
        kind: str,
        namespace: Optional[str],
        name: str,
        patch: dict,
        subresource: Optional[str] = None,
    ) -> dict:
        return await self.request(
            "PATCH",
            resource_path(api_version, kind, namespace, name, subresource),
            body=patch,
            content_type="application/merge-patch+json",
        )

    async def strategic_patch(
        self,
        api_version: str,
        kind: str,
        namespace: Optional[str],
        name: str,
        patch: dict,
        subresource: Optional[str] = None,
    ) -> dict:
        """A strategic merge patch: lists with a merge key (a pod's ``status.conditions`` by ``type``) are merged
        item by item, so setting one condition leaves the kubelet's own conditions alone."""
        return await self.request(
            "PATCH",
            resource_path(api_version, kind, namespace, name, subresource),
            body=patch,
            content_type="application/strategic-merge-patch+json",
        )

    async def delete_collection(self, api_version: str, kind: str, namespace: str, label_selector: str) -> None:
        """Delete every object of ``kind`` in ``namespace`` matching ``label_selector``, in one request."""
        await self.request(
            "DELETE",
            resource_path(api_version, kind, namespace),
            params={"labelSelector": label_selector, "propagationPolicy": "Background"},
        )

    async def delete(self, api_version: str, kind: str, namespace: Optional[str], name: str) -> None:
        try:
            await self.request(
                "DELETE",
                resource_path(api_version, kind, namespace, name),
                body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
        except KubeApiError as e:
            if e.status != 404:
                raise
