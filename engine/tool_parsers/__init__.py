"""Tool calling for ``/v1/chat/completions`` (docs/api.md, "Tool calling").

* ``base``: the parser contract (``ToolParser.scan``) and ``ToolCall``.
* ``families``: each model family's markup, by ``--tool-call-parser`` name (``PARSERS``).
* ``forced``: ``tool_choice`` required / named, read from grammar-constrained JSON.
* ``plan``: what a request's ``tools`` / ``tool_choice`` mean (template tools, constraint, parser).
* ``stream``: ``ChoiceOutput``, one choice's text deltas -> chat deltas (reasoning, content, tool calls).
"""

from kvship.engine.tool_parsers.base import ToolCall, ToolParser
from kvship.engine.tool_parsers.families import PARSERS, detect_family
from kvship.engine.tool_parsers.plan import ToolPlan, plan_tools, template_messages
from kvship.engine.tool_parsers.stream import ChoiceOutput

__all__ = [
    "PARSERS",
    "ChoiceOutput",
    "ToolCall",
    "ToolParser",
    "ToolPlan",
    "detect_family",
    "plan_tools",
    "template_messages",
]
