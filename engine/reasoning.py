"""Splitting a reasoning model's thinking from its answer (``--reasoning-parser``; docs/api.md, "Reasoning").

Both families think between ``<think>`` and ``</think>``; the thinking goes to
``reasoning_content``, what follows ``</think>`` (leading whitespace dropped)
to ``content``.

* ``deepseek-r1``: the output starts in the thinking (the R1 templates open
  ``<think>`` in the prompt; a ``<think>`` the model writes itself is dropped);
  with no ``</think>`` at all, everything is thinking.
* ``qwen3``: the output starts in the thinking when the rendered prompt ends
  inside an open ``<think>`` (thinking templates that open it for the model),
  or when the output itself starts with ``<think>``; otherwise (e.g.
  ``chat_template_kwargs: {"enable_thinking": false}``) it is all content.

``split(text, final)`` is a pure function of the text so far, with the same
prefix rule as the tool parsers (``kvship.engine.tool_parsers.base``): while
not final, a tail that could still become ``<think>`` / ``</think>`` is held
back, and so is whitespace that may turn out to lead the answer.
"""

from __future__ import annotations

from typing import Callable, Optional

from kvship.engine.tool_parsers.base import held_prefix

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek-r1")


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open ``<think>`` block."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def grammar_start(
    family: str, prompt: str, encode: Callable[[str], list[int]]
) -> Optional[tuple[tuple[int, ...], Optional[int]]]:
    """Where a constrained answer (``response_format``, forced ``tool_choice``) starts under ``family``:
    ``(after, opener)`` for ``SamplingParams.grammar_after`` / ``grammar_opener`` (the thinking is free,
    the grammar starts after ``</think>``), or None when the answer starts at the first token.

    * ``deepseek-r1`` or a prompt that ends inside an open ``<think>``: after ``</think>``.
    * ``qwen3`` otherwise: when the prompt does not end with a closed think block (e.g. ``enable_thinking:
      false``) and ``<think>`` is one token, the model may open one as its first token (then the grammar
      starts after ``</think>``) or start the answer at once.
    """
    after = tuple(encode(CLOSE))
    if not after:
        return None
    if family == "deepseek-r1" or prompt_opens_thinking(prompt):
        return after, None
    opener = encode(OPEN)
    if len(opener) == 1 and not prompt.rstrip().endswith(CLOSE):
        return after, opener[0]
    return None


class ReasoningSplitter:
    def __init__(self, family: str, prompt: str):
        if family not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {family!r} (one of {', '.join(REASONING_PARSERS)})")
        self.starts_inside = family == "deepseek-r1" or prompt_opens_thinking(prompt)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the output so far."""
        s = text.lstrip()
        if not self.starts_inside:
            if not s.startswith(OPEN):
                if not final and OPEN.startswith(s):
                    return "", ""  # may still become <think>
                return "", text
        if s.startswith(OPEN):
            s = s[len(OPEN) :]
        elif not final and OPEN.startswith(s):
            return "", ""
        end = s.find(CLOSE)
        if end < 0:
            if final:
                return s.strip(), ""
            return _held(s[: held_prefix(s, (CLOSE,))].lstrip()), ""
        reasoning, content = s[:end].strip(), s[end + len(CLOSE) :].lstrip()
        return reasoning, content


def _held(reasoning: str) -> str:
    """Thinking sent while it may go on: its trailing whitespace waits (the final thinking is stripped)."""
    return reasoning.rstrip()
