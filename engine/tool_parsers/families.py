"""The call markup of the model families kvship serves (docs/api.md, "Tool calling").

* ``hermes`` / ``qwen25`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  several per turn, text before them.
* ``llama3`` (Llama 3.1 / 3.2 JSON tool calling): the whole answer is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several separated by ``;``.
* ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (and the newer
  ``[TOOL_CALLS]name[ARGS]{...}``), text before it.
* ``deepseekv3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`` (V3.1: ``name<｜tool▁sep｜>{...}`` in the block).
"""

from __future__ import annotations

import re
from typing import Callable, Optional

from kvship.engine.tool_parsers.base import (
    Scan,
    ToolCall,
    ToolParser,
    call_from_json_streamed,
    call_from_obj,
    held_prefix,
    json_call_partial,
    json_values,
)


class TaggedParser(ToolParser):
    """Calls in ``call_start ... call_end`` blocks, the first opened by ``outer_start`` (defaults to
    ``call_start``); ``outer`` markers between blocks are dropped.  Calls are sent as each block closes, or,
    with ``partial``, from when the open block's call is named (its arguments in fragments)."""

    def __init__(
        self,
        call_start: str,
        call_end: str,
        body: Callable[[str], Optional[ToolCall]],
        outer: tuple[str, ...] = (),
        partial: Optional[Callable[[str], Optional[ToolCall]]] = None,
    ):
        self.call_start, self.call_end, self.body, self.outer = call_start, call_end, body, outer
        self.partial = partial  # the call an unclosed block is writing, once its name is known (streamed)
        self.first = outer[0] if outer else call_start

    def scan(self, text: str, final: bool) -> Scan:
        i = text.find(self.first)
        if i < 0 and self.first != self.call_start:
            i = text.find(self.call_start)
        if i < 0:
            return Scan(text if final else text[: held_prefix(text, (self.first, self.call_start))])
        head, calls, extra = text[:i], [], []
        pos = i
        while True:
            j = text.find(self.call_start, pos)
            between = text[pos : len(text) if j < 0 else j]
            if j < 0:
                if not final:
                    return Scan(head, calls)
                extra.append(between)
                break
            extra.append(between)
            k = text.find(self.call_end, j + len(self.call_start))
            if k < 0:
                if not final:
                    body = text[j + len(self.call_start) :]
                    body = body[: held_prefix(body, (self.call_end,))]  # a tail that may close the block waits
                    open_call = self.partial(body) if self.partial else None
                    return Scan(head, calls, open_call)
                call = self.body(text[j + len(self.call_start) :])  # the model stopped before closing the block
                if call is None:
                    extra.append(text[j:])
                else:
                    calls.append(call)
                break
            call = self.body(text[j + len(self.call_start) : k])
            if call is None:
                extra.append(text[j : k + len(self.call_end)])
            else:
                calls.append(call)
            pos = k + len(self.call_end)
        if not calls:
            return Scan(text)
        rest = []
        for piece in extra:
            for m in self.outer:
                piece = piece.replace(m, "")
            if piece.strip():
                rest.append(piece)
        return Scan(head + "".join(rest), calls)


class Llama3Parser(ToolParser):
    """The whole answer is the call(s); anything else makes it plain text."""

    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        s = text.lstrip()
        candidate = s.startswith(self.TAG) or s.startswith("{")
        if not final:
            if candidate or self.TAG.startswith(s):
                return Scan()
            return Scan(text)
        if not candidate:
            return Scan(text)
        body = s[len(self.TAG) :] if s.startswith(self.TAG) else s
        values = json_values(body, ";")
        calls = [call_from_obj(v, ("parameters", "arguments")) for v in values or []]
        if not calls or any(c is None for c in calls):
            return Scan(text)
        return Scan("", [c for c in calls if c is not None])


class MistralParser(ToolParser):
    MARK = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    keep_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        i = text.find(self.MARK)
        if i < 0:
            return Scan(text if final else text[: held_prefix(text, (self.MARK,))])
        if not final:
            return Scan(text[:i])
        calls = self._calls(text[i:])
        return Scan(text[:i], calls) if calls else Scan(text)

    def _calls(self, tail: str) -> Optional[list[ToolCall]]:
        parts = [p for p in tail.split(self.MARK) if p.strip()]
        out: list[ToolCall] = []
        for p in parts:
            if self.ARGS in p:  # name[ARGS]{...}
                name, _, args = p.partition(self.ARGS)
                call = call_from_obj({"name": name.strip(), "arguments": _one_json(args)})
                if call is None:
                    return None
                out.append(call)
                continue
            values = json_values(p)
            if values is None or len(values) != 1:
                return None
            items = values[0] if isinstance(values[0], list) else [values[0]]
            for item in items:
                call = call_from_obj(item)
                if call is None:
                    return None
                out.append(call)
        return out or None


def _one_json(text: str) -> object:
    values = json_values(text)
    return values[0] if values and len(values) == 1 else None


_DS_V3 = re.compile(r"^\s*(\w+)<｜tool▁sep｜>(.+?)\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)
_DS_V31 = re.compile(r"^\s*(.+?)<｜tool▁sep｜>(.*)$", re.DOTALL)


def _deepseek_call(block: str) -> Optional[ToolCall]:
    m = _DS_V3.match(block)
    if m:
        return call_from_obj({"name": m.group(2).strip(), "arguments": _one_json(m.group(3))})
    m = _DS_V31.match(block)
    if m:
        return call_from_obj({"name": m.group(1).strip(), "arguments": _one_json(m.group(2))})
    return None


def _hermes_call(block: str) -> Optional[ToolCall]:
    return call_from_json_streamed(block.strip())


def hermes() -> ToolParser:
    return TaggedParser("<tool_call>", "</tool_call>", _hermes_call, partial=json_call_partial)


def deepseekv3() -> ToolParser:
    p = TaggedParser(
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        _deepseek_call,
        outer=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    )
    p.keep_special_tokens = True
    return p


PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": hermes,
    "qwen25": hermes,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "deepseekv3": deepseekv3,
}


# what each family's chat template writes about its markup (--tool-call-parser auto)
_TEMPLATE_MARKERS = {
    "qwen25": "<tool_call>",
    "llama3": "<|python_tag|>",
    "mistral": "[TOOL_CALLS]",
    "deepseekv3": "tool▁calls▁begin",
}


def detect_family(template: Optional[str]) -> Optional[str]:
    """The parser a chat template's markup names, when exactly one family's marker is in it."""
    found = [name for name, marker in _TEMPLATE_MARKERS.items() if template and marker in template]
    return found[0] if len(found) == 1 else None
