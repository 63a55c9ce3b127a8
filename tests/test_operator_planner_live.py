"""The SLO planner live: the real operator (kopf, `kvship operator` in a subprocess, under the Helm chart's RBAC)
against the loopback API server, reading a router stand-in that serves a recorded load ramp.

The stand-in is a small HTTP server answering the router's ``GET /workers`` and ``GET /slo`` (docs/router.md)
with the figures of a ramp low -> high -> low: its workers are the current replicas of the service's worker
Deployments.  A thread plays the Deployment controller (status follows ``spec.replicas``).  The operator must
scale decode up on the ITL miss and prefill up on the TTFT miss, then both back to minReplicas, and post each
decision as an Event that ``kubectl describe`` shows.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kube_emulator import EmulatorThread
from test_operator_e2e import HELM, KUBECTL, NS, OPERATOR_NS, ROOT, Operator, deployments, install_chart_rbac, wait_for

pytestmark = pytest.mark.skipif(
    KUBECTL is None or HELM is None, reason="kubectl or helm not installed: run .ci/install-k8s-tools.sh"
)
NAME = "ramp"
SERVICE = {
    "apiVersion": "kvship.io/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": NAME, "namespace": NS},
    "spec": {
        "model": {"uri": "builtin:smollm2"},
        "prefill": {"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}},
        "decode": {"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}},
        "slo": {"ttftP90Ms": 500, "itlP50Ms": 50},
        "autoscaling": {"mode": "slo", "cooldownSeconds": 0, "scaleDownStabilizationSeconds": 2},
    },
}
# per phase: GET /slo figures, and the requests in flight on each role (spread over its replicas)
RAMP = {
    "low": ({"requests": 40, "ttft_p90_ms": 180.0, "itl_p50_ms": 15.0, "requests_per_second": 0.7}, 1, 2),
    "high": ({"requests": 400, "ttft_p90_ms": 1600.0, "itl_p50_ms": 140.0, "requests_per_second": 6.0}, 6, 24),
}


class RouterStandIn:
    """``GET /workers`` and ``GET /slo`` of the ramp's current phase (test only: the operator reads a real
    router in production)."""

    def __init__(self, kube: Any):
        self.kube, self.phase, self.reads = kube, "low", 0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = stand_in.answer(self.path.split("?")[0])
                data = json.dumps(body).encode()
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, path: str) -> Any:
        slo, prefill_busy, decode_busy = RAMP[self.phase]
        if path == "/slo":
            self.reads += 1
            return {"window_s": 60.0, **slo}
        if path != "/workers":
            return None
        workers, revisions = [], set()
        for dep in deployments(self.kube, NAME).values():
            labels = dep["metadata"]["labels"]
            role, rev = labels.get("app.kubernetes.io/component"), labels.get("kvship.io/revision")
            if role not in ("prefill", "decode"):
                continue
            revisions.add(rev)
            n = dep["spec"].get("replicas", 1)
            busy = prefill_busy if role == "prefill" else decode_busy
            for i in range(n):
                workers.append(
                    {
                        "url": f"http://10.0.0.{i}:30000",
                        "role": role,
                        "revision": rev,
                        "in_rotation": True,
                        "in_flight": busy // n + (1 if i < busy % n else 0),
                        "pod": f"{dep['metadata']['name']}-{i}",
                    }
                )
        return {"pd": True, "workers": workers, "revisions": [{"revision": r, "serving": True} for r in revisions]}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def follow_replicas(kube: Any, stop: threading.Event) -> None:
    """The Deployment controller's status: every pod of every Deployment ready at once."""
    while not stop.is_set():
        for dep in deployments(kube, NAME).values():
            n = dep["spec"].get("replicas", 1)
            st = dep.get("status") or {}
            if st.get("readyReplicas") == n and st.get("observedGeneration") == dep["metadata"]["generation"]:
                continue
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
                    "conditions": [{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}],
                },
            )
        stop.wait(0.2)


def replicas(kube: Any) -> dict[str, int]:
    out = {}
    for dep in deployments(kube, NAME).values():
        role = dep["metadata"]["labels"].get("app.kubernetes.io/component")
        if role in ("prefill", "decode"):
            out[role] = dep["spec"].get("replicas", 1)
    return out


def test_load_ramp_scales_decode_on_itl_and_prefill_on_ttft_then_back_with_events(tmp_path):
    with EmulatorThread(bookmark_interval=1) as kube:
        kube.emulator.collect_dangling_dependents = True
        router = RouterStandIn(kube)
        stop = threading.Event()
        follower = threading.Thread(target=follow_replicas, args=(kube, stop), daemon=True)
        follower.start()
        op = None
        try:

            def kubectl(*args: str) -> str:
                out = subprocess.run(
                    [KUBECTL, "--kubeconfig", kube.kubeconfig, *args], capture_output=True, text=True, timeout=60
                )
                assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
                return out.stdout

            kubectl("apply", "--validate=false", "-f", str(ROOT / "crds" / "inferenceservices.kvship.io.yaml"))
            sa = install_chart_rbac(kube)
            op = Operator(kube.service_account_kubeconfig(OPERATOR_NS, sa), tmp_path, router_url=router.url)
            op.start()
            kube.create("kvship.io/v1alpha1", "inferenceservices", NS, json.loads(json.dumps(SERVICE)))
            wait_for(lambda: router.reads >= 2, 60, "the operator reading the router's figures")
            time.sleep(2)
            assert replicas(kube) == {"prefill": 1, "decode": 1}, op.tail()  # low load: nothing moves

            router.phase = "high"
            wait_for(lambda: replicas(kube) == {"prefill": 3, "decode": 3}, 60, "scale-up to maxReplicas")
            router.phase = "low"
            wait_for(lambda: replicas(kube) == {"prefill": 1, "decode": 1}, 60, "scale-down to minReplicas")

            events = [
                e
                for e in kube.list("v1", "events", NS)
                if e.get("involvedObject", {}).get("name") == NAME and e.get("reason") in ("ScaledUp", "ScaledDown")
            ]
            ups = [e["message"] for e in events if e["reason"] == "ScaledUp"]
            downs = [e["message"] for e in events if e["reason"] == "ScaledDown"]
            assert any(m.startswith("decode 1 -> ") and "itl p50 140 ms > target 50 ms" in m for m in ups), ups
            assert any(m.startswith("prefill 1 -> ") and "ttft p90 1600 ms > target 500 ms" in m for m in ups), ups
            assert any(m.startswith("decode ") and "-> 1" in m for m in downs), downs
            assert any(m.startswith("prefill ") and "-> 1" in m for m in downs), downs
            described = kubectl("describe", "inferenceservice", NAME, "-n", NS)
            assert "ScaledUp" in described and "ScaledDown" in described, described
            # the planner left HPAs out and stayed within the chart's RBAC
            assert not kube.list("autoscaling/v2", "horizontalpodautoscalers", NS)
            log = op.tail(400)
            assert not [line for line in log.splitlines() if "WARNING" in line and "planner" in line], log
        finally:
            stop.set()
            follower.join(5)
            if op is not None:
                op.stop()
            router.close()
