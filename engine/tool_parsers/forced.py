"""``tool_choice`` "required" and a named function (docs/api.md, "Tool calling").

Both are enforced with the structured-output path (xgrammar, JSON schema): the
model writes plain JSON and these parsers read it, whatever the model family.

* named function ``f``: the output is ``f``'s arguments object (its
  ``parameters`` schema); the call's name is known from the first token, so
  the arguments stream as they are written.
* ``required``: the output is a JSON array of ``{"name": ..., "arguments": {...}}``
  objects, one per call (``minItems`` 1; ``maxItems`` 1 with
  ``parallel_tool_calls`` false), each name one of the offered functions with
  its own ``parameters`` schema; a call is sent when its object is complete.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from kvship.engine.tool_parsers.base import Scan, ToolCall, ToolParser, call_from_obj

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def function_schema(tool: dict) -> dict:
    """The ``parameters`` schema of an offered tool (any object when it has none)."""
    params = (tool.get("function") or {}).get("parameters")
    return params if isinstance(params, dict) and params else ANY_OBJECT


def required_schema(tools: list[dict], parallel: bool) -> dict:
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": function_schema(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items} if len(items) > 1 else items[0]}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedParser(ToolParser):
    """The output is the arguments of ``name``."""

    def __init__(self, name: str):
        self.name = name

    def scan(self, text: str, final: bool) -> Scan:
        args = text.strip()
        if final:
            return Scan("", [ToolCall(self.name, args)]) if args else Scan()
        return Scan(partial=ToolCall(self.name, args)) if args else Scan()


class RequiredParser(ToolParser):
    """The output is a JSON array of calls; complete items are calls as soon as they are closed."""

    def scan(self, text: str, final: bool) -> Scan:
        calls, _ = _items(text)
        if final and not calls:
            return Scan(text)  # cut before the first call closed (max_tokens): the text as written
        return Scan("", calls)


def _items(text: str) -> tuple[list[ToolCall], bool]:
    dec = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if not text.startswith("[", i):
        return [], False
    i += 1
    calls: list[ToolCall] = []
    while True:
        i = _skip_ws(text, i)
        if calls:
            if text.startswith("]", i):
                return calls, True
            if not text.startswith(",", i):
                return calls, False
            i = _skip_ws(text, i + 1)
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return calls, False
        call: Optional[ToolCall] = call_from_obj(obj)
        if call is None:
            return calls, False
        calls.append(call)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
