"""The router <-> worker protocol extensions, defined once for both ends.

A worker is an OpenAI / SGLang-compatible server; the router adds to a
client's request only what this module names (docs/api.md, "Router
extensions"; docs/pd.md, "Protocol, worker side"):

Headers (router -> worker):

* ``REQUEST_ID_HEADER``: the request's id (the client's, else the router's);
* ``ROUTER_IDS_HEADER`` = ``1``: stream events carry token ids
  (``kvship_prompt_ids`` / ``kvship_token_ids``; /generate:
  ``meta_info.kvship_prompt_ids``) so a broken stream can be resumed;
* ``PD_FIRST_TOKEN_HEADER`` = ``1`` (to a prefill worker): stream the first
  token as soon as it is sampled;
* ``TRACEPARENT_HEADER`` / ``TRACESTATE_HEADER``: W3C trace context
  (docs/observability.md); a client's own are kept, the router's span
  becomes the parent.

Body fields (router -> worker): ``BOOTSTRAP_FIELDS`` (PD: where decode finds
prefill's KV, the room and its token), ``RESUME_FIELD`` (a resumed stream's
continuation) and ``RETURN_TRACE_FIELD`` (PD timestamps in
``meta_info.trace``).  Request ``i`` of a body (choice ``i`` of ``n``, batch
item) uses room ``choice_room(room, i)`` on both workers.

Nothing here imports the engine or the router: both import it.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Mapping, Optional

WIRE_VERSION = 1

REQUEST_ID_HEADER = "x-request-id"
ROUTER_IDS_HEADER = "x-kvship-token-ids"
PD_FIRST_TOKEN_HEADER = "x-kvship-first-token"
SESSION_HEADER = "x-session-id"
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"

BOOTSTRAP_HOST = "bootstrap_host"
BOOTSTRAP_PORT = "bootstrap_port"
BOOTSTRAP_ROOM = "bootstrap_room"
BOOTSTRAP_TOKEN = "bootstrap_token"
BOOTSTRAP_FIELDS = (BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM, BOOTSTRAP_TOKEN)
RESUME_FIELD = "kvship_resume"
RETURN_TRACE_FIELD = "return_trace"

ROOM_MOD = 2**63


def choice_room(room: Optional[int], index: int) -> Optional[int]:
    """PD: the bootstrap room of request ``index`` of a body: ``room + index`` (mod 2^63), computed the same
    way on the prefill and the decode worker."""
    return None if room is None else (room + index) % ROOM_MOD


def flag_header(headers: Mapping[str, str], name: str) -> bool:
    """Whether a ``1``-valued router flag header (``ROUTER_IDS_HEADER``, ``PD_FIRST_TOKEN_HEADER``) is set."""
    return headers.get(name) == "1"


# --------------------------------------------------------------------------- W3C trace context

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_MAX_TRACESTATE = 512  # W3C: at most 32 members; a longer header is dropped, not forwarded


@dataclass(frozen=True)
class TraceContext:
    """A W3C ``traceparent`` (and its ``tracestate``): the span a request's next spans are children of.

    ``parse`` accepts what the W3C Trace Context spec accepts (version 00, or a later version's first four
    fields) and returns None for anything else (all-zero ids, upper case, version ff): such a header is
    ignored, never an error, and a new trace starts.
    """

    trace_id: str  # 32 lower-case hex digits
    span_id: str  # 16 lower-case hex digits: the parent span
    sampled: bool = True
    tracestate: Optional[str] = None

    @classmethod
    def parse(cls, traceparent: Optional[str], tracestate: Optional[str] = None) -> Optional["TraceContext"]:
        if not traceparent:
            return None
        m = _TRACEPARENT.match(traceparent.strip())
        if m is None:
            return None
        version, trace_id, span_id, flags, rest = m.groups()
        if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(span_id) == {"0"}:
            return None
        state = tracestate.strip() if tracestate and len(tracestate) <= _MAX_TRACESTATE else None
        return cls(trace_id, span_id, bool(int(flags, 16) & 1), state or None)

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> Optional["TraceContext"]:
        return cls.parse(headers.get(TRACEPARENT_HEADER), headers.get(TRACESTATE_HEADER))

    @classmethod
    def new_root(cls, sampled: bool = True) -> "TraceContext":
        """A fresh trace id with a random parent span id (a request that came without a trace context)."""
        return cls(secrets.token_hex(16), secrets.token_hex(8), sampled)

    def child(self, span_id: str) -> "TraceContext":
        """The same trace with ``span_id`` as the parent of what comes next."""
        return TraceContext(self.trace_id, span_id, self.sampled, self.tracestate)

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"

    def headers(self) -> dict[str, str]:
        """The headers that carry this context to the next hop."""
        out = {TRACEPARENT_HEADER: self.traceparent}
        if self.tracestate:
            out[TRACESTATE_HEADER] = self.tracestate
        return out
