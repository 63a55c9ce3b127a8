"""Incremental detokenization and stop-string handling for streamed output.

``IncrementalDetokenizer`` turns a growing list of output token ids into text
deltas.  Contract:

* A delta never ends inside an incomplete UTF-8 sequence: while the decoded
  tail ends with U+FFFD (a multi-byte character split over byte-level BPE or
  byte-fallback tokens), the tokens are held back until the character
  completes.  ``finish()`` flushes whatever is held, so a sequence that never
  completes shows up exactly as ``tokenizer.decode`` shows it.
* The concatenation of every delta plus ``finish()`` equals
  ``tokenizer.decode(all_ids, skip_special_tokens=...)`` for tokenizers whose
  decode of a window is a prefix of the decode of a longer window (byte-level
  BPE, SentencePiece with byte fallback, WordPiece).

It decodes a short sliding window (``prefix_offset`` .. end) rather than the
whole output each step, so the cost per token stays flat.

``StopStringMatcher`` sits after it on the text side: it holds back the
longest tail that could still become a stop string, and once a stop string
appears it returns the text before it (the stop string itself is trimmed, as
OpenAI does) and reports the match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

_REPLACEMENT = "\ufffd"
_PRIME_CONTEXT_TOKENS = 5  # earlier tokens decoded with a resumed stream's first deltas (spacing, merges)


class IncrementalDetokenizer:
    """Per-request streaming decoder; not thread-safe (one owner)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._spaces = spaces_between_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens before this are already emitted as text
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        kwargs = {"skip_special_tokens": self._skip}
        if not self._spaces:
            kwargs["spaces_between_special_tokens"] = False
        try:
            return self._tok.decode(list(ids), **kwargs)
        except TypeError:  # tokenizers without spaces_between_special_tokens
            return self._tok.decode(list(ids), skip_special_tokens=self._skip)

    def prime(self, ids: Sequence[int]) -> str:
        """Continue after ``ids`` (a resumed stream's earlier output, io_struct.Resumed): later deltas
        are decoded in their context; returns their text (without a trailing incomplete character,
        whose tokens stay held until a later delta completes it)."""
        self.ids = [int(t) for t in ids]
        ready = len(self.ids)
        text = self._decode(self.ids)
        while ready > 0 and text.endswith(_REPLACEMENT) and len(self.ids) - ready < 4:
            ready -= 1
            text = self._decode(self.ids[:ready])
        self._read_offset = ready
        self._prefix_offset = max(0, ready - _PRIME_CONTEXT_TOKENS)
        self.text = text
        return text

    def add(self, new_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now final (maybe "")."""
        self.ids.extend(int(t) for t in new_ids)
        if not new_ids:
            return ""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.ids[self._prefix_offset :])
        if full_text.endswith(_REPLACEMENT):
            return ""  # incomplete multi-byte character: wait for more tokens
        delta = self._diff(prefix_text, full_text)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Flush held-back tokens (the output is over); return the last delta."""
        if self._read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.ids[self._prefix_offset :])
        delta = self._diff(prefix_text, full_text)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta

    def _diff(self, prefix_text: str, full_text: str) -> str:
        if full_text.startswith(prefix_text):
            return full_text[len(prefix_text) :]
        # The window's decode was not a prefix of the longer decode (rare
        # normalisations): re-derive the delta from the whole output.
        whole = self._decode(self.ids)
        if whole.startswith(self.text):
            return whole[len(self.text) :]
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""


@dataclass
class StopMatch:
    text: str  # text safe to emit now
    matched: Optional[str] = None  # the stop string that ended the output


class StopStringMatcher:
    """Hold back possible stop-string prefixes; detect and trim stop strings.

    Feed text deltas with ``feed``; once it reports a match, the output is
    over (later feeds return nothing).  ``flush`` returns the held-back tail
    when the output ends for another reason.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: Optional[str] = None
        self._max_len = max((len(s) for s in self.stops), default=0)
        self._first_chars = frozenset(s[0] for s in self.stops)

    def feed(self, text: str) -> StopMatch:
        if self.matched is not None:
            return StopMatch("", self.matched)
        if not self.stops:
            return StopMatch(text)
        buf = self._held + text
        best_pos, best_stop = -1, None
        for s in self.stops:
            pos = buf.find(s)
            if pos != -1 and (best_pos == -1 or pos < best_pos):
                best_pos, best_stop = pos, s
        if best_stop is not None:
            self.matched = best_stop
            self._held = ""
            return StopMatch(buf[:best_pos], best_stop)
        hold = self._holdback_len(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return StopMatch(buf[: len(buf) - hold])

    def hold(self, text: str) -> None:
        """Start with ``text`` held back: output the client has not seen yet (a resumed stream)."""
        self._held = text

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out if self.matched is None else ""

    def _holdback_len(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string.

        Only tails starting with some stop string's first character are
        tried, so the usual cost is one scan of the last ``max_len - 1``
        characters.
        """
        start = max(0, len(buf) - (self._max_len - 1))
        for pos in range(start, len(buf)):
            if buf[pos] not in self._first_chars:
                continue
            tail = buf[pos:]
            if any(s.startswith(tail) for s in self.stops):
                return len(buf) - pos
        return 0
