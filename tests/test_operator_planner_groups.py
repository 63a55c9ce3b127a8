"""The SLO planner scales multi-node worker groups whole (docs/operator.md, "SLO planner", "Multi-node worker
groups"): against the Kubernetes API emulator, the real reconcile (builders + apply) and the planner loop, a decode
role with ``nodesPerReplica: 2`` grows and shrinks by groups — more StatefulSets of 2 pods (the fallback) or a
LeaderWorkerSet's ``replicas`` — and never changes the pod count of a group."""

from __future__ import annotations

import copy

import pytest
from kube_emulator import EmulatorThread
from test_operator_groups import _lws_crd

from kvship.operator.builders import Images
from kvship.operator.controller import reconcile
from kvship.operator.crd import crd_manifest
from kvship.operator.groups import PLANNED_GROUPS_ANNOTATION, planned_groups, planned_groups_patch
from kvship.operator.kube import KubeClient, load_auth
from kvship.operator.planner_loop import PlannerLoop
from kvship.operator.router_client import RouterView
from kvship.operator.spec import parse_service

IMAGES = Images(worker="reg/worker:1", router="reg/router:1")
NS = "default"
LWS = "leaderworkerset.x-k8s.io/v1"
SPEC = {
    "model": {"uri": "hf://org/model"},
    "prefill": {"replicas": 1},
    "decode": {
        "replicas": 1,
        "nodesPerReplica": 2,
        "tensorParallelSize": 2,
        "autoscaling": {"minReplicas": 1, "maxReplicas": 3},
    },
    "slo": {"itlP50Ms": 50},
    "autoscaling": {"mode": "slo", "cooldownSeconds": 0, "scaleDownStabilizationSeconds": 0},
}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


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


def view(groups: int, revision: str, itl_ms: float, in_flight: int) -> RouterView:
    """The router's answer: the decode leaders (one per group) in rotation, ``in_flight`` spread over them."""
    workers = [
        {"url": f"http://10.0.0.{i}:30000", "role": "decode", "revision": revision, "in_rotation": True}
        | {"in_flight": in_flight // groups}
        for i in range(groups)
    ]
    workers.append({"url": "http://10.0.1.0:30000", "role": "prefill", "revision": revision, "in_rotation": True})
    slo = {"requests": 100, "ttft_p90_ms": 100.0, "itl_p50_ms": itl_ms, "requests_per_second": 2.0}
    return RouterView("http://router", True, workers=workers, slo=slo)


def group_sets(kube, name: str) -> dict[str, tuple[int, str]]:
    """The decode StatefulSets: name -> (pods per group, uid)."""
    sets = kube.list("apps/v1", "statefulsets", NS, f"app.kubernetes.io/instance={name},kvship.io/role=decode")
    return {s["metadata"]["name"]: (s["spec"]["replicas"], s["metadata"]["uid"]) for s in sets}


async def pass_(kube, client, name: str):
    body = kube.get("kvship.io/v1alpha1", "inferenceservices", NS, name)
    out = await reconcile(client, body, IMAGES)
    assert not out.spec_errors and not out.applied.errors, (out.spec_errors, out.applied.errors)
    return out


def events(kube, name: str) -> list[str]:
    return [
        f"{e['reason']}: {e['message']}"
        for e in kube.list("v1", "events", NS)
        if e.get("involvedObject", {}).get("name") == name and e.get("reason") in ("ScaledUp", "ScaledDown")
    ]


def test_planned_groups_annotation_is_read_strictly_and_patched_per_role():
    body = {"metadata": {"annotations": {PLANNED_GROUPS_ANNOTATION: '{"decode": 3, "prefill": 2}'}}}
    assert planned_groups(body) == {"decode": 3, "prefill": 2}
    assert planned_groups_patch(body, "decode", 1) == {
        "metadata": {"annotations": {PLANNED_GROUPS_ANNOTATION: '{"decode":1,"prefill":2}'}}
    }
    for junk in ("[3]", "{", '{"decode": -1, "router": 2, "prefill": true}', '{"decode": "3"}', "x" * 300):
        assert planned_groups({"metadata": {"annotations": {PLANNED_GROUPS_ANNOTATION: junk}}}) == {}
    assert planned_groups({}) == {}


async def test_planner_adds_and_removes_whole_statefulset_groups(kube, client):
    name = "plgrp"
    body = {"apiVersion": "kvship.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}}
    kube.create("kvship.io/v1alpha1", "inferenceservices", NS, dict(body, spec=copy.deepcopy(SPEC)))
    out = await pass_(kube, client, name)
    rev = out.revision
    first = group_sets(kube, name)
    assert list(first.values())[0][0] == 2 and len(first) == 1  # minReplicas groups of 2 pods before any decision
    clock = Clock()
    loop = PlannerLoop(clock)
    cfg = out.config
    # ITL misses with 12 requests on the one group: +2 groups (the step limit), as a count of groups
    decisions = await loop.plan(client, cfg, rev, view(1, rev, 140.0, 12))
    (d,) = [d for d in decisions if d.role == "decode"]
    assert (d.current, d.desired, d.reason) == (1, 3, "ScaledUp")
    assert planned_groups(kube.get("kvship.io/v1alpha1", "inferenceservices", NS, name)) == {"decode": 3}
    assert not [x for x in decisions if x.role == "prefill"]  # prefill has no autoscaling: not the planner's
    await pass_(kube, client, name)
    grown = group_sets(kube, name)
    assert sorted(grown) == [f"{name}-decode-{rev}-g{i}" for i in range(3)]
    assert all(size == 2 for size, _ in grown.values())  # whole groups: every one of 2 pods
    assert grown[f"{name}-decode-{rev}-g0"] == first[f"{name}-decode-{rev}-g0"]  # the first group untouched
    assert (await pass_(kube, client, name)).status["decode"]["ready"] == "0/3"  # counted in groups
    # load falls: one group at a time, the last one first, the others untouched
    clock.t = 10
    (d,) = [d for d in await loop.plan(client, cfg, rev, view(3, rev, 10.0, 3)) if d.role == "decode"]
    assert (d.current, d.desired) == (3, 2)
    await pass_(kube, client, name)
    shrunk = group_sets(kube, name)
    assert shrunk == {k: v for k, v in grown.items() if not k.endswith("-g2")}
    got = events(kube, name)
    assert any(m.startswith("ScaledUp: decode 1 -> 3: itl p50 140 ms > target 50 ms") for m in got), got
    assert any(m.startswith("ScaledDown: decode 3 -> 2") and "groups of 2 pods, scaled whole" in m for m in got), got


async def test_planner_scales_a_leader_worker_set_by_groups(kube, client):
    name = "pllws"
    if kube.get("apiextensions.k8s.io/v1", "customresourcedefinitions", None, "leaderworkersets." + LWS[:-3]) is None:
        kube.create("apiextensions.k8s.io/v1", "customresourcedefinitions", None, _lws_crd())
    body = {"apiVersion": "kvship.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}}
    kube.create("kvship.io/v1alpha1", "inferenceservices", NS, dict(body, spec=copy.deepcopy(SPEC)))
    out = await pass_(kube, client, name)
    rev = out.revision
    lws_name = f"{name}-decode-{rev}"
    lws = kube.get(LWS, "leaderworkersets", NS, lws_name)
    assert lws["spec"]["replicas"] == 1 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert not group_sets(kube, name)
    loop = PlannerLoop(Clock())
    (d,) = [d for d in await loop.plan(client, out.config, rev, view(1, rev, 70.0, 4)) if d.role == "decode"]
    assert (d.current, d.desired) == (1, 2)
    await pass_(kube, client, name)
    lws = kube.get(LWS, "leaderworkersets", NS, lws_name)
    assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    # a planned count outside the bounds (maxReplicas lowered since) is held to them by the builders
    kube.patch("kvship.io/v1alpha1", "inferenceservices", NS, name, planned_groups_patch({}, "decode", 9))
    await pass_(kube, client, name)
    assert kube.get(LWS, "leaderworkersets", NS, lws_name)["spec"]["replicas"] == 3
    assert (
        parse_service(kube.get("kvship.io/v1alpha1", "inferenceservices", NS, name)).spec.decode.nodes_per_replica == 2
    )
