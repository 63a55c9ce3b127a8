"""One chat choice's output as OpenAI sends it: text deltas in, ``reasoning_content`` / ``content`` /
``tool_calls`` out (docs/api.md, "Tool calling" and "Reasoning").

``ChoiceOutput.feed(text)`` appends a text delta and returns the chat delta
to send (empty when everything new is held back); ``feed("", final=True)``
at the end flushes what was held.  Each step re-reads the whole text with the
pure parsers (``ReasoningSplitter.split``, then ``ToolParser.scan`` on the
answer) and sends what grew, so the accumulated stream equals the
non-streaming message built from the same text (``message()``).

Tool-call deltas follow OpenAI: a call's first delta carries ``index``,
``id``, ``type`` and ``function.name`` (and the arguments known so far);
later ones carry ``index`` and more ``function.arguments``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from kvship.engine.tool_parsers.base import ToolCall, ToolParser, new_call_id

if TYPE_CHECKING:
    from kvship.engine.reasoning import ReasoningSplitter


class ChoiceOutput:
    def __init__(self, tools: Optional[ToolParser], reasoning: Optional["ReasoningSplitter"]):
        self.tools, self.reasoning_splitter = tools, reasoning
        self.text = ""
        self.reasoning = ""  # sent so far (all of it once final)
        self.content = ""
        self.calls: list[tuple[str, ToolCall]] = []  # (id, call) of the calls sent in full
        self._partial: Optional[tuple[str, str, str]] = None  # (id, name, arguments sent) of the call in progress
        self._dropped = 0  # streamed calls that turned out malformed: later calls' stream indices move past them

    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        self.text += text
        if self.reasoning_splitter is not None:
            reasoning, answer = self.reasoning_splitter.split(self.text, final)
        else:
            reasoning, answer = "", self.text
        delta: dict[str, Any] = {}
        if len(reasoning) > len(self.reasoning):
            delta["reasoning_content"] = reasoning[len(self.reasoning) :]
            self.reasoning = reasoning
        if self.tools is None:
            content, calls, partial = answer, [], None
        else:
            scan = self.tools.scan(answer, final)
            content, calls, partial = scan.content, scan.calls, scan.partial
            if not final:
                content = content.rstrip()  # whitespace before a call is not content (sent once text follows)
            elif calls and not content.strip():
                content = ""
        if len(content) > len(self.content):
            delta["content"] = content[len(self.content) :]
            self.content = content
        if self._partial is not None:
            nxt = calls[len(self.calls)] if len(calls) > len(self.calls) else partial
            _, name, sent = self._partial
            if (nxt is None and final) or (
                nxt is not None and (nxt.name != name or not nxt.arguments.startswith(sent))
            ):
                self._partial = None  # the call being streamed broke: it stays as sent (docs/api.md, "Tool calling")
                self._dropped += 1
        tool_deltas = []
        for i in range(len(self.calls), len(calls)):
            tool_deltas.append(self._send(i + self._dropped, calls[i], complete=True))
        if partial is not None:
            tool_deltas.append(self._send(len(self.calls) + self._dropped, partial, complete=False))
        if tool_deltas:
            delta["tool_calls"] = [d for d in tool_deltas if d is not None]
            if not delta["tool_calls"]:
                del delta["tool_calls"]
        return delta

    def _send(self, index: int, call: ToolCall, complete: bool) -> Optional[dict[str, Any]]:
        if self._partial is not None:
            cid, name, sent = self._partial
            rest = call.arguments[len(sent) :]
            out = {"index": index, "function": {"arguments": rest}} if rest else None
        else:
            cid, rest = new_call_id(), call.arguments
            out = {"index": index, "id": cid, "type": "function", "function": {"name": call.name, "arguments": rest}}
        if complete:
            self._partial = None
            self.calls.append((cid, call))
        else:
            self._partial = (cid, call.name, call.arguments)
        return out

    def message_fields(self) -> dict[str, Any]:
        """``reasoning_content`` / ``content`` / ``tool_calls`` of the whole message (after the final feed)."""
        out: dict[str, Any] = {"content": self.content or (None if self.calls else "")}
        if self.reasoning_splitter is not None:
            out["reasoning_content"] = self.reasoning or None
        if self.calls:
            out["tool_calls"] = [
                {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for cid, c in self.calls
            ]
        return out

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if self.calls and reason == "stop" else reason
