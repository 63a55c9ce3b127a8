"""A Deployment controller and a kubelet for the emulator, so operator tests can run real processes as pods.

``Workloads(kube, namespace, backend)`` runs a thread that, every ``period`` seconds:

* for each Deployment of the namespace creates pods from its template (labels + ``pod-template-hash``,
  owner reference to the Deployment) up to ``spec.replicas``, removes surplus ones, and on a template
  change replaces the old pods once the new ones are Ready (maxUnavailable 0, as the operator's CPU
  roles roll);
* plays the kubelet: a pod whose Deployment ``backend(deployment)`` maps to a local port gets
  ``podIP`` 127.0.0.1, the ``kvship.io/port`` annotation of that port, and ``ContainersReady`` from a
  real ``GET /health`` of the process there; the emulator derives ``Ready`` from it and the pod's
  readiness gates (tests/kube_emulator.py).  Pods without a backend never get ready.  With
  ``per_pod=True`` the backend is asked per pod (``backend(pod)``: a process per pod, so a Deployment
  of several replicas runs several);
* writes each Deployment's status (replicas, updated, ready, available, observedGeneration and the
  Progressing condition) the way the Deployment controller does.

Deleting a Deployment removes its pods through the emulator's garbage collector.  ``history`` keeps
every change of the Deployment set the thread observed (for assertions on rollout steps).
"""

from __future__ import annotations

import copy
import hashlib
import json
import secrets
import threading
from typing import Any, Callable, Optional

import httpx

PORT_ANNOTATION = "kvship.io/port"


def template_hash(dep: dict) -> str:
    return hashlib.sha256(json.dumps(dep["spec"]["template"], sort_keys=True).encode()).hexdigest()[:10]


def _cond(obj: dict, ctype: str) -> Optional[dict]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == ctype), None)


def is_ready(pod: dict) -> bool:
    return (_cond(pod, "Ready") or {}).get("status") == "True"


class Workloads:
    def __init__(
        self,
        kube: Any,
        namespace: str,
        backend: Callable[[dict], Optional[int]],
        period: float = 0.25,
        selector: str = "",
        per_pod: bool = False,
    ):
        self.kube, self.namespace, self.backend, self.period, self.selector = kube, namespace, backend, period, selector
        self.per_pod = per_pod
        self.history: list[dict[str, tuple[int, int]]] = []  # {deployment: (ready, desired)} at every change
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._http = httpx.Client(timeout=2.0)

    def __enter__(self) -> "Workloads":
        self._thread = threading.Thread(target=self._run, name="emulator-workloads", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._http.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a race with the operator's deletes: the next step sees it
                self.errors.append(repr(e))
            self._stop.wait(self.period)

    # ------------------------------------------------------------------ one pass
    def step(self) -> None:
        deps = self.kube.list("apps/v1", "deployments", self.namespace, self.selector)
        pods = self.kube.list("v1", "pods", self.namespace)
        seen: dict[str, tuple[int, int]] = {}
        for dep in deps:
            seen[dep["metadata"]["name"]] = self._reconcile(dep, pods)
        if not self.history or self.history[-1] != seen:
            self.history.append(seen)

    def _reconcile(self, dep: dict, pods: list[dict]) -> tuple[int, int]:
        uid = dep["metadata"]["uid"]
        want = int(dep["spec"].get("replicas", 1))
        h = template_hash(dep)
        own = [
            p
            for p in pods
            if any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences") or [])
            and not p["metadata"].get("deletionTimestamp")
        ]
        current = [p for p in own if p["metadata"]["labels"].get("pod-template-hash") == h]
        stale = [p for p in own if p not in current]
        port = None if self.per_pod else self.backend(dep)
        while len(current) < want:
            current.append(self._create_pod(dep, h, port))
        for extra in current[want:]:
            self._delete(extra)
        current = current[:want]
        for pod in current + stale:
            if self.per_pod:
                self._kubelet(pod, self._pod_port(pod))
            else:
                self._kubelet(pod, port if pod in current else self._port_of(pod))
        fresh = {p["metadata"]["name"]: p for p in self.kube.list("v1", "pods", self.namespace)}
        current = [fresh[p["metadata"]["name"]] for p in current if p["metadata"]["name"] in fresh]
        stale = [fresh[p["metadata"]["name"]] for p in stale if p["metadata"]["name"] in fresh]
        ready_current = sum(is_ready(p) for p in current)
        if stale and ready_current >= want:
            for p in stale:
                self._delete(p)
            stale = []
        ready = ready_current + sum(is_ready(p) for p in stale)
        done = ready_current >= want and not stale
        status = {
            "observedGeneration": dep["metadata"].get("generation", 1),
            "replicas": len(current) + len(stale),
            "updatedReplicas": len(current),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": [
                {
                    "type": "Progressing",
                    "status": "True",
                    "reason": "NewReplicaSetAvailable" if done else "ReplicaSetUpdated",
                }
            ],
        }
        old = dep.get("status") or {}
        if any(old.get(k) != v for k, v in status.items()):
            try:
                self.kube.patch_status("apps/v1", "deployments", self.namespace, dep["metadata"]["name"], status)
            except Exception as e:  # noqa: BLE001 - deleted meanwhile
                self.errors.append(repr(e))
        return ready, want

    def _pod_port(self, pod: dict) -> Optional[int]:
        """``per_pod``: the pod's own process port, annotated on the pod (the router's discovery reads it)."""
        port = self.backend(pod)
        if port is not None and self._port_of(pod) != port:
            try:
                self.kube.patch(
                    "v1",
                    "pods",
                    self.namespace,
                    pod["metadata"]["name"],
                    {"metadata": {"annotations": {PORT_ANNOTATION: str(port)}}},
                )
            except Exception as e:  # noqa: BLE001 - deleted meanwhile
                self.errors.append(repr(e))
        return port

    def _port_of(self, pod: dict) -> Optional[int]:
        raw = (pod["metadata"].get("annotations") or {}).get(PORT_ANNOTATION)
        return int(raw) if raw else None

    def _create_pod(self, dep: dict, h: str, port: Optional[int]) -> dict:
        tpl = copy.deepcopy(dep["spec"]["template"])
        meta = tpl.get("metadata") or {}
        labels = dict(meta.get("labels") or {}, **{"pod-template-hash": h})
        annotations = dict(meta.get("annotations") or {})
        if port is not None:
            annotations[PORT_ANNOTATION] = str(port)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{dep['metadata']['name']}-{h}-{secrets.token_hex(3)[:5]}",
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": dep["metadata"]["name"],
                        "uid": dep["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": tpl["spec"],
        }
        return self.kube.create("v1", "pods", self.namespace, pod)

    def _delete(self, pod: dict) -> None:
        try:
            self.kube.delete("v1", "pods", self.namespace, pod["metadata"]["name"])
        except Exception as e:  # noqa: BLE001 - already gone
            self.errors.append(repr(e))

    def _healthy(self, port: Optional[int]) -> bool:
        if port is None:
            return False
        try:
            return self._http.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _kubelet(self, pod: dict, port: Optional[int]) -> None:
        ok = "True" if self._healthy(port) else "False"
        st = pod.get("status") or {}
        gated = bool(pod["spec"].get("readinessGates"))
        if st.get("podIP") == "127.0.0.1" and (_cond(pod, "ContainersReady") or {}).get("status") == ok:
            return
        conds = [{"type": "ContainersReady", "status": ok}]
        if not gated:
            conds.append({"type": "Ready", "status": ok})
        patch = {"status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": conds}}
        try:
            self.kube.request(
                "PATCH",
                self.kube.path("v1", "pods", self.namespace, pod["metadata"]["name"], "status"),
                patch,
                "application/strategic-merge-patch+json",
            )
        except Exception as e:  # noqa: BLE001 - deleted meanwhile
            self.errors.append(repr(e))
