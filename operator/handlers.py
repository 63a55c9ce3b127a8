"""Layer 4: thin kopf handlers.  ``register(registry, config)`` adds them to a kopf registry.

* startup: kopf settings (progress in ``kvship.io/*`` annotations, no status
  storage, events only for warnings and our own notes, watch timeouts) and the
  API client; login with the operator's own credentials.
* create / update / resume of an InferenceService, and a resync timer: one
  :func:`~kvship.operator.controller.reconcile` pass.  An invalid spec is
  reported (``Valid=False`` condition + Warning event) and *not* retried; a
  failed apply is retried with backoff.
* events of the Deployments the operator manages: refresh the owner's status.
* no delete handler and no finalizer: children carry owner references, so the
  garbage collector removes them with the InferenceService.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kvship.operator.builders import MANAGED_BY, Images
from kvship.operator.config import OperatorConfig
from kvship.operator.controller import reconcile, refresh_status
from kvship.operator.kube import KubeClient, connection_info, load_auth

RESOURCE = ("kvship.io", "v1alpha1", "inferenceservices")
RETRY_DELAY = 20.0


def _images(config: OperatorConfig) -> Images:
    return Images(worker=config.worker_image, router=config.router_image, pull_policy=config.image_pull_policy)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register every handler of the operator in ``registry`` (nothing happens at import time)."""
    images = _images(config)

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvship.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="kvship.io", key="last-handled-configuration")
        settings.persistence.finalizer = "kvship.io/finalizer"
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = config.watch_timeout
        settings.watching.client_timeout = config.watch_timeout + 30
        settings.watching.connect_timeout = 30
        settings.networking.request_timeout = 60
        memo.client = KubeClient(lambda: load_auth(config.kubeconfig))

    @kopf.on.cleanup(registry=registry)
    async def close(memo: kopf.Memo, **_: Any) -> None:
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
        outcome = await reconcile(memo.client, dict(body), images)
        if outcome.spec_errors:
            message = "; ".join(outcome.spec_errors)
            logger.info("invalid spec, nothing created: %s", message)
            kopf.warn(body, reason="InvalidSpec", message=message[:1000])
            return
        applied = outcome.applied
        if applied.changed:
            note = "; ".join(f"{what}: {', '.join(items)}" for what, items in (
                ("created", applied.created), ("patched", applied.patched), ("deleted", applied.deleted)) if items)
            kopf.info(body, reason="Applied", message=note[:1000])
        if applied.errors:
            message = "; ".join(applied.errors)
            kopf.warn(body, reason="ApplyFailed", message=message[:1000])
            raise kopf.TemporaryError(message, delay=RETRY_DELAY)

    @kopf.timer(*RESOURCE, interval=config.resync_interval, initial_delay=config.resync_interval,
                registry=registry)
    async def resync(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
        outcome = await reconcile(memo.client, dict(body), images)
        if outcome.applied.changed:
            logger.info("resync corrected drift: created %s, patched %s, deleted %s", outcome.applied.created,
                        outcome.applied.patched, outcome.applied.deleted)

    @kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGED_BY},
                   registry=registry)
    async def child_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        for ref in body.get("metadata", {}).get("ownerReferences") or []:
            if ref.get("kind") == "InferenceService" and ref.get("controller"):
                await refresh_status(memo.client, body["metadata"]["namespace"], ref["name"])
