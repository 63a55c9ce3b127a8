"""The loopback Kubernetes API (tests/kube_emulator.py) behaves like a real server for our clients."""

from __future__ import annotations

import json
import threading
import time

import httpx
import kubernetes
import pytest
import yaml
from kube_emulator import ApiError, EmulatorThread
from kube_emulator_api import apply_json_patch, merge_patch, parse_path, select_labels

CRD_PATH = str(
    __import__("pathlib").Path(__file__).resolve().parent.parent / "crds" / "inferenceservices.kvship.io.yaml"
)


@pytest.fixture(scope="module")
def kube():
    with EmulatorThread(bookmark_interval=1) as k:
        yield k


def _pod(name, labels=None, owner=None):
    meta = {"name": name, "labels": labels or {}}
    if owner:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": [{"name": "c", "image": "x"}]}}


def test_created_objects_get_uid_resource_version_timestamp_and_generation(kube):
    obj = kube.create("v1", "configmaps", "default", {"metadata": {"name": "cm1"}, "data": {"a": "1"}})
    meta = obj["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z") and meta["generation"] == 1
    assert int(meta["resourceVersion"]) > 0
    again = kube.patch("v1", "configmaps", "default", "cm1", {"data": {"a": "2"}})
    assert int(again["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert again["metadata"]["uid"] == meta["uid"]


def test_generate_name_makes_a_unique_name(kube):
    a = kube.create("v1", "configmaps", "default", {"metadata": {"generateName": "gen-"}})
    b = kube.create("v1", "configmaps", "default", {"metadata": {"generateName": "gen-"}})
    assert a["metadata"]["name"].startswith("gen-") and a["metadata"]["name"] != b["metadata"]["name"]


def test_duplicate_create_is_409_already_exists(kube):
    kube.create("v1", "configmaps", "default", {"metadata": {"name": "dup"}})
    with pytest.raises(ApiError) as e:
        kube.create("v1", "configmaps", "default", {"metadata": {"name": "dup"}})
    assert e.value.code == 409 and e.value.reason == "AlreadyExists"


def test_failed_json_patch_test_is_422_and_changes_nothing(kube):
    obj = kube.create("v1", "configmaps", "default", {"metadata": {"name": "jp"}, "data": {"k": "v"}})
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
        {"op": "replace", "path": "/data/k", "value": "changed"},
    ]
    with pytest.raises(ApiError) as e:
        kube.request("PATCH", kube.path("v1", "configmaps", "default", "jp"), ops, "application/json-patch+json")
    assert e.value.code == 422
    assert kube.get("v1", "configmaps", "default", "jp")["data"] == {"k": "v"}
    ops[0]["value"] = obj["metadata"]["resourceVersion"]
    out = kube.request("PATCH", kube.path("v1", "configmaps", "default", "jp"), ops, "application/json-patch+json")
    assert out["data"] == {"k": "changed"}


def test_lists_carry_kind_api_version_and_resource_version(kube):
    data = kube.request("GET", "/apis/apps/v1/namespaces/default/deployments")
    assert data["kind"] == "DeploymentList" and data["apiVersion"] == "apps/v1"
    assert int(data["metadata"]["resourceVersion"]) >= 1


def test_namespaces_paths_parse_and_serve(kube):
    kube.create("v1", "namespaces", None, {"metadata": {"name": "team-a"}})
    names = [n["metadata"]["name"] for n in kube.request("GET", "/api/v1/namespaces")["items"]]
    assert {"default", "team-a"} <= set(names)
    assert kube.request("GET", "/api/v1/namespaces/team-a")["metadata"]["name"] == "team-a"
    assert parse_path("/api/v1/namespaces/ns/pods/p/status").subresource == "status"
    assert parse_path("/api/v1/namespaces/ns/status").name == "ns"


def test_label_selectors_filter_lists():
    pod = _pod("p", {"app": "kvship", "role": "decode"})
    assert select_labels(pod, "app=kvship,role in (decode, prefill)")
    assert not select_labels(pod, "role notin (decode)")
    assert select_labels(pod, "app,!missing") and not select_labels(pod, "role!=decode")


def test_watch_replays_events_after_resource_version_with_label_selector(kube):
    start = kube.request("GET", "/api/v1/namespaces/default/pods")["metadata"]["resourceVersion"]
    kube.create("v1", "pods", "default", _pod("w1", {"app": "disc", "role": "decode"}))
    kube.create("v1", "pods", "default", _pod("w2", {"app": "other"}))
    kube.patch_status("v1", "pods", "default", "w1", {"podIP": "10.0.0.7", "phase": "Running"})
    lines = []
    with httpx.stream(
        "GET",
        kube.url + "/api/v1/namespaces/default/pods",
        params={"watch": "true", "resourceVersion": start, "labelSelector": "app=disc", "timeoutSeconds": "1"},
        timeout=10,
    ) as r:
        for line in r.iter_lines():
            if line.strip():
                lines.append(yaml.safe_load(line))
    events = [(e["type"], e["object"]["metadata"]["name"]) for e in lines]
    assert events == [("ADDED", "w1"), ("MODIFIED", "w1")]
    assert lines[-1]["object"]["status"]["podIP"] == "10.0.0.7"


def test_official_client_lists_and_watches_pods_by_label(kube):
    client = kubernetes.config.new_client_from_config(config_file=kube.kubeconfig)
    v1 = kubernetes.client.CoreV1Api(client)
    v1.create_namespaced_pod("default", _pod("c1", {"app": "cli", "role": "prefill"}))
    assert [p.metadata.name for p in v1.list_namespaced_pod("default", label_selector="app=cli").items] == ["c1"]
    rv = v1.list_namespaced_pod("default", label_selector="app=cli").metadata.resource_version
    seen = []

    def watch():
        w = kubernetes.watch.Watch()
        for ev in w.stream(
            v1.list_namespaced_pod, "default", label_selector="app=cli", resource_version=rv, timeout_seconds=2
        ):
            seen.append((ev["type"], ev["object"].metadata.name))

    t = threading.Thread(target=watch)
    t.start()
    time.sleep(0.3)
    v1.create_namespaced_pod("default", _pod("c2", {"app": "cli"}))
    v1.delete_namespaced_pod("c1", "default")
    t.join(10)
    assert seen == [("ADDED", "c2"), ("DELETED", "c1")]


def test_status_subresource_splits_spec_and_status_and_bumps_generation(kube):
    kube.create(
        "apps/v1",
        "deployments",
        "default",
        {
            "metadata": {"name": "d1"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"a": "b"}},
                "template": {"metadata": {"labels": {"a": "b"}}, "spec": {}},
            },
            "status": {"readyReplicas": 9},
        },
    )
    d = kube.get("apps/v1", "deployments", "default", "d1")
    assert "status" not in d and d["metadata"]["generation"] == 1
    d = kube.patch_status("apps/v1", "deployments", "default", "d1", {"readyReplicas": 1})
    assert d["status"] == {"readyReplicas": 1} and d["metadata"]["generation"] == 1
    d = kube.patch("apps/v1", "deployments", "default", "d1", {"spec": {"replicas": 2}, "status": {"x": 1}})
    assert d["spec"]["replicas"] == 2 and d["status"] == {"readyReplicas": 1} and d["metadata"]["generation"] == 2


def test_deleting_an_owner_collects_its_dependents(kube):
    owner = kube.create("v1", "configmaps", "default", {"metadata": {"name": "owner"}})
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    kube.create("v1", "pods", "default", _pod("dep", owner=ref))
    kube.delete("v1", "configmaps", "default", "owner")
    assert kube.get("v1", "pods", "default", "dep") is None


def test_finalizers_hold_deletion_until_removed(kube):
    kube.create("v1", "configmaps", "default", {"metadata": {"name": "fin", "finalizers": ["x/y"]}})
    kube.delete("v1", "configmaps", "default", "fin")
    held = kube.get("v1", "configmaps", "default", "fin")
    assert held["metadata"]["deletionTimestamp"]
    kube.patch("v1", "configmaps", "default", "fin", {"metadata": {"finalizers": None}})
    assert kube.get("v1", "configmaps", "default", "fin") is None


def test_created_crd_is_served_defaulted_and_validated(kube):
    kube.create("apiextensions.k8s.io/v1", "customresourcedefinitions", None, yaml.safe_load(open(CRD_PATH)))
    groups = [g["name"] for g in kube.request("GET", "/apis")["groups"]]
    assert "kvship.io" in groups
    res = kube.request("GET", "/apis/kvship.io/v1alpha1")["resources"]
    main = next(r for r in res if r["name"] == "inferenceservices")
    assert (
        main["shortNames"] == ["kvsvc"]
        and main["namespaced"]
        and "inferenceservices/status" in {r["name"] for r in res}
    )
    obj = kube.create(
        "kvship.io/v1alpha1",
        "inferenceservices",
        "default",
        {
            "apiVersion": "kvship.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "s"},
            "spec": {"model": {"uri": "builtin:smollm2"}, "junk": 1},
        },
    )
    assert obj["spec"]["decode"]["replicas"] == 1 and obj["spec"]["kvTransfer"]["backend"] == "tcp"
    assert "junk" not in obj["spec"]  # pruned like a real server
    with pytest.raises(ApiError) as e:
        kube.create(
            "kvship.io/v1alpha1",
            "inferenceservices",
            "default",
            {"metadata": {"name": "bad"}, "spec": {"model": {"uri": "builtin:smollm2"}, "decode": {"replicas": -1}}},
        )
    assert e.value.code == 422 and "replicas" in e.value.message


def test_merge_and_json_patch_helpers_follow_the_rfcs():
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": None}, "l": [2]}) == {"a": {"c": 2}, "l": [2]}
    doc = {"x": [1, 2]}
    assert apply_json_patch(doc, [{"op": "add", "path": "/x/-", "value": 3}]) == {"x": [1, 2, 3]}
    assert apply_json_patch(doc, [{"op": "move", "from": "/x", "path": "/y"}]) == {"y": [1, 2]}


def test_service_account_tokens_get_only_what_their_roles_grant(kube):
    """RBAC as the API server evaluates it: RoleBinding -> namespace only, ClusterRoleBinding -> everywhere, 403."""
    rbac = "rbac.authorization.k8s.io/v1"
    kube.create("v1", "namespaces", None, {"metadata": {"name": "rbac-ns"}})
    kube.create("v1", "serviceaccounts", "rbac-ns", {"metadata": {"name": "bot"}})
    rules = [
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"], "resourceNames": ["allowed"]},
        {"apiGroups": ["kvship.io"], "resources": ["inferenceservices/status"], "verbs": ["patch"]},
    ]
    kube.create(rbac, "roles", "rbac-ns", {"metadata": {"name": "bot"}, "rules": rules})
    subject = {"kind": "ServiceAccount", "name": "bot", "namespace": "rbac-ns"}
    kube.create(
        rbac,
        "rolebindings",
        "rbac-ns",
        {"metadata": {"name": "bot"}, "roleRef": {"kind": "Role", "name": "bot"}, "subjects": [subject]},
    )
    kube.create(
        rbac,
        "clusterroles",
        None,
        {
            "metadata": {"name": "ns-reader"},
            "rules": [{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list"]}],
        },
    )
    kube.create(
        rbac,
        "clusterrolebindings",
        None,
        {
            "metadata": {"name": "bot-ns"},
            "roleRef": {"kind": "ClusterRole", "name": "ns-reader"},
            "subjects": [subject],
        },
    )
    api = kubernetes.config.new_client_from_config(config_file=kube.service_account_kubeconfig("rbac-ns", "bot"))
    try:
        apps, core = kubernetes.client.AppsV1Api(api), kubernetes.client.CoreV1Api(api)
        assert apps.list_namespaced_deployment("rbac-ns").items == []
        assert core.list_namespace().items  # cluster-wide through the ClusterRoleBinding
        kube.create("v1", "configmaps", "rbac-ns", {"metadata": {"name": "allowed"}})
        kube.create("v1", "configmaps", "rbac-ns", {"metadata": {"name": "other"}})
        assert core.read_namespaced_config_map("allowed", "rbac-ns").metadata.name == "allowed"
        forbidden = [
            lambda: apps.list_deployment_for_all_namespaces(),  # the Role is namespaced
            lambda: apps.list_namespaced_deployment("default"),  # another namespace
            lambda: apps.delete_namespaced_deployment("x", "rbac-ns"),  # verb not granted
            lambda: core.read_namespaced_config_map("other", "rbac-ns"),  # resourceNames
            lambda: core.list_namespaced_secret("rbac-ns"),  # resource not granted
        ]
        for call in forbidden:
            with pytest.raises(kubernetes.client.ApiException) as e:
                call()
            assert e.value.status == 403, e.value
        message = json.loads(e.value.body)["message"]
        assert 'User "system:serviceaccount:rbac-ns:bot" cannot list resource "secrets"' in message
        # escalation: a Role may grant only what its author holds
        rbac_api = kubernetes.client.RbacAuthorizationV1Api(api)
        kube.create(
            "rbac.authorization.k8s.io/v1",
            "roles",
            "rbac-ns",
            {
                "metadata": {"name": "role-writer"},
                "rules": [{"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles"], "verbs": ["create"]}],
            },
        )
        kube.create(
            "rbac.authorization.k8s.io/v1",
            "rolebindings",
            "rbac-ns",
            {"metadata": {"name": "rw"}, "roleRef": {"kind": "Role", "name": "role-writer"}, "subjects": [subject]},
        )
        held = {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["list"]}
        rbac_api.create_namespaced_role("rbac-ns", {"metadata": {"name": "ok"}, "rules": [held]})
        more = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}
        with pytest.raises(kubernetes.client.ApiException) as e:
            rbac_api.create_namespaced_role("rbac-ns", {"metadata": {"name": "escalate"}, "rules": [more]})
        assert e.value.status == 403 and "not currently held" in json.loads(e.value.body)["message"]
        # the admin kubeconfig is unaffected
        assert kube.list("v1", "secrets", "rbac-ns") == []
    finally:
        api.close()
    denied = {(d.verb, d.resource, d.namespace) for d in kube.emulator.rbac.denied()}
    assert ("list", "deployments", None) in denied and ("delete", "deployments", "rbac-ns") in denied


def test_dependents_created_for_a_deleted_owner_are_collected_when_asked(kube):
    owner = kube.create("v1", "configmaps", "default", {"metadata": {"name": "gone-owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "gone-owner", "uid": owner["metadata"]["uid"]}
    kube.delete("v1", "configmaps", "default", "gone-owner")
    kube.emulator.collect_dangling_dependents = True
    try:
        kube.create("v1", "pods", "default", _pod("late-dependent", owner=ref))
        assert kube.get("v1", "pods", "default", "late-dependent") is None
        live = kube.create("v1", "configmaps", "default", {"metadata": {"name": "live-owner"}})
        ref = dict(ref, name="live-owner", uid=live["metadata"]["uid"])
        kube.create("v1", "pods", "default", _pod("kept-dependent", owner=ref))
        assert kube.get("v1", "pods", "default", "kept-dependent") is not None
    finally:
        kube.emulator.collect_dangling_dependents = False
