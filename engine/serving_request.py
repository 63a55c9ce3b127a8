"""One request context per HTTP body, and the one builder of its engine requests.

Every handler (chat, completions, generate) reads as parse -> build ->
submit -> format: it parses and checks its body, tokenizes, then hands each
prompt to ``RequestContext.add`` and submits with ``RequestContext.open``.
The context reads the router's extensions once (``kvship.common.protocol``):

* the PD bootstrap fields, single (request ``k`` of the body gets room
  ``room + k``) or one per batch item (``/generate``: choice ``j`` of item
  ``i`` gets ``rooms[i] + j``), each field on its own; the room token of
  request ``k`` is ``choice_token(token, k)`` the same way;
* ``kvship_resume`` (a resumed stream's continuation), ``return_trace`` (PD
  timestamps), the token-ids and first-token headers;
* the W3C trace context (``traceparent`` / ``tracestate``), handed to the
  engine's tracer with each request (docs/observability.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from starlette.requests import Request

from kvship.common.protocol import (
    PD_FIRST_TOKEN_HEADER,
    ROOM_MOD,
    ROUTER_IDS_HEADER,
    TraceContext,
    choice_room,
    flag_header,
)
from kvship.engine.disagg.auth import choice_token
from kvship.engine.engine import Engine, RequestHandle
from kvship.engine.http_errors import bad_request
from kvship.engine.io_struct import GenerateRequest, Resumed, SamplingParams
from kvship.engine.serving import check_bootstrap_token, choice_params, choice_rid, open_requests


@dataclass(frozen=True)
class _ItemField:
    """A body field given once for the whole body or once per batch item (``/generate``)."""

    values: tuple
    per_item: bool

    @classmethod
    def of(cls, value: Any, batch: int, name: str) -> "_ItemField":
        if isinstance(value, list):
            if len(value) != batch:
                raise bad_request(f"{name} has {len(value)} entries but the batch has {batch}", name)
            return cls(tuple(value), True)
        return cls((value,) * batch, False)


@dataclass
class RequestContext:
    """The engine-side context of one HTTP request body (see the module docstring)."""

    engine: Engine
    stream: bool
    router_ids: bool  # the router asked for token ids in stream events (it may resume the stream)
    pd_first_token: bool  # a PD prefill worker streams the first token at once (docs/pd.md)
    trace: Optional[TraceContext]
    return_trace: bool
    resumed: Optional[Resumed] = None
    created: float = field(default_factory=time.time)
    hosts: _ItemField = _ItemField((), False)
    ports: _ItemField = _ItemField((), False)
    rooms: _ItemField = _ItemField((), False)
    tokens: _ItemField = _ItemField((), False)
    requests: list[GenerateRequest] = field(default_factory=list)

    @classmethod
    def of(cls, engine: Engine, request: Request, body: Any, batch: int = 1) -> "RequestContext":
        """Read the router's extensions of ``body`` (a chat, completions or generate body of ``batch``
        prompts) and ``request``'s headers; 400 on bad bootstrap fields."""
        stream = bool(body.stream)
        ctx = cls(
            engine=engine,
            stream=stream,
            router_ids=stream and flag_header(request.headers, ROUTER_IDS_HEADER),
            pd_first_token=stream and flag_header(request.headers, PD_FIRST_TOKEN_HEADER),
            trace=TraceContext.from_headers(request.headers),
            return_trace=bool(getattr(body, "return_trace", False)),
            hosts=_ItemField.of(body.bootstrap_host, batch, "bootstrap_host"),
            ports=_ItemField.of(body.bootstrap_port, batch, "bootstrap_port"),
            rooms=_ItemField.of(body.bootstrap_room, batch, "bootstrap_room"),
            tokens=_ItemField.of(body.bootstrap_token, batch, "bootstrap_token"),
        )
        fields = (body.bootstrap_host, body.bootstrap_port, body.bootstrap_room, body.bootstrap_token)
        if engine.server_args.mode != "decode" or any(f is not None for f in fields):
            # (a decode worker prefills a body without any bootstrap field itself: docs/router.md, "--pd-selective")
            for token in ctx.tokens.values:
                check_bootstrap_token(engine, token)
        for p in ctx.ports.values:
            if p is not None and not 0 < p < 65536:
                raise bad_request("bootstrap_port must be in 1..65535", "bootstrap_port")
        for room in ctx.rooms.values:
            if room is not None and not 0 <= room < ROOM_MOD:
                raise bad_request("bootstrap_room must be in [0, 2^63)", "bootstrap_room")
        return ctx

    def add(
        self,
        item: int,
        rid: str,
        input_ids: Sequence[int],
        sp: SamplingParams,
        n: int = 1,
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        total: Optional[int] = None,
    ) -> list[GenerateRequest]:
        """The ``n`` engine requests of prompt ``item`` (choice ``j`` uses ``choice_params(sp, j, n)``); their
        ids are ``choice_rid(rid, j, n)``, or ``choice_rid(rid, k, total)`` by their index ``k`` in the body
        when ``total`` (every request of a multi-prompt body shares one id, as completions does)."""
        out = []
        for j in range(n):
            k = len(self.requests)
            own = choice_rid(rid, j, n) if total is None else choice_rid(rid, k, total)
            greq = GenerateRequest(
                rid=own,
                input_ids=list(input_ids),
                sampling_params=choice_params(sp, j, n),
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num,
                stream=self.stream,
                bootstrap_host=self.hosts.values[item],
                bootstrap_port=self.ports.values[item],
                bootstrap_room=choice_room(self.rooms.values[item], j if self.rooms.per_item else k),
                bootstrap_token=choice_token(self.tokens.values[item], j if self.tokens.per_item else k),
                created_time=self.created,
                resumed=self.resumed,
                trace={"http_received": self.created} if self.return_trace else None,
                pd_first_token=self.pd_first_token,
            )
            self.requests.append(greq)
            out.append(greq)
        return out

    def open(self) -> list[RequestHandle]:
        """Submit every request built so far (all or none), their trace context with them."""
        tracer = self.engine.tracer
        if not tracer.enabled:
            return open_requests(self.engine, self.requests)
        started = [
            g.rid for g in self.requests if tracer.request_started(g.rid, self.trace, len(g.input_ids), self.created)
        ]
        try:
            return open_requests(self.engine, self.requests)
        except BaseException:
            for rid in started:  # (not another request's of the same id: a duplicate id is refused here)
                tracer.request_dropped(rid)
            raise
