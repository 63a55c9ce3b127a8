"""The tool-call parser interface (docs/api.md, "Tool calling").

A parser reads the text a model wrote for one chat choice and splits it into
``content`` and complete tool calls.  It is a pure function of the text, which
keeps streaming and non-streaming answers equal: the streamer
(``kvship.engine.tool_parsers.stream``) calls ``scan`` on the text so far and
sends what grew.

Contract of ``ToolParser.scan(text, final)``:

* ``final=True``: the whole output.  Everything is decided; a call that does
  not parse (bad JSON, a missing name, an unclosed block) stays in ``content``
  as the model wrote it.
* ``final=False``: a prefix of the output.  Whatever it returns must hold for
  every continuation: ``content`` is a prefix of the content, ``calls`` a
  prefix of the calls, and ``partial`` (a call still being written) a call
  whose name is final and whose ``arguments`` is a prefix of its final
  arguments; it is the call right after ``calls``.  A parser that cannot tell
  yet returns less (markup is held back, never sent as content).
"""

from __future__ import annotations

import abc
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class Scan:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    partial: Optional[ToolCall] = None


class ToolParser(abc.ABC):
    """One model family's call markup.  ``keep_special_tokens``: its markers are special tokens, so the
    output is detokenized with them (``skip_special_tokens`` false) while tools are offered."""

    keep_special_tokens = False

    @abc.abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """See the module docstring."""


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of ``text`` without its longest tail that could still grow into one of ``markers``."""
    cut = len(text)
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


def call_from_obj(obj: Any, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> Optional[ToolCall]:
    """A call from ``{"name": str, "arguments"|"parameters": object}`` (arguments may be a JSON string), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for k in arg_keys:
        if k in obj:
            args = obj[k]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def call_from_json(text: str) -> Optional[ToolCall]:
    try:
        return call_from_obj(json.loads(text))
    except ValueError:
        return None


def json_values(text: str, sep: str = "") -> Optional[list[Any]]:
    """The JSON values ``text`` holds one after another (optionally separated by ``sep``), or None."""
    dec = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i == n:
            return out or None
        if out and sep:
            if not text.startswith(sep, i):
                return None
            i += len(sep)
            while i < n and text[i].isspace():
                i += 1
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


# ``{"name": "f", "arguments": {`` (the name first, then the arguments object): such a call's arguments stream
# as the model writes them (docs/api.md, "Tool calling", Streaming)
_NAMED_ARGS = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


def _object_end(text: str, start: int) -> Optional[int]:
    """The end of the JSON object opening at ``text[start]`` (``{``), or None while it is not closed."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def json_call_partial(body: str) -> Optional[ToolCall]:
    """The call a JSON body being written names, with the arguments written so far as the model wrote them,
    once the name is known and the arguments object has begun (``_NAMED_ARGS``); else None."""
    m = _NAMED_ARGS.match(body)
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
    except ValueError:
        return None
    if not name:
        return None
    end = _object_end(body, m.end())
    return ToolCall(name, body[m.end() : len(body) if end is None else end])


def call_from_json_streamed(text: str) -> Optional[ToolCall]:
    """``call_from_json``, except that a call in ``_NAMED_ARGS`` order keeps its arguments as the model wrote
    them (so the fragments streamed by ``json_call_partial`` add up to them)."""
    call = call_from_json(text)
    if call is None:
        return None
    partial = json_call_partial(text)
    if partial is None or partial.name != call.name:
        return call
    return ToolCall(call.name, partial.arguments)
