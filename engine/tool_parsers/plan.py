"""What a chat request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` mean for the worker
(docs/api.md, "Tool calling"): the tools the chat template sees, the output constraint, and the parser
that reads each choice's output.

=================  ===================  ==========================  ====================================
tool_choice        template's tools     output constraint           parser
=================  ===================  ==========================  ====================================
none (no tools)    none                 response_format, if any     none
auto (tools)       the tools            response_format, if any     ``--tool-call-parser`` (none: text)
required           the tools            JSON array of calls         ``RequiredParser``
{function: f}      the tools            ``f``'s parameters schema   ``NamedParser(f)``
=================  ===================  ==========================  ====================================

``parallel_tool_calls: false`` keeps the first call (``required``: the
array holds at most one).  Invalid combinations are 400s naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvship.engine.http_errors import bad_request
from kvship.engine.tool_parsers.base import Scan, ToolParser
from kvship.engine.tool_parsers.families import PARSERS
from kvship.engine.tool_parsers.forced import NamedParser, RequiredParser, function_schema, required_schema


@dataclass(frozen=True)
class ToolPlan:
    template_tools: Optional[list[dict]] = None
    json_schema: Optional[str] = None  # the forced call's output constraint
    parser: Optional[Callable[[], ToolParser]] = None  # one parser per choice (None: the output is text)
    keep_special_tokens: bool = False


class FirstCallOnly(ToolParser):
    """``parallel_tool_calls: false`` under ``auto``: the first call; later ones are dropped."""

    def __init__(self, inner: ToolParser):
        self.inner = inner
        self.keep_special_tokens = inner.keep_special_tokens

    def scan(self, text: str, final: bool) -> Scan:
        s = self.inner.scan(text, final)
        return Scan(s.content, s.calls[:1], s.partial if not s.calls else None)


def _check_tools(tools: Any) -> list[dict]:
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request("each tool must be {'type': 'function', 'function': {...}}", f"tools.{i}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("a function needs a non-empty 'name'", f"tools.{i}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request("'parameters' must be a JSON schema object", f"tools.{i}.function.parameters")
        if name in names:
            raise bad_request(f"function {name!r} is offered twice", f"tools.{i}.function.name")
        names.add(name)
    return tools


def plan_tools(
    tools: Optional[list[dict]],
    tool_choice: Any,
    parallel: Optional[bool],
    family: Optional[str],
    has_response_format: bool,
) -> ToolPlan:
    """The plan of one request; ``family`` is ``--tool-call-parser``."""
    tools = _check_tools(tools) if tools else None
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    one = parallel is False
    if choice == "none":
        return ToolPlan()
    if choice == "auto":
        if not tools or family is None:
            return ToolPlan(template_tools=tools)
        make = PARSERS[family]
        return ToolPlan(
            template_tools=tools,
            parser=(lambda: FirstCallOnly(make())) if one else make,
            keep_special_tokens=make().keep_special_tokens,
        )
    if not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if has_response_format:
        raise bad_request("give response_format or a forced tool_choice, not both", "response_format")
    if choice == "required":
        schema = required_schema(tools, parallel=not one)
        return ToolPlan(template_tools=tools, json_schema=json.dumps(schema), parser=RequiredParser)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                "tool_choice",
            )
        tool = next((t for t in tools if t["function"]["name"] == name), None)
        if tool is None:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan(
            template_tools=tools,
            json_schema=json.dumps(function_schema(tool)),
            parser=lambda: NamedParser(name),
        )
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")


def template_messages(messages: list[dict]) -> list[dict]:
    """``messages`` for the chat template: an assistant turn's ``tool_calls[].function.arguments`` arrive
    from OpenAI clients as JSON text; templates write them with ``tojson``, so they get the object (text
    that is not a JSON object is left as it is)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list) and any(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
            m = {**m, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(m)
    return out


def _call_for_template(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call
