"""Layer 4: thin kopf handlers.  ``register(registry, config)`` adds them to a kopf registry.

* startup: kopf settings (progress in ``kvship.io/*`` annotations, no status
  storage, events only for our own notes, watch timeouts), the API client and
  the resync loop; login with the operator's own credentials.
* create / update / resume of an InferenceService: one
  :func:`~kvship.operator.controller.reconcile` pass.  An invalid spec is
  reported (``Valid=False`` condition + Warning event) and *not* retried; a
  failed apply is retried with backoff.
* a resync loop (started at startup, not a kopf timer: kopf puts a finalizer
  on every object that has a timer) reconciles every InferenceService each
  ``--resync-interval`` seconds: drifted children are re-applied, the router is
  read (pods' in-rotation gates, drained revisions retired, ``status.slo``),
  status refreshed; services in ``spec.autoscaling.mode: slo`` then get a planner pass
  (kvship.operator.planner_loop).
* events of the Deployments the operator manages (watched with a server-side label
  selector, so only those are streamed): refresh the owner's status.
* events of the StatefulSets and LeaderWorkerSets of multi-node worker groups (same selector; a
  LeaderWorkerSet is watched only where its CRD is installed): the StatefulSet fallback's whole-group
  restart runs at once (kvship.operator.groups; a lost or restarted pod changes its StatefulSet's
  counts), then the owner's status (groups ready/desired) is refreshed, without waiting for the resync.
* no delete handler and no finalizer: children carry owner references, so the
  garbage collector removes them with the InferenceService, and uninstalling
  the operator never leaves objects stuck in deletion.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

import kopf

from kvship.operator.apply import observe_children
from kvship.operator.builders import MANAGED_BY, Images
from kvship.operator.builders.groups import LWS_API_VERSION
from kvship.operator.config import OperatorConfig
from kvship.operator.controller import API, Outcome, RouterAccess, reconcile, refresh_status, restart_groups
from kvship.operator.kube import KubeApiError, KubeClient, connection_info, load_auth
from kvship.operator.planner_loop import PlannerLoop
from kvship.operator.spec import SpecError, parse_service

RESOURCE = ("kvship.io", "v1alpha1", "inferenceservices")
RETRY_DELAY = 20.0
DEPLOYMENT_SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"
LWS_GROUP, LWS_VERSION = LWS_API_VERSION.split("/")
log = logging.getLogger(__name__)


def _images(config: OperatorConfig) -> Images:
    return Images(
        worker=config.worker_image,
        router=config.router_image,
        pull_policy=config.image_pull_policy,
        allowed_prefixes=config.image_prefixes,
    )


def _router_access(config: OperatorConfig) -> RouterAccess:
    return RouterAccess(url=config.router_url, timeout=config.router_timeout)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register every handler of the operator in ``registry`` (nothing happens at import time)."""
    images = _images(config)
    routers = _router_access(config)

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvship.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="kvship.io", key="last-handled-configuration"
        )
        settings.persistence.finalizer = "kvship.io/finalizer"  # named, but no handler here needs one
        # Events: only the explicit notes below (Applied, InvalidSpec, ApplyFailed), not every log line.
        settings.posting.level = logging.INFO
        settings.posting.loggers = False
        # Server-side filter: the API streams only the Deployments the operator made, never every
        # Deployment of the cluster (the handler's labels= filter alone would apply after the transfer).
        settings.watching.label_selectors["apps", "v1", "deployments"] = DEPLOYMENT_SELECTOR
        settings.watching.label_selectors["apps", "v1", "statefulsets"] = DEPLOYMENT_SELECTOR
        settings.watching.label_selectors[LWS_GROUP, LWS_VERSION, "leaderworkersets"] = DEPLOYMENT_SELECTOR
        settings.watching.server_timeout = config.watch_timeout
        settings.watching.client_timeout = config.watch_timeout + 30
        settings.watching.connect_timeout = 30
        settings.networking.request_timeout = 60
        memo.client = KubeClient(lambda: load_auth(config.kubeconfig))
        memo.resync = asyncio.create_task(resync_loop(memo.client, config, images), name="kvship-resync")

    @kopf.on.cleanup(registry=registry)
    async def close(memo: kopf.Memo, **_: Any) -> None:
        task: Optional[asyncio.Task] = getattr(memo, "resync", None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        client = getattr(memo, "client", None)
        if client is not None:
            await client.aclose()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> Any:
        return connection_info(load_auth(config.kubeconfig))

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, registry=registry)
    async def reconcile_service(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
        outcome = await reconcile(memo.client, dict(body), images, routers, config.network)
        if outcome.spec_errors:
            message = "; ".join(outcome.spec_errors)
            logger.info("invalid spec, nothing created: %s", message)
            kopf.warn(body, reason="InvalidSpec", message=message[:1000])
            return
        applied = outcome.applied
        if applied.changed:
            note = "; ".join(
                f"{what}: {', '.join(items)}"
                for what, items in (
                    ("created", applied.created),
                    ("patched", applied.patched),
                    ("deleted", applied.deleted),
                )
                if items
            )
            kopf.info(body, reason="Applied", message=note[:1000])
        if applied.errors:
            message = "; ".join(applied.errors)
            kopf.warn(body, reason="ApplyFailed", message=message[:1000])
            raise kopf.TemporaryError(message, delay=RETRY_DELAY)

    @kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGED_BY}, registry=registry)
    async def child_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        for ref in body.get("metadata", {}).get("ownerReferences") or []:
            if ref.get("kind") == "InferenceService" and ref.get("controller"):
                await refresh_status(memo.client, body["metadata"]["namespace"], ref["name"], images)

    @kopf.on.event("apps", "v1", "statefulsets", labels={"app.kubernetes.io/managed-by": MANAGED_BY}, registry=registry)
    @kopf.on.event(
        LWS_GROUP,
        LWS_VERSION,
        "leaderworkersets",
        labels={"app.kubernetes.io/managed-by": MANAGED_BY},
        registry=registry,
    )
    async def group_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        for ref in body.get("metadata", {}).get("ownerReferences") or []:
            if ref.get("kind") == "InferenceService" and ref.get("controller"):
                namespace = body["metadata"]["namespace"]
                if body.get("kind") == "StatefulSet":
                    await restart_service_groups(memo.client, namespace, ref["name"], images)
                await refresh_status(memo.client, namespace, ref["name"], images)


async def restart_service_groups(client: KubeClient, namespace: str, name: str, images: Images) -> list[str]:
    """The StatefulSet fallback's whole-group restart for one InferenceService, outside a full reconcile (on a
    StatefulSet event); returns the groups restarted.  A spec that does not parse is left to the reconcile."""
    body = await client.get(*API, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return []
    try:
        cfg = parse_service(body, images.allowed_prefixes)
    except SpecError:
        return []
    out = Outcome(config=cfg)
    try:
        await restart_groups(client, cfg, await observe_children(client, cfg), out)
    except KubeApiError as e:  # the next event or resync pass tries again
        log.warning("%s/%s: restarting worker groups failed: %s", namespace, name, e)
    return out.group_restarts


async def resync_loop(client: KubeClient, config: OperatorConfig, images: Images) -> None:
    """Every ``resync_interval`` seconds, reconcile each InferenceService the operator watches: re-apply drift,
    read its router (gates, rollouts, ``status.slo``), refresh its status."""
    namespaces: list[Optional[str]] = [None] if config.clusterwide else list(config.namespace)
    routers = _router_access(config)
    planners = PlannerLoop()
    while True:
        await asyncio.sleep(config.resync_interval)
        for ns in namespaces:
            try:
                bodies = await client.list("kvship.io/v1alpha1", "InferenceService", ns)
            except (KubeApiError, OSError) as e:
                log.warning("resync: listing InferenceServices in %s failed: %s", ns or "all namespaces", e)
                continue
            for body in bodies:
                if body["metadata"].get("deletionTimestamp"):
                    continue
                try:
                    outcome = await reconcile(client, body, images, routers, config.network)
                except Exception as e:  # keep the loop alive; the next pass retries
                    log.warning(
                        "resync of %s/%s failed: %s", body["metadata"].get("namespace"), body["metadata"]["name"], e
                    )
                    continue
                if outcome.config is not None and outcome.revision is not None:
                    try:  # spec.autoscaling.mode slo: scale the current revision's roles from the router's figures
                        await planners.plan(client, outcome.config, outcome.revision, outcome.router)
                    except Exception as e:  # the next pass plans again
                        log.warning("planner of %s/%s failed: %s", outcome.config.namespace, outcome.config.name, e)
                for rev in outcome.retired:
                    log.info(
                        "%s/%s: revision %s drained, its Deployments deleted",
                        body["metadata"].get("namespace"),
                        body["metadata"]["name"],
                        rev or "(unlabelled)",
                    )
                if outcome.applied.changed:
                    log.info(
                        "resync of %s/%s corrected drift: created %s, patched %s, deleted %s",
                        body["metadata"].get("namespace"),
                        body["metadata"]["name"],
                        outcome.applied.created,
                        outcome.applied.patched,
                        outcome.applied.deleted,
                    )
