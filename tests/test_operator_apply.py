"""Layer 3 against the loopback API server: create, patch only what differs, prune, never touch foreign objects."""

from __future__ import annotations

import asyncio
import copy

import pytest
from kube_emulator import EmulatorThread

from kvship.operator.apply import LAST_APPLIED, apply_children, compute_patch
from kvship.operator.builders import Images, build_children, worker_revision
from kvship.operator.kube import KubeClient, load_auth
from kvship.operator.spec import parse_service

IMAGES = Images(worker="reg/worker:1", router="reg/router:1")


@pytest.fixture(scope="module")
def kube():
    with EmulatorThread() as k:
        yield k


@pytest.fixture
async def client(kube):
    c = KubeClient(lambda: load_auth(kube.kubeconfig))
    yield c
    await c.aclose()


_uid = iter(range(1, 10_000))


def config(spec: dict, name: str, uid: str | None = None):
    return parse_service(
        {
            "metadata": {"name": name, "namespace": "default", "uid": uid or f"uid-{next(_uid)}", "generation": 1},
            "spec": spec,
        }
    )


async def apply(client, cfg):
    return await apply_children(client, cfg, build_children(cfg, IMAGES))


BASE = {"model": {"uri": "builtin:smollm2"}, "decode": {"nodeSelector": {"pool": "cpu", "zone": "a"}}}


async def test_first_pass_creates_everything_and_second_changes_nothing(kube, client):
    cfg = config(BASE, "a1")
    first = await apply(client, cfg)
    assert not first.errors and len(first.created) == 10 and not first.patched
    dep = kube.get("apps/v1", "deployments", "default", "a1-worker")
    assert LAST_APPLIED in dep["metadata"]["annotations"]
    second = await apply(client, cfg)
    assert not second.changed and len(second.unchanged) == 10 and not second.errors


async def test_a_spec_change_patches_only_what_differs(kube, client):
    cfg = config(BASE, "a2", uid="uid-a2")
    await apply(client, cfg)
    before = kube.get("apps/v1", "deployments", "default", "a2-router")["metadata"]["resourceVersion"]
    spec = copy.deepcopy(BASE)
    spec["engine"] = {"extraArgs": ["--page-size", "16"]}
    spec["decode"]["nodeSelector"] = {"pool": "cpu"}  # zone removed
    result = await apply(client, config(spec, "a2", uid="uid-a2"))
    assert result.patched == ["ConfigMap a2-config", "Deployment a2-worker"], result
    worker = kube.get("apps/v1", "deployments", "default", "a2-worker")
    pod = worker["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"][-2:] == ["--page-size", "16"]
    assert pod["nodeSelector"] == {"pool": "cpu"}, "a key removed from the spec must leave the child"
    assert kube.get("apps/v1", "deployments", "default", "a2-router")["metadata"]["resourceVersion"] == before


async def test_drift_is_corrected(kube, client):
    cfg = config(BASE, "a3")
    await apply(client, cfg)
    kube.patch("apps/v1", "deployments", "default", "a3-worker", {"spec": {"replicas": 5}})
    result = await apply(client, cfg)
    assert result.patched == ["Deployment a3-worker"]
    assert kube.get("apps/v1", "deployments", "default", "a3-worker")["spec"]["replicas"] == 1


async def test_autoscaling_takes_over_replicas_and_its_removal_prunes_the_hpa(kube, client):
    await apply(client, config(BASE, "a4", uid="uid-a4"))
    scaled = copy.deepcopy(BASE)
    scaled["decode"]["autoscaling"] = {"minReplicas": 2, "maxReplicas": 4}
    result = await apply(client, config(scaled, "a4", uid="uid-a4"))
    assert "HorizontalPodAutoscaler a4-worker" in result.created
    assert "PodDisruptionBudget a4-worker" in result.created
    kube.patch("apps/v1", "deployments", "default", "a4-worker", {"spec": {"replicas": 3}})  # the HPA scales
    again = await apply(client, config(scaled, "a4", uid="uid-a4"))
    assert "Deployment a4-worker" not in again.patched
    assert kube.get("apps/v1", "deployments", "default", "a4-worker")["spec"]["replicas"] == 3
    back = await apply(client, config(BASE, "a4", uid="uid-a4"))
    assert set(back.deleted) == {"HorizontalPodAutoscaler a4-worker", "PodDisruptionBudget a4-worker"}
    assert kube.get("autoscaling/v2", "horizontalpodautoscalers", "default", "a4-worker") is None


async def test_switching_unified_to_pd_replaces_the_worker_role(kube, client):
    await apply(client, config(BASE, "a5", uid="uid-a5"))
    pd = dict(BASE, prefill={"replicas": 1})
    cfg = config(pd, "a5", uid="uid-a5")
    result = await apply(client, cfg)
    rev = worker_revision(cfg, IMAGES)
    assert {
        f"Deployment a5-prefill-{rev}",
        f"Deployment a5-decode-{rev}",
        "Service a5-prefill",
        "Service a5-decode",
    } <= set(result.created)
    assert set(result.deleted) == {"Deployment a5-worker", "Service a5-worker"}
    names = {
        d["metadata"]["name"] for d in kube.list("apps/v1", "deployments", "default", "app.kubernetes.io/instance=a5")
    }
    assert names == {f"a5-prefill-{rev}", f"a5-decode-{rev}", "a5-router"}


async def test_objects_it_does_not_own_are_reported_and_left_alone(kube, client):
    kube.create("v1", "configmaps", "default", {"metadata": {"name": "a6-config"}, "data": {"mine": "yes"}})
    result = await apply(client, config(BASE, "a6"))
    assert result.errors == [
        "ConfigMap a6-config already exists and is not owned by InferenceService a6; delete or rename it"
    ]
    assert kube.get("v1", "configmaps", "default", "a6-config")["data"] == {"mine": "yes"}
    assert "Deployment a6-worker" in result.created


async def test_concurrent_passes_race_to_create_without_duplicates_or_errors(kube, client):
    cfg = config(BASE, "a7")
    other = KubeClient(lambda: load_auth(kube.kubeconfig))
    try:
        one, two = await asyncio.gather(apply(client, cfg), apply(other, cfg))
    finally:
        await other.aclose()
    assert not one.errors and not two.errors
    assert len(one.created) + len(two.created) == 10
    assert len(kube.list("apps/v1", "deployments", "default", "app.kubernetes.io/instance=a7")) == 2


def test_compute_patch_nulls_removed_keys_and_ignores_server_defaults():
    desired = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "x", "labels": {"a": "1"}},
        "data": {"k": "v"},
    }
    live = copy.deepcopy(desired)
    live["metadata"].update(uid="u", resourceVersion="7", annotations={})
    patch = compute_patch(live, desired)
    assert patch["metadata"]["annotations"][LAST_APPLIED]
    live["metadata"]["annotations"] = patch["metadata"]["annotations"]
    assert compute_patch(live, desired) is None
    smaller = copy.deepcopy(desired)
    del smaller["data"]
    assert compute_patch(live, smaller)["data"] is None
