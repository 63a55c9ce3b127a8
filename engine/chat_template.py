"""Rendering a chat template with bounded time and output (docs/api.md, "Chat templates").

The model's template is trusted code; the conversation and the
``chat_template_kwargs`` a client sends are not.  So:

* A client never supplies template code: ``check_template_kwargs`` accepts
  only the documented switches of ``TEMPLATE_KWARGS`` with small scalar
  values (bool, bounded int, short string) and refuses every other key
  (``chat_template``, ``tokenize``, ``return_*``, ``tools``...) by name.
* ``render`` runs the template in ``BoundedSandbox``, Jinja's immutable
  sandbox (what transformers uses) whose hooks also keep a budget: every
  attribute / item lookup, call, ``range`` step, intercepted operator and
  emitted chunk ticks it, and it raises ``RenderLimitError`` once the
  deadline (``RenderLimits.timeout_s``) has passed or the output would pass
  ``RenderLimits.max_output_chars``.  ``*`` on a string or list, ``**`` and
  ``+`` are checked before they allocate, so ``'x' * 10**10`` costs nothing.
  A template's work on data always goes through one of those hooks (reading a
  message is a lookup), so the budget bounds the whole render; the render
  thread stops itself, nothing has to be killed.

The environment mirrors transformers' chat-template environment
(``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``,
``strftime_now``, a ``tojson`` that does not escape HTML, ``{% generation %}``
blocks rendered as their body) so a template renders the same text here as
with ``tokenizer.apply_chat_template``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# switches chat templates read, and the type each takes (docs/api.md lists them)
TEMPLATE_KWARGS: dict[str, type] = {
    "enable_thinking": bool,  # Qwen3 and others: think before answering
    "thinking": bool,  # DeepSeek V3.1 / Kimi style
    "reasoning_effort": str,  # gpt-oss: low / medium / high
    "thinking_budget": int,
    "tools_in_user_message": bool,  # Llama 3.x
    "date_string": str,  # Llama 3.x
    "model_identity": str,  # gpt-oss
}
MAX_KWARG_STR = 256
MAX_KWARG_INT = 2**31
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_CHECK_EVERY = 64  # ticks between clock reads


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (no template, bad roles, template raised)."""


class RenderLimitError(ChatTemplateError):
    """The render passed its time or output budget (``status`` is the HTTP status to answer with)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RenderLimits:
    """Budget of one render: output characters and wall seconds."""

    max_output_chars: int = 4 * 1024 * 1024
    timeout_s: float = 2.0


def check_template_kwargs(kwargs: Optional[dict]) -> Optional[tuple[str, str]]:
    """``(key, message)`` of the first ``chat_template_kwargs`` entry that is not allowed, or None."""
    for key, value in (kwargs or {}).items():
        want = TEMPLATE_KWARGS.get(key)
        if want is None:
            if key == "chat_template":
                why = "a client cannot replace the model's chat template"
            elif key in ("add_generation_prompt", "continue_final_message", "tools"):
                why = f"use the request's top-level '{key}' field"
            else:
                why = "not a documented template switch"
            allowed = ", ".join(sorted(TEMPLATE_KWARGS))
            return key, f"chat_template_kwargs.{key} is not accepted ({why}); allowed keys: {allowed}"
        ok = type(value) is want  # bool is not an int here, and an int is not a bool
        if ok and want is str:
            ok = len(value) <= MAX_KWARG_STR
        if ok and want is int:
            ok = -MAX_KWARG_INT <= value <= MAX_KWARG_INT
        if not ok:
            limit = {str: f" of at most {MAX_KWARG_STR} characters", int: " in [-2^31, 2^31]"}.get(want, "")
            return key, f"chat_template_kwargs.{key} must be a {want.__name__}{limit}"
    return None


class _Budget:
    __slots__ = ("deadline", "max_chars", "timeout_s", "ticks", "chars")

    def __init__(self, limits: RenderLimits):
        self.timeout_s = limits.timeout_s
        self.deadline = time.monotonic() + limits.timeout_s
        self.max_chars = limits.max_output_chars
        self.ticks = 0
        self.chars = 0

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks % _CHECK_EVERY == 0 and time.monotonic() > self.deadline:
            raise RenderLimitError(f"chat template rendering took longer than {self.timeout_s:g} s", 400)

    def room(self, n: int) -> None:
        """Raise when ``n`` more characters would not fit the output cap."""
        if n > self.max_chars - self.chars:
            raise RenderLimitError(
                f"the rendered chat prompt would exceed {self.max_chars} characters (--max-chat-template-output-chars)",
                413,
            )


_local = threading.local()


def _budget() -> _Budget:
    """The budget of the render running on this thread (``render`` sets it; templates compiled here
    run nowhere else)."""
    return _local.budget


def _size(x: Any) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else 0


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to ``environment.bounded_join`` (Jinja's ``str_join`` has no sandbox hook)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            return super().visit_Concat(node, frame)
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox whose hooks spend the current render's budget (module docstring)."""

    intercepted_binops = frozenset(["*", "**", "+"])
    code_generator_class = _BoundedCodeGenerator

    @staticmethod
    def bounded_join(parts: Any) -> str:
        texts = [str(p) for p in parts]
        b = _budget()
        b.tick()
        b.room(sum(len(t) for t in texts))
        return "".join(texts)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().tick()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        _budget().tick()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        b.tick()
        if operator == "+" and type(left) is str and type(right) is str:  # the common case: building text
            if len(left) + len(right) > b.max_chars - b.chars:
                b.room(len(left) + len(right))
            return left + right
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and _size(seq):
                b.room(_size(seq) * max(n, 0))
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 4096:
                raise RenderLimitError("chat template: exponent too large", 400)
        elif operator == "+":
            b.room(_size(left) + _size(right))
        return super().call_binop(context, operator, left, right)


class _BoundedRange:
    """``range`` for templates: at most 100000 items (Jinja's sandbox limit); each item iterated ticks the budget."""

    def __init__(self, *args: int):
        self._r = range(*args)
        if len(self._r) > 100_000:
            raise SecurityError("range too big (at most 100000 items)")

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, i: Any) -> Any:
        return self._r[i]

    def __iter__(self) -> Any:
        b = _budget()
        for i in self._r:
            b.tick()
            yield i


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without the class itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names (as transformers' does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's Namespace signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore attributes on a namespace ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    text = json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    _budget().room(len(text))
    return text


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        range=_BoundedRange,
        dict=_TemplateDict(),
        namespace=_Namespace,
    )
    return env.from_string(template)


def _stream(template: jinja2.Template, budget: _Budget, context: dict) -> str:
    parts: list[str] = []
    for chunk in template.generate(**context):
        if len(chunk) > budget.max_chars - budget.chars:
            budget.room(len(chunk))
        budget.chars += len(chunk)
        budget.tick()
        parts.append(chunk)
    return "".join(parts)


def render(
    template: str,
    messages: list[dict],
    *,
    limits: RenderLimits,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    tools: Optional[list[dict]] = None,
    special_tokens: Optional[dict[str, str]] = None,
    template_kwargs: Optional[dict] = None,
) -> str:
    """``template`` applied to ``messages`` (plain JSON data) within ``limits``.

    Raises ``RenderLimitError`` past the budget and ``ChatTemplateError`` for a
    template that fails (``raise_exception``, a missing field) or does not
    compile.  With ``continue_final_message`` the text ends inside the last
    message, as transformers renders it."""
    try:
        compiled = _compile(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None
    chat = [_alias_reasoning(m) for m in messages]
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise ChatTemplateError("continue_final_message: the final message has no text content to continue")
        chat[-1] = dict(chat[-1], content=final + _CONTINUE_TAG)
    context = {**(special_tokens or {}), **(template_kwargs or {})}
    context.update(messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt)
    budget = _Budget(limits)
    _local.budget = budget
    try:
        text = _stream(compiled, budget, context)
    except ChatTemplateError:
        raise
    except RecursionError:
        raise ChatTemplateError("chat template failed: recursion too deep") from None
    except Exception as e:  # noqa: BLE001 - raise_exception(...), sandbox refusals and template errors
        raise ChatTemplateError(f"chat template failed: {e}") from None
    finally:
        _local.budget = None
    if final is None:
        return text
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message: the chat template drops the final message's text")
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _alias_reasoning(message: dict) -> dict:
    """A message's reasoning under every name templates read (``reasoning_content``, ``thinking``)."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return dict(message)
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}
