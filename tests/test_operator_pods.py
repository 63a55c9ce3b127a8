"""Worker and router pods an SRE would accept: bounded volumes, requested storage, QoS, RDMA, advertised IP."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
import yaml

from kvship.operator.builders import Images, build_children
from kvship.operator.spec import SpecError, parse_service

ROOT = Path(__file__).resolve().parent.parent
IMAGES = Images(worker="reg/worker:1", router="reg/router:1")
EXAMPLES = sorted(glob.glob(str(ROOT / "examples" / "*.yaml")))
PD = {
    "model": {"uri": "hf://org/model"},
    "prefill": {"replicas": 1, "resources": {"limits": {"nvidia.com/gpu": 1}}},
    "decode": {"replicas": 1, "resources": {"limits": {"nvidia.com/gpu": 1}}},
    "kvTransfer": {"backend": "mooncake", "rdmaDevices": ["mlx5_0"]},
}


def pods(spec: dict) -> dict[str, dict]:
    body = {"metadata": {"name": "svc", "namespace": "ml", "uid": "u-1"}, "spec": spec}
    deps = [c for c in build_children(parse_service(body), IMAGES) if c["kind"] == "Deployment"]
    return {role_name(d["metadata"]): d["spec"]["template"] for d in deps}


def role_name(meta: dict) -> str:
    """A Deployment's name without the revision suffix PD worker Deployments carry (``svc-decode-<rev>``)."""
    rev = (meta.get("labels") or {}).get("kvship.io/revision")
    return meta["name"][: -len(rev) - 1] if rev and meta["name"].endswith("-" + rev) else meta["name"]


def example_pods(path: str) -> dict[str, dict]:
    body = yaml.safe_load(Path(path).read_text())
    deps = [c for c in build_children(parse_service(dict(body, metadata={**body["metadata"], "uid": "u"})), IMAGES)]
    return {role_name(d["metadata"]): d["spec"]["template"] for d in deps if d["kind"] == "Deployment"}


def volumes(tpl: dict) -> dict[str, dict]:
    return {v["name"]: v for v in tpl["spec"]["volumes"]}


def worker(tpl: dict) -> dict:
    return tpl["spec"]["containers"][0]


def test_shm_and_model_cache_are_bounded_and_the_cache_is_requested_as_ephemeral_storage():
    tpl = pods(PD)["svc-decode"]
    vols = volumes(tpl)
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}  # GPU worker default
    assert vols["cache"]["emptyDir"] == {"sizeLimit": "100Gi"}  # hf:// download default
    assert worker(tpl)["resources"]["requests"]["ephemeral-storage"] == "100Gi"
    # sizes from the spec; a CPU worker of a built-in model gets the small defaults
    tpl = pods(dict(PD, model={"uri": "hf://org/model", "cacheSize": "300Gi"}, engine={"shmSize": "32Gi"}))
    vols = volumes(tpl["svc-prefill"])
    assert vols["cache"]["emptyDir"]["sizeLimit"] == "300Gi" and vols["dshm"]["emptyDir"]["sizeLimit"] == "32Gi"
    assert worker(tpl["svc-prefill"])["resources"]["requests"]["ephemeral-storage"] == "300Gi"
    tpl = pods({"model": {"uri": "builtin:smollm2"}})["svc-worker"]
    assert volumes(tpl)["dshm"]["emptyDir"]["sizeLimit"] == "1Gi"
    assert volumes(tpl)["cache"]["emptyDir"]["sizeLimit"] == "10Gi"


def test_a_shared_cache_claim_is_not_requested_as_node_storage_and_is_not_rechowned_each_start():
    tpl = pods(dict(PD, model={"uri": "hf://org/model", "cacheVolumeClaim": "model-cache"}))["svc-decode"]
    assert volumes(tpl)["cache"] == {"name": "cache", "persistentVolumeClaim": {"claimName": "model-cache"}}
    assert "ephemeral-storage" not in worker(tpl)["resources"].get("requests", {})
    sc = tpl["spec"]["securityContext"]
    assert sc["fsGroup"] == 1000 and sc["fsGroupChangePolicy"] == "OnRootMismatch"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: Path(p).name)
def test_no_pod_of_any_example_is_best_effort(path):
    for name, tpl in example_pods(path).items():
        for c in tpl["spec"]["containers"] + tpl["spec"].get("initContainers", []):
            res = c.get("resources") or {}
            effective = set(res.get("requests") or {}) | set(res.get("limits") or {})
            assert {"cpu", "memory"} <= effective, f"{name}/{c['name']} requests no cpu/memory: {res}"


def test_roles_without_resources_get_default_requests():
    tpls = pods({"model": {"uri": "builtin:smollm2"}})
    assert worker(tpls["svc-worker"])["resources"]["requests"] == {
        "cpu": "1",
        "memory": "2Gi",
        "ephemeral-storage": "10Gi",
    }
    assert worker(tpls["svc-router"])["resources"] == {"requests": {"cpu": "250m", "memory": "256Mi"}}


def test_moe_example_requests_its_rdma_device_network_and_ipc_lock():
    tpls = example_pods(str(ROOT / "examples" / "moe-qwen3-30b-a3b-ep.yaml"))
    for role in ("qwen3-moe-prefill", "qwen3-moe-decode"):
        c = worker(tpls[role])
        assert c["resources"]["limits"]["rdma/hca"] == "1"
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert tpls[role]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
        env = {e["name"]: e for e in c["env"]}
        assert env["UCX_NET_DEVICES"]["value"] == "mlx5_0:1,mlx5_1:1"
    router = worker(tpls["qwen3-moe-router"])
    assert "IPC_LOCK" not in str(router["securityContext"]) and "rdma/hca" not in str(router["resources"])


def test_ipc_lock_can_be_turned_off_and_rdma_fields_need_an_rdma_backend():
    tpl = pods(dict(PD, kvTransfer=dict(PD["kvTransfer"], ipcLock=False)))["svc-decode"]
    assert worker(tpl)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    bad = dict(PD, kvTransfer={"backend": "tcp", "rdmaResource": "rdma/hca", "ipcLock": True})
    with pytest.raises(SpecError) as e:
        pods(bad)
    assert "spec.kvTransfer.rdmaResource: needs backend mooncake or nixl" in str(e.value)
    assert "spec.kvTransfer.ipcLock" in str(e.value)


def test_workers_advertise_the_pod_ip(monkeypatch):
    for tpl in pods(PD).values():
        c = worker(tpl)
        if c["name"] != "worker":
            continue
        env = {e["name"]: e for e in c["env"]}
        assert env["KVSHIP_ADVERTISE_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    from kvship.engine.disagg.base import advertise_host

    monkeypatch.setenv("KVSHIP_ADVERTISE_HOST", "10.1.2.3")
    assert advertise_host("0.0.0.0") == "10.1.2.3"
    assert advertise_host("192.168.0.9") == "192.168.0.9"  # an explicit bind address wins
    monkeypatch.delenv("KVSHIP_ADVERTISE_HOST")
    assert advertise_host("0.0.0.0") != "10.1.2.3"
