"""Layer 3, the glue: one reconcile pass of an InferenceService.

``reconcile`` = parse + validate -> build -> apply -> observe -> write status.
It is level-based and idempotent: the kopf create/update/resume handlers, the
resync timer and the child-event handler may all call it at any time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from kvship.operator.apply import ApplyResult, apply_children, observe_children
from kvship.operator.builders import Images, build_children
from kvship.operator.kube import KubeApiError, KubeClient
from kvship.operator.spec import ServiceConfig, SpecError, parse_service
from kvship.operator.status import compute_status

log = logging.getLogger(__name__)
API = ("kvship.io/v1alpha1", "InferenceService")


@dataclass
class Outcome:
    """What one pass found and did."""

    config: Optional[ServiceConfig] = None
    spec_errors: list[str] = field(default_factory=list)
    applied: ApplyResult = field(default_factory=ApplyResult)
    status: dict = field(default_factory=dict)
    status_written: bool = False


async def write_status(client: KubeClient, body: dict, status: dict) -> bool:
    """Patch ``status`` onto the object when it differs; False if nothing changed or it is gone."""
    if (body.get("status") or {}) == status:
        return False
    meta = body["metadata"]
    # conditions is a list: a merge patch replaces it whole, which is what we want
    try:
        await client.merge_patch(*API, meta.get("namespace"), meta["name"], {"status": status}, "status")
    except KubeApiError as e:
        if e.status == 404:
            return False
        raise
    return True


async def reconcile(client: KubeClient, body: dict, images: Images) -> Outcome:
    """One full pass; raises only on API failures of the status write itself."""
    out = Outcome()
    try:
        out.config = parse_service(body)
    except SpecError as e:
        out.spec_errors = e.errors
        out.status = compute_status(body, None, e.errors, [], {})
        out.status_written = await write_status(client, body, out.status)
        return out
    cfg = out.config
    out.applied = await apply_children(client, cfg, build_children(cfg, images))
    children = await observe_children(client, cfg)
    out.status = compute_status(body, cfg, [], out.applied.errors, children)
    out.status_written = await write_status(client, body, out.status)
    return out


async def refresh_status(client: KubeClient, namespace: str, name: str) -> Optional[dict]:
    """Recompute the status of one InferenceService from its children, without applying anything.

    Used when a child changes.  Leaves the status alone while the spec is invalid or the last apply
    failed (the next reconcile owns those messages).  Returns the status written, if any.
    """
    body = await client.get(*API, namespace, name)
    if body is None:
        return None
    ready = next((c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
    if ready.get("reason") in ("ApplyFailed", "InvalidSpec"):
        return None
    try:
        cfg = parse_service(body)
    except SpecError:
        return None
    status = compute_status(body, cfg, [], [], await observe_children(client, cfg))
    return status if await write_status(client, body, status) else None
