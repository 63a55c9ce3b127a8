"""Typed fields for the InferenceService API: one source for parsing *and* the CRD schema.

Each API type is a frozen dataclass whose fields are declared with
:func:`api_field` (description, enum, bounds, pattern, default).  From those
declarations this module derives

* :func:`openapi_schema` — the structural OpenAPI v3 schema of the CRD
  (every property has a ``description``; enums, minimums, defaults, CEL
  rules from the class' ``__cel__`` attribute), and
* :func:`parse` — JSON (the custom resource's ``spec``) -> dataclass
  instance, collecting *every* problem as ``"spec.decode.replicas: must be
  >= 0 (got -1)"`` instead of stopping at the first.

JSON names are the camelCase forms of the Python names (``tensor_parallel_size``
-> ``tensorParallelSize``).  Kubernetes-native shapes the operator only passes
through (resources, tolerations, affinity, env) are declared with
``kube="..."`` and kept as plain JSON.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import MISSING, dataclass, field
from typing import Any, Optional, Union

# Kubernetes-native shapes kept as raw JSON (schema below, passed to pods unchanged).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
    "pattern": QUANTITY_PATTERN,
}
KUBE_SCHEMAS: dict[str, dict[str, Any]] = {
    "resources": {
        "type": "object",
        "properties": {
            "limits": {
                "type": "object",
                "additionalProperties": dict(_QUANTITY),
                "description": "Most of each resource a container may use, e.g. cpu: 8, memory: 64Gi, nvidia.com/gpu: 1.",
            },
            "requests": {
                "type": "object",
                "additionalProperties": dict(_QUANTITY),
                "description": "Resources the scheduler reserves for each container.",
            },
        },
    },
    "tolerations": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "key": {"type": "string", "description": "Taint key the toleration applies to."},
                "operator": {
                    "type": "string",
                    "enum": ["Exists", "Equal"],
                    "description": "Exists or Equal (default Equal).",
                },
                "value": {"type": "string", "description": "Taint value matched with operator Equal."},
                "effect": {
                    "type": "string",
                    "enum": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"],
                    "description": "Taint effect to match; empty matches all effects.",
                },
                "tolerationSeconds": {
                    "type": "integer",
                    "format": "int64",
                    "description": "How long a NoExecute taint is tolerated.",
                },
            },
        },
    },
    "affinity": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    "env": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "description": "Environment variable name."},
                "value": {"type": "string", "description": "Literal value."},
                "valueFrom": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": True,
                    "description": "Source of the value (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef).",
                },
            },
        },
    },
    "int-or-string": {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True},
    "network-peers": {
        "type": "array",
        "items": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "description": "A NetworkPolicyPeer: podSelector, namespaceSelector (both: pods of those namespaces) "
            "or ipBlock.",
        },
    },
}


def api_field(
    description: str,
    default: Any = None,
    *,
    required: bool = False,
    enum: tuple | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    pattern: str | None = None,
    kube: str | None = None,
    min_items: int | None = None,
    max_length: int | None = None,
    hint: str | None = None,
) -> Any:
    """Declare one API field.

    ``default`` may be a value, a list/dict (copied per instance) or a dataclass type (instantiated);
    ``required=True`` fields have no default and are listed in the schema's ``required``.
    """
    meta = {
        "description": description,
        "enum": enum,
        "minimum": minimum,
        "maximum": maximum,
        "exclusive_minimum": exclusive_minimum,
        "exclusive_maximum": exclusive_maximum,
        "pattern": pattern,
        "kube": kube,
        "min_items": min_items,
        "max_length": max_length,
        "hint": hint,
    }
    if required:
        return field(metadata=meta)
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def json_name(py_name: str) -> str:
    head, *rest = py_name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING  # type: ignore[misc]


def _default_value(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


# ---------------------------------------------------------------- schema generation
def openapi_schema(cls: type) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of dataclass ``cls`` (its fields documented)."""
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        tp, optional = _unwrap_optional(hints[f.name])
        schema = _field_schema(tp, f.metadata)
        if _has_default(f) and not optional:
            default = _default_value(f)
            if dataclasses.is_dataclass(default):
                default = {}
            if default is not None and f.metadata.get("kube") is None:
                schema["default"] = default
        elif not _has_default(f):
            required.append(json_name(f.name))
        props[json_name(f.name)] = schema
    out: dict[str, Any] = {"type": "object", "description": _doc(cls), "properties": props}
    if required:
        out["required"] = required
    rules = getattr(cls, "__cel__", ())
    if rules:
        out["x-kubernetes-validations"] = [{"rule": r, "message": m} for r, m in rules]
    return out


def _doc(cls: type) -> str:
    return " ".join((cls.__doc__ or cls.__name__).split())


def _field_schema(tp: Any, meta: typing.Mapping[str, Any]) -> dict[str, Any]:
    kube = meta.get("kube")
    if kube is not None:
        schema = _deepcopy(KUBE_SCHEMAS[kube])
    elif dataclasses.is_dataclass(tp):
        schema = openapi_schema(tp)
        schema.pop("description", None)
    elif tp is str:
        schema = {"type": "string"}
    elif tp is bool:
        schema = {"type": "boolean"}
    elif tp is int:
        schema = {"type": "integer", "format": "int32"}
    elif tp is float:
        schema = {"type": "number"}
    elif typing.get_origin(tp) is list:
        (inner,) = typing.get_args(tp)
        schema = {"type": "array", "items": _field_schema(inner, {})}
    elif typing.get_origin(tp) is dict:
        _, inner = typing.get_args(tp)
        schema = {"type": "object", "additionalProperties": _field_schema(inner, {})}
    else:  # pragma: no cover - a programming error in the API types
        raise TypeError(f"unsupported API field type {tp!r}")
    desc = meta.get("description")
    if desc:
        schema["description"] = desc
    if meta.get("enum"):
        schema["enum"] = list(meta["enum"])
    for key, name in (("minimum", "minimum"), ("maximum", "maximum")):
        if meta.get(key) is not None:
            schema[name] = meta[key]
    if meta.get("exclusive_minimum"):
        schema["exclusiveMinimum"] = True
    if meta.get("exclusive_maximum"):
        schema["exclusiveMaximum"] = True
    if meta.get("pattern"):
        schema["pattern"] = meta["pattern"]
    if meta.get("min_items") is not None:
        schema["minItems"] = meta["min_items"]
    if meta.get("max_length") is not None:
        schema["maxLength"] = meta["max_length"]
    return schema


def _deepcopy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _deepcopy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_deepcopy(v) for v in obj]
    return obj


# ---------------------------------------------------------------- parsing
class ParseErrors(Exception):
    """Every problem found in a document, one ``"path: message"`` per entry."""

    def __init__(self, errors: list[str]):
        super().__init__("; ".join(errors))
        self.errors = list(errors)


def parse(cls: type, data: Any, path: str = "spec") -> Any:
    """JSON ``data`` -> instance of dataclass ``cls``; raises :class:`ParseErrors` listing every problem."""
    errors: list[str] = []
    value = _parse_value(cls, {}, data, path, errors)
    if errors:
        raise ParseErrors(errors)
    return value


def _parse_dataclass(cls: type, data: Any, path: str, errors: list[str]) -> Any:
    if not isinstance(data, dict):
        errors.append(f"{path}: must be an object (got {_kind(data)})")
        return None
    hints = typing.get_type_hints(cls)
    fields = {json_name(f.name): f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            errors.append(f"{path}.{key}: unknown field (known: {', '.join(sorted(fields))})")
    values: dict[str, Any] = {}
    for jname, f in fields.items():
        tp, optional = _unwrap_optional(hints[f.name])
        sub = f"{path}.{jname}"
        raw = data.get(jname, None)
        if raw is None:
            if _has_default(f):
                values[f.name] = _default_value(f)
            elif optional:
                values[f.name] = None
            else:
                errors.append(f"{sub}: required")
                values[f.name] = None
            continue
        values[f.name] = _parse_value(tp, f.metadata, raw, sub, errors)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:  # pragma: no cover - defaults always construct
        errors.append(f"{path}: {e}")
        return None


def _kind(v: Any) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }.get(type(v), type(v).__name__)


def _parse_value(tp: Any, meta: typing.Mapping[str, Any], raw: Any, path: str, errors: list[str]) -> Any:
    tp, _ = _unwrap_optional(tp)
    kube = meta.get("kube")
    if kube is not None:
        return _check_kube(kube, raw, path, errors)
    if dataclasses.is_dataclass(tp):
        return _parse_dataclass(tp, raw, path, errors)
    if typing.get_origin(tp) is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(raw, list):
            errors.append(f"{path}: must be an array (got {_kind(raw)})")
            return []
        if meta.get("min_items") is not None and len(raw) < meta["min_items"]:
            errors.append(f"{path}: needs at least {meta['min_items']} item(s)")
        return [_parse_value(inner, {}, item, f"{path}[{i}]", errors) for i, item in enumerate(raw)]
    if typing.get_origin(tp) is dict:
        _, inner = typing.get_args(tp)
        if not isinstance(raw, dict):
            errors.append(f"{path}: must be an object (got {_kind(raw)})")
            return {}
        return {str(k): _parse_value(inner, {}, v, f"{path}.{k}", errors) for k, v in raw.items()}
    return _parse_scalar(tp, meta, raw, path, errors)


def _parse_scalar(tp: Any, meta: typing.Mapping[str, Any], raw: Any, path: str, errors: list[str]) -> Any:
    if tp is bool:
        if not isinstance(raw, bool):
            errors.append(f"{path}: must be true or false (got {raw!r})")
        return raw
    if tp is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            errors.append(f"{path}: must be an integer (got {raw!r})")
            return raw
    elif tp is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            errors.append(f"{path}: must be a number (got {raw!r})")
            return raw
        raw = float(raw)
    elif tp is str:
        if not isinstance(raw, str):
            errors.append(f"{path}: must be a string (got {raw!r})")
            return raw
    enum = meta.get("enum")
    if enum and raw not in enum:
        errors.append(f"{path}: must be one of {', '.join(map(str, enum))} (got {raw!r})")
    lo, hi = meta.get("minimum"), meta.get("maximum")
    if lo is not None:
        if (meta.get("exclusive_minimum") and raw <= lo) or raw < lo:
            errors.append(f"{path}: must be {'>' if meta.get('exclusive_minimum') else '>='} {lo} (got {raw})")
    if hi is not None:
        if (meta.get("exclusive_maximum") and raw >= hi) or raw > hi:
            errors.append(f"{path}: must be {'<' if meta.get('exclusive_maximum') else '<='} {hi} (got {raw})")
    pattern = meta.get("pattern")
    if pattern and isinstance(raw, str) and not re.fullmatch(pattern, raw):
        errors.append(f"{path}: {meta.get('hint') or 'must match ' + pattern} (got {raw!r})")
    if meta.get("max_length") is not None and isinstance(raw, str) and len(raw) > meta["max_length"]:
        errors.append(f"{path}: longer than {meta['max_length']} characters")
    return raw


_QUANTITY_RE = re.compile(KUBE_SCHEMAS["resources"]["properties"]["limits"]["additionalProperties"]["pattern"])


def _check_kube(kube: str, raw: Any, path: str, errors: list[str]) -> Any:
    """Shape checks of the pass-through Kubernetes fields (the API server checks the rest)."""
    if kube == "int-or-string":
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            errors.append(f"{path}: must be an integer or a string (got {raw!r})")
        return raw
    schema = KUBE_SCHEMAS[kube]
    want = schema["type"]
    if (want == "object" and not isinstance(raw, dict)) or (want == "array" and not isinstance(raw, list)):
        errors.append(f"{path}: must be an {want} (got {_kind(raw)})")
        return {} if want == "object" else []
    if kube == "resources":
        for part, items in raw.items():
            if part not in ("limits", "requests"):
                errors.append(f"{path}.{part}: unknown field (known: limits, requests)")
                continue
            if not isinstance(items, dict):
                errors.append(f"{path}.{part}: must be an object (got {_kind(items)})")
                continue
            for res, qty in items.items():
                if isinstance(qty, bool) or not isinstance(qty, (int, str)) or not _QUANTITY_RE.match(str(qty)):
                    errors.append(f"{path}.{part}.{res}: {qty!r} is not a Kubernetes quantity")
    elif kube in ("env", "tolerations", "network-peers"):
        for i, item in enumerate(raw):
            if not isinstance(item, dict):
                errors.append(f"{path}[{i}]: must be an object (got {_kind(item)})")
            elif kube == "env" and not isinstance(item.get("name"), str):
                errors.append(f"{path}[{i}].name: required")
    return raw


def to_json(obj: Any) -> Any:
    """Dataclass instance -> JSON with camelCase keys, ``None`` fields left out."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is not None:
                out[json_name(f.name)] = to_json(v)
        return out
    if isinstance(obj, list):
        return [to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    return obj


__all__ = [
    "api_field",
    "openapi_schema",
    "parse",
    "ParseErrors",
    "to_json",
    "json_name",
    "KUBE_SCHEMAS",
    "dataclass",
    "Optional",
]
