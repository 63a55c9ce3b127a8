"""Issue 30 on the operator side: the service's Secrets and how pods get them, NetworkPolicies, the router's
allow-lists, image prefixes, and a bounded, authenticated read of the router (docs/operator.md, "Credentials",
"Network policies", "What an InferenceService author can do")."""

from __future__ import annotations

import argparse
import asyncio
import base64
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kubernetes_validate
import pytest
from kube_emulator import EmulatorThread

from kvship.operator.builders import Images, Network, build_children
from kvship.operator.builders.credentials import KV_SECRET_FILE, secret_keys, secret_manifest
from kvship.operator.controller import reconcile
from kvship.operator.crd import crd_manifest
from kvship.operator.credentials import ROTATE_ANNOTATION, ensure_credentials
from kvship.operator.kube import KubeClient, load_auth
from kvship.operator.router_client import read_router
from kvship.operator.spec import parse_service
from kvship.router.config import RouterConfig

pytestmark = pytest.mark.timeout(120)
IMAGES = Images(worker="reg.io/kvship/worker:1", router="reg.io/kvship/router:1")
PD = {"model": {"uri": "builtin:smollm2"}, "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
UNIFIED = {"model": {"uri": "builtin:smollm2"}}


def cfg_of(spec: dict, name: str = "svc", namespace: str = "ml"):
    return parse_service({"metadata": {"name": name, "namespace": namespace, "uid": "uid-1"}, "spec": spec})


def deployments(children: list[dict]) -> dict[str, dict]:
    return {c["metadata"]["labels"]["kvship.io/role"]: c for c in children if c["kind"] == "Deployment"}


def container(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["containers"][0]


def secret_env(c: dict) -> dict[str, tuple[str, str]]:
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in c.get("env") or []
        if "secretKeyRef" in (e.get("valueFrom") or {})
    }


# ------------------------------------------------------------------------------------ pods and Secrets
def test_prefill_and_decode_mount_the_kv_secret_and_every_worker_requires_the_worker_key():
    deps = deployments(build_children(cfg_of(PD), IMAGES))
    for role in ("prefill", "decode"):
        c, pod = container(deps[role]), deps[role]["spec"]["template"]["spec"]
        args = c["args"]
        assert args[args.index("--kv-transfer-secret-file") + 1] == KV_SECRET_FILE
        assert {"name": "kv-transfer", "mountPath": "/var/run/kvship/kv-transfer", "readOnly": True} in c[
            "volumeMounts"
        ]
        volume = next(v for v in pod["volumes"] if v["name"] == "kv-transfer")
        assert volume["secret"]["secretName"] == "svc-kv-transfer"
        assert volume["secret"]["items"] == [{"key": "secret", "path": "secret"}]
        assert volume["secret"]["defaultMode"] == 0o440
        assert secret_env(c) == {"KVSHIP_API_KEY": ("svc-worker-key", "key")}
        assert "--kv-transfer-insecure" not in args
    for name, key in secret_keys(cfg_of(PD)):
        kubernetes_validate.validate(secret_manifest(cfg_of(PD), name, key, "v"), "1.35.0", strict=True)
    unified = deployments(build_children(cfg_of(UNIFIED), IMAGES))["unified"]
    assert secret_env(container(unified)) == {"KVSHIP_API_KEY": ("svc-worker-key", "key")}
    assert "--kv-transfer-secret-file" not in container(unified)["args"]
    assert not any(v["name"] == "kv-transfer" for v in unified["spec"]["template"]["spec"]["volumes"])


def test_router_gets_worker_and_admin_keys_and_the_client_key_only_when_asked():
    spec = dict(UNIFIED, router={"apiKeySecretRef": {"name": "clients", "key": "k"}})
    router = container(deployments(build_children(cfg_of(spec), IMAGES))["router"])
    assert secret_env(router) == {
        "KVSHIP_API_KEY": ("clients", "k"),
        "KVSHIP_WORKER_API_KEY": ("svc-worker-key", "key"),
        "KVSHIP_ADMIN_API_KEY": ("svc-admin-key", "key"),
    }
    plain = container(deployments(build_children(cfg_of(UNIFIED), IMAGES))["router"])
    assert "KVSHIP_API_KEY" not in secret_env(plain)


def test_router_allow_lists_name_the_namespace_and_the_operators_cidrs():
    network = Network(worker_allow_cidrs=("10.8.0.0/16", "fd00::/8"))
    args = container(deployments(build_children(cfg_of(PD, namespace="team-a"), IMAGES, network))["router"])["args"]
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    RouterConfig.add_cli_args(parser)
    cfg = RouterConfig.from_cli_args(parser.parse_args(args[1:]))
    assert cfg.worker_allow_hosts == "*.team-a.svc,*.team-a.svc.cluster.local"
    assert cfg.worker_allow_cidrs == "10.8.0.0/16,fd00::/8"
    cfg.validate()


def test_a_credentials_digest_rolls_every_pod_template():
    plain = deployments(build_children(cfg_of(PD), IMAGES))
    rolled = deployments(build_children(cfg_of(PD), IMAGES, credentials="abc123"))
    for role, dep in rolled.items():
        assert dep["spec"]["template"]["metadata"]["annotations"]["kvship.io/credentials"] == "abc123"
        assert "kvship.io/credentials" not in (plain[role]["spec"]["template"]["metadata"]["annotations"] or {})
        assert dep["metadata"]["name"] == plain[role]["metadata"]["name"], "same revision: patched in place"


# ------------------------------------------------------------------------------------ NetworkPolicies
def policies(children: list[dict]) -> dict[str, dict]:
    return {c["metadata"]["name"]: c for c in children if c["kind"] == "NetworkPolicy"}


def test_pd_network_policies_keep_kv_ports_between_the_services_workers_and_http_to_router_and_operator():
    extra = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    spec = dict(PD, networkPolicy={"workerHttpFrom": [extra]})
    network = Network(operator_namespace="kvship-system")
    children = build_children(cfg_of(spec), IMAGES, network)
    pol = policies(children)
    assert set(pol) == {"svc-worker", "svc-router"}
    for p in pol.values():
        kubernetes_validate.validate(p, "1.35.0", strict=True)
        assert p["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    workers = pol["svc-worker"]["spec"]
    pd_pods = {
        "matchLabels": {"app.kubernetes.io/instance": "svc", "app.kubernetes.io/managed-by": "kvship-operator"},
        "matchExpressions": [{"key": "kvship.io/role", "operator": "In", "values": ["prefill", "decode"]}],
    }
    assert workers["podSelector"] == pd_pods and workers["policyTypes"] == ["Ingress"]
    kv, http = workers["ingress"]
    assert kv == {"from": [{"podSelector": pd_pods}]}, "every port (dynamic Mooncake/NIXL listeners) between P and D"
    assert http["ports"] == [{"protocol": "TCP", "port": 30000}]
    router_pods = {
        "app.kubernetes.io/instance": "svc",
        "app.kubernetes.io/managed-by": "kvship-operator",
        "kvship.io/role": "router",
    }
    assert http["from"] == [
        {"podSelector": {"matchLabels": router_pods}},
        {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvship-operator"}},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvship-system"}},
        },
        extra,
    ]
    # the selectors pick exactly the pods the Deployments make
    deps = deployments(children)
    for role in ("prefill", "decode"):
        labels = deps[role]["spec"]["template"]["metadata"]["labels"]
        assert pd_pods["matchLabels"].items() <= labels.items() and labels["kvship.io/role"] in ("prefill", "decode")
    assert router_pods.items() <= deps["router"]["spec"]["template"]["metadata"]["labels"].items()
    router = pol["svc-router"]["spec"]
    assert router["podSelector"] == {"matchLabels": router_pods}
    assert router["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}], "the endpoint: from anywhere"


def test_unified_policy_has_no_kv_rule_and_an_operator_in_the_same_namespace_needs_no_namespace_selector():
    pol = policies(build_children(cfg_of(UNIFIED), IMAGES, Network(operator_namespace="ml")))
    (http,) = pol["svc-worker"]["spec"]["ingress"]
    assert pol["svc-worker"]["spec"]["podSelector"]["matchExpressions"][0]["values"] == ["unified"]
    assert http["from"][1] == {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvship-operator"}}}


def test_network_policies_can_be_switched_off():
    assert not policies(build_children(cfg_of(dict(PD, networkPolicy={"enabled": False})), IMAGES))


# ------------------------------------------------------------------------------------ against the API emulator
@pytest.fixture(scope="module")
def kube():
    with EmulatorThread() as k:
        k.create("apiextensions.k8s.io/v1", "customresourcedefinitions", None, crd_manifest())
        yield k


@pytest.fixture
async def client(kube):
    c = KubeClient(lambda: load_auth(kube.kubeconfig))
    yield c
    await c.aclose()


def create_service(kube, name: str, spec: dict) -> dict:
    body = {"apiVersion": "kvship.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": spec}
    return kube.create("kvship.io/v1alpha1", "inferenceservices", "default", body)


def secret_value(kube, name: str, key: str) -> str:
    return base64.b64decode(kube.get("v1", "secrets", "default", name)["data"][key]).decode()


async def test_secrets_are_made_once_random_owned_and_never_overwritten(kube, client):
    body = create_service(kube, "s1", PD)
    other = create_service(kube, "s2", PD)
    cfg, cfg2 = parse_service(body), parse_service(other)
    first = await ensure_credentials(client, cfg)
    await ensure_credentials(client, cfg2)
    assert not first.errors
    made = {n: kube.get("v1", "secrets", "default", n) for n in ("s1-kv-transfer", "s1-worker-key", "s1-admin-key")}
    for name, s in made.items():
        assert s["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
        (value,) = s["data"].values()
        assert len(base64.b64decode(value)) >= 32
    assert first.worker_key == secret_value(kube, "s1-worker-key", "key")
    assert first.worker_key != secret_value(kube, "s2-worker-key", "key"), "random per service"
    assert secret_value(kube, "s1-admin-key", "key") != first.worker_key, "separate credentials"
    again = await ensure_credentials(client, cfg)
    assert (again.worker_key, again.digest) == (first.worker_key, first.digest)
    for name, s in made.items():
        assert (
            kube.get("v1", "secrets", "default", name)["metadata"]["resourceVersion"]
            == s["metadata"]["resourceVersion"]
        ), f"{name} untouched on a second pass"


async def test_a_secret_made_beforehand_is_used_as_is(kube, client):
    mine = base64.b64encode(b"my-own-worker-key").decode()
    kube.create("v1", "secrets", "default", {"metadata": {"name": "s3-worker-key"}, "data": {"key": mine}})
    creds = await ensure_credentials(client, parse_service(create_service(kube, "s3", UNIFIED)))
    assert creds.worker_key == "my-own-worker-key"


async def test_rotation_by_annotation_or_deletion_writes_a_new_value_and_rolls_the_pods(kube, client):
    create_service(kube, "s4", PD)
    body = kube.get("kvship.io/v1alpha1", "inferenceservices", "default", "s4")
    out = await reconcile(client, body, IMAGES)
    assert not out.applied.errors
    router = kube.get("apps/v1", "deployments", "default", "s4-router")
    digest = router["spec"]["template"]["metadata"]["annotations"]["kvship.io/credentials"]
    old = secret_value(kube, "s4-worker-key", "key")
    kube.patch("v1", "secrets", "default", "s4-worker-key", {"metadata": {"annotations": {ROTATE_ANNOTATION: "1"}}})
    await reconcile(client, body, IMAGES)
    rotated = kube.get("v1", "secrets", "default", "s4-worker-key")
    assert ROTATE_ANNOTATION not in (rotated["metadata"].get("annotations") or {})
    assert secret_value(kube, "s4-worker-key", "key") != old
    router = kube.get("apps/v1", "deployments", "default", "s4-router")
    assert router["spec"]["template"]["metadata"]["annotations"]["kvship.io/credentials"] != digest
    kv = secret_value(kube, "s4-kv-transfer", "secret")
    kube.delete("v1", "secrets", "default", "s4-kv-transfer")
    await reconcile(client, body, IMAGES)
    assert secret_value(kube, "s4-kv-transfer", "secret") != kv


async def test_switching_policies_off_removes_them(kube, client):
    create_service(kube, "s5", UNIFIED)
    body = kube.get("kvship.io/v1alpha1", "inferenceservices", "default", "s5")
    await reconcile(client, body, IMAGES)
    assert len(kube.list("networking.k8s.io/v1", "networkpolicies", "default", "app.kubernetes.io/instance=s5")) == 2
    body["spec"]["networkPolicy"] = {"enabled": False}
    out = await reconcile(client, body, IMAGES)
    assert sorted(out.applied.deleted) == ["NetworkPolicy s5-router", "NetworkPolicy s5-worker"]
    assert not kube.list("networking.k8s.io/v1", "networkpolicies", "default", "app.kubernetes.io/instance=s5")


async def test_an_image_outside_the_allowed_prefixes_makes_the_spec_invalid_and_creates_nothing(kube, client):
    create_service(kube, "s6", dict(UNIFIED, engine={"image": "docker.io/someone/miner:1"}))
    body = kube.get("kvship.io/v1alpha1", "inferenceservices", "default", "s6")
    strict = Images(IMAGES.worker, IMAGES.router, allowed_prefixes=("reg.io/kvship/",))
    out = await reconcile(client, body, strict)
    assert out.spec_errors and "spec.engine.image: 'docker.io/someone/miner:1' is not allowed" in out.spec_errors[0]
    valid = next(c for c in out.status["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert not kube.list("apps/v1", "deployments", "default", "app.kubernetes.io/instance=s6")
    assert kube.get("v1", "secrets", "default", "s6-worker-key") is None


# ------------------------------------------------------------------------------------ reading the router
class Router:
    """A loopback stand-in for the router's GET /workers: records the Authorization header it got and answers
    ``body`` (bytes) with or without a Content-Length, at ``drip`` seconds per 64 KiB."""

    def __init__(self, body: bytes, length: bool = True, claimed: int | None = None, drip: float = 0.0):
        self.auth: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.auth.append(self.headers.get("Authorization"))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if length:
                    self.send_header("Content-Length", str(claimed if claimed is not None else len(body)))
                else:
                    self.send_header("Connection", "close")
                self.end_headers()
                try:
                    for i in range(0, len(body), 65536):
                        self.wfile.write(body[i : i + 65536])
                        if drip:
                            time.sleep(drip)
                except OSError:  # the reader hung up: what a bounded reader does
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def test_router_is_read_with_the_worker_key_as_bearer():
    router = Router(b'{"workers": [], "revisions": []}')
    try:
        view = await read_router(router.url, 5.0, api_key="wk-123")
        assert view.reachable and router.auth == ["Bearer wk-123", "Bearer wk-123"]  # /workers and /slo
    finally:
        router.close()


@pytest.mark.parametrize(
    "kind",
    ["content-length over the cap", "no content-length", "a small claimed length and a huge body"],
)
async def test_a_router_body_over_the_cap_is_dropped_with_a_clear_error(kind):
    huge = b'{"workers": [' + b'{"url": "x"},' * 600_000 + b"{}]}"  # ~7.8 MB > 4 MiB
    router = Router(huge, length=kind != "no content-length", claimed=10 if kind.startswith("a small") else None)
    try:
        start = time.monotonic()
        view = await read_router(router.url, 5.0, api_key="k")
        assert not view.reachable and time.monotonic() - start < 4
        if kind.startswith("a small"):  # httpx stops at the claimed length: the body is cut, not trusted
            assert "GET" in view.error
        else:
            assert "body too large" in view.error, view.error
    finally:
        router.close()


async def test_a_router_answering_a_byte_at_a_time_costs_at_most_the_timeout():
    router = Router(b'{"workers": []' + b" " * (64 * 1024 * 40) + b"}", length=True, drip=0.2)
    try:
        start = time.monotonic()
        view = await read_router(router.url, 1.0, api_key="k")
        assert not view.reachable and "within 1 s" in view.error
        assert time.monotonic() - start < 2.5
    finally:
        router.close()
        await asyncio.sleep(0)
