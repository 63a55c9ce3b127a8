"""End to end: the real operator (kopf, `kvship operator` in a subprocess) against the loopback API server,
driven with real kubectl like a user would.

The operator runs as the Helm chart's service account, under the chart's rendered RBAC (the emulator
enforces it: anything the chart does not grant is a 403, and the last test checks none happened).
Readiness is simulated by patching child Deployments' status the way the Deployment controller would.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
import yaml
from kube_emulator import EmulatorThread, find_tool

from kvship.common.ports import free_port  # below the ephemeral range: no race with bind(0)

ROOT = Path(__file__).resolve().parent.parent
NS = "default"
KUBECTL = find_tool("kubectl")
HELM = find_tool("helm")
OPERATOR_NS = "kvship-system"
pytestmark = pytest.mark.skipif(
    KUBECTL is None or HELM is None, reason="kubectl or helm not installed: run .ci/install-k8s-tools.sh"
)
if KUBECTL is None or HELM is None:
    print("test_operator_e2e: skipped, kubectl or helm not found (.ci/install-k8s-tools.sh installs them)")
RBAC_PLURALS = {
    "ServiceAccount": ("v1", "serviceaccounts"),
    "ClusterRole": ("rbac.authorization.k8s.io/v1", "clusterroles"),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io/v1", "clusterrolebindings"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
}


def install_chart_rbac(kube) -> str:
    """Create the chart's ServiceAccount and RBAC (watching NS) as an admin; return the service account's name."""
    out = subprocess.run(
        [HELM, "template", "kvship", str(ROOT / "charts" / "kvship-operator"), "--namespace", OPERATOR_NS]
        + ["--set", "watch.namespaces={" + NS + "}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    kube.create("v1", "namespaces", None, {"metadata": {"name": OPERATOR_NS}})
    sa = None
    for doc in (d for d in yaml.safe_load_all(out.stdout) if d):
        if doc["kind"] == "ServiceAccount":
            sa = doc["metadata"]["name"]
        if doc["kind"] in RBAC_PLURALS:
            api_version, plural = RBAC_PLURALS[doc["kind"]]
            kube.create(api_version, plural, doc["metadata"].get("namespace"), doc)
    assert sa is not None
    return sa


class Operator:
    """`kvship operator` as a subprocess; ``restart()`` stops it (SIGTERM) and starts a new one."""

    def __init__(self, kubeconfig: str, workdir: Path, router_url: str = ""):
        self.kubeconfig, self.workdir = kubeconfig, workdir
        # no router runs in these tests: a closed port answers at once (tests/test_operator_live.py runs one)
        self.router_url = router_url or f"http://127.0.0.1:{free_port()}"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.logs: list[Path] = []

    def start(self) -> None:
        log = self.workdir / f"operator-{len(self.logs)}.log"
        self.logs.append(log)
        cmd = [
            sys.executable,
            "-m",
            "kvship.app.cli",
            "operator",
            "--kubeconfig",
            self.kubeconfig,
            "--namespace",
            NS,
            "--liveness-port",
            str(self.port),
            "--resync-interval",
            "2",
            "--router-url",
            self.router_url,
            "--worker-image",
            "reg.example/kvship/worker:test",
            "--router-image",
            "reg.example/kvship/router:test",
        ]
        self.proc = subprocess.Popen(cmd, cwd=self.workdir, stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_for(self.alive, 60, "the operator's liveness endpoint")

    def alive(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.tail()
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def restart(self) -> None:
        self.stop()
        self.start()

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.logs[-1].read_text().splitlines()[-n:]) if self.logs else ""


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("operator-e2e")
    with EmulatorThread(bookmark_interval=1) as kube:
        # a resync that read a service just before its deletion may still create children for it: as on a
        # cluster, the garbage collector removes those (their owner is gone)
        kube.emulator.collect_dangling_dependents = True

        def kubectl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
            out = subprocess.run(
                [KUBECTL, "--kubeconfig", kube.kubeconfig, *args], capture_output=True, text=True, timeout=60
            )
            if check:
                assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
            return out

        kubectl("apply", "--validate=false", "-f", str(ROOT / "crds" / "inferenceservices.kvship.io.yaml"))
        sa = install_chart_rbac(kube)
        op = Operator(kube.service_account_kubeconfig(OPERATOR_NS, sa), workdir)
        op.start()
        try:
            yield kube, kubectl, op
        finally:
            op.stop()
            print("operator log tail:\n" + op.tail(30))


def service(kube, name: str) -> dict:
    return kube.get("kvship.io/v1alpha1", "inferenceservices", NS, name)


def phase(kube, name: str) -> str | None:
    return ((service(kube, name) or {}).get("status") or {}).get("phase")


def deployments(kube, name: str) -> dict[str, dict]:
    return {
        d["metadata"]["name"]: d for d in kube.list("apps/v1", "deployments", NS, f"app.kubernetes.io/instance={name}")
    }


def mark_ready(kube, name: str) -> None:
    """What the Deployment controller reports once every pod of the current spec is ready."""
    for dep in deployments(kube, name).values():
        n = dep["spec"].get("replicas", 1)
        kube.patch_status(
            "apps/v1",
            "deployments",
            NS,
            dep["metadata"]["name"],
            {
                "observedGeneration": dep["metadata"]["generation"],
                "replicas": n,
                "readyReplicas": n,
                "updatedReplicas": n,
                "availableReplicas": n,
                "conditions": [
                    {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
                    {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
                ],
            },
        )


def test_kubectl_explain_teaches_the_spec(cluster):
    _, kubectl, _ = cluster
    out = kubectl("explain", "inferenceservice.spec.decode").stdout
    assert "tensorParallelSize" in out and "GPUs each pipeline stage of one worker shards the model over" in out
    assert "speculative" in kubectl("explain", "kvsvc.spec.decode.speculative").stdout


def test_applied_service_gets_owned_children_and_goes_ready(cluster):
    kube, kubectl, _ = cluster
    kubectl("apply", "--validate=false", "-n", NS, "-f", str(ROOT / "examples" / "unified-smollm2-cpu.yaml"))
    uid = service(kube, "smollm2")["metadata"]["uid"]
    deps = wait_for(
        lambda: len(deployments(kube, "smollm2")) == 2 and deployments(kube, "smollm2"),
        30,
        "the worker and router Deployments",
    )
    assert set(deps) == {"smollm2-worker", "smollm2-router"}
    for name in ("smollm2-config", "smollm2-router"):
        assert kube.get("v1", "configmaps" if name.endswith("config") else "services", NS, name)
    for dep in deps.values():
        (ref,) = dep["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceService", "smollm2", uid, True)
    # the service's Secrets and NetworkPolicies, made under the chart's RBAC (docs/operator.md, "Credentials")
    for name in ("smollm2-kv-transfer", "smollm2-worker-key", "smollm2-admin-key"):
        assert kube.get("v1", "secrets", NS, name)["metadata"]["ownerReferences"][0]["uid"] == uid
    policies = kube.list("networking.k8s.io/v1", "networkpolicies", NS, "app.kubernetes.io/instance=smollm2")
    assert {p["metadata"]["name"] for p in policies} == {"smollm2-worker", "smollm2-router"}
    worker_args = deps["smollm2-worker"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert worker_args[:7] == ["serve", "--host", "0.0.0.0", "--port", "30000", "--mode", "unified"]
    assert (
        deps["smollm2-worker"]["spec"]["template"]["spec"]["containers"][0]["image"] == "reg.example/kvship/worker:test"
    )
    wait_for(lambda: phase(kube, "smollm2") == "Progressing", 30, "phase Progressing")
    table = kubectl("get", "kvsvc", "-n", NS).stdout
    assert table.split("\n")[0].split() == [
        "NAME",
        "MODEL",
        "PREFILL",
        "DECODE",
        "ROUTER",
        "PHASE",
        "TTFT-P50",
        "ITL-P50",
        "RPS",
        "URL",
        "AGE",
    ]
    mark_ready(kube, "smollm2")
    wait_for(lambda: phase(kube, "smollm2") == "Ready", 30, "phase Ready")
    status = service(kube, "smollm2")["status"]
    conds = {c["type"]: c["status"] for c in status["conditions"]}
    assert conds == {
        "Valid": "True",
        "Ready": "True",
        "PrefillReady": "True",
        "DecodeReady": "True",
        "RouterReady": "True",
        "RouterSynced": "False",  # no router process answers here
    }

    def synced() -> dict:
        return next(c for c in service(kube, "smollm2")["status"]["conditions"] if c["type"] == "RouterSynced")

    # the router pod is ready now, so the next resync asks it (and finds nothing listening)
    wait_for(lambda: synced()["reason"] == "RouterUnreachable", 30, "RouterSynced=False, RouterUnreachable")
    assert "/workers failed" in synced()["message"]
    row = kubectl("get", "inferenceservices", "smollm2", "-n", NS).stdout.split("\n")[1].split()
    # no router answers here: the SLO columns are blank (so the URL follows the phase in the split row)
    assert row[:7] == [
        "smollm2",
        "builtin:smollm2",
        "0/0",
        "1/1",
        "1/1",
        "Ready",
        "http://smollm2-router.default.svc:8000",
    ]
    print(kubectl("get", "kvsvc", "-n", NS).stdout)
    assert not service(kube, "smollm2")["metadata"].get("finalizers"), "no finalizer: deletion never blocks"


def test_resync_undoes_manual_drift_of_a_child(cluster):
    kube, kubectl, _ = cluster
    kubectl("scale", "deployment", "smollm2-router", "-n", NS, "--replicas", "3")
    kubectl(
        "patch",
        "deployment",
        "smollm2-router",
        "-n",
        NS,
        "--type",
        "json",
        "-p",
        json.dumps([{"op": "replace", "path": "/spec/template/spec/containers/0/args/1", "value": "--hacked"}]),
    )

    def restored():
        dep = deployments(kube, "smollm2")["smollm2-router"]
        return dep["spec"]["replicas"] == 1 and dep["spec"]["template"]["spec"]["containers"][0]["args"][1] == "--host"

    wait_for(restored, 30, "the resync loop to restore the router Deployment")
    mark_ready(kube, "smollm2")


def test_spec_change_patches_the_children(cluster):
    kube, kubectl, _ = cluster
    wait_for(lambda: phase(kube, "smollm2") == "Ready", 30, "phase Ready")
    before = deployments(kube, "smollm2")
    kubectl(
        "patch",
        "kvsvc",
        "smollm2",
        "-n",
        NS,
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {"engine": {"extraArgs": ["--page-size", "16"]}, "decode": {"replicas": 2}}}),
    )

    def rolled():
        dep = deployments(kube, "smollm2")["smollm2-worker"]
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[-2:] == ["--page-size", "16"] and dep["spec"]["replicas"] == 2 and dep

    dep = wait_for(rolled, 30, "the worker Deployment to be patched")
    assert dep["metadata"]["uid"] == before["smollm2-worker"]["metadata"]["uid"], "patched, not recreated"
    assert dep["metadata"]["generation"] > before["smollm2-worker"]["metadata"]["generation"]
    wait_for(lambda: phase(kube, "smollm2") == "Progressing", 30, "phase Progressing during the rollout")
    mark_ready(kube, "smollm2")
    wait_for(lambda: phase(kube, "smollm2") == "Ready", 30, "phase Ready after the rollout")
    svc = service(kube, "smollm2")
    assert svc["status"]["observedGeneration"] == svc["metadata"]["generation"]
    assert svc["status"]["decode"]["ready"] == "2/2"


def test_invalid_spec_is_reported_and_creates_nothing_until_fixed(cluster):
    kube, kubectl, _ = cluster
    bad = {
        "apiVersion": "kvship.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "broken"},
        "spec": {"model": {"uri": "builtin:smollm2"}, "decode": {"tensorParallelSize": 2}},
    }
    kube.create("kvship.io/v1alpha1", "inferenceservices", NS, bad)
    wait_for(lambda: phase(kube, "broken") == "Failed", 30, "phase Failed")
    valid = next(c for c in service(kube, "broken")["status"]["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert "spec.decode.resources: tensorParallelSize 2 needs limits nvidia.com/gpu: 2" in valid["message"]
    events = wait_for(
        lambda: [
            e
            for e in kube.list("v1", "events", NS)
            if e.get("involvedObject", {}).get("name") == "broken" and e.get("reason") == "InvalidSpec"
        ],
        30,
        "an InvalidSpec event",
    )
    assert events[0]["type"] == "Warning"
    time.sleep(3)  # a resync pass later: still nothing, and no crash loop
    assert deployments(kube, "broken") == {}
    assert phase(kube, "broken") == "Failed"
    kubectl(
        "patch",
        "kvsvc",
        "broken",
        "-n",
        NS,
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {"decode": {"tensorParallelSize": 1}}}),
    )
    wait_for(lambda: len(deployments(kube, "broken")) == 2, 30, "children once the spec is fixed")
    wait_for(lambda: phase(kube, "broken") == "Progressing", 30, "phase Progressing after the fix")


def test_an_abbreviated_extra_arg_is_an_invalid_spec_with_an_event(cluster):
    kube, _, _ = cluster
    bad = {
        "apiVersion": "kvship.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "sneaky"},
        "spec": {"model": {"uri": "builtin:smollm2"}, "engine": {"extraArgs": ["--api-k", ""]}},
    }
    kube.create("kvship.io/v1alpha1", "inferenceservices", NS, bad)
    events = wait_for(
        lambda: [
            e
            for e in kube.list("v1", "events", NS)
            if e.get("involvedObject", {}).get("name") == "sneaky" and e.get("reason") == "InvalidSpec"
        ],
        30,
        "an InvalidSpec event",
    )
    assert "spec.engine.extraArgs: unrecognized arguments: --api-k" in events[0]["message"]
    assert phase(kube, "sneaky") == "Failed" and deployments(kube, "sneaky") == {}
    assert kube.get("v1", "secrets", NS, "sneaky-worker-key") is None, "nothing is made for an invalid spec"
    kube.delete("kvship.io/v1alpha1", "inferenceservices", NS, "sneaky")


def test_pd_service_gets_prefill_decode_router_and_autoscaler(cluster):
    kube, kubectl, _ = cluster
    kubectl("apply", "--validate=false", "-n", NS, "-f", str(ROOT / "examples" / "pd-llama-3.1-8b-mooncake.yaml"))
    deps = wait_for(
        lambda: len(deployments(kube, "llama-8b")) == 3 and deployments(kube, "llama-8b"),
        30,
        "prefill, decode and router Deployments",
    )
    router_args = deps["llama-8b-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--pd" in router_args and "--prefill-selector" in router_args
    hpa = kube.get("autoscaling/v2", "horizontalpodautoscalers", NS, "llama-8b-decode")
    decode = next(d for name, d in deps.items() if name.startswith("llama-8b-decode-"))  # named by its revision
    assert hpa["spec"]["scaleTargetRef"]["name"] == decode["metadata"]["name"]
    assert decode["metadata"]["labels"]["kvship.io/revision"] == decode["metadata"]["name"].rsplit("-", 1)[1]
    assert "replicas" not in decode["spec"] or decode["spec"]["replicas"] >= 1


def test_a_mooncake_store_gets_its_master_and_turning_it_off_removes_it(cluster, tmp_path):
    kube, kubectl, _ = cluster
    body = {
        "apiVersion": "kvship.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "kvstore", "namespace": NS},
        "spec": {"model": {"uri": "builtin:smollm2"}, "hicache": {"storage": "mooncake"}},
    }
    (tmp_path / "kvstore.json").write_text(json.dumps(body))
    kubectl("apply", "--validate=false", "-f", str(tmp_path / "kvstore.json"))

    def store_objects() -> dict[str, dict]:
        out = {}
        for api, plural in (
            ("apps/v1", "deployments"),
            ("v1", "services"),
            ("networking.k8s.io/v1", "networkpolicies"),
        ):
            obj = kube.get(api, plural, NS, "kvstore-mooncake-master")
            if obj is not None:
                out[plural] = obj
        return out

    made = wait_for(lambda: len(store_objects()) == 3 and store_objects(), 30, "the master's three objects")
    assert made["deployments"]["metadata"]["ownerReferences"][0]["name"] == "kvstore"
    worker = wait_for(lambda: deployments(kube, "kvstore").get("kvstore-worker"), 30, "the worker Deployment")
    args = worker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--hicache-storage-master") + 1] == f"kvstore-mooncake-master.{NS}.svc:50051"
    mark_ready(kube, "kvstore")
    wait_for(
        lambda: ((service(kube, "kvstore") or {}).get("status") or {}).get("storeMaster", {}).get("ready") == "1/1",
        30,
        "status.storeMaster 1/1",
    )
    kubectl(
        "patch",
        "kvsvc",
        "kvstore",
        "-n",
        NS,
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {"hicache": {"storage": "none"}}}),
    )
    wait_for(lambda: not store_objects(), 30, "the master's objects to be pruned")

    def plain_worker():
        dep = deployments(kube, "kvstore")["kvstore-worker"]
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        return not [a for a in args if a.startswith("--hicache")]

    wait_for(plain_worker, 30, "the worker's store flags to go")
    kubectl("delete", "kvsvc", "kvstore", "-n", NS)
    wait_for(lambda: not deployments(kube, "kvstore"), 30, "the children to be garbage-collected")


def test_operator_restart_changes_and_duplicates_nothing(cluster):
    kube, _, op = cluster
    wait_for(lambda: phase(kube, "smollm2") == "Ready", 30, "phase Ready")
    time.sleep(2.5)  # let in-flight resyncs settle
    before = {
        name: (d["metadata"]["uid"], d["metadata"]["resourceVersion"])
        for name, d in deployments(kube, "smollm2").items()
    }
    op.restart()
    time.sleep(5)  # resume handlers + two resync passes
    after = {
        name: (d["metadata"]["uid"], d["metadata"]["resourceVersion"])
        for name, d in deployments(kube, "smollm2").items()
    }
    assert after == before, "a restarted operator must find its children, not recreate or re-patch them"
    assert len(kube.list("v1", "services", NS, "app.kubernetes.io/instance=smollm2")) == 2
    assert phase(kube, "smollm2") == "Ready"


def test_deleting_the_service_removes_its_children(cluster):
    kube, kubectl, _ = cluster
    kubectl("delete", "kvsvc", "broken", "-n", NS)
    wait_for(lambda: not deployments(kube, "broken"), 30, "the children to be garbage-collected")
    assert not kube.list("v1", "services", NS, "app.kubernetes.io/instance=broken")


def test_the_operator_stayed_within_the_charts_rbac_and_watched_only_its_deployments(cluster):
    kube, _, _ = cluster
    rbac = kube.emulator.rbac
    wait_for(
        lambda: any(d.verb == "watch" and d.resource == "deployments" for d in rbac.decisions),
        30,
        "the operator's Deployment watch, authorized as its service account",
    )
    decisions = list(rbac.decisions)
    denied = sorted({(d.verb, d.resource, d.namespace) for d in rbac.denied()})
    assert denied == [], f"requests outside the chart's RBAC: {denied}"
    watches = [d for d in decisions if d.verb == "watch" and d.resource == "deployments"]
    for d in watches:
        params = dict(d.params)
        assert params.get("labelSelector") == "app.kubernetes.io/managed-by=kvship-operator", params
        assert d.namespace == NS, "namespaced: no cluster-wide watch"
    assert not [d for d in decisions if d.verb == "watch" and d.resource in ("configmaps", "services")]
