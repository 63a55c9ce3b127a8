"""Revisions, lockstep PD rollouts and the in-rotation readiness gate (operator side, docs/operator.md).

Pure rules first (revision hash, rollout plan, gate updates), then the controller against the loopback
API server (tests/kube_emulator.py) with a Deployment controller + kubelet playing pods
(tests/kube_emulator_workloads.py) and a scripted stand-in for the router's ``GET /workers`` / ``GET /slo``
(the contract of docs/router.md), so each rollout step can be held and checked.  The same flow with the
real ``kvship router`` and workers is tests/test_operator_live.py.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kube_emulator import EmulatorThread
from kube_emulator_workloads import Workloads

from kvship.operator.builders import Images, worker_revision
from kvship.operator.controller import RouterAccess, reconcile
from kvship.operator.crd import crd_manifest
from kvship.operator.kube import KubeClient, load_auth
from kvship.operator.revision import REVISION_LABEL, revision_flags
from kvship.operator.rollout import gate_updates, plan_rollout
from kvship.operator.router_client import RouterView
from kvship.operator.spec import parse_service

pytestmark = pytest.mark.timeout(180)
IMAGES = Images(worker="reg/worker:1", router="reg/router:1")
NS = "default"
GATE = "kvship.io/in-rotation"
PD = {
    "model": {"uri": "hf://org/model-a"},
    "prefill": {"replicas": 2},
    "decode": {"replicas": 3},
}


def cfg_of(spec: dict, name: str = "svc"):
    return parse_service({"metadata": {"name": name, "namespace": NS, "uid": "u1", "generation": 1}, "spec": spec})


def rev(spec: dict) -> str:
    return worker_revision(cfg_of(spec), IMAGES)


# ------------------------------------------------------------------------------------ the revision
def test_revision_changes_with_weights_image_and_kv_flags_only():
    base = rev(PD)
    assert len(base) == 12 and int(base, 16) >= 0
    same = [
        dict(PD, prefill={"replicas": 5}),
        dict(PD, decode={"replicas": 1, "resources": {"requests": {"cpu": "4"}}}),
        dict(PD, engine={"extraArgs": ["--max-running-requests", "8"]}),
        dict(PD, decode={"replicas": 3, "nodeSelector": {"pool": "b"}}),
    ]
    for spec in same:
        assert rev(spec) == base, spec
    changed = [
        dict(PD, model={"uri": "hf://org/model-b"}),
        dict(PD, model={"uri": "hf://org/model-a@v2"}),
        dict(PD, engine={"image": "reg/worker:2"}),
        dict(PD, engine={"kvCacheDtype": "float16"}),
        dict(PD, engine={"extraArgs": ["--page-size", "16"]}),
        dict(PD, decode={"replicas": 3, "extraArgs": ["--page-size=16"]}),
    ]
    revs = [rev(spec) for spec in changed]
    assert base not in revs and len(set(revs)) == len(revs)
    assert worker_revision(cfg_of(PD), Images(worker="reg/worker:2", router="r")) != base, "the default image counts"


def test_revision_flags_are_picked_with_their_values():
    args = ["--max-running-requests", "8", "--page-size", "16", "--load-format=dummy", "--trust-remote-code"]
    assert revision_flags(args) == ["--page-size=16", "--load-format=dummy", "--trust-remote-code"]


def test_prefill_and_decode_of_one_spec_carry_the_same_revision_label():
    from kvship.operator.builders import build_children

    deps = [c for c in build_children(cfg_of(PD), IMAGES) if c["kind"] == "Deployment"]
    labels = {
        d["metadata"]["labels"]["kvship.io/role"]: d["spec"]["template"]["metadata"]["labels"].get(REVISION_LABEL)
        for d in deps
    }
    assert labels["prefill"] == labels["decode"] == rev(PD) and labels["router"] is None
    for d in deps:
        if d["metadata"]["labels"]["kvship.io/role"] != "router":
            assert d["spec"]["selector"]["matchLabels"][REVISION_LABEL] == rev(PD)
            assert d["spec"]["template"]["spec"]["readinessGates"] == [{"conditionType": GATE}]


def test_a_router_client_key_keeps_the_gate_the_operator_reads_with_the_worker_key():
    from kvship.operator.builders import build_children

    spec = dict(PD, router={"apiKeySecretRef": {"name": "k", "key": "key"}})
    workers = [c for c in build_children(cfg_of(spec), IMAGES) if c["kind"] == "Deployment"][:2]
    for d in workers:
        assert d["spec"]["template"]["spec"]["readinessGates"] == [{"conditionType": GATE}]


# ------------------------------------------------------------------------------------ the plan
def view(serving: list[str], in_flight: dict[str, int] | None = None, reachable: bool = True) -> RouterView:
    workers = [{"url": f"http://w/{r}", "revision": r, "in_flight": n} for r, n in (in_flight or {}).items()]
    revisions = [{"revision": r, "serving": r in serving} for r in {*serving, *(in_flight or {})}]
    return RouterView("http://router", reachable, "" if reachable else "refused", workers, revisions)


def test_old_revisions_stay_until_the_router_serves_another_and_they_drained():
    assert plan_rollout("new", ["old"], None).keep == ["old"]
    assert plan_rollout("new", ["old"], view([], reachable=False)).keep == ["old"]
    assert plan_rollout("new", ["old"], view(["old"])).keep == ["old"], "the new set is not serving yet"
    assert plan_rollout("new", ["old"], view([])).keep == ["old"], "nothing serves: keep what exists"
    draining = plan_rollout("new", ["old"], view(["new"], {"old": 2}))
    assert draining.keep == ["old"] and "2 requests in flight" in draining.why["old"]
    done = plan_rollout("new", ["old"], view(["new"], {"old": 0}))
    assert done.remove == ["old"] and not done.keep
    # a revision that never served (replaced again before it came up) goes while the old one still serves
    skipped = plan_rollout("newest", ["old", "mid"], view(["old"]))
    assert skipped.keep == ["old"] and skipped.remove == ["mid"]


def pod(name: str, ip: str | None, port: int, gate_status: str | None = None, gated: bool = True) -> dict:
    p: dict[str, Any] = {
        "metadata": {"name": name, "annotations": {"kvship.io/port": str(port)}},
        "spec": {"readinessGates": [{"conditionType": GATE}]} if gated else {},
        "status": {"podIP": ip} if ip else {},
    }
    if gate_status:
        p["status"]["conditions"] = [{"type": GATE, "status": gate_status}]
    return p


def test_gate_follows_the_routers_rotation_by_pod_name_or_address():
    router = RouterView(
        "http://router",
        True,
        workers=[
            {"url": "http://10.0.0.1:30000", "pod": None, "in_rotation": True},
            {"url": "http://10.0.0.2:30000", "pod": "default/by-name", "in_rotation": True},
            {"url": "http://10.0.0.3:30000", "pod": "draining", "in_rotation": False},
        ],
    )
    pods = [
        pod("by-ip", "10.0.0.1", 30000),
        pod("by-name", "10.9.9.9", 30000),
        pod("draining", "10.0.0.3", 30000, gate_status="True"),
        pod("unknown", "10.0.0.4", 30000),
        pod("already", "10.0.0.1", 30000, gate_status="True"),
        pod("ungated", "10.0.0.1", 30000, gated=False),
    ]
    updates = {u.pod: u.status for u in gate_updates(pods, router)}
    assert updates == {"by-ip": "True", "by-name": "True", "draining": "False", "unknown": "False"}
    assert gate_updates(pods, RouterView("http://router", False, "refused")) == [], "unreachable: change nothing"


# ------------------------------------------------------------------------------------ the controller
class FakeRouter:
    """Answers GET /workers, /slo and /health as the router's contract says, from a state the test scripts:
    ``serving`` revisions, ``in_flight`` per revision, ``listed`` decides which pods are in rotation."""

    def __init__(self, kube: EmulatorThread):
        self.kube = kube
        self.serving: list[str] = []
        self.in_flight: dict[str, int] = {}
        self.slo: dict[str, Any] = {"window_s": 60, "requests": 0}
        self.reads = 0
        self.refused = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                # like the router: /workers and /slo only with a service's worker key (docs/router.md)
                if self.path != "/health" and self.headers.get("Authorization") not in outer.worker_bearers():
                    outer.refused += 1
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = outer.answer(self.path)
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeRouter":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()

    def worker_bearers(self) -> set[str]:
        """``Bearer <key>`` of every ``<name>-worker-key`` Secret the operator made in the namespace."""
        return {
            "Bearer " + base64.b64decode(s["data"]["key"]).decode()
            for s in self.kube.list("v1", "secrets", NS)
            if s["metadata"]["name"].endswith("-worker-key")
        }

    def answer(self, path: str) -> dict:
        if path == "/slo":
            return self.slo
        if path != "/workers":
            return {"status": "ok"}
        self.reads += 1
        workers = []
        for p in self.kube.list("v1", "pods", NS):
            labels = p["metadata"].get("labels") or {}
            containers_ready = any(
                c.get("type") == "ContainersReady" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or []
            )
            r = labels.get(REVISION_LABEL)
            if r is None or not containers_ready:
                continue
            workers.append(
                {
                    "url": f"http://127.0.0.1:{p['metadata']['annotations']['kvship.io/port']}/{p['metadata']['name']}",
                    "role": labels.get("kvship.io/role"),
                    "revision": r,
                    "pod": f"{NS}/{p['metadata']['name']}",
                    "in_rotation": r in self.serving,
                    # the revision's requests all run on its first listed worker
                    "in_flight": 0 if any(w["revision"] == r for w in workers) else self.in_flight.get(r, 0),
                }
            )
        revs = sorted({w["revision"] for w in workers})
        return {
            "pd": True,
            "workers": workers,
            "revisions": [{"revision": r, "serving": r in self.serving} for r in revs],
        }


@pytest.fixture
def env():
    with EmulatorThread() as kube:
        kube.emulator.collect_dangling_dependents = True  # pods made from a stale read of a deleted Deployment go
        kube.create("apiextensions.k8s.io/v1", "customresourcedefinitions", None, crd_manifest())
        with FakeRouter(kube) as router:
            # every Deployment's pods are "played" by the fake router's /health (always ready containers)
            with Workloads(kube, NS, lambda dep: router.port, period=0.1) as workloads:
                yield kube, router, workloads


async def run_passes(kube, client, access: RouterAccess, name: str, until, timeout: float = 30.0, what: str = ""):
    """Reconcile ``name`` (as the resync loop does) until ``until(outcome)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        body = kube.get("kvship.io/v1alpha1", "inferenceservices", NS, name)
        outcome = await reconcile(client, body, IMAGES, access)
        if until(outcome):
            return outcome
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: status {json.dumps(outcome.status)[:1500]}")
        await asyncio.sleep(0.15)


def pd_sets(kube, name: str) -> dict[str, dict[str, int]]:
    """{revision: {role: desired replicas}} of the live worker Deployments."""
    out: dict[str, dict[str, int]] = {}
    for d in kube.list("apps/v1", "deployments", NS, f"app.kubernetes.io/instance={name}"):
        labels = d["metadata"]["labels"]
        if labels["kvship.io/role"] in ("prefill", "decode"):
            out.setdefault(labels[REVISION_LABEL], {})[labels["kvship.io/role"]] = d["spec"]["replicas"]
    return out


def gate_of(p: dict) -> str | None:
    return next((c["status"] for c in p.get("status", {}).get("conditions", []) if c["type"] == GATE), None)


async def test_model_change_rolls_out_a_new_revision_set_in_lockstep_and_retires_the_old_after_it_drains(env):
    kube, router, workloads = env
    client = KubeClient(lambda: load_auth(kube.kubeconfig))
    access = RouterAccess(url=router.url, timeout=2.0)
    body = {"apiVersion": "kvship.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "svc"}, "spec": PD}
    kube.create("kvship.io/v1alpha1", "inferenceservices", NS, body)
    old = rev(PD)
    observed: list[dict[str, dict[str, int]]] = []

    def watch(outcome) -> None:
        observed.append(pd_sets(kube, "svc"))

    # first revision: pods run (containers ready) but stay unready until the router puts them in rotation
    await run_passes(
        kube, client, access, "svc", lambda o: (watch(o), len(kube.list("v1", "pods", NS)) >= 6)[1], what="pods"
    )
    await asyncio.sleep(0.5)
    out = await run_passes(kube, client, access, "svc", lambda o: True)
    worker_pods = [p for p in kube.list("v1", "pods", NS) if REVISION_LABEL in p["metadata"]["labels"]]
    assert len(worker_pods) == 5 and all(gate_of(p) in (None, "False") for p in worker_pods)
    assert not any(
        c["status"] == "True" for p in worker_pods for c in p["status"]["conditions"] if c["type"] == "Ready"
    )
    synced = next(c for c in out.status["conditions"] if c["type"] == "RouterSynced")
    assert synced["status"] == "False" and synced["reason"] == "PodsNotInRotation"
    router.serving = [old]
    out = await run_passes(
        kube,
        client,
        access,
        "svc",
        lambda o: o.status["phase"] == "Ready" and o.status["prefill"]["ready"] == "2/2",
        what="the first revision in rotation and Ready",
    )
    assert all(gate_of(p) == "True" for p in kube.list("v1", "pods", NS) if REVISION_LABEL in p["metadata"]["labels"])
    assert next(c for c in out.status["conditions"] if c["type"] == "RouterSynced")["status"] == "True"
    assert out.status["revisions"] == [
        {"revision": old, "current": True, "prefill": "2/2", "decode": "3/3", "serving": True, "inFlight": 0}
    ]

    # the model changes: a new revision's pair of Deployments beside the old one, same 2:3 ratio
    kube.patch("kvship.io/v1alpha1", "inferenceservices", NS, "svc", {"spec": {"model": {"uri": "hf://org/model-b"}}})
    new = rev(dict(PD, model={"uri": "hf://org/model-b"}))
    out = await run_passes(
        kube, client, access, "svc", lambda o: (watch(o), new in pd_sets(kube, "svc"))[1], what="the new set"
    )
    assert pd_sets(kube, "svc") == {old: {"prefill": 2, "decode": 3}, new: {"prefill": 2, "decode": 3}}
    # the new pods come up but the router still serves the old revision: the old set stays, new pods unready
    await run_passes(
        kube,
        client,
        access,
        "svc",
        lambda o: (watch(o), sum(1 for p in kube.list("v1", "pods", NS) if new in str(p["metadata"]["labels"])) == 5)[
            1
        ],
        what="the new pods",
    )
    out = await run_passes(kube, client, access, "svc", lambda o: (watch(o), True)[1])
    assert out.status["phase"] == "Progressing" and set(pd_sets(kube, "svc")) == {old, new}
    revs = {r["revision"]: r for r in out.status["revisions"]}
    assert revs[new]["current"] and revs[new]["serving"] is False and revs[old]["serving"] is True
    # the router moves to the new revision while requests still run on the old one: the old set drains
    router.serving, router.in_flight = [new], {old: 3}
    out = await run_passes(
        kube,
        client,
        access,
        "svc",
        lambda o: (watch(o), o.status["prefill"]["ready"] == "2/2" and o.status["decode"]["ready"] == "3/3")[1],
        what="the new revision ready",
    )
    assert set(pd_sets(kube, "svc")) == {old, new}, "draining: the old set stays"
    assert {r["revision"]: r.get("inFlight") for r in out.status["revisions"]} == {new: 0, old: 3}
    router.in_flight = {}
    out = await run_passes(
        kube, client, access, "svc", lambda o: (watch(o), bool(o.retired))[1], what="the old revision retired"
    )
    assert out.retired == [old] and set(pd_sets(kube, "svc")) == {new}
    out = await run_passes(kube, client, access, "svc", lambda o: o.status["phase"] == "Ready", what="Ready")
    assert [r["revision"] for r in out.status["revisions"]] == [new]
    # the garbage collector took the old pods with their Deployments
    await asyncio.sleep(0.5)
    left = {p["metadata"]["labels"].get(REVISION_LABEL) for p in kube.list("v1", "pods", NS)} - {None}
    assert left == {new}
    # P:D held at every observed step: each revision had both roles at 2:3, or neither
    for sets in observed + [pd_sets(kube, "svc")]:
        for r, roles in sets.items():
            assert roles == {"prefill": 2, "decode": 3}, (r, roles)
    # the Deployment controller's view, sampled while the passes ran (what `kubectl get deploy` would print): a set
    # is created by two API calls, so one sample may fall between them; it is removed by one (deletecollection)
    halves: dict[str, int] = {}
    for i, step in enumerate(workloads.history):
        by_rev: dict[str, set[str]] = {}
        for name in step:
            for r in (old, new):
                if name.endswith(r):
                    by_rev.setdefault(r, set()).add(name.rsplit("-", 2)[-2])
        for r, roles in by_rev.items():
            if roles != {"prefill", "decode"}:
                later = workloads.history[i + 1 :]
                assert later and all(f"svc-decode-{r}" in s and f"svc-prefill-{r}" in s for s in later[:1]), (
                    f"revision {r} half there at step {i} and not completed next: {step}"
                )
                halves[r] = halves.get(r, 0) + 1
    assert all(n <= 1 for n in halves.values()), halves
    await client.aclose()


async def test_slo_figures_land_in_status_and_slo_met_flips_with_the_target(env):
    kube, router, _ = env
    client = KubeClient(lambda: load_auth(kube.kubeconfig))
    access = RouterAccess(url=router.url, timeout=2.0)
    spec = copy.deepcopy(PD)
    spec["slo"] = {"ttftP90Ms": 500, "itlP50Ms": 40}
    body = {"apiVersion": "kvship.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "s2"}, "spec": spec}
    kube.create("kvship.io/v1alpha1", "inferenceservices", NS, body)
    router.serving = [rev(spec)]
    router.slo = {
        "window_s": 60,
        "requests": 120,
        "ttft_p50_ms": 81.234,
        "ttft_p90_ms": 140.0,
        "ttft_p99_ms": 190.0,
        "itl_p50_ms": 12.345,
        "itl_p90_ms": 20.0,
        "itl_p99_ms": 30.0,
        "e2e_p50_ms": 500.0,
        "e2e_p90_ms": 600.0,
        "e2e_p99_ms": 700.0,
        "requests_per_second": 2.0,
        "output_tokens_per_second": 64.0,
        "kv_transfer_gbps": None,
    }
    out = await run_passes(kube, client, access, "s2", lambda o: "slo" in o.status, what="status.slo")
    slo = out.status["slo"]
    assert slo["ttftP50Ms"] == 81.2 and slo["itlP50Ms"] == 12.35 and slo["requestsPerSecond"] == 2.0
    assert slo["window"] == "60s" and slo["requests"] == 120 and "kvTransferGBps" not in slo
    met = next(c for c in out.status["conditions"] if c["type"] == "SLOMet")
    assert met["status"] == "True" and "ttft p90 140 ms <= target 500 ms" in met["message"]
    kube.patch("kvship.io/v1alpha1", "inferenceservices", NS, "s2", {"spec": {"slo": {"ttftP90Ms": 100}}})
    out = await run_passes(kube, client, access, "s2", lambda o: True)
    met = next(c for c in out.status["conditions"] if c["type"] == "SLOMet")
    assert met["status"] == "False" and met["reason"] == "TargetMissed"
    assert "ttft p90 140 ms > target 100 ms" in met["message"]
    router.slo = {"window_s": 60, "requests": 0, "ttft_p50_ms": None, "ttft_p90_ms": None, "itl_p50_ms": None}
    out = await run_passes(kube, client, access, "s2", lambda o: True)
    met = next(c for c in out.status["conditions"] if c["type"] == "SLOMet")
    assert met["status"] == "Unknown" and met["reason"] == "NoSamples"
    stored = kube.get("kvship.io/v1alpha1", "inferenceservices", NS, "s2")["status"]
    assert stored["slo"]["requests"] == 0 and "ttftP50Ms" not in stored["slo"]
    await client.aclose()


def test_a_pass_that_cannot_read_the_router_keeps_the_last_figures_and_slo_met():
    from kvship.operator.status import Observed, compute_status

    spec = dict(PD, slo={"ttftP90Ms": 100})
    cfg = cfg_of(spec)
    previous = {
        "slo": {"window": "60s", "requests": 9, "ttftP90Ms": 140.0, "observedAt": "2026-01-01T00:00:00Z"},
        "conditions": [
            {"type": "SLOMet", "status": "False", "reason": "TargetMissed", "message": "m", "lastTransitionTime": "t"}
        ],
    }
    body = {
        "metadata": {"name": "svc", "namespace": NS, "uid": "u1", "generation": 1},
        "spec": spec,
        "status": previous,
    }
    down = RouterView("http://router", False, "timed out")
    st = compute_status(body, cfg, [], [], {}, observed=Observed(revision=rev(spec), router=down))
    assert st["slo"] == previous["slo"]
    assert next(c for c in st["conditions"] if c["type"] == "SLOMet") == previous["conditions"][0]
    up = RouterView("http://router", True, slo={"window_s": 60, "requests": 0, "ttft_p90_ms": None})
    st = compute_status(body, cfg, [], [], {}, observed=Observed(revision=rev(spec), router=up))
    assert "ttftP90Ms" not in st["slo"] and st["slo"]["requests"] == 0
    assert next(c for c in st["conditions"] if c["type"] == "SLOMet")["reason"] == "NoSamples"
