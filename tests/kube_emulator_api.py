"""Pure helpers of tests/kube_emulator.py: paths, errors, selectors, patches, schemas, tables.

Each follows the Kubernetes API conventions closely enough for kopf, kubectl
and the ``kubernetes`` client; none does I/O.
"""

from __future__ import annotations

import copy
import datetime
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import jsonschema


class ApiError(Exception):
    """An API failure rendered as a ``Status`` object with ``code`` and ``reason``."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        name: str = "",
        kind: str = "",
        causes: Optional[list[dict]] = None,
    ):
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason, self.message = code, reason, message
        self.name, self.kind, self.causes = name, kind, causes or []


def status_body(e: ApiError) -> dict:
    details: dict[str, Any] = {}
    if e.name:
        details["name"] = e.name
    if e.kind:
        details["kind"] = e.kind
    if e.causes:
        details["causes"] = e.causes
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": e.message,
        "reason": e.reason,
        "details": details,
        "code": e.code,
    }


@dataclass(frozen=True)
class Target:
    group: str
    version: Optional[str]
    plural: Optional[str]
    namespace: Optional[str]
    name: Optional[str]
    subresource: Optional[str]


def parse_path(path: str) -> Optional[Target]:
    """``/api/v1/namespaces/ns/pods/p/status`` -> Target; ``None`` for non-resource paths (discovery root)."""
    parts = [p for p in path.strip("/").split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 2 and parts[0] == "apis":
        group, version, rest = parts[1], (parts[2] if len(parts) >= 3 else None), parts[3:]
    else:
        return None
    if not rest:
        return Target(group, version, None, None, None, None)
    namespace = None
    # /namespaces/NS/<plural>... but /namespaces, /namespaces/NAME and /namespaces/NAME/{status,finalize}
    # address Namespace objects themselves.
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    sub = "/".join(rest[2:]) or None
    return Target(group, version, plural, namespace, name, sub)


def gv_of(group: str, version: Optional[str]) -> str:
    return f"{group}/{version}" if group else str(version)


def discovery_entry(plural: str, info: Any) -> list[dict]:
    main = {
        "name": plural,
        "singularName": info.singular or plural,
        "namespaced": bool(info.namespaced),
        "kind": info.kind or plural.capitalize(),
        "verbs": sorted(info.verbs or {"get", "list", "watch", "create", "update", "patch", "delete"}),
    }
    if info.shortnames:
        main["shortNames"] = sorted(info.shortnames)
    if info.categories:
        main["categories"] = sorted(info.categories)
    out = [main]
    for sub in sorted(info.subresources or ()):
        out.append(
            {
                "name": f"{plural}/{sub}",
                "singularName": "",
                "namespaced": bool(info.namespaced),
                "kind": info.kind or plural.capitalize(),
                "verbs": ["get", "patch", "update"],
            }
        )
    return out


# ---------------------------------------------------------------- selectors
_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(selector: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return [p.strip() for p in out if p.strip()]


def select_labels(obj: dict, selector: str) -> bool:
    """Kubernetes label selector: ``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x)``, ``a``, ``!a``."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in _split_selector(selector or ""):
        m = _SET_RE.match(term)
        if m:
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",") if v.strip()}
            if op == "in" and labels.get(key) not in values:
                return False
            if op == "notin" and key in labels and labels[key] in values:
                return False
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def select_fields(obj: dict, selector: str) -> bool:
    """Field selectors (= and !=) on ``metadata.name`` / ``metadata.namespace`` and, for Events (what
    ``kubectl describe`` asks for), ``involvedObject.*`` / ``reason`` / ``type``."""
    meta = obj.get("metadata") or {}
    for term in _split_selector(selector or ""):
        neg = "!=" in term
        key, value = (s.strip() for s in term.replace("==", "=").split("!=" if neg else "=", 1))
        field = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace")}.get(key)
        if key.startswith("involvedObject.") or key in ("reason", "type"):
            found = obj
            for part in key.split("."):
                found = found.get(part) if isinstance(found, dict) else None
            field = "" if found is None else str(found)  # an absent field selects as empty, as on a server
        if (field == value) == neg:
            return False
    return True


# ---------------------------------------------------------------- patches
def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (``null`` deletes a key; lists are replaced)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


# Merge keys of the built-in list fields strategic merge patches merge item by item (as the API server's Go types
# declare them with patchMergeKey); other lists are replaced, as in a JSON merge patch.
MERGE_KEYS = {
    "conditions": "type",
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "readinessGates": "conditionType",
    "tolerations": "key",
    "imagePullSecrets": "name",
}


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A strategic merge patch: like :func:`merge_patch`, but the lists of :data:`MERGE_KEYS` are merged by their
    key (an item of the patch replaces-by-merge the item with the same key, or is appended)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif key in MERGE_KEYS and isinstance(value, list) and isinstance(out.get(key), list):
            mk = MERGE_KEYS[key]
            merged = [copy.deepcopy(item) for item in out[key]]
            for item in value:
                if not isinstance(item, dict) or mk not in item:
                    merged = copy.deepcopy(value)
                    break
                at = next(
                    (i for i, old in enumerate(merged) if isinstance(old, dict) and old.get(mk) == item[mk]), None
                )
                if at is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merged[at] = strategic_merge_patch(merged[at], item)
            out[key] = merged
        else:
            out[key] = strategic_merge_patch(out.get(key), value)
    return out


def pod_readiness(pod: dict) -> Optional[dict]:
    """What the kubelet reports for a pod with readiness gates: ``Ready`` is True only when ``ContainersReady`` is
    True and every gate's condition is True.  ``None`` when the pod has no gates or no ContainersReady yet."""
    gates = [g.get("conditionType") for g in (pod.get("spec") or {}).get("readinessGates") or []]
    conds = {c.get("type"): c for c in (pod.get("status") or {}).get("conditions") or [] if isinstance(c, dict)}
    if not gates or "ContainersReady" not in conds:
        return None
    if conds["ContainersReady"].get("status") != "True":
        return {"status": "False", "reason": "ContainersNotReady", "message": "containers are not ready"}
    missing = [g for g in gates if (conds.get(g) or {}).get("status") != "True"]
    if missing:
        return {
            "status": "False",
            "reason": "ReadinessGatesNotReady",
            "message": "corresponding condition of pod readiness gate "
            + ", ".join(f'"{g}"' for g in missing)
            + " does not exist or is not True",
        }
    return {"status": "True", "reason": "", "message": ""}


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for p in parts:
        if isinstance(doc, list):
            doc = doc[int(p)]
        elif isinstance(doc, dict):
            doc = doc[p]
        else:
            raise KeyError(p)
    return doc


def apply_json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch; a failed ``test`` or a bad path answers 422 like the API server."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "a JSON patch must be an array of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, parts = op.get("op"), _pointer(op.get("path", ""))
        try:
            if kind == "test":
                if _walk(doc, parts) != op.get("value"):
                    raise ApiError(
                        422,
                        "Invalid",
                        f"the server rejected our request due to an error in our "
                        f"request: testing value {op.get('path')} failed",
                    )
                continue
            if kind in ("move", "copy"):
                value = copy.deepcopy(_walk(doc, _pointer(op["from"])))
                if kind == "move":
                    doc = _remove(doc, _pointer(op["from"]))
                doc = _add(doc, parts, value)
            elif kind == "add":
                doc = _add(doc, parts, copy.deepcopy(op.get("value")))
            elif kind == "remove":
                doc = _remove(doc, parts)
            elif kind == "replace":
                _walk(doc, parts)  # must exist
                doc = _add(_remove(doc, parts), parts, copy.deepcopy(op.get("value")))
            else:
                raise ApiError(422, "Invalid", f"unknown JSON patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f"JSON patch {kind} {op.get('path')}: {e!r}")
    return doc


def _add(doc: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    parent = _walk(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, list):
        parent.insert(len(parent) if last == "-" else int(last), value)
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise KeyError(last)
    return doc


def _remove(doc: Any, parts: list[str]) -> Any:
    parent = _walk(doc, parts[:-1])
    if isinstance(parent, list):
        parent.pop(int(parts[-1]))
    else:
        del parent[parts[-1]]
    return doc


# ---------------------------------------------------------------- structural schemas
def schema_defaults_prune(obj: Any, schema: dict) -> Any:
    """Apply ``default`` values and drop fields the schema does not know (as the API server does)."""
    if isinstance(obj, dict) and schema.get("type") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            props = schema.get("properties") or {}
            out = dict(obj)
        else:
            props = schema.get("properties")
            addl = schema.get("additionalProperties")
            if props is None and isinstance(addl, dict):
                return {k: schema_defaults_prune(v, addl) for k, v in obj.items()}
            if props is None:
                return obj if schema.get("x-kubernetes-preserve-unknown-fields") else {}
            out = {k: v for k, v in obj.items() if k in props or k in ("apiVersion", "kind", "metadata")}
        for key, sub in (props or {}).items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out and key != "metadata":
                out[key] = schema_defaults_prune(out[key], sub)
        return out
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [schema_defaults_prune(v, schema["items"]) for v in obj]
    return obj


def validate_schema(obj: dict, schema: dict, kind: str, name: str) -> None:
    """JSON-schema checks (types, enums, bounds, patterns, required): 422 Invalid listing the causes."""
    body = {k: v for k, v in obj.items() if k != "metadata"}
    sch = dict(schema)
    sch["properties"] = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    errors = sorted(jsonschema.Draft4Validator(sch).iter_errors(body), key=lambda e: list(e.path))
    if errors:
        causes = [
            {"reason": "FieldValueInvalid", "field": ".".join(str(p) for p in e.path), "message": e.message}
            for e in errors
        ]
        msg = "; ".join(f"{c['field']}: {c['message']}" for c in causes)
        raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {msg}', name=name, kind=kind, causes=causes)


# ---------------------------------------------------------------- tables (kubectl get)
def human_age(timestamp: str, now: Optional[datetime.datetime] = None) -> str:
    """``2024-01-01T00:00:00Z`` -> ``5s`` / ``3m`` / ``2h`` / ``4d`` like kubectl."""
    try:
        then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    except (TypeError, ValueError):
        return "<unknown>"
    secs = int(((now or datetime.datetime.now(datetime.timezone.utc)) - then).total_seconds())
    if secs < 120:
        return f"{max(secs, 0)}s"
    if secs < 3600 * 3:
        return f"{secs // 60}m"
    if secs < 86400 * 2:
        return f"{secs // 3600}h"
    return f"{secs // 86400}d"


def json_path(obj: Any, path: str) -> Any:
    """The simple JSONPath of printer columns: ``.status.phase``, ``.spec.items[0].name``."""
    cur = obj
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            idx = int(part[1:-1])
            cur = cur[idx] if isinstance(cur, list) and idx < len(cur) else None
        else:
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur is None:
            return None
    return cur


def table_for(emulator: Any, t: Target, items: list[dict], rv: int) -> dict:
    """A ``meta.k8s.io/v1`` Table: Name, the CRD's printer columns (or Age for builtins)."""
    crd = emulator._crds.get((t.group, t.plural))
    columns = [
        {
            "name": "Name",
            "type": "string",
            "format": "name",
            "priority": 0,
            "description": "Name must be unique within a namespace.",
        }
    ]
    printer: list[dict] = []
    if crd is not None:
        ver = next(v for v in crd["spec"]["versions"] if v["name"] == t.version)
        printer = ver.get("additionalPrinterColumns") or []
    else:
        printer = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    for col in printer:
        columns.append(
            {
                "name": col["name"],
                "type": col["type"],
                "format": col.get("format", ""),
                "priority": col.get("priority", 0),
                "description": col.get("description", ""),
            }
        )
    rows = []
    for obj in items:
        cells: list[Any] = [obj["metadata"]["name"]]
        for col in printer:
            value = json_path(obj, col["jsonPath"])
            if col["type"] == "date":
                value = human_age(value) if value else "<unknown>"
            cells.append(value)
        meta = obj["metadata"]
        rows.append(
            {
                "cells": cells,
                "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": meta},
            }
        )
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": str(rv)},
        "columnDefinitions": columns,
        "rows": rows,
    }


# ---------------------------------------------------------------- OpenAPI v3 (kubectl explain)
def openapi_document(crds: dict, path: str) -> Optional[dict]:
    """``/openapi/v3`` (index) or ``/openapi/v3/apis/G/V`` built from the CRDs; ``None`` when unknown."""
    if path.rstrip("/") == "/openapi/v3":
        paths = {}
        for (g, _), crd in crds.items():
            for v in crd["spec"]["versions"]:
                paths[f"apis/{g}/{v['name']}"] = {"serverRelativeURL": f"/openapi/v3/apis/{g}/{v['name']}"}
        return {"paths": paths}
    parts = path.strip("/").split("/")  # openapi v3 apis G V
    if len(parts) == 5 and parts[2] == "apis":
        g, v = parts[3], parts[4]
        schemas, paths = {}, {}
        for (cg, plural), crd in crds.items():
            if cg != g:
                continue
            names = crd["spec"]["names"]
            for ver in crd["spec"]["versions"]:
                if ver["name"] != v:
                    continue
                rev = ".".join(reversed(g.split(".")))
                sch = copy.deepcopy(ver["schema"]["openAPIV3Schema"])
                gvk = {"group": g, "version": v, "kind": names["kind"]}
                sch["x-kubernetes-group-version-kind"] = [gvk]
                ref = f"{rev}.{v}.{names['kind']}"
                schemas[ref] = sch
                ns = "/namespaces/{namespace}" if crd["spec"].get("scope", "Namespaced") == "Namespaced" else ""
                get = {
                    "x-kubernetes-action": "get",
                    "x-kubernetes-group-version-kind": gvk,
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}},
                        }
                    },
                }
                paths[f"/apis/{g}/{v}{ns}/{plural}/{{name}}"] = {"get": get}
        if schemas:
            return {
                "openapi": "3.0.0",
                "info": {"title": "Kubernetes", "version": "v1.35.0"},
                "paths": paths,
                "components": {"schemas": schemas},
            }
    return None


def as_scale(obj: dict) -> dict:
    """An autoscaling/v1 Scale view of a Deployment-like object (the ``/scale`` subresource)."""
    sel = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {
            k: obj["metadata"][k]
            for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if k in obj["metadata"]
        },
        "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 1)},
        "status": {
            "replicas": (obj.get("status") or {}).get("replicas", 0),
            "selector": ",".join(f"{k}={v}" for k, v in sorted(sel.items())),
        },
    }


def find_tool(name: str) -> Optional[str]:
    """``kubectl`` / ``helm`` from .tools/bin (installed by .ci/install-k8s-tools.sh) or PATH."""
    import shutil

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".tools", "bin", name)
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    found = shutil.which(name)
    if found and name == "kubectl" and "google-cloud-sdk" in os.path.realpath(found):
        return None  # gcloud's dispatcher shim, not a plain kubectl
    return found
