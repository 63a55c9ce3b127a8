"""The Helm chart lints, renders valid Kubernetes objects, grants only what the operator uses, and runs it."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kube_emulator import find_tool

from kvship.operator.builders import CHILD_KINDS
from kvship.operator.config import OperatorConfig
from kvship.operator.crd import render_crd_yaml
from kvship.operator.kube import KINDS

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "kvship-operator"
HELM = find_tool("helm")
pytestmark = pytest.mark.skipif(HELM is None, reason="helm not installed: run .ci/install-k8s-tools.sh")
if HELM is None:
    print("test_helm: skipped, helm not found (.ci/install-k8s-tools.sh installs it)")


def helm(*args: str) -> str:
    out = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def render(*sets: str, crds: bool = False) -> list[dict]:
    args = ["template", "kvship", str(CHART), "--namespace", "kvship-system"]
    if crds:
        args.append("--include-crds")
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args)) if d]


def test_chart_lints():
    assert "0 chart(s) failed" in helm("lint", str(CHART), "--strict")


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("watch.namespaces={ml,research}",),
        ("watch.allNamespaces=true",),
        ("serviceAccount.create=false", "serviceAccount.name=ops"),
    ],
)
def test_rendered_objects_pass_the_kubernetes_schema(sets):
    docs = render(*sets, crds=True)
    assert any(d["kind"] == "CustomResourceDefinition" for d in docs)
    for doc in docs:
        kubernetes_validate.validate(doc, "1.35.0", strict=True)


@pytest.mark.parametrize(
    "sets,kinds",
    [
        (
            (),
            {
                "ServiceAccount",
                "ClusterRole",
                "ClusterRoleBinding",
                "Role",
                "RoleBinding",
                "Deployment",
                "NetworkPolicy",
            },
        ),
        (
            ("watch.allNamespaces=true",),
            {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "NetworkPolicy"},
        ),
        (("serviceAccount.create=false", "rbac.create=false", "networkPolicy.enabled=false"), {"Deployment"}),
    ],
)
def test_chart_renders_exactly_these_kinds(sets, kinds):
    docs = render(*sets, crds=True)
    assert {d["kind"] for d in docs} == kinds | {"CustomResourceDefinition"}


def test_watching_everything_and_a_namespace_list_exclude_each_other():
    out = subprocess.run(
        [HELM, "template", "kvship", str(CHART), "--set", "watch.allNamespaces=true", "--set", "watch.namespaces={ml}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "exclude each other" in out.stderr


def test_chart_crd_is_the_generated_one():
    assert (CHART / "crds" / "inferenceservices.kvship.io.yaml").read_text() == render_crd_yaml()


def _deployment(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment")


def _operator_args(docs: list[dict]) -> argparse.Namespace:
    args = _deployment(docs)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "operator"
    parser = argparse.ArgumentParser(exit_on_error=False)
    OperatorConfig.add_cli_args(parser)
    return parser.parse_args(args[1:])


def test_operator_deployment_is_non_root_single_and_probed():
    dep = _deployment(render())
    spec = dep["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    c = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert c["image"] == "ghcr.io/kvship/operator:0.1.0"


def test_namespaced_by_default_and_cluster_wide_only_when_asked():
    docs = render()
    cfg = OperatorConfig(**vars(_operator_args(docs)))
    cfg.validate()
    assert cfg.namespace == ["kvship-system"] and not cfg.clusterwide
    assert cfg.worker_image == "ghcr.io/kvship/worker:0.1.0" and cfg.liveness_port == 8080
    (role,) = [d for d in docs if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "kvship-system"
    cluster_role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert {g for r in cluster_role["rules"] for g in r["apiGroups"]} == {"apiextensions.k8s.io", ""}
    assert {res for r in cluster_role["rules"] for res in r["resources"]} == {"customresourcedefinitions", "namespaces"}

    docs = render("watch.namespaces={ml,research}", "workerImage=reg/w:9")
    cfg = OperatorConfig(**vars(_operator_args(docs)))
    assert cfg.namespace == ["ml", "research"] and not cfg.clusterwide and cfg.worker_image == "reg/w:9"
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "research"]

    docs = render("watch.allNamespaces=true")
    cfg = OperatorConfig(**vars(_operator_args(docs)))
    assert cfg.clusterwide and not [d for d in docs if d["kind"] == "Role"]
    cluster_role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert ("apps", "deployments", "create") in _grants(cluster_role["rules"])


def _grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]}


def expected_grants() -> set[tuple[str, str, str]]:
    """Exactly what the operator does: apply.py's verbs on every child kind, kopf's watches, status, events."""
    grants = set()
    for api_version, kind in CHILD_KINDS:
        group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
        plural = KINDS[(api_version, kind)][0]
        grants |= {(group, plural, verb) for verb in ("get", "list", "create", "patch", "delete")}
    grants.add(("apps", "deployments", "watch"))  # child events refresh the status (label-selected watch)
    grants.add(("apps", "deployments", "deletecollection"))  # a drained revision's pair goes in one request
    # ... and its worker groups (docs/operator.md, "Multi-node worker groups")
    grants |= {
        ("apps", "statefulsets", "deletecollection"),
        ("leaderworkerset.x-k8s.io", "leaderworkersets", "deletecollection"),
        ("apps", "statefulsets", "watch"),  # group events restart a group and refresh the status
        ("leaderworkerset.x-k8s.io", "leaderworkersets", "watch"),
    }
    grants.add(("", "pods", "delete"))  # the StatefulSet fallback restarts a whole group
    grants.add(("", "pods/status", "patch"))  # the kvship.io/in-rotation readiness gate
    grants |= {("kvship.io", "inferenceservices", v) for v in ("get", "list", "watch", "patch")}
    grants |= {("kvship.io", "inferenceservices/status", v) for v in ("get", "patch")}
    grants |= {("", "pods", v) for v in ("get", "list", "watch")}  # what it grants routers, it must hold
    grants.add(("", "events", "create"))
    # each service's Secrets: read by name, created once, patched to rotate (kvship.operator.credentials)
    grants |= {("", "secrets", v) for v in ("get", "create", "patch")}
    return grants


CLUSTER_READS = {(g, r, v) for g, r in (("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces"))
                 for v in ("get", "list", "watch")}  # fmt: skip


@pytest.mark.parametrize("sets", [(), ("watch.allNamespaces=true",)])
def test_rbac_covers_what_the_operator_does_and_nothing_more(sets):
    docs = render(*sets)
    cluster = _grants(next(d for d in docs if d["kind"] == "ClusterRole")["rules"])
    namespaced = [_grants(d["rules"]) for d in docs if d["kind"] == "Role"]
    if sets:
        assert cluster == CLUSTER_READS | expected_grants() and namespaced == []
    else:
        assert cluster == CLUSTER_READS and namespaced == [expected_grants()]
    # spelled out, the things that must never appear
    for grants in [cluster, *namespaced]:
        assert not any("*" in g for g in grants), "no wildcards"
        assert not {("", "secrets", v) for v in ("list", "watch", "delete")} & grants, "Secrets only by name"
        assert not any(v in ("update", "escalate", "bind", "impersonate") for _, _, v in grants)
        assert not {("", r, "watch") for r in ("configmaps", "services", "serviceaccounts")} & grants


def test_operator_network_policy_admits_only_its_liveness_port_and_can_be_switched_off():
    docs = render("livenessPort=9090")
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    selector = _deployment(docs)["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["podSelector"] == {"matchLabels": selector}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 9090}]}]
    assert not [d for d in render("networkPolicy.enabled=false") if d["kind"] == "NetworkPolicy"]


def test_operator_flags_name_its_own_pods_namespace_cidrs_and_image_prefixes():
    docs = render("allowedImagePrefixes={reg.io/a/,reg.io/b/}", "workerAllowCidrs={10.1.0.0/16}")
    cfg = OperatorConfig(**vars(_operator_args(docs)))
    cfg.validate()
    pod_labels = _deployment(docs)["spec"]["template"]["metadata"]["labels"]
    assert cfg.operator_namespace == "kvship-system"
    assert dict(cfg.network.operator_pod_labels).items() <= pod_labels.items()
    assert cfg.image_prefixes == ("reg.io/a/", "reg.io/b/") and cfg.network.worker_allow_cidrs == ("10.1.0.0/16",)
    assert OperatorConfig(**vars(_operator_args(render()))).image_prefixes == ()
