"""The SLO planner live with real workers: the real operator (kopf, under the chart's RBAC), ``kvship router`` and CPU
``kvship serve`` workers of a tiny random llama (PD over TCP), the Kubernetes API emulator with its Deployment
controller running one process per pod (tests/kube_emulator_workloads.py, ``per_pod``), real kubectl.

A load generator (streaming completions through the router) ramps low -> high -> low.  The targets are set from
what this machine does at low load (the router's own ``GET /slo`` after a calibration phase: TTFT p90 and ITL p50
times :data:`HEADROOM`), so that low load meets them and high load (more concurrent streams, longer prompts)
misses them on any CPU.  Checked (issue 37): on the misses the operator adds a decode replica (ITL) and a prefill
replica (TTFT), the new pods join the router's rotation and serve, then at low load both roles scale back to one,
the leaving pods drain (SIGTERM, then the router resumes any stream cut short), no request fails, and
``kubectl describe`` shows the decisions with the figures behind them (per-role prompt tokens/s, queue depth, KV
usage from the router's worker scrape).
"""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import build_tiny_model
from kube_emulator import EmulatorThread, find_tool
from kube_emulator_groups import LoopbackNetwork
from kube_emulator_workloads import Workloads
from test_operator_e2e import NS, Operator, free_port, install_chart_rbac, wait_for
from test_operator_groups_live import GroupProcesses
from test_operator_live import ROUTER_GATES, Pods

ROOT = Path(__file__).resolve().parent.parent
KUBECTL = find_tool("kubectl")
HELM = find_tool("helm")
pytestmark = [
    pytest.mark.skipif(KUBECTL is None or HELM is None, reason="kubectl or helm not installed"),
    pytest.mark.skipif(not ROUTER_GATES, reason="the router's discovery waits for Ready (issue 20, router side)"),
    pytest.mark.timeout(600),
    pytest.mark.slow,
]
NAME = "ramp"
# targets = these x the low-load figures, at least the floors below.  Measured on 2-core boxes: high load raises
# TTFT p90 about 10x over low load but ITL p50 only ~3.2x, and only once prefill has grown and feeds decode faster
# (a decode step of this model is mostly fixed cost): with 3x and a 15 ms floor decode sometimes never grew (one
# CI run: 13.5 ms at high load against a 15 ms target).  Low load stays under 0.8 x these targets.
HEADROOM, ITL_HEADROOM = 3.0, 2.5
MIN_TTFT_MS, MIN_ITL_MS = 400.0, 10.0
LOW, HIGH = 1, 6  # concurrent streams
MAX_TOKENS = 16


class Load:
    """``clients`` threads streaming completions through the router; ``level`` of them active at a time."""

    def __init__(self, router_url: str, clients: int):
        self.router_url, self.level = router_url, 0
        self.results: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as http:
            while not self.stop.is_set():
                if i >= self.level:
                    time.sleep(0.05)
                    continue
                n += 1
                words = 6 if self.level <= LOW else 40  # high load: longer prompts too
                prompt = " ".join(f"client {i} request {n} word {k}" for k in range(words))
                self.results.append(dict(self._complete(http, prompt), t=time.monotonic(), level=self.level))

    def _complete(self, http: httpx.Client, prompt: str) -> dict[str, Any]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        rec: dict[str, Any] = {"error": None, "finish": None, "status": None}
        try:
            with http.stream("POST", self.router_url + "/v1/completions", json=dict(body, stream=True)) as r:
                rec["status"] = r.status_code
                if r.status_code != 200:
                    rec["error"] = r.read().decode(errors="replace")[:300]
                    return dict(rec, ok=False)
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
        rec["ok"] = rec["status"] == 200 and rec["error"] is None and rec["finish"] == "length"
        return rec

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(130)


def worker_key(kube) -> dict[str, str]:
    secret = kube.get("v1", "secrets", NS, f"{NAME}-worker-key")
    return {"Authorization": "Bearer " + base64.b64decode(secret["data"]["key"]).decode()} if secret else {}


def router_get(router_url: str, kube, path: str) -> Any:
    try:
        return httpx.get(router_url + path, timeout=5, headers=worker_key(kube)).json()
    except (httpx.HTTPError, ValueError):
        return None


def in_rotation(router_url: str, kube) -> dict[str, int]:
    workers = (router_get(router_url, kube, "/workers") or {}).get("workers") or []
    out: dict[str, int] = {}
    for w in workers:
        if w.get("in_rotation"):
            out[w["role"]] = out.get(w["role"], 0) + 1
    return out


def replicas(kube) -> dict[str, int]:
    out = {}
    for dep in kube.list("apps/v1", "deployments", NS, f"app.kubernetes.io/instance={NAME}"):
        role = dep["metadata"]["labels"].get("kvship.io/role")
        if role in ("prefill", "decode"):
            out[role] = dep["spec"].get("replicas", 1)
    return out


def worker_pods(kube) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in kube.list("v1", "pods", NS, f"app.kubernetes.io/instance={NAME}"):
        role = p["metadata"]["labels"].get("kvship.io/role")
        if role in ("prefill", "decode"):
            out[role] = out.get(role, 0) + 1
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    # wider and deeper than the default tiny model, so that a decode step and a prefill take measurable time
    size = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, head_dim=32)
    return build_tiny_model(str(tmp_path_factory.mktemp("ramp_model")), "llama", seed=7, **size)


def test_real_load_ramp_scales_decode_on_itl_and_prefill_on_ttft_then_back_without_failed_requests(tmp_path, model):
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    t0 = time.monotonic()
    with EmulatorThread(bookmark_interval=1) as kube:
        kube.emulator.collect_dangling_dependents = True

        def kubectl(*args: str) -> str:
            out = subprocess.run(
                [KUBECTL, "--kubeconfig", kube.kubeconfig, *args], capture_output=True, text=True, timeout=60
            )
            assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
            return out.stdout

        kubectl("apply", "--validate=false", "-f", str(ROOT / "crds" / "inferenceservices.kvship.io.yaml"))
        sa = install_chart_rbac(kube)
        pods = Pods(tmp_path, kube.kubeconfig, router_port, kube)
        procs = GroupProcesses(pods, LoopbackNetwork(NS), kube, tmp_path, extra=["--max-total-tokens", "4096"])
        stop = threading.Event()

        def reaper() -> None:
            while not stop.wait(0.2):
                with contextlib.suppress(Exception):
                    procs.reap()

        reaping = threading.Thread(target=reaper, daemon=True)
        op = Operator(kube.service_account_kubeconfig("kvship-system", sa), tmp_path, router_url)
        load = None
        with (
            Workloads(kube, NS, pods, period=0.2, selector="kvship.io/role=router"),
            Workloads(kube, NS, procs, period=0.2, selector="kvship.io/role=prefill", per_pod=True),
            Workloads(kube, NS, procs, period=0.2, selector="kvship.io/role=decode", per_pod=True),
        ):
            reaping.start()
            op.start()
            try:
                spec = {
                    "model": {"uri": model, "servedName": "tiny"},
                    "prefill": {
                        "replicas": 1,
                        "autoscaling": {"minReplicas": 1, "maxReplicas": 2},
                        "extraArgs": ["--max-running-requests", "2"],
                    },
                    "decode": {
                        "replicas": 1,
                        "autoscaling": {"minReplicas": 1, "maxReplicas": 2},
                        "extraArgs": ["--max-running-requests", "8"],
                    },
                    "kvTransfer": {"backend": "tcp"},
                    "router": {
                        "policy": "round_robin",
                        "extraArgs": ["--slo-window", "5", "--slo-scrape-interval", "0.5"],
                    },
                    # no decision before calibration: targets no load here misses
                    "slo": {"ttftP90Ms": 600000, "itlP50Ms": 600000},
                    "autoscaling": {
                        "mode": "slo",
                        "cooldownSeconds": 3,
                        "scaleUpStabilizationSeconds": 0,
                        # short: a scale-up is never undone before its pods serve (the planner's serving guard),
                        # and on a loaded CI box low load must hold ITL far enough below target for this long
                        "scaleDownStabilizationSeconds": 6,
                        "maxScaleUpStep": 1,
                        "maxScaleDownStep": 1,
                    },
                }
                body = {"apiVersion": "kvship.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": NAME}}
                kube.create("kvship.io/v1alpha1", "inferenceservices", NS, dict(body, spec=spec))
                wait_for(lambda: in_rotation(router_url, kube) == {"prefill": 1, "decode": 1}, 300, "workers up")
                t_up = time.monotonic()
                load = Load(router_url, HIGH)
                load.level = LOW  # calibration: what this machine does at low load
                time.sleep(6)
                base = router_get(router_url, kube, "/slo")
                assert base and base["requests"] > 5 and base["roles"]["prefill"]["prompt_tokens_per_second"], base
                ttft = round(max(HEADROOM * base["ttft_p90_ms"], MIN_TTFT_MS))
                itl = round(max(ITL_HEADROOM * base["itl_p50_ms"], MIN_ITL_MS), 1)
                slo_patch = {"spec": {"slo": {"ttftP90Ms": ttft, "itlP50Ms": itl}}}
                kube.patch("kvship.io/v1alpha1", "inferenceservices", NS, NAME, slo_patch)
                time.sleep(5)  # two resync passes at low load under the real targets: nothing moves
                assert replicas(kube) == {"prefill": 1, "decode": 1}, (base, op.tail())

                t_high = time.monotonic()
                load.level = HIGH
                try:
                    wait_for(lambda: replicas(kube) == {"prefill": 2, "decode": 2}, 120, "scale-up of both roles")
                except AssertionError as e:  # what the targets came from and what the router saw at high load
                    now = router_get(router_url, kube, "/slo")
                    raise AssertionError(
                        f"{e}: replicas {replicas(kube)}; targets ttft p90 {ttft} ms, itl p50 {itl} ms from low load "
                        f"{base['ttft_p90_ms']} / {base['itl_p50_ms']} ms; high load now "
                        f"{now and now['ttft_p90_ms']} / {now and now['itl_p50_ms']} ms"
                    ) from None
                t_scaled = time.monotonic()
                wait_for(lambda: in_rotation(router_url, kube) == {"prefill": 2, "decode": 2}, 180, "new pods serve")
                t_serving = time.monotonic()
                time.sleep(3)  # high load on both replicas of each role
                high = router_get(router_url, kube, "/slo")

                t_low = time.monotonic()
                load.level = LOW
                seen: dict[str, Any] = {}

                def scaled_down() -> bool:
                    seen["slo"], seen["serving"] = router_get(router_url, kube, "/slo"), in_rotation(router_url, kube)
                    return replicas(kube) == {"prefill": 1, "decode": 1}

                try:
                    wait_for(scaled_down, 180, "scale-down of both roles")
                except AssertionError as e:  # what the planner last saw (its holds are logged at debug level)
                    raise AssertionError(f"{e}: replicas {replicas(kube)}; the router's last figures {seen}") from None
                wait_for(lambda: worker_pods(kube) == {"prefill": 1, "decode": 1}, 60, "the leaving pods gone")
                t_down = time.monotonic()
                time.sleep(3)  # low load on what is left
                load.close()
                results = load.results
                failed = [r for r in results if not r["ok"]]
                served_high = [r for r in results if r["level"] == HIGH and r["ok"]]
                print(
                    f"ramp: workers up {t_up - t0:.1f} s after start; targets ttft p90 {ttft} ms, itl p50 {itl} ms "
                    f"(low load: {base['ttft_p90_ms']} / {base['itl_p50_ms']} ms; high: {high and high['ttft_p90_ms']}"
                    f" / {high and high['itl_p50_ms']} ms); scaled up {t_scaled - t_high:.1f} s after the load rose,"
                    f" new pods serving after {t_serving - t_high:.1f} s; scaled down and drained "
                    f"{t_down - t_low:.1f} s after it fell; {len(results)} requests ({len(served_high)} at high load),"
                    f" {len(failed)} failed; test {time.monotonic() - t0:.0f} s"
                )
                assert not failed, failed[:5]
                assert served_high

                got = [
                    e
                    for e in kube.list("v1", "events", NS)
                    if e.get("involvedObject", {}).get("name") == NAME and e.get("reason") in ("ScaledUp", "ScaledDown")
                ]
                ups = [e["message"] for e in got if e["reason"] == "ScaledUp"]
                downs = [e["message"] for e in got if e["reason"] == "ScaledDown"]
                # decode grows on an ITL miss, or ahead of one once ITL nears the target with the concurrency it
                # learnt (the planner's "near target" rule: docs/operator.md, "SLO planner")
                assert any(
                    m.startswith("decode 1 -> 2: itl p50 ")
                    and (f"> target {itl:g} ms" in m or f"near target {itl:g} ms" in m)
                    for m in ups
                ), ups
                # prefill grows on a TTFT miss, or first on the planner's full-KV rule (its rooms wait on the busy
                # decode side, queued with kv >= 90%: docs/operator.md, "SLO planner"), whichever comes first
                assert any(
                    m.startswith("prefill 1 -> 2: ttft p90 ") and (f"> target {ttft:g} ms" in m or ": full" in m)
                    for m in ups
                ), ups
                assert any(m.startswith("decode 2 -> 1") for m in downs), downs
                assert any(m.startswith("prefill 2 -> 1") for m in downs), downs
                # the figures behind each decision: the router's per-role scrape (prompt tokens/s, queue, KV)
                assert all("prompt tok/s" in m and "queued" in m and "kv " in m for m in ups + downs), ups + downs
                described = kubectl("describe", "inferenceservice", NAME, "-n", NS)
                assert "ScaledUp" in described and "ScaledDown" in described, described
                assert not kube.list("autoscaling/v2", "horizontalpodautoscalers", NS)
            finally:
                stop.set()
                if load is not None:
                    load.close()
                reaping.join(5)
                op.stop()
                procs.stop()
                pods.stop()
                print("operator log tail:\n" + op.tail(40))
