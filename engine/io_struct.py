"""Wire types between the HTTP front end and the scheduler (one hop, in-process queues).

Front end -> scheduler: ``GenerateRequest`` (already tokenized), ``abort(rid)``.
Scheduler -> front end: ``TokenChunk`` per request per step that produced
tokens, the last one with ``finished=True``.  Every request gets exactly one
finished chunk, whatever happens (stop, length, abort, error).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Optional, Union

FinishKind = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 / 0 = no top-k
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # structured output (at most one; ``kvship.engine.grammar``): a JSON schema (text), a regex, an EBNF grammar
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    # the constraint starts once the output produced these token ids (free tokens before; chosen by the
    # serving layer, e.g. after a reasoning model's ``</think>``: docs/api.md, "Reasoning"); with
    # ``grammar_opener``, only when the first output token is that id (``kvship.engine.grammar.deferred``)
    grammar_after: Optional[tuple[int, ...]] = None
    grammar_opener: Optional[int] = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def grammar_key(self) -> Optional[tuple[str, str]]:
        """``(kind, text)`` of the output constraint (kind: json_schema / regex / ebnf), or None."""
        for kind in ("json_schema", "regex", "ebnf"):
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a user-facing message when a value is out of range."""
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError("temperature must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("frequency_penalty must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError("presence_penalty must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError("repetition_penalty must be in (0, 2]")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop must be non-empty strings")
        if len(self.stop) > 16:
            raise ValueError("at most 16 stop strings")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
        if sum(getattr(self, k) is not None for k in ("json_schema", "regex", "ebnf")) > 1:
            raise ValueError("json_schema, regex and ebnf are exclusive: give at most one")


@dataclass(frozen=True)
class Resumed:
    """A continuation of a stream broken by a worker's death (docs/router.md, "Resuming broken streams").

    The last ``output_len`` input ids are output the first worker generated;
    the client already has the first ``relayed_chars`` characters of their text
    (the rest was held back, e.g. as a possible stop-string prefix).  Stop
    strings, penalties and per-step seeds count those ids as output, so the
    continuation behaves as if the stream had not broken.
    """

    output_len: int
    relayed_chars: int


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = False
    resumed: Optional[Resumed] = None
    # PD disaggregation: where the prefill worker's bootstrap endpoint is
    bootstrap_host: Optional[str] = None
    bootstrap_port: Optional[int] = None
    bootstrap_room: Optional[int] = None
    # the room token (the router's ``bootstrap_token``, per choice ``engine.disagg.auth.choice_token``): never
    # logged or shown (docs/pd.md, "KV plane authentication")
    bootstrap_token: Optional[str] = field(default=None, repr=False)
    created_time: float = field(default_factory=time.time)
    # ``return_trace``: stage -> time.time() stamps the PD roles add while the request passes (docs/pd.md,
    # "Reading a request's trace"); written by the scheduler thread, read by the HTTP layer after the finish
    trace: Optional[dict[str, float]] = None
    # PD prefill, streamed: send the first token as soon as it is sampled (the router asks with
    # PD_FIRST_TOKEN_HEADER; docs/pd.md, "The first token from prefill")
    pd_first_token: bool = False


@dataclass(frozen=True, eq=False)
class FinishReason(Mapping):
    """Why a request finished; also a read-only mapping in SGLang's wire shape.

    ``{"type": "stop", "matched": <token id or stop string>}``,
    ``{"type": "length", "length": n}`` or ``{"type": "abort", "message": str}``:
    ``dict(reason)`` is what ``meta_info.finish_reason`` carries, and a reason
    compares equal to that dict.  Build one with ``stop`` / ``length`` /
    ``abort``; read ``kind`` / ``matched`` / ``length`` / ``message``.
    """

    kind: FinishKind
    matched: Union[int, str, None] = None
    length: int = 0
    message: str = ""

    @classmethod
    def stop(cls, matched: Union[int, str, None]) -> "FinishReason":
        return cls("stop", matched=matched)

    @classmethod
    def of_length(cls, length: int) -> "FinishReason":
        return cls("length", length=int(length))

    @classmethod
    def abort(cls, message: str) -> "FinishReason":
        return cls("abort", message=str(message))

    @classmethod
    def from_wire(cls, d: Optional[Mapping]) -> "FinishReason":
        """The reverse of ``dict(reason)``; a missing or unknown shape is an abort saying so."""
        if isinstance(d, FinishReason):
            return d
        if not d:
            return cls.abort("finished without a reason")
        kind = d.get("type")
        if kind == "stop":
            return cls.stop(d.get("matched"))
        if kind == "length":
            return cls.of_length(int(d.get("length") or 0))
        return cls.abort(str(d.get("message") or "aborted"))

    @property
    def is_abort(self) -> bool:
        return self.kind == "abort"

    def _wire(self) -> dict[str, Any]:
        if self.kind == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.kind == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message}

    def __getitem__(self, key: str) -> Any:
        return self._wire()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._wire())

    def __len__(self) -> int:
        return 2


@dataclass
class TokenChunk:
    rid: str
    token_ids: list[int]  # tokens new since the previous chunk
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    logprobs: Optional[list[float]] = None  # one per token in token_ids
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    cached_tokens: int = 0
    spec_accept_length: Optional[float] = None  # speculative decoding: tokens per verify round so far
