"""Kubernetes pod discovery: keep the worker registry in step with Ready pods matching label selectors.

One watcher per role (``unified`` with ``--selector``; in PD mode ``prefill``
with ``--prefill-selector`` and ``decode`` with ``--decode-selector``), each a
thread running the ``kubernetes`` client's list + watch loop on pods of
``--namespace``:

* a pod that serves (condition ``Ready=True``; or, for a pod carrying the
  operator's readiness gate ``kvship.io/in-rotation``, ``ContainersReady=True``
  and every *other* readiness gate True: that gate turns True only once this
  router lists the pod, so waiting for it would never end), has a pod IP
  and is not being deleted is registered as ``http://<podIP>:<port>``, where the port is the
  pod annotation ``kvship.io/port`` or ``--service-discovery-port``; its label
  ``kvship.io/revision`` (set by the operator) is the worker's revision
  (docs/router.md, "Revisions"), and its name is reported in ``/workers``;
* a pod that stops being Ready, loses its IP, starts terminating or is
  deleted is removed; a pod whose address changed is re-registered;
* after every (re)list the set of known pods is reconciled against the list,
  so events missed while disconnected cannot leave stale workers behind;
  a ``410 Gone`` or any error restarts from a fresh list (with backoff).

Threads only read the API; every registry change is handed to the event loop
(``call_soon_threadsafe``) so the registry stays single-threaded.  Credentials:
in-cluster service account when running in a pod, else ``--kubeconfig`` or the
default kubeconfig.  Only workers this module added are ever removed by it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any, Optional

from kvship.router.config import RouterConfig, selector_string
from kvship.router.worker import WorkerRegistry

logger = logging.getLogger(__name__)

PORT_ANNOTATION = "kvship.io/port"
REVISION_LABEL = "kvship.io/revision"
IN_ROTATION_GATE = "kvship.io/in-rotation"  # the readiness gate the operator sets from this router's /workers


def pod_serves(pod: Any) -> bool:
    """Whether the pod's containers serve: ``Ready``, or ready but for the in-rotation gate (module doc)."""
    conditions = {c.type: c.status for c in (pod.status.conditions or [])}
    if conditions.get("Ready") == "True":
        return True
    gates = [g.condition_type for g in ((pod.spec.readiness_gates if pod.spec is not None else None) or [])]
    if IN_ROTATION_GATE not in gates:
        return False
    others_true = all(conditions.get(g) == "True" for g in gates if g != IN_ROTATION_GATE)
    return conditions.get("ContainersReady") == "True" and others_true


SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
WATCH_TIMEOUT_S = 60


def pod_worker_url(pod: Any, default_port: int) -> Optional[str]:
    """``http://ip:port`` of a serving (``pod_serves``), addressed, not-terminating pod; ``None`` for any other pod."""
    meta, status = pod.metadata, pod.status
    if meta is None or status is None or meta.deletion_timestamp is not None or not status.pod_ip:
        return None
    if not pod_serves(pod):
        return None
    port = default_port
    raw = (meta.annotations or {}).get(PORT_ANNOTATION)
    if raw is not None:
        try:
            port = int(raw)
        except ValueError:
            logger.warning(
                "pod %s/%s: annotation %s=%r is not a port; using %d",
                meta.namespace,
                meta.name,
                PORT_ANNOTATION,
                raw,
                default_port,
            )
    host = status.pod_ip if ":" not in status.pod_ip else f"[{status.pod_ip}]"
    return f"http://{host}:{port}"


def pod_revision(pod: Any) -> Optional[str]:
    """The pod's ``kvship.io/revision`` label, or None."""
    labels = (pod.metadata.labels if pod.metadata is not None else None) or {}
    value = labels.get(REVISION_LABEL)
    return value or None


def resolve_namespace(config: RouterConfig) -> str:
    if config.namespace:
        return config.namespace
    try:
        with open(SA_NAMESPACE_FILE, encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def load_client_configuration(kubeconfig: Optional[str]) -> Any:
    """A ``kubernetes.client.Configuration``: in-cluster when possible (and no kubeconfig given)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return cfg


class PodDiscovery:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry):
        self.config = config
        self.registry = registry
        self.namespace = resolve_namespace(config)
        if config.pd:
            self.targets = [
                ("prefill", selector_string(config.prefill_selector_labels)),
                ("decode", selector_string(config.decode_selector_labels)),
            ]
        else:
            self.targets = [("unified", selector_string(config.selector_labels))]
        self.known: dict[tuple[str, str], str] = {}  # (role, pod uid) -> worker URL
        self.known_revision: dict[tuple[str, str], Optional[str]] = {}  # (role, pod uid) -> revision label
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: list[Any] = []
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        from kubernetes import client

        self._loop = asyncio.get_running_loop()
        cfg = await self._loop.run_in_executor(None, load_client_configuration, self.config.kubeconfig)
        api = client.CoreV1Api(client.ApiClient(cfg))
        for role, selector in self.targets:
            t = threading.Thread(
                target=self._watch_loop, args=(api, role, selector), daemon=True, name=f"kvship-discovery-{role}"
            )
            self._threads.append(t)
            t.start()
        logger.info(
            "discovering %s in namespace %s", ", ".join(f"{r} pods [{s}]" for r, s in self.targets), self.namespace
        )

    async def stop(self) -> None:
        self._stop.set()
        for w in self._watches:
            w.stop()
        for task in list(self._tasks):
            task.cancel()

    # -- watcher threads ---------------------------------------------------
    def _watch_loop(self, api: Any, role: str, selector: str) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        while not self._stop.is_set():
            try:
                listing = api.list_namespaced_pod(self.namespace, label_selector=selector, _request_timeout=30)
                present = {}
                for pod in listing.items:
                    url = pod_worker_url(pod, self.config.service_discovery_port)
                    if url is not None:
                        present[pod.metadata.uid] = (
                            f"{pod.metadata.namespace}/{pod.metadata.name}",
                            url,
                            pod_revision(pod),
                        )
                self._to_loop(self._reconcile, role, present)
                rv = listing.metadata.resource_version
                w = watch.Watch()
                self._watches.append(w)
                try:
                    for event in w.stream(
                        api.list_namespaced_pod,
                        self.namespace,
                        label_selector=selector,
                        resource_version=rv,
                        timeout_seconds=WATCH_TIMEOUT_S,
                        allow_watch_bookmarks=True,
                        _request_timeout=WATCH_TIMEOUT_S + 10,
                    ):
                        if self._stop.is_set():
                            break
                        kind, pod = event["type"], event["object"]  # ERROR events raise ApiException
                        if kind == "BOOKMARK":
                            continue
                        url = None if kind == "DELETED" else pod_worker_url(pod, self.config.service_discovery_port)
                        self._to_loop(
                            self._apply,
                            role,
                            pod.metadata.uid,
                            f"{pod.metadata.namespace}/{pod.metadata.name}",
                            url,
                            pod_revision(pod),
                        )
                finally:
                    self._watches.remove(w)
                backoff = 0.5
            except ApiException as e:
                if e.status != 410:
                    logger.warning(
                        "pod watch (%s) failed: %s %s; retrying in %.1f s", role, e.status, e.reason, backoff
                    )
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 30.0)
            except Exception as e:  # noqa: BLE001 - the watch must survive any client or network error
                if self._stop.is_set():
                    return
                logger.warning("pod watch (%s) failed: %r; retrying in %.1f s", role, e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _to_loop(self, fn, *args: Any) -> None:
        assert self._loop is not None
        if not self._stop.is_set():
            self._loop.call_soon_threadsafe(fn, *args)

    # -- event-loop side -----------------------------------------------------
    def _apply(self, role: str, uid: str, name: str, url: Optional[str], revision: Optional[str] = None) -> None:
        key = (role, uid)
        old = self.known.get(key)
        if old == url:
            if url is not None and self.known_revision.get(key) != revision:
                self.known_revision[key] = revision
                worker = self.registry.get(url)
                if worker is not None:
                    self.registry.set_label_revision(worker, revision)
            return
        if old is not None:
            del self.known[key]
            self.known_revision.pop(key, None)
            if old not in self.known.values():
                self.registry.remove(old)
            logger.info("discovery: %s pod %s (%s) left", role, name, old)
        if url is not None:
            self.known[key] = url
            self.known_revision[key] = revision
            logger.info("discovery: %s pod %s ready at %s (revision %s)", role, name, url, revision or "-")
            self._register(url, role, name, revision)

    def _reconcile(self, role: str, present: dict[str, tuple[str, str, Optional[str]]]) -> None:
        """After a (re)list: drop known pods of ``role`` that are gone or changed, add the listed ones."""
        for (r, uid), url in list(self.known.items()):
            if r == role and (uid not in present or present[uid][1] != url):
                self._apply(role, uid, f"uid {uid}", None)
        for uid, (name, url, revision) in present.items():
            self._apply(role, uid, name, url, revision)

    def _register(self, url: str, role: str, name: str, revision: Optional[str]) -> None:
        namespace, _, pod = name.rpartition("/")

        async def register() -> None:
            try:
                await self.registry.register(
                    url, role, source="discovery", revision=revision, pod=pod, namespace=namespace or None
                )
            except Exception as e:  # noqa: BLE001 - e.g. the URL is a static worker of another role
                logger.error("discovery: could not register %s as %s: %s", url, role, e)

        task = asyncio.get_running_loop().create_task(register())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
