"""Layer 3: make the cluster match the builders' output.

For each desired child: create it when absent (a 409 means someone created it
meanwhile: re-read and go on), patch it when the live object differs, leave
it alone otherwise.  Children that are no longer desired (a role removed,
autoscaling switched off, unified <-> PD) are deleted — only those whose owner
reference is this InferenceService.  An object with a child's name that this
service does not own is never touched; that is reported as an error.

Patches are JSON merge patches of the whole desired object, plus ``null`` for
every field the previous apply set and this one does not (the previous
desired state is kept in the ``kvship.io/last-applied`` annotation), so
removing e.g. a node selector key really removes it.  ``spec.replicas`` is
never nulled: once a role gets an HPA, the HPA owns the count.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kvship.operator.builders import CHILD_KINDS, instance_labels
from kvship.operator.builders.groups import LWS_API_VERSION, LWS_KIND, any_grouped
from kvship.operator.kube import KubeApiError, KubeClient
from kvship.operator.spec import ServiceConfig

log = logging.getLogger(__name__)

LAST_APPLIED = "kvship.io/last-applied"
# Paths never nulled when they disappear from the desired state (another controller owns them then).
RELINQUISHED = {("spec", "replicas")}


@dataclass
class ApplyResult:
    """What one apply pass did; ``errors`` holds one message per child that could not be applied."""

    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    live: dict[tuple[str, str], dict] = field(default_factory=dict)  # (kind, name) -> object after apply

    @property
    def changed(self) -> bool:
        return bool(self.created or self.patched or self.deleted)


def _label(obj: dict) -> str:
    return f"{obj['kind']} {obj['metadata']['name']}"


def is_subset(want: Any, have: Any) -> bool:
    """Every field of ``want`` is in ``have`` with the same value (lists: same length, element-wise).

    Numbers and strings compare by text, since the API server renders quantities as strings.
    """
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and is_subset(v, have[k]) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    if isinstance(want, bool) or isinstance(have, bool):
        return want == have
    if isinstance(want, (int, float, str)) and isinstance(have, (int, float, str)):
        return want == have or str(want) == str(have)
    return want == have


def removed_fields(last: Any, desired: Any, path: tuple[str, ...] = ()) -> dict:
    """Merge-patch ``null``s for dict keys set by the last apply and absent from ``desired``."""
    out: dict = {}
    if not isinstance(last, dict) or not isinstance(desired, dict):
        return out
    for key, old in last.items():
        sub = path + (key,)
        if key not in desired:
            if sub not in RELINQUISHED:
                out[key] = None
        elif isinstance(old, dict) and isinstance(desired[key], dict):
            nested = removed_fields(old, desired[key], sub)
            if nested:
                out[key] = nested
    return out


def _still_present(nulls: dict, live: Any) -> bool:
    for key, value in nulls.items():
        if not isinstance(live, dict) or key not in live:
            continue
        if value is None or _still_present(value, live[key]):
            return True
    return False


def with_last_applied(desired: dict) -> dict:
    out = json.loads(json.dumps(desired))
    ann = out["metadata"].setdefault("annotations", {})
    ann[LAST_APPLIED] = json.dumps(desired, sort_keys=True, separators=(",", ":"))
    return out


def compute_patch(live: dict, desired: dict) -> Optional[dict]:
    """The merge patch turning ``live`` into ``desired`` (``None`` when nothing needs to change)."""
    target = with_last_applied(desired)
    try:
        last = json.loads(((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED) or "{}")
    except ValueError:
        last = {}
    nulls = removed_fields(last, desired)
    if is_subset(target, live) and not _still_present(nulls, live):
        return None
    return _merge(target, nulls)


def merged_with_nulls(target: dict, nulls: dict) -> dict:
    """``target`` plus the merge-patch ``null``s of :func:`removed_fields` (a patch that also removes keys)."""
    return _merge(target, nulls)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        elif k not in out:
            out[k] = v
    return out


def owned_by(obj: dict, uid: str) -> bool:
    return any(
        r.get("uid") == uid and r.get("controller") for r in (obj.get("metadata") or {}).get("ownerReferences") or []
    )


async def apply_one(client: KubeClient, cfg: ServiceConfig, desired: dict, result: ApplyResult) -> None:
    meta = desired["metadata"]
    key = (desired["kind"], meta["name"])
    live = await client.get(desired["apiVersion"], desired["kind"], meta.get("namespace"), meta["name"])
    if live is None:
        try:
            result.live[key] = await client.create(with_last_applied(desired))
            result.created.append(_label(desired))
            return
        except KubeApiError as e:
            if e.status != 409:
                raise
            live = await client.get(desired["apiVersion"], desired["kind"], meta.get("namespace"), meta["name"])
            if live is None:  # created and deleted meanwhile: the next pass recreates it
                raise
    if not owned_by(live, cfg.uid):
        result.errors.append(
            f"{_label(desired)} already exists and is not owned by InferenceService {cfg.name}; delete or rename it"
        )
        return
    patch = compute_patch(live, desired)
    if patch is None:
        result.live[key] = live
        result.unchanged.append(_label(desired))
        return
    result.live[key] = await client.merge_patch(
        desired["apiVersion"], desired["kind"], meta.get("namespace"), meta["name"], patch
    )
    result.patched.append(_label(desired))


async def apply_children(
    client: KubeClient, cfg: ServiceConfig, desired: list[dict], keep: Optional[Callable[[str, dict], bool]] = None
) -> ApplyResult:
    """Create/patch every desired child, then delete owned children that are no longer desired
    (except those ``keep(kind, obj)`` spares: an old revision's Deployments while it drains)."""
    result = ApplyResult()
    for obj in desired:
        try:
            await apply_one(client, cfg, obj, result)
        except KubeApiError as e:
            result.errors.append(f"{_label(obj)}: {e.status} {e.reason}: {e.message}")
    await prune(client, cfg, {(o["kind"], o["metadata"]["name"]) for o in desired}, result, keep)
    return result


async def prune(
    client: KubeClient,
    cfg: ServiceConfig,
    keep: set[tuple[str, str]],
    result: ApplyResult,
    spare: Optional[Callable[[str, dict], bool]] = None,
) -> None:
    selector = ",".join(f"{k}={v}" for k, v in sorted(instance_labels(cfg).items()))
    for api_version, kind in CHILD_KINDS:
        try:
            existing = await client.list(api_version, kind, cfg.namespace, selector)
        except KubeApiError as e:
            if e.status == 404:  # a kind the cluster does not serve (LeaderWorkerSet without its CRD): none exist
                continue
            result.errors.append(f"listing {kind}: {e.status} {e.reason}: {e.message}")
            continue
        for obj in existing:
            name = obj["metadata"]["name"]
            if (kind, name) in keep or not owned_by(obj, cfg.uid) or (spare is not None and spare(kind, obj)):
                continue
            try:
                await client.delete(api_version, kind, cfg.namespace, name)
                result.deleted.append(f"{kind} {name}")
            except KubeApiError as e:
                result.errors.append(f"{kind} {name}: {e.status} {e.reason}: {e.message}")


async def observe_children(client: KubeClient, cfg: ServiceConfig) -> dict[tuple[str, str], dict]:
    """The live workloads (Deployments; StatefulSets and LeaderWorkerSets of worker groups) and Services of the
    service, keyed ``(kind, name)``."""
    selector = ",".join(f"{k}={v}" for k, v in sorted(instance_labels(cfg).items()))
    out: dict[tuple[str, str], dict] = {}
    kinds = [("apps/v1", "Deployment"), ("v1", "Service")]
    if any_grouped(cfg):
        kinds += [("apps/v1", "StatefulSet"), (LWS_API_VERSION, LWS_KIND)]
    for api_version, kind in kinds:
        try:
            listed = await client.list(api_version, kind, cfg.namespace, selector)
        except KubeApiError as e:
            if e.status == 404 and kind == LWS_KIND:  # the cluster has no LeaderWorkerSet CRD
                continue
            raise
        for obj in listed:
            if owned_by(obj, cfg.uid):
                out[(kind, obj["metadata"]["name"])] = obj
    return out
