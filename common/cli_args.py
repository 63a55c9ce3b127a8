"""Argparse built from frozen config dataclasses: one ``--flag`` per field.

A field declared with :func:`opt` carries its help text (and optional
``choices`` / ``nargs`` / ``flag`` name) in its metadata;
:func:`add_dataclass_arguments` turns every field into a flag
(``max_running_requests`` -> ``--max-running-requests``; booleans get
``--x`` / ``--no-x``) and :func:`dataclass_from_namespace` builds the
dataclass back from the parsed namespace.  A field with ``metadata["cli"] is
False`` or ``init=False`` gets no flag.

Standard library only: the router and the operator use it without the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import field
from typing import Any, Sequence


def opt(
    default: Any, help: str, *, choices: Sequence[Any] | None = None, nargs: str | None = None, flag: str | None = None
) -> Any:
    """A dataclass field carrying its CLI help text (and optional choices)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = list(choices)
    if nargs is not None:
        meta["nargs"] = nargs
    if flag is not None:
        meta["flag"] = flag
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--flag`` per field of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False:
            continue
        name = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f.metadata.get("help", "")
        kwargs: dict[str, Any] = {"dest": f.name, "default": default}
        if tp is bool:
            parser.add_argument(name, action=argparse.BooleanOptionalAction, help=help_text, **kwargs)
            continue
        origin = typing.get_origin(tp)
        if origin in (list, tuple):
            inner = typing.get_args(tp)[0] if typing.get_args(tp) else str
            kwargs["type"] = inner
            kwargs["nargs"] = f.metadata.get("nargs", "*")
        else:
            kwargs["type"] = tp if tp in (int, float, str) else str
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if default not in (None, [], ()) and tp is not bool:
            help_text = f"{help_text} (default: {default})"
        parser.add_argument(name, help=help_text, **kwargs)


def dataclass_from_namespace(cls: type, ns: argparse.Namespace, **overrides: Any) -> Any:
    """``cls`` built from the parsed flags its fields name (lists become tuples where the field is a tuple)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(ns, f.name)}
    for k, v in list(values.items()):
        if isinstance(v, list) and typing.get_origin(_base_type(typing.get_type_hints(cls)[k])) is tuple:
            values[k] = tuple(v)
    values.update(overrides)
    return cls(**values)
