"""Wire types of the router <-> worker hop (HTTP + JSON), version ``WIRE_VERSION``.

Router -> worker: the client's request body, unchanged in unified mode; in PD
mode the same body plus ``bootstrap_host`` / ``bootstrap_port`` /
``bootstrap_room`` of the chosen prefill worker (``PDBootstrap.inject``).
Headers: ``x-request-id``, ``Authorization`` when a worker key is set, and
``ROUTER_IDS_HEADER`` on resumable streams.

Worker -> router, read once on registration:
``GET /get_model_info`` and ``GET /get_server_info`` (``WorkerInfo.parse``),
``GET /v1/models`` (served model ids), ``GET /health`` by the health checker.

``RoutingRequest`` is the router's view of one client request: what the
policies look at (the request text for prefix matching, the model, the
session) and what the proxy forwards (the raw body).  Parsing validates what
the router can judge itself so that bad requests get a 4xx without reaching a
worker.
"""

from __future__ import annotations

import array
import json
import secrets
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlsplit

from kvship.common import fastjson

# the router <-> worker extensions are defined once for both ends; the router's modules import them from here
from kvship.common.protocol import (  # noqa: F401
    BOOTSTRAP_HOST,
    BOOTSTRAP_PORT,
    BOOTSTRAP_ROOM,
    BOOTSTRAP_TOKEN,
    PD_FIRST_TOKEN_HEADER,
    ROUTER_IDS_HEADER,
    SESSION_HEADER,
    WIRE_VERSION,
)

ROUTE_CHAT = "/v1/chat/completions"
ROUTE_COMPLETIONS = "/v1/completions"
ROUTE_GENERATE = "/generate"
PROXY_ROUTES = (ROUTE_CHAT, ROUTE_COMPLETIONS, ROUTE_GENERATE)

# ``ROUTER_IDS_HEADER`` (token ids in stream events, so a broken stream can be resumed: ``kvship.router.resume``)
# and ``PD_FIRST_TOKEN_HEADER`` (docs/pd.md, "The first token from prefill") come from ``kvship.common.protocol``.


class RequestError(Exception):
    """A client error the router answers itself: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, code: str = "invalid_request_error", headers: Optional[dict[str, str]] = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}


def error_body(message: str, status: int, code: str) -> bytes:
    """The JSON error body every router-made error uses (OpenAI shape)."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()


@dataclass
class WorkerInfo:
    """What the router learned about a worker from its info endpoints."""

    models: tuple[str, ...] = ()
    mode: str = "unified"
    bootstrap_port: Optional[int] = None
    model_path: Optional[str] = None
    # the worker's model fingerprint and revision (``--revision``, else the fingerprint); None from
    # workers that predate them (docs/router.md, "Revisions")
    fingerprint: Optional[str] = None
    revision: Optional[str] = None
    raw_server_info: dict = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, model_info: dict, server_info: dict, models_list: Optional[dict]) -> "WorkerInfo":
        """Combine ``/get_model_info``, ``/get_server_info`` and ``/v1/models`` replies.

        Model ids come from ``/v1/models`` when it lists any, else from
        ``served_model_name`` / ``model_path``.  ``mode`` and
        ``disaggregation_bootstrap_port`` are read from the top level of the
        server info or from its ``server_args`` object (kvship workers nest
        their flags there).  ``revision`` is the worker's ``revision`` (its
        ``--revision``), else its ``fingerprint``.  Unknown fields are ignored.
        """
        args = server_info.get("server_args") if isinstance(server_info.get("server_args"), dict) else {}

        def field_of(name: str) -> Any:
            value = server_info.get(name)
            return value if value is not None else args.get(name)

        ids: list[str] = []
        if isinstance(models_list, dict):
            for entry in models_list.get("data") or []:
                if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                    ids.append(entry["id"])
        if not ids:
            for name in (field_of("served_model_name"), model_info.get("served_model_name")):
                if isinstance(name, str) and name:
                    ids.append(name)
                    break
        model_path = model_info.get("model_path") or field_of("model_path")
        if not ids and isinstance(model_path, str):
            ids.append(model_path)
        port = field_of("disaggregation_bootstrap_port")
        mode = field_of("mode") or field_of("disaggregation_mode") or "unified"
        fingerprint = server_info.get("fingerprint")
        fingerprint = fingerprint if isinstance(fingerprint, str) and fingerprint else None
        revision = field_of("revision")
        revision = revision if isinstance(revision, str) and revision else fingerprint
        return cls(
            models=tuple(dict.fromkeys(ids)),
            mode=str(mode),
            bootstrap_port=int(port) if isinstance(port, (int, str)) and str(port).isdigit() else None,
            model_path=model_path if isinstance(model_path, str) else None,
            fingerprint=fingerprint,
            revision=revision,
            raw_server_info=server_info,
        )


def _text_of_content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return ""


def _is_ids(value: Any) -> bool:
    """A list of token ids (JSON integers; ``bool`` is not one). One C-level pass: a 4096-id prompt is checked in
    ~0.1 ms, against ~0.35 ms for an ``isinstance`` loop."""
    return isinstance(value, list) and (not value or set(map(type, value)) == {int})


assert array.array("I").itemsize == 4  # a C unsigned int: the UTF-32 code unit
_UTF32 = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"


def ids_key(ids: list[int]) -> str:
    """The routing text of a token-id prompt: one character per id, so the cache-aware policy's prefix tree
    compares ids as it compares characters (a key a sixth as long as the decimals).  Built as UTF-32 in one
    C-level pass (~0.1 ms for 4096 ids, against ~0.25 ms for ``chr`` per id and ~0.8 ms for decimals); ids
    in the surrogate range are characters too.  Ids no vocabulary reaches (negative, past U+10FFFF) fall
    back to decimals; the worker refuses them anyway."""
    try:
        return array.array("I", ids).tobytes().decode(_UTF32, "surrogatepass")
    except (ValueError, OverflowError):
        return " ".join(map(str, ids))


def _prompt_text(prompt: Any) -> tuple[str, int]:
    """(routing text, batch size) of an OpenAI ``prompt`` or native ``text``/``input_ids`` value."""
    if isinstance(prompt, str):
        return prompt, 1
    if isinstance(prompt, list) and prompt:
        if _is_ids(prompt):
            return ids_key(prompt), 1
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt), len(prompt)
        if all(_is_ids(p) for p in prompt):
            return "\n".join(map(ids_key, prompt)), len(prompt)
    raise RequestError(
        400, "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    )


@dataclass
class RoutingRequest:
    """One client request as the router sees it (never logged: ``text`` holds the prompt)."""

    route: str
    body: dict
    raw: bytes
    text: str
    model: Optional[str]
    stream: bool
    session_id: Optional[str]
    batch_size: int = 1
    text_is_ids: bool = False  # ``text`` holds one character per prompt token id (``ids_key``)

    @classmethod
    def parse(cls, route: str, raw: bytes, session_header: Optional[str] = None) -> "RoutingRequest":
        """Parse and check a body for ``route``; raise ``RequestError`` (400) when malformed."""
        try:
            body = fastjson.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise RequestError(400, "request body nests JSON too deeply") from None
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError(400, "'model' must be a string")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(400, "'stream' must be true or false")
        batch = 1
        if route == ROUTE_CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError(400, "'messages' must be a non-empty list")
            parts = []
            for m in messages:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise RequestError(400, "each message must be an object with a 'role'")
                parts.append(f"{m['role']}: {_text_of_content(m.get('content'))}\n")
            text = "".join(parts)
            if model is None:
                raise RequestError(400, "'model' is required")
        elif route == ROUTE_COMPLETIONS:
            if "prompt" not in body:
                raise RequestError(400, "'prompt' is required")
            text, batch = _prompt_text(body["prompt"])
            if model is None:
                raise RequestError(400, "'model' is required")
        elif route == ROUTE_GENERATE:
            if body.get("text") is not None:
                text, batch = _prompt_text(body["text"])
            elif body.get("input_ids") is not None:
                text, batch = _prompt_text(body["input_ids"])
            else:
                raise RequestError(400, "one of 'text' or 'input_ids' is required")
        else:  # pragma: no cover - routes are fixed by the app
            raise RequestError(404, f"unknown route {route}")
        session = body.get("session_id")
        if session is not None and not isinstance(session, (str, int)):
            raise RequestError(400, "'session_id' must be a string")
        # the session key: body ``session_id``, else the x-session-id header, else the OpenAI ``user`` field
        user = body.get("user")
        session_id = (
            str(session)
            if session is not None
            else (session_header or (user if isinstance(user, str) and user else None))
        )
        if route == ROUTE_GENERATE:
            prompt = body.get("input_ids") if body.get("text") is None else None
        else:
            prompt = body.get("prompt")
        ids = isinstance(prompt, list) and bool(prompt) and (_is_ids(prompt) or all(_is_ids(p) for p in prompt))
        return cls(
            route=route,
            body=body,
            raw=raw,
            text=text,
            model=model,
            stream=stream,
            session_id=session_id,
            batch_size=batch,
            text_is_ids=ids,
        )


@dataclass(frozen=True)
class PDBootstrap:
    """Where the decode worker finds the prefill worker's KV: injected into both requests."""

    host: str
    port: int
    room: int
    token: Optional[str] = field(default=None, repr=False)  # never logged (docs/pd.md, KV plane authentication)

    @classmethod
    def for_prefill(cls, prefill_url: str, bootstrap_port: int) -> "PDBootstrap":
        """Bootstrap fields for a prefill worker: its URL's host, its port, an unguessable 63-bit room and a room
        token (``secrets``: the workers derive the tags that bind the room's KV transfer from it).

        Workers give item ``i`` of a batch (or choice ``i`` of ``n``) room ``room + i``
        (mod 2^63) and a token derived from this one and ``i`` on both sides, so one room and one token per
        request body are enough.
        """
        host = urlsplit(prefill_url).hostname or "127.0.0.1"
        return cls(host=host, port=bootstrap_port, room=secrets.randbits(63), token=secrets.token_urlsafe(24))

    def inject(self, body: dict, raw: Optional[bytes] = None) -> bytes:
        """The request body for both workers of the pair, as JSON bytes.

        ``raw``, the client's body that parsed to ``body`` (``RoutingRequest.raw``), gets the three fields
        spliced in before its closing brace instead of ``body`` being written out again (a 4096-id prompt costs
        ~0.3 ms to serialise). Only a UTF-8 object without bootstrap fields of its own is spliced; anything
        else (another encoding, a BOM, a client's own ``bootstrap_*``) is written out from ``body``.
        """
        fields: dict[str, Any] = {BOOTSTRAP_HOST: self.host, BOOTSTRAP_PORT: self.port, BOOTSTRAP_ROOM: self.room}
        if self.token is not None:
            fields[BOOTSTRAP_TOKEN] = self.token
        if raw is not None and not fields.keys() & body.keys():
            head = raw.rstrip()
            if head.endswith(b"}") and head.lstrip()[:1] == b"{":
                return head[:-1] + (b"," if body else b"") + json.dumps(fields)[1:-1].encode() + b"}"
        return json.dumps({**body, **fields}).encode()


def new_request_id() -> str:
    return uuid.uuid4().hex
