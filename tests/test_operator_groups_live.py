"""A multi-node worker group live: the real operator (kopf, under the chart's RBAC), ``kvship router`` and CPU
workers, the Kubernetes API emulator with its StatefulSet controller (tests/kube_emulator_groups.py), real kubectl.

The decode role has ``nodesPerReplica: 2`` and ``tensorParallelSize: 2``: the emulator has no LeaderWorkerSet CRD,
so the operator makes the StatefulSet fallback (one StatefulSet of 2 pods per group).  Each pod is a real
``kvship serve`` process started from the pod's own container (its ``$(VAR)`` arguments expanded from the pod's env,
the rank from the downward-API pod-index label, as the kubelet does): pod 0 is node 0 (HTTP, rank 0), pod 1 node 1
(rank 1); they form TP=2 over gloo.  The rendezvous address the operator wrote (the leader's stable DNS name, port
29500) is reached through the emulator's loopback pod network (``LoopbackNetwork``: pod DNS -> 127.0.0.1, each
pod's container port -> a host port of its own), the only change made to the argv besides loopback ports and a
small KV pool.  Prefill and router are Deployments played by tests/kube_emulator_workloads.py.

Checked (issue 37): the group comes up as one decode replica (status 1/1), only its leader is in the router's
rotation, requests through the router are served by the leader; deleting the group's second pod makes the operator
restart the whole group (both pods new), and once the group is back requests succeed again.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import httpx
import pytest
from conftest import build_tiny_model
from kube_emulator import EmulatorThread, find_tool
from kube_emulator_groups import Groups, LoopbackNetwork
from kube_emulator_workloads import Workloads
from test_operator_e2e import NS, Operator, free_port, install_chart_rbac, wait_for
from test_operator_live import ROUTER_GATES, WORKER_EXTRA, Pods

ROOT = Path(__file__).resolve().parent.parent
KUBECTL = find_tool("kubectl")
HELM = find_tool("helm")
pytestmark = [
    pytest.mark.skipif(KUBECTL is None or HELM is None, reason="kubectl or helm not installed"),
    pytest.mark.skipif(not ROUTER_GATES, reason="the router's discovery waits for Ready (issue 20, router side)"),
    pytest.mark.timeout(900),
    pytest.mark.slow,
]
NAME = "grp"
GROUP_EXTRA = ["--max-total-tokens", "4096", "--max-running-requests", "4"]
GROUP_LABEL = "kvship.io/group"
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
FIELD_LABEL = re.compile(r"metadata\.labels\['([^']+)'\]")


class GroupProcesses:
    """The kubelet of worker pods (group members, or the pods of a Deployment with ``Workloads(per_pod=True)``):
    one ``kvship serve`` process per pod (by uid), restarted when it exits (``restartCount`` + 1, as a container
    restart), and when its pod is deleted (``reap``) sent SIGTERM, then SIGKILL after ``grace_s`` (what the
    kubelet does within ``terminationGracePeriodSeconds``; the worker drains its open requests meanwhile)."""

    def __init__(
        self,
        pods: Pods,
        net: LoopbackNetwork,
        kube: Any,
        workdir: Path,
        extra: Optional[list[str]] = None,
        grace_s: float = 10.0,
    ):
        self.pods, self.net, self.kube, self.workdir = pods, net, kube, workdir
        self.extra = WORKER_EXTRA if extra is None else extra
        self.grace_s = grace_s
        self.terminating: list[threading.Thread] = []
        self.running: dict[str, tuple[str, subprocess.Popen, int]] = {}  # pod name -> (uid, process, port)
        self.started: list[str] = []  # "<pod>/<uid>" per process start
        self.lock = threading.Lock()
        self.closed = False

    def __call__(self, pod: dict) -> Optional[int]:
        name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        with self.lock:
            if self.closed:
                return None
            held = self.running.get(name)
            if held is not None and held[0] == uid and held[1].poll() is None:
                return held[2]
            if held is not None:
                _kill(held[1])
                if held[0] == uid:  # the container exited: the kubelet restarts it
                    self._bump_restart(pod)
            port = free_port()
            self.running[name] = (uid, self._start(pod, port), port)
            self.started.append(f"{name}/{uid}")
            return port

    def reap(self) -> None:
        live = {p["metadata"]["uid"] for p in self.kube.list("v1", "pods", NS)}
        with self.lock:
            for name, (uid, proc, _) in list(self.running.items()):
                if uid not in live:
                    stop = threading.Thread(target=_terminate, args=(proc, self.grace_s), daemon=True)
                    stop.start()
                    self.terminating.append(stop)
                    del self.running[name]

    def _bump_restart(self, pod: dict) -> None:
        statuses = (pod.get("status") or {}).get("containerStatuses") or [{"name": "worker", "restartCount": 0}]
        statuses = [dict(statuses[0], restartCount=int(statuses[0].get("restartCount") or 0) + 1)]
        with contextlib.suppress(Exception):  # deleted meanwhile
            self.kube.patch_status("v1", "pods", NS, pod["metadata"]["name"], {"containerStatuses": statuses})

    def _env(self, pod: dict, container: dict) -> dict[str, str]:
        env = {}
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = e["value"]
                continue
            path = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
            label = FIELD_LABEL.fullmatch(path)
            if label:
                env[e["name"]] = pod["metadata"]["labels"][label.group(1)]
            elif path == "metadata.name":
                env[e["name"]] = pod["metadata"]["name"]
        env.update(self.pods._secret_env(container))
        return env

    def _start(self, pod: dict, port: int) -> subprocess.Popen:
        name = pod["metadata"]["name"]
        container = pod["spec"]["containers"][0]
        env = self._env(pod, container)
        args = [VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in container["args"]]
        if "--dist-init-addr" in args:
            i = args.index("--dist-init-addr")
            args[i + 1] = self.net.address(args[i + 1])  # the leader's DNS name: the loopback pod network
        args = self.pods._mount_secrets(name, pod["spec"], container, args)
        args += ["--host", "127.0.0.1", "--port", str(port)] + self.extra
        if pod["metadata"]["labels"].get("kvship.io/role") == "prefill":
            args += ["--disaggregation-bootstrap-port", str(free_port())]
        log = open(self.workdir / f"{name}-{pod['metadata']['uid'][:8]}.log", "w")  # noqa: SIM115 - with the process
        return subprocess.Popen(
            [sys.executable, "-m", "kvship.app.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **env),
            start_new_session=True,
            preexec_fn=lambda: os.nice(10),
        )

    def stop(self) -> None:
        with self.lock:
            self.closed = True
            for _, proc, _ in self.running.values():
                _kill(proc)
            self.running.clear()
        for t in self.terminating:
            t.join(self.grace_s + 15)


def _terminate(proc: subprocess.Popen, grace_s: float) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("groups_live")), "llama", seed=5)


@pytest.fixture(scope="module")
def live(tmp_path_factory, model):
    workdir = tmp_path_factory.mktemp("groups-live")
    router_port = free_port()
    with EmulatorThread(bookmark_interval=1) as kube:
        kube.emulator.collect_dangling_dependents = True
        out = subprocess.run(
            [KUBECTL, "--kubeconfig", kube.kubeconfig, "apply", "--validate=false", "-f"]
            + [str(ROOT / "crds" / "inferenceservices.kvship.io.yaml")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        sa = install_chart_rbac(kube)
        pods = Pods(workdir, kube.kubeconfig, router_port, kube)
        # a decode group runs up to 4 streams at once (the prefill Deployment keeps WORKER_EXTRA's 1)
        members = GroupProcesses(pods, LoopbackNetwork(NS), kube, workdir, extra=GROUP_EXTRA)
        stop = threading.Event()

        def reaper() -> None:
            while not stop.wait(0.3):
                with contextlib.suppress(Exception):
                    members.reap()

        reaping = threading.Thread(target=reaper, daemon=True)
        op = Operator(kube.service_account_kubeconfig("kvship-system", sa), workdir, f"http://127.0.0.1:{router_port}")
        with Workloads(kube, NS, pods, period=0.2), Groups(kube, NS, members, period=0.2) as groups:
            reaping.start()
            op.start()
            try:
                yield kube, op, members, groups, f"http://127.0.0.1:{router_port}"
            finally:
                stop.set()
                reaping.join(5)
                op.stop()
                members.stop()
                pods.stop()
                print("operator log tail:\n" + op.tail(40))
                for log in sorted(workdir.glob("*.log")):
                    print(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-12:]))


def service(kube) -> dict:
    return kube.get("kvship.io/v1alpha1", "inferenceservices", NS, NAME) or {}


def decode_pods(kube) -> dict[str, dict]:
    return {
        p["metadata"]["name"]: p
        for p in kube.list("v1", "pods", NS, "kvship.io/role=decode")
        if not p["metadata"].get("deletionTimestamp")
    }


def in_rotation(router_url: str, kube) -> dict[str, dict]:
    """The router's workers in rotation, by URL (GET /workers with the service's worker key)."""
    secret = kube.get("v1", "secrets", NS, f"{NAME}-worker-key")
    headers = {"Authorization": "Bearer " + base64.b64decode(secret["data"]["key"]).decode()} if secret else {}
    try:
        workers = httpx.get(router_url + "/workers", timeout=5, headers=headers).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    return {w["url"]: w for w in workers if w.get("in_rotation")}


def complete(router_url: str, prompt: str) -> dict[str, Any]:
    """One streamed completion through the router: its status, decode worker, finish reason and error."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    rec: dict[str, Any] = {"error": None, "finish": None}
    try:
        with httpx.stream("POST", router_url + "/v1/completions", json=body, timeout=60) as r:
            rec["status"], rec["decode"] = r.status_code, r.headers.get("x-kvship-decode")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = chunk["error"]
                for c in chunk.get("choices") or []:
                    rec["finish"] = c.get("finish_reason") or rec["finish"]
    except httpx.HTTPError as e:
        rec["error"] = repr(e)
    rec["ok"] = rec.get("status") == 200 and rec["error"] is None and rec["finish"] == "length"
    return rec


def leader_url(kube) -> Optional[str]:
    leader = next((p for n, p in decode_pods(kube).items() if n.endswith("-g0-0")), None)
    port = ((leader or {}).get("metadata", {}).get("annotations") or {}).get("kvship.io/port")
    return f"http://127.0.0.1:{port}" if port else None


def test_decode_group_of_two_pods_serves_tp2_through_the_router(live, model):
    kube, op, members, groups, router_url = live
    spec = {
        "model": {"uri": model, "servedName": "tiny"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1, "nodesPerReplica": 2, "tensorParallelSize": 2},
        "kvTransfer": {"backend": "tcp"},
        "router": {"policy": "round_robin", "extraArgs": ["--debug-headers"]},
    }
    body = {"apiVersion": "kvship.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": NAME}, "spec": spec}
    kube.create("kvship.io/v1alpha1", "inferenceservices", NS, body)
    wait_for(lambda: (service(kube).get("status") or {}).get("phase") == "Ready", 400, "phase Ready")
    sets = kube.list("apps/v1", "statefulsets", NS, f"app.kubernetes.io/instance={NAME}")
    assert len(sets) == 1 and sets[0]["metadata"]["name"].endswith("-g0") and sets[0]["spec"]["replicas"] == 2
    assert not kube.list("apps/v1", "deployments", NS, "kvship.io/role=decode")
    assert service(kube)["status"]["decode"]["ready"] == "1/1"
    pods = decode_pods(kube)
    assert len(pods) == 2 and {p["metadata"]["labels"][GROUP_LABEL] for p in pods.values()} == {
        sets[0]["metadata"]["name"]
    }
    # the two pods are nodes 0 and 1 of one TP=2 world: node 1's launcher says so in its log
    node1_logs = [p for p in members.workdir.glob("*-g0-1-*.log")]
    wait_for(lambda: any("node 1 of 2" in p.read_text() for p in node1_logs), 60, "node 1 running its rank")
    # only the leader is in the router's rotation for decode
    leader = leader_url(kube)
    decode_urls = lambda: {u for u, w in in_rotation(router_url, kube).items() if w.get("role") == "decode"}  # noqa: E731
    wait_for(lambda: decode_urls() == {leader}, 30, f"only the leader {leader} in the decode rotation")
    for i in range(3):
        rec = complete(router_url, f"group request {i} says")
        assert rec["ok"], rec
        assert rec["decode"] == leader, rec


def test_losing_one_pod_restarts_the_whole_group_and_serving_resumes(live):
    kube, op, members, groups, router_url = live
    before = {n: p["metadata"]["uid"] for n, p in decode_pods(kube).items()}
    member = next(n for n in before if n.endswith("-g0-1"))
    results: list[dict] = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            results.append(dict(complete(router_url, f"during restart {i}"), t=time.monotonic()))
            time.sleep(0.2)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    time.sleep(1.0)
    t_kill = time.monotonic()
    kube.delete("v1", "pods", NS, member)

    def whole_group_new() -> bool:
        now = decode_pods(kube)
        return len(now) == 2 and not set(p["metadata"]["uid"] for p in now.values()) & set(before.values())

    wait_for(whole_group_new, 120, "both pods of the group recreated")
    t_restarted = time.monotonic()

    def serving_again() -> bool:
        leader = leader_url(kube)
        urls = {u for u, w in in_rotation(router_url, kube).items() if w.get("role") == "decode"}
        return (service(kube).get("status") or {}).get("phase") == "Ready" and urls == {leader}

    wait_for(serving_again, 300, "the restarted group back in the router's rotation")
    t_back = time.monotonic()
    after = [complete(router_url, f"after restart {i}") for i in range(3)]
    stop.set()
    loader.join(90)
    assert all(r["ok"] for r in after), after
    assert {r["decode"] for r in after} == {leader_url(kube)}
    assert "restarting the whole group" in "\n".join(p.read_text() for p in op.logs)
    failed = [r for r in results if not r["ok"]]
    ok_after = [r for r in results if r["ok"] and r["t"] > t_back]
    print(
        f"group restart: whole group recreated {t_restarted - t_kill:.1f} s after the pod was deleted, "
        f"serving again after {t_back - t_kill:.1f} s; {len(results)} requests during the test, {len(failed)} failed "
        f"(one decode group: none can be served while it restarts), {len(ok_after)} ok after it came back"
    )
    assert results and results[0]["ok"], results[:1]  # the load was served before the loss


def stream(router_url: str, prompt: str, max_tokens: int, progress: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion; ``progress`` holds its decode worker (``decode``) and ``tokens`` so far."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    rec: dict[str, Any] = {"error": None, "finish": None, "tokens": 0}
    try:
        body.update(stream=True, stream_options={"include_usage": True})
        with httpx.stream("POST", router_url + "/v1/completions", json=body, timeout=180) as r:
            progress["decode"] = r.headers.get("x-kvship-decode")
            rec["status"], rec["decode"] = r.status_code, progress["decode"]
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = chunk["error"]
                for c in chunk.get("choices") or []:
                    rec["finish"] = c.get("finish_reason") or rec["finish"]
                usage = chunk.get("usage") or {}
                rec["tokens"] = usage.get("completion_tokens", rec["tokens"] + 1)
                progress["tokens"] = rec["tokens"]
    except httpx.HTTPError as e:
        rec["error"] = repr(e)
    rec["ok"] = rec.get("status") == 200 and rec["error"] is None and rec["finish"] == "length"
    return rec


def test_streams_resume_on_the_other_group_while_a_group_restarts(live):
    """Two decode groups; one pod of the group serving streams is killed: every stream completes (the router
    resumes the broken ones on the other group) and the group comes back whole."""
    kube, op, members, groups, router_url = live
    kube.patch("kvship.io/v1alpha1", "inferenceservices", NS, NAME, {"spec": {"decode": {"replicas": 2}}})

    def leaders() -> dict[str, str]:
        """group StatefulSet -> its leader's URL, for the groups whose leader is in the router's rotation."""
        urls = {u for u, w in in_rotation(router_url, kube).items() if w.get("role") == "decode"}
        out = {}
        for name, p in decode_pods(kube).items():
            port = (p["metadata"].get("annotations") or {}).get("kvship.io/port")
            if name.endswith("-0") and port and f"http://127.0.0.1:{port}" in urls:
                out[p["metadata"]["labels"][GROUP_LABEL]] = f"http://127.0.0.1:{port}"
        return out

    wait_for(lambda: len(leaders()) == 2, 300, "two decode groups in the router's rotation")
    wait_for(lambda: (service(kube).get("status") or {}).get("decode", {}).get("ready") == "2/2", 30, "2/2 groups")
    by_group = leaders()
    victim_group = sorted(by_group)[0]
    victim_url = by_group[victim_group]
    before = {n: p["metadata"]["uid"] for n, p in decode_pods(kube).items() if n.startswith(victim_group + "-")}
    # streams long enough to be cut; round-robin puts two on each group, which runs them at once
    progress = [{"decode": None, "tokens": 0} for _ in range(4)]
    results: list[Optional[dict]] = [None] * len(progress)

    def run(i: int) -> None:
        results[i] = stream(router_url, f"resume across groups {i} says", 200, progress[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(progress))]
    for t in threads:
        t.start()
        time.sleep(0.1)
    wait_for(
        lambda: sum(p["decode"] == victim_url and p["tokens"] >= 5 for p in progress) >= 2, 120, "streams on the victim"
    )
    on_victim = sum(p["decode"] == victim_url for p in progress)
    t_kill = time.monotonic()
    kube.delete("v1", "pods", NS, f"{victim_group}-1")
    for t in threads:
        t.join(240)
    t_done = time.monotonic()
    assert all(r is not None and r["ok"] and r["tokens"] == 200 for r in results), results
    # the group comes back whole (both pods new) and serves again
    wait_for(
        lambda: (
            len([n for n in decode_pods(kube) if n.startswith(victim_group + "-")]) == 2
            and not {p["metadata"]["uid"] for n, p in decode_pods(kube).items()} & set(before.values())
        ),
        120,
        "the victim group recreated",
    )
    wait_for(lambda: len(leaders()) == 2, 300, "both groups back in the router's rotation")
    t_back = time.monotonic()
    print(
        f"group restart under streams: {on_victim} of {len(progress)} streams started on the victim group, all "
        f"{len(progress)} completed {t_done - t_kill:.1f} s after the kill; the group served again after "
        f"{t_back - t_kill:.1f} s"
    )
    assert on_victim >= 2
