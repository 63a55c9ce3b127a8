"""StatefulSet and LeaderWorkerSet controllers (and their kubelet) for the emulator: worker groups as pods.

``Groups(kube, namespace, backend)`` runs a thread that, every ``period`` seconds, does what the real
controllers do with the parts the operator relies on (docs/operator.md, "Multi-node worker groups"):

* **StatefulSet** (apps/v1): pods ``<sts>-<ordinal>`` for ordinals ``0..replicas-1`` from the template, labelled
  ``apps.kubernetes.io/pod-index`` and ``statefulset.kubernetes.io/pod-name``, hostname/subdomain set from
  ``serviceName``; a deleted pod is recreated under the same name (nothing else: a StatefulSet never restarts
  its other pods); status ``replicas`` / ``readyReplicas`` / ``updatedReplicas`` / ``observedGeneration``
  counted in pods.
* **LeaderWorkerSet** (leaderworkerset.x-k8s.io/v1): per group ``g`` a leader ``<lws>-<g>`` and workers
  ``<lws>-<g>-<w>`` (``w`` = 1..size-1) labelled ``leaderworkerset.sigs.k8s.io/{name,group-index,
  worker-index}``, with ``LWS_LEADER_ADDRESS`` / ``LWS_GROUP_SIZE`` / ``LWS_WORKER_INDEX`` put into every
  container's env, as the LWS webhook does; ``restartPolicy: RecreateGroupOnPodRestart`` deletes every pod of a
  group one of whose pods was lost or restarted, then recreates the group; status counts **groups**: a group is
  ready only when all its pods are (``readyReplicas``), with an ``Available`` condition.

The kubelet part: a pod whose ``backend(pod)`` gives a local port gets ``podIP`` 127.0.0.1, the ``kvship.io/port``
annotation of that port (the router's discovery reads it) and ``ContainersReady`` from a real ``GET /health`` there
(the emulator derives ``Ready`` from it and the pod's readiness gates); ``bump_restart(pod)`` plays a container
restart (``restartCount`` + 1).

The pod network on loopback: every pod's IP is 127.0.0.1, so a pod's stable DNS name (a StatefulSet pod's
``<pod>.<service>.<namespace>.svc[.cluster.local]``, a LeaderWorkerSet leader's ``<pod>.<lws>.<namespace>``) resolves
to 127.0.0.1, and the container ports of the pods, which would not collide on separate IPs, are mapped to host
ports of their own: :class:`LoopbackNetwork` (``address(host_port)`` for an address a container was given).
"""

from __future__ import annotations

import copy
import socket
import threading
from typing import Any, Callable, Optional

import httpx

LWS = "leaderworkerset.x-k8s.io/v1"
LWS_PREFIX = "leaderworkerset.sigs.k8s.io/"
PORT_ANNOTATION = "kvship.io/port"


class LoopbackNetwork:
    """Cluster DNS and pod ports on one host (module docstring): ``(pod name, container port)`` -> a free host
    port, the same for every pod of that name (a StatefulSet or LWS pod keeps its name, and so its DNS name and
    address, across restarts)."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        self._ports: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def pod_of(self, host: str) -> str:
        """The pod a stable DNS name names; ValueError for a name that is not a pod's in this namespace."""
        labels = host.rstrip(".").split(".")
        if len(labels) < 3 or labels[2] != self.namespace or (len(labels) > 3 and labels[3] != "svc"):
            raise ValueError(f"{host!r} is not a pod's DNS name in namespace {self.namespace}")
        return labels[0]

    def host_port(self, pod: str, container_port: int) -> int:
        with self._lock:
            key = (pod, container_port)
            if key not in self._ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    self._ports[key] = s.getsockname()[1]
            return self._ports[key]

    def address(self, host_port: str) -> str:
        """``<pod dns name>:<container port>`` as a process on this host reaches it: ``127.0.0.1:<host port>``."""
        host, port = host_port.rsplit(":", 1)
        return f"127.0.0.1:{self.host_port(self.pod_of(host), int(port))}"


def _cond(obj: dict, ctype: str) -> Optional[dict]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == ctype), None)


def is_ready(pod: dict) -> bool:
    return (_cond(pod, "Ready") or {}).get("status") == "True"


def restarts(pod: dict) -> int:
    return sum(int(c.get("restartCount") or 0) for c in (pod.get("status") or {}).get("containerStatuses") or [])


class Groups:
    def __init__(self, kube: Any, namespace: str, backend: Callable[[dict], Optional[int]], period: float = 0.2):
        self.kube, self.namespace, self.backend, self.period = kube, namespace, backend, period
        self.errors: list[str] = []
        self.recreated: list[str] = []  # "<lws>-<group>" each time a whole group was recreated
        self._seen: dict[str, dict[str, tuple[str, int]]] = {}  # group -> pod name -> (uid, restarts) once whole
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._http = httpx.Client(timeout=2.0)

    def __enter__(self) -> "Groups":
        self._thread = threading.Thread(target=self._run, name="emulator-groups", daemon=True)
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
            except Exception as e:  # noqa: BLE001 - a race with a delete: the next step sees it
                self.errors.append(repr(e))
            self._stop.wait(self.period)

    def step(self) -> None:
        pods = [p for p in self.kube.list("v1", "pods", self.namespace) if not p["metadata"].get("deletionTimestamp")]
        for sts in self.kube.list("apps/v1", "statefulsets", self.namespace):
            self._statefulset(sts, pods)
        try:
            sets = self.kube.list(LWS, "leaderworkersets", self.namespace)
        except Exception:  # noqa: BLE001 - the LWS CRD is not installed in this emulator
            sets = []
        for lws in sets:
            self._leader_worker_set(lws, pods)

    # ---------------------------------------------------------------- StatefulSet
    def _statefulset(self, sts: dict, pods: list[dict]) -> None:
        name, uid = sts["metadata"]["name"], sts["metadata"]["uid"]
        want = int(sts["spec"].get("replicas", 1))
        own = {p["metadata"]["name"]: p for p in pods if _owned(p, uid)}
        for i in range(want):
            pod_name = f"{name}-{i}"
            if pod_name not in own:
                labels = {"apps.kubernetes.io/pod-index": str(i), "statefulset.kubernetes.io/pod-name": pod_name}
                own[pod_name] = self._create(sts, "apps/v1", "StatefulSet", pod_name, sts["spec"]["template"], labels)
        for pod_name, pod in list(own.items()):
            if int(pod_name.rsplit("-", 1)[1]) >= want:
                self._delete(pod_name)
                del own[pod_name]
        ready = sum(is_ready(p) for p in self._kubelet_all(list(own.values())))
        self._status(
            "apps/v1",
            "statefulsets",
            sts,
            {
                "observedGeneration": sts["metadata"].get("generation", 1),
                "replicas": len(own),
                "readyReplicas": ready,
                "availableReplicas": ready,
                "currentReplicas": len(own),
                "updatedReplicas": len(own),
            },
        )

    # ---------------------------------------------------------------- LeaderWorkerSet
    def _leader_worker_set(self, lws: dict, pods: list[dict]) -> None:
        name, uid = lws["metadata"]["name"], lws["metadata"]["uid"]
        groups, tpl = int(lws["spec"].get("replicas", 1)), lws["spec"]["leaderWorkerTemplate"]
        size = int(tpl.get("size", 1))
        recreate = tpl.get("restartPolicy") == "RecreateGroupOnPodRestart"
        own = {p["metadata"]["name"]: p for p in pods if _owned(p, uid)}
        ready_groups = 0
        for g in range(groups):
            group = f"{name}-{g}"
            names = [group] + [f"{group}-{w}" for w in range(1, size)]
            members = {n: own[n] for n in names if n in own}
            seen = self._seen.get(group)
            if recreate and seen is not None:
                now = {n: (p["metadata"]["uid"], restarts(p)) for n, p in members.items()}
                if any(now.get(n) != v for n, v in seen.items()):  # a pod lost or restarted: the whole group goes
                    for n in members:
                        self._delete(n)
                    self._seen.pop(group, None)
                    self.recreated.append(group)
                    continue
            for w, pod_name in enumerate(names):
                if pod_name not in members:
                    template = (
                        tpl.get("leaderTemplate") if w == 0 and tpl.get("leaderTemplate") else tpl["workerTemplate"]
                    )
                    labels = {
                        LWS_PREFIX + "name": name,
                        LWS_PREFIX + "group-index": str(g),
                        LWS_PREFIX + "worker-index": str(w),
                        LWS_PREFIX + "group-key": group,
                    }
                    env = {
                        "LWS_LEADER_ADDRESS": f"{group}.{name}.{self.namespace}",
                        "LWS_GROUP_SIZE": str(size),
                        "LWS_WORKER_INDEX": str(w),
                    }
                    members[pod_name] = self._create(lws, LWS, "LeaderWorkerSet", pod_name, template, labels, env)
            live = self._kubelet_all(list(members.values()))
            if len(live) == size and all(is_ready(p) for p in live):
                ready_groups += 1
            if len(live) == size and self._seen.get(group) is None:
                self._seen[group] = {p["metadata"]["name"]: (p["metadata"]["uid"], restarts(p)) for p in live}
        for pod_name in own:  # groups beyond replicas (scale down)
            if int(own[pod_name]["metadata"]["labels"].get(LWS_PREFIX + "group-index", "0")) >= groups:
                self._delete(pod_name)
        self._status(
            LWS,
            "leaderworkersets",
            lws,
            {
                "replicas": groups,
                "readyReplicas": ready_groups,
                "updatedReplicas": groups,
                "hpaPodSelector": f"{LWS_PREFIX}name={name},{LWS_PREFIX}worker-index=0",
                "conditions": [
                    {
                        "type": "Available",
                        "status": "True" if ready_groups >= groups else "False",
                        "reason": "AllGroupsReady" if ready_groups >= groups else "GroupsNotReady",
                        "message": f"{ready_groups}/{groups} groups ready",
                        "lastTransitionTime": "1970-01-01T00:00:00Z",
                    }
                ],
            },
        )

    # ---------------------------------------------------------------- shared
    def _create(
        self,
        owner: dict,
        api_version: str,
        kind: str,
        name: str,
        template: dict,
        labels: dict,
        env: Optional[dict] = None,
    ) -> dict:
        tpl = copy.deepcopy(template)
        meta = tpl.get("metadata") or {}
        spec = tpl["spec"]
        for c in spec.get("containers") or []:
            if env:
                c["env"] = [{"name": k, "value": v} for k, v in env.items()] + list(c.get("env") or [])
        if kind == "StatefulSet":
            spec["hostname"], spec["subdomain"] = name, owner["spec"].get("serviceName")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": dict(meta.get("labels") or {}, **labels),
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": api_version,
                        "kind": kind,
                        "name": owner["metadata"]["name"],
                        "uid": owner["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": spec,
        }
        return self.kube.create("v1", "pods", self.namespace, pod)

    def _delete(self, name: str) -> None:
        try:
            self.kube.delete("v1", "pods", self.namespace, name)
        except Exception as e:  # noqa: BLE001 - already gone
            self.errors.append(repr(e))

    def _status(self, api_version: str, plural: str, obj: dict, status: dict) -> None:
        old = obj.get("status") or {}
        if any(old.get(k) != v for k, v in status.items()):
            try:
                self.kube.patch_status(api_version, plural, self.namespace, obj["metadata"]["name"], status)
            except Exception as e:  # noqa: BLE001 - deleted meanwhile
                self.errors.append(repr(e))

    def _healthy(self, port: Optional[int]) -> bool:
        if port is None:
            return False
        try:
            return self._http.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _kubelet_all(self, pods: list[dict]) -> list[dict]:
        for pod in pods:
            self._kubelet(pod)
        fresh = {p["metadata"]["name"]: p for p in self.kube.list("v1", "pods", self.namespace)}
        return [fresh[p["metadata"]["name"]] for p in pods if p["metadata"]["name"] in fresh]

    def _kubelet(self, pod: dict) -> None:
        port = self.backend(pod)
        ok = "True" if self._healthy(port) else "False"
        st = pod.get("status") or {}
        annotations = pod["metadata"].get("annotations") or {}
        if port is not None and annotations.get(PORT_ANNOTATION) != str(port):
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
        if st.get("podIP") == "127.0.0.1" and (_cond(pod, "ContainersReady") or {}).get("status") == ok:
            return
        conds = [{"type": "ContainersReady", "status": ok}]
        if not pod["spec"].get("readinessGates"):
            conds.append({"type": "Ready", "status": ok})
        patch: dict[str, Any] = {"status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": conds}}
        if not st.get("containerStatuses"):
            c = pod["spec"]["containers"][0]
            patch["status"]["containerStatuses"] = [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "restartCount": 0,
                    "ready": ok == "True",
                }
            ]
        try:
            self.kube.request(
                "PATCH",
                self.kube.path("v1", "pods", self.namespace, pod["metadata"]["name"], "status"),
                patch,
                "application/strategic-merge-patch+json",
            )
        except Exception as e:  # noqa: BLE001 - deleted meanwhile
            self.errors.append(repr(e))

    def bump_restart(self, name: str) -> None:
        """A container restart of pod ``name`` (what the kubelet reports after the process died)."""
        pod = self.kube.get("v1", "pods", self.namespace, name)
        statuses = copy.deepcopy((pod.get("status") or {}).get("containerStatuses") or [{"name": "worker"}])
        statuses[0]["restartCount"] = int(statuses[0].get("restartCount") or 0) + 1
        self.kube.patch_status("v1", "pods", self.namespace, name, {"containerStatuses": statuses})


def _owned(pod: dict, uid: str) -> bool:
    return any(r.get("uid") == uid for r in pod["metadata"].get("ownerReferences") or [])
