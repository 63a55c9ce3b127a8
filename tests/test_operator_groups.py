"""Multi-node worker groups (nodesPerReplica > 1): spec rules, LeaderWorkerSet / StatefulSet builders checked
against the official schemas, the router's leader-only discovery, group counts in the status, the operator's
group restart of the StatefulSet fallback, and the emulator's controllers (gang readiness, group restart)."""

from __future__ import annotations

import argparse
import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest

from kvship.engine.config import ServerArgs
from kvship.operator.builders import Images, Network, build_children
from kvship.operator.builders.groups import GROUP_LABEL, GROUP_PODS_ANNOTATION, LWS_WORKER_INDEX_LABEL
from kvship.operator.groups import group_restarts, leader_of, role_workload
from kvship.operator.rollout import gate_updates
from kvship.operator.router_client import RouterView
from kvship.operator.spec import SpecError, parse_service
from kvship.operator.status import compute_status

HERE = Path(__file__).resolve().parent
LWS_SCHEMA = json.loads((HERE / "data" / "leaderworkerset_v1_schema.json").read_text())
IMAGES = Images(worker="reg/worker:1", router="reg/router:1")
K8S = "1.35.0"
GPU = "nvidia.com/gpu"


def cfg_of(spec: dict, name: str = "svc"):
    return parse_service({"metadata": {"name": name, "namespace": "ml", "uid": "u1", "generation": 1}, "spec": spec})


def pd_spec(nodes: int = 2, replicas: int = 2) -> dict:
    return {
        "model": {"uri": "hf://org/model"},
        "prefill": {"replicas": 1, "tensorParallelSize": 2, "resources": {"limits": {GPU: 2}}},
        "decode": {
            "replicas": replicas,
            "nodesPerReplica": nodes,
            "tensorParallelSize": 8,
            "resources": {"limits": {GPU: 8 // nodes}},
        },
    }


def pp_prefill_spec(pp: int = 2) -> dict:
    """A PD service whose prefill workers run tensorParallelSize 8 x pipelineParallelSize ``pp`` over two pods."""
    return {
        "model": {"uri": "hf://org/model"},
        "prefill": {
            "replicas": 1,
            "tensorParallelSize": 8,
            "pipelineParallelSize": pp,
            "nodesPerReplica": 2,
            "resources": {"limits": {GPU: 8 * pp // 2}},
        },
        "decode": {"replicas": 1, "tensorParallelSize": 8, "resources": {"limits": {GPU: 8}}},
    }


def of_kind(children: list[dict], kind: str) -> list[dict]:
    return [c for c in children if c["kind"] == kind]


def server_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p.parse_args(argv[1:])  # argv[0] is the "serve" subcommand


def router_args(children: list[dict]) -> list[str]:
    router = next(c for c in of_kind(children, "Deployment") if c["metadata"]["name"] == "svc-router")
    return router["spec"]["template"]["spec"]["containers"][0]["args"]


# ------------------------------------------------------------------------------------------- spec
def test_spec_rules_for_groups():
    cfg = cfg_of(pd_spec())
    assert cfg.spec.decode.nodes_per_replica == 2 and cfg.spec.prefill.nodes_per_replica == 1
    bad = pd_spec(nodes=3)
    with pytest.raises(SpecError) as e:
        cfg_of(bad)
    assert any("nodesPerReplica: 3 must divide tensorParallelSize 8" in m for m in e.value.errors)
    bad = pd_spec()
    bad["decode"]["resources"] = {"limits": {GPU: 8}}
    with pytest.raises(SpecError) as e:
        cfg_of(bad)
    assert any("4 on each of its 2 pods" in m for m in e.value.errors)
    bad = pd_spec()
    bad["decode"]["autoscaling"] = {"maxReplicas": 3}
    with pytest.raises(SpecError) as e:
        cfg_of(bad)
    assert any(
        "decode.autoscaling: with nodesPerReplica > 1 only the SLO planner scales groups" in m for m in e.value.errors
    )
    bad["slo"], bad["autoscaling"] = {"itlP50Ms": 50}, {"mode": "slo"}  # the planner scales whole groups
    assert cfg_of(bad).spec.decode.autoscaling.max_replicas == 3
    with pytest.raises(SpecError) as e:
        cfg_of(pd_spec(), name="a" * 40)
    assert any("multi-node worker groups" in m for m in e.value.errors)


def test_nodes_per_replica_is_part_of_the_revision_only_above_one():
    one = build_children(cfg_of(pd_spec(nodes=1)), IMAGES)
    plain = copy.deepcopy(pd_spec(nodes=1))
    del plain["decode"]["nodesPerReplica"]
    assert of_kind(one, "Deployment") == of_kind(build_children(cfg_of(plain), IMAGES), "Deployment")
    two = build_children(cfg_of(pd_spec()), IMAGES)
    rev = lambda cs: next(c for c in cs if c["kind"] == "Deployment")["metadata"]["labels"]["kvship.io/revision"]  # noqa: E731
    assert rev(one) != rev(two)  # a new set of groups rolls out beside the old Deployments


def test_pipeline_parallel_size_is_part_of_the_revision_only_above_one():
    rev = lambda cs: {  # noqa: E731
        c["metadata"]["labels"]["kvship.io/role"]: c["metadata"]["labels"]["kvship.io/revision"]
        for c in cs
        if c["kind"] in ("Deployment", "StatefulSet") and c["metadata"]["labels"]["kvship.io/role"] != "router"
    }
    one = pp_prefill_spec(pp=1)
    explicit = rev(build_children(cfg_of(one), IMAGES))
    del one["prefill"]["pipelineParallelSize"]
    assert rev(build_children(cfg_of(one), IMAGES)) == explicit  # existing services keep their revision
    two = rev(build_children(cfg_of(pp_prefill_spec(pp=2)), IMAGES))
    # a new prefill layout rolls both roles out as one new worker set (prefill and decode share the revision)
    assert len(set(two.values())) == 1 and set(two.values()).isdisjoint(explicit.values())
    # so does another split of the layers over the same stages
    split = pp_prefill_spec(pp=2)
    split["prefill"]["extraArgs"] = ["--pp-layer-partition", "10,22"]
    moved = rev(build_children(cfg_of(split), IMAGES))
    assert len(set(moved.values())) == 1 and set(moved.values()).isdisjoint(two.values())


# ------------------------------------------------------------------------------------------- builders
def test_leader_worker_set_matches_the_official_schema_and_wires_the_rendezvous():
    children = build_children(cfg_of(pd_spec()), IMAGES, Network(leader_worker_set=True))
    (lws,) = of_kind(children, "LeaderWorkerSet")
    jsonschema.validate(lws, LWS_SCHEMA)
    tpl = lws["spec"]["leaderWorkerTemplate"]
    assert tpl["size"] == 2 and tpl["restartPolicy"] == "RecreateGroupOnPodRestart" and lws["spec"]["replicas"] == 2
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tpl["workerTemplate"]},
        K8S,
        strict=True,
    )
    args = tpl["workerTemplate"]["spec"]["containers"][0]["args"]
    ns = server_args(args[:-6] + ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "leader:29500"])
    assert (ns.nnodes, ns.node_rank) == (2, 1)
    assert args[-6:] == [
        "--nnodes",
        "2",
        "--node-rank",
        "$(LWS_WORKER_INDEX)",
        "--dist-init-addr",
        "$(LWS_LEADER_ADDRESS):29500",
    ]
    assert tpl["workerTemplate"]["spec"]["containers"][0]["resources"]["limits"][GPU] == 4
    # the decode role has no Deployment, HPA or PDB any more; prefill keeps its Deployment
    deps = {c["metadata"]["labels"]["kvship.io/role"] for c in of_kind(children, "Deployment")}
    assert deps == {"prefill", "router"}
    # only leaders are discovered by the router
    args = router_args(children)
    decode_sel = args[args.index("--decode-selector") + 1 : args.index("--decode-selector") + 5]
    assert f"{LWS_WORKER_INDEX_LABEL}=0" in decode_sel
    assert not any(
        LWS_WORKER_INDEX_LABEL in a for a in args[args.index("--prefill-selector") : args.index("--decode-selector")]
    )
    svc = next(c for c in of_kind(children, "Service") if c["metadata"]["name"] == "svc-decode")
    assert svc["spec"]["publishNotReadyAddresses"] is True


def test_statefulset_fallback_one_per_group_matches_the_official_schema():
    children = build_children(cfg_of(pd_spec()), IMAGES)
    sets = of_kind(children, "StatefulSet")
    assert len(sets) == 2 and not of_kind(children, "LeaderWorkerSet")
    for i, sts in enumerate(sets):
        kubernetes_validate.validate(sts, K8S, strict=True)
        name = sts["metadata"]["name"]
        assert name.endswith(f"-g{i}") and sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == "svc-decode"
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        c = sts["spec"]["template"]["spec"]["containers"][0]
        assert c["args"][-6:] == [
            "--nnodes",
            "2",
            "--node-rank",
            "$(GROUP_NODE_RANK)",
            "--dist-init-addr",
            f"{name}-0.svc-decode.ml.svc:29500",
        ]
        rank_env = next(e for e in c["env"] if e["name"] == "GROUP_NODE_RANK")
        assert rank_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
        assert sts["spec"]["selector"]["matchLabels"][GROUP_LABEL] == name
        assert sts["spec"]["template"]["metadata"]["labels"][GROUP_LABEL] == name
    args = router_args(children)
    assert "apps.kubernetes.io/pod-index=0" in args


@pytest.mark.parametrize("lws", [True, False], ids=["leaderworkerset", "statefulsets"])
def test_pipeline_parallel_prefill_groups_split_tp_times_pp_gpus_over_their_pods(lws):
    children = build_children(cfg_of(pp_prefill_spec()), IMAGES, Network(leader_worker_set=lws))
    if lws:
        (obj,) = of_kind(children, "LeaderWorkerSet")
        jsonschema.validate(obj, LWS_SCHEMA)
        tpl = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tpl}, K8S, strict=True
        )
        assert obj["spec"]["leaderWorkerTemplate"]["size"] == 2
    else:
        (obj,) = of_kind(children, "StatefulSet")
        kubernetes_validate.validate(obj, K8S, strict=True)
        tpl = obj["spec"]["template"]
        assert obj["spec"]["replicas"] == 2
    assert tpl["metadata"]["labels"]["kvship.io/role"] == "prefill"
    c = tpl["spec"]["containers"][0]
    assert c["resources"]["limits"][GPU] == 8  # 8 x 2 ranks over 2 pods
    args = c["args"]
    assert args[args.index("--pp-size") + 1] == "2" and args[args.index("--tp-size") + 1] == "8"
    for rank in ("0", "1"):  # what the kubelet runs on each pod once $(VARS) are expanded
        ns = server_args(args[:-6] + ["--nnodes", "2", "--node-rank", rank, "--dist-init-addr", "leader:29500"])
        ServerArgs.from_cli_args(ns).validate()
        assert (ns.mode, ns.tp_size, ns.pp_size, ns.nnodes, ns.node_rank) == ("prefill", 8, 2, 2, int(rank))
    # the decode role (one pod of TP 8) stays a Deployment without pipeline stages
    (decode,) = [d for d in of_kind(children, "Deployment") if d["metadata"]["labels"]["kvship.io/role"] == "decode"]
    dargs = decode["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--pp-size" not in dargs and server_args(dargs).pp_size == 1


def test_unified_groups_open_every_port_between_the_workers():
    spec = {
        "model": {"uri": "builtin:smollm2"},
        "decode": {"replicas": 1, "nodesPerReplica": 2, "tensorParallelSize": 2},
    }
    children = build_children(cfg_of(spec), IMAGES, Network(leader_worker_set=True))
    (lws,) = of_kind(children, "LeaderWorkerSet")
    assert lws["metadata"]["name"] == "svc-worker"
    policy = next(c for c in of_kind(children, "NetworkPolicy") if c["metadata"]["name"] == "svc-worker")
    assert any("ports" not in rule for rule in policy["spec"]["ingress"])
    for obj in children:
        if obj["kind"] != "LeaderWorkerSet":
            kubernetes_validate.validate(obj, K8S, strict=True)


# ------------------------------------------------------------------------------------------- status
def _lws(ready: int, replicas: int = 2) -> dict:
    return {
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "svc-decode-x", "labels": {"kvship.io/role": "decode", "kvship.io/revision": "x"}},
        "spec": {"replicas": replicas},
        "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas},
    }


def _sts(i: int, ready: int) -> dict:
    return {
        "kind": "StatefulSet",
        "metadata": {"name": f"svc-decode-x-g{i}", "generation": 1, "labels": {"kvship.io/role": "decode"}},
        "spec": {"replicas": 2},
        "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": ready, "updatedReplicas": 2},
    }


def test_groups_count_ready_only_when_all_their_pods_are():
    assert role_workload({("LeaderWorkerSet", "svc-decode-x"): _lws(1)}, "svc-decode-x")["status"]["readyReplicas"] == 1
    children = {("StatefulSet", "svc-decode-x-g0"): _sts(0, 2), ("StatefulSet", "svc-decode-x-g1"): _sts(1, 1)}
    w = role_workload(children, "svc-decode-x")
    assert (w["spec"]["replicas"], w["status"]["readyReplicas"]) == (2, 1)  # 3 of 4 pods ready = 1 of 2 groups
    assert role_workload(children, "svc-decode") is None


def test_status_shows_groups_ready_over_desired():
    cfg = cfg_of(pd_spec())
    built = build_children(cfg, IMAGES, Network(leader_worker_set=True))
    rev = next(c for c in built if c["kind"] == "LeaderWorkerSet")["metadata"]["labels"]["kvship.io/revision"]
    children = {}
    for c in built:
        if c["kind"] in ("Deployment", "Service", "LeaderWorkerSet"):
            obj = copy.deepcopy(c)
            obj["metadata"]["generation"] = 1
            replicas = obj["spec"].get("replicas", 1)
            obj["status"] = {
                "observedGeneration": 1,
                "replicas": replicas,
                "readyReplicas": replicas,
                "updatedReplicas": replicas,
            }
            if c["kind"] == "LeaderWorkerSet":
                obj["status"]["readyReplicas"] = 1
            children[(c["kind"], c["metadata"]["name"])] = obj
    body = {"metadata": {"name": "svc", "namespace": "ml", "uid": "u1", "generation": 1}, "spec": pd_spec()}
    from kvship.operator.status import Observed

    status = compute_status(body, cfg, [], [], children, observed=Observed(revision=rev))
    assert status["decode"]["ready"] == "1/2" and status["decode"]["nodesPerReplica"] == 2
    assert "nodesPerReplica" not in status["prefill"]
    assert status["phase"] != "Ready"
    assert status["revisions"][0]["decode"] == "1/2"


# ------------------------------------------------------------------------------------------- operator restarts
def _pod(name: str, uid: str, group: str, index: int, restarts: int = 0, ready: bool = True) -> dict:
    return {
        "metadata": {
            "name": name,
            "uid": uid,
            "labels": {GROUP_LABEL: group, "apps.kubernetes.io/pod-index": str(index)},
        },
        "status": {
            "phase": "Running",
            "conditions": [{"type": "ContainersReady", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "worker", "restartCount": restarts}],
        },
    }


def test_statefulset_group_restart_when_a_pod_is_lost_or_restarts():
    sts = {"metadata": {"name": "g0", "annotations": {}}, "spec": {"replicas": 2}}
    pods = [_pod("g0-0", "a", "g0", 0), _pod("g0-1", "b", "g0", 1)]
    (first,) = group_restarts([sts], pods)
    assert first.record == "a:0,b:0" and not first.delete  # whole: recorded
    sts["metadata"]["annotations"][GROUP_PODS_ANNOTATION] = first.record
    assert group_restarts([sts], pods) == []  # unchanged: nothing to do
    replaced = [pods[0], _pod("g0-1", "c", "g0", 1, ready=False)]  # the StatefulSet recreated pod 1
    (restart,) = group_restarts([sts], replaced)
    assert restart.record is None and restart.delete == ("g0-0", "g0-1") and "b:0" in restart.reason
    restarted = [_pod("g0-0", "a", "g0", 0, restarts=1), pods[1]]  # leader's container restarted
    assert group_restarts([sts], restarted)[0].delete == ("g0-0", "g0-1")
    assert group_restarts([sts], pods[:1])[0].delete == ("g0-0",)  # a pod gone and not yet back
    half = {"metadata": {"name": "g0", "annotations": {}}, "spec": {"replicas": 2}}
    assert group_restarts([half], pods[:1]) == []  # never whole yet: nothing recorded


def test_group_members_follow_their_leader_into_rotation():
    gate = [{"conditionType": "kvship.io/in-rotation"}]
    leader = {
        "metadata": {"name": "svc-decode-x-0", "labels": {LWS_WORKER_INDEX_LABEL: "0"}},
        "spec": {"readinessGates": gate},
        "status": {"podIP": "10.0.0.1"},
    }
    member = {
        "metadata": {"name": "svc-decode-x-0-1", "labels": {LWS_WORKER_INDEX_LABEL: "1"}},
        "spec": {"readinessGates": gate},
        "status": {"podIP": "10.0.0.2"},
    }
    assert leader_of(member) == "svc-decode-x-0" and leader_of(leader) is None
    sts_member = {"metadata": {"name": "svc-decode-x-g1-1", "labels": {"apps.kubernetes.io/pod-index": "1"}}}
    assert leader_of(sts_member) == "svc-decode-x-g1-0"
    router = RouterView(
        "http://r",
        True,
        None,
        workers=[{"url": "http://10.0.0.1:30000", "name": "svc-decode-x-0", "in_rotation": True}],
    )
    updates = {u.pod: u.status for u in gate_updates([leader, member], router)}
    assert updates == {"svc-decode-x-0": "True", "svc-decode-x-0-1": "True"}
    alone = {u.pod: u.status for u in gate_updates([member], router)}  # leader gone: the member is out
    assert alone == {"svc-decode-x-0-1": "False"}


# ------------------------------------------------------------------------------------------- emulator
class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def health_port():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def _lws_crd() -> dict:
    # a CRD's schema requires no apiVersion / kind / metadata (the API server owns those)
    schema = {k: v for k, v in LWS_SCHEMA.items() if k not in ("$comment", "required")}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
        "spec": {
            "group": "leaderworkerset.x-k8s.io",
            "scope": "Namespaced",
            "names": {
                "kind": "LeaderWorkerSet",
                "plural": "leaderworkersets",
                "singular": "leaderworkerset",
                "listKind": "LeaderWorkerSetList",
            },
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                }
            ],
        },
    }


def _wait(pred, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_emulator_lws_gang_readiness_and_group_restart(health_port):
    from kube_emulator import EmulatorThread
    from kube_emulator_groups import Groups

    up: set[str] = set()
    children = build_children(cfg_of(pd_spec(replicas=1)), IMAGES, Network(leader_worker_set=True))
    (lws,) = of_kind(children, "LeaderWorkerSet")
    for c in lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]:
        c.pop("resources")
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"].pop("readinessGates")
    lws["metadata"].pop("ownerReferences")
    with EmulatorThread() as kube:
        kube.create("apiextensions.k8s.io/v1", "customresourcedefinitions", None, _lws_crd())
        kube.create("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "ml", lws)
        name = lws["metadata"]["name"]
        with Groups(kube, "ml", lambda pod: health_port if pod["metadata"]["name"] in up else None) as groups:
            pods = _wait(lambda: len(kube.list("v1", "pods", "ml")) == 2 and kube.list("v1", "pods", "ml"))
            leader = next(p for p in pods if p["metadata"]["labels"][LWS_WORKER_INDEX_LABEL] == "0")
            worker = next(p for p in pods if p["metadata"]["labels"][LWS_WORKER_INDEX_LABEL] == "1")
            assert leader["metadata"]["name"] == f"{name}-0" and worker["metadata"]["name"] == f"{name}-0-1"
            env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
            assert env["LWS_WORKER_INDEX"] == "1" and env["LWS_LEADER_ADDRESS"] == f"{name}-0.{name}.ml"
            up.add(leader["metadata"]["name"])  # one pod of two up: the group is not ready
            time.sleep(1.0)
            assert (kube.get("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "ml", name).get("status") or {}).get(
                "readyReplicas"
            ) == 0
            up.add(worker["metadata"]["name"])
            _wait(
                lambda: (
                    kube.get("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "ml", name)["status"]["readyReplicas"]
                    == 1
                )
            )
            kube.delete("v1", "pods", "ml", worker["metadata"]["name"])  # one pod lost: the whole group restarts
            _wait(lambda: groups.recreated == [f"{name}-0"])
            fresh = _wait(lambda: len(kube.list("v1", "pods", "ml")) == 2 and kube.list("v1", "pods", "ml"))
            assert {p["metadata"]["uid"] for p in fresh}.isdisjoint(
                {leader["metadata"]["uid"], worker["metadata"]["uid"]}
            )
            assert not groups.errors or all("NotFound" in e or "404" in e for e in groups.errors)


def test_emulator_statefulset_recreates_only_the_lost_pod(health_port):
    from kube_emulator import EmulatorThread
    from kube_emulator_groups import Groups

    children = build_children(cfg_of(pd_spec(replicas=1)), IMAGES)
    (sts,) = of_kind(children, "StatefulSet")
    sts["metadata"].pop("ownerReferences")
    sts["spec"]["template"]["spec"].pop("readinessGates")  # no operator here to set the in-rotation gate
    with EmulatorThread() as kube:
        kube.create("apps/v1", "statefulsets", "ml", sts)
        name = sts["metadata"]["name"]
        with Groups(kube, "ml", lambda pod: health_port):
            pods = _wait(lambda: len(kube.list("v1", "pods", "ml")) == 2 and kube.list("v1", "pods", "ml"))
            assert sorted(p["metadata"]["name"] for p in pods) == [f"{name}-0", f"{name}-1"]
            assert {p["metadata"]["labels"]["apps.kubernetes.io/pod-index"] for p in pods} == {"0", "1"}
            _wait(
                lambda: (kube.get("apps/v1", "statefulsets", "ml", name).get("status") or {}).get("readyReplicas") == 2
            )
            uid0 = next(p["metadata"]["uid"] for p in pods if p["metadata"]["name"] == f"{name}-0")
            kube.delete("v1", "pods", "ml", f"{name}-1")
            again = _wait(lambda: len(kube.list("v1", "pods", "ml")) == 2 and kube.list("v1", "pods", "ml"))
            # a StatefulSet keeps the other pod: restarting the group is the operator's job (group_restarts)
            assert uid0 in {p["metadata"]["uid"] for p in again}
