"""OpenAI-style error bodies, the exception handlers that produce them, and the request guards.

Every error the server returns has the body
``{"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}``
and one of these statuses:

* 400 ``invalid_request_error`` - a value is wrong (range, context length, vocabulary, ...)
* 401 ``authentication_error`` - missing or wrong API key
* 404 ``not_found_error`` - unknown route or model (code ``model_not_found``)
* 405 ``invalid_request_error`` - wrong method on a known route
* 413 ``invalid_request_error`` - body over ``--max-request-bytes``
* 422 ``invalid_request_error`` - malformed body: wrong type, missing field
* 503 ``service_unavailable_error`` - queue full or model loop dead
* 500 ``internal_error`` - a bug; logged with its traceback, never caused by input

``BodyGuardMiddleware`` (pure ASGI) rejects oversized bodies before any
handler runs and checks the bearer token when ``--api-key`` is set (every
route but ``/health``, ``/abort_request`` and the info routes included).  On a
deployed worker that key is the *worker key* the router sends, never a
client's key (docs/router.md, "Authentication").
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error with an HTTP status that becomes an OpenAI-style JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[str | int] = None,
        type: Optional[str] = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code, type=self.type)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(
    status: int,
    message: str,
    *,
    param: Optional[str] = None,
    code: Optional[str | int] = None,
    type: Optional[str] = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type or _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


_TYPE_TAGS = {"str", "int", "bool", "float", "list", "dict", "none"}


def _clean_loc(loc: tuple) -> list[str]:
    """Field path of a pydantic error without union-member tags (``GenerateSamplingParams``, ``list[str]``)."""
    out = []
    for part in loc:
        if isinstance(part, int):
            out.append(str(part))
            continue
        part = str(part)
        if part == "body" or part in _TYPE_TAGS or part[:1].isupper() or any(c in part for c in "[]'()-"):
            continue
        out.append(part)
    return out


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A 422 naming the offending field (``messages.0.role``).

    With unions, pydantic reports one error per member; the deepest one is
    the member the client meant (a dict with a bad key, not "not a list").
    """
    errors = exc.errors()
    if not errors:
        return APIError(422, "invalid request body")
    best = max(errors, key=lambda e: len(_clean_loc(tuple(e.get("loc", ())))))
    param = ".".join(_clean_loc(tuple(best.get("loc", ())))) or None
    msg = best.get("msg", "invalid value")
    where = f"{param}: " if param else ""
    return APIError(422, f"{where}{msg}", param=param, code="invalid_value")


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON, or a 400 for an empty / malformed body."""
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body nests JSON too deeply", code="invalid_json") from None


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ValidationError)
    async def _pydantic_error(_: Request, exc: ValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: "no such route", 405: "method not allowed on this route"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(
            error_body(exc.status_code, message), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)


class BodyGuardMiddleware:
    """Reject bodies over ``max_bytes`` (413) and, with ``api_key``, unauthenticated calls (401).

    The body is read here once (at most ``max_bytes + 1`` bytes are buffered)
    and replayed to the app, so a handler never sees an oversized body.
    """

    OPEN_PATHS = ("/health",)

    def __init__(self, app: Any, max_bytes: int, api_key: Optional[str] = None):
        self.app = app
        self.max_bytes = max_bytes
        self.api_key = api_key
        self._key_digest = hashlib.sha256((api_key or "").encode("utf-8", "replace")).digest()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key and scope.get("path") not in self.OPEN_PATHS and not self._authorized(scope):
            await self._reply(
                send,
                APIError(
                    401, "missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
                ),
            )
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await self._reply(send, APIError(400, "invalid Content-Length header"))
                return
            if declared > self.max_bytes:
                await self._reply(send, self._too_large())
                return
        if scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE") and length is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._reply(send, self._too_large())
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body is larger than {self.max_bytes} bytes", code="request_too_large")

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope.get("headers") or []:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                # digests of equal length: the compare's time says nothing of the key's bytes or length
                got = hashlib.sha256(token.strip().encode("utf-8", "replace")).digest()
                return scheme.lower() == "bearer" and hmac.compare_digest(got, self._key_digest)
        return False

    @staticmethod
    async def _reply(send: Any, err: APIError) -> None:
        payload = json.dumps(err.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})
