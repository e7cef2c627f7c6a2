"""OpenAI-style error bodies for every failure a client can cause.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` with a 4xx status for
client mistakes (named precisely: which field, what was wrong) and 5xx for ours; never a
traceback.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flowprefill.errors import InvalidRequestError

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    499: "cancelled",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    type_: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(message, type_ or ERROR_TYPES.get(status, "error"), param),
        status_code=status,
        headers=headers,
    )


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    if param is None:
        # About the body as a whole: pydantic's own words ("Field required", "Input should
        # be a valid dictionary") would not say that it is the body that is wrong.
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        return _describe_body(first, exc.body) + more, None
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


JSON_BODY = "a JSON object sent as content-type application/json"


def _describe_body(error: Any, body: object) -> str:
    if error.get("type") == "missing":
        return f"request body is required: {JSON_BODY}"
    if isinstance(body, bytes | bytearray):  # FastAPI parses JSON only if declared JSON
        return f"request body is not JSON (by its content-type): send {JSON_BODY}"
    return f"request body: {error.get('msg', 'invalid value')}"


# FastAPI's answer to a body it could not decode for another reason than bad JSON syntax
# (bytes that are not UTF-8); it names neither the cause nor the fix.
_FASTAPI_PARSE_ERROR = "There was an error parsing the body"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.detail == _FASTAPI_PARSE_ERROR:
            return error_response(400, "request body is not valid JSON: not UTF-8 text")
        # The exception's headers are part of the answer: a 405's ``Allow`` (RFC 9110
        # requires it), a 401's ``WWW-Authenticate``.
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    app.add_middleware(UnexpectedErrors)


def log_unexpected(exc: BaseException) -> None:
    """Log an exception no handler took by type and traceback, never by message (see
    :class:`UnexpectedErrors`)."""
    log.error(
        "unhandled %s (message withheld: it may echo the request)\n%s",
        type(exc).__name__,
        "".join(traceback.format_tb(exc.__traceback__)).rstrip(),
    )


class UnexpectedErrors:
    """ASGI middleware: an exception no handler took is answered 500 (unless the response
    has started) and logged by type and traceback, not by message: a message may echo the
    request (pydantic's ``input_value``, a tokenizer's input), and logs carry request ids,
    never prompt text. Not re-raised: Starlette's outermost middleware would hand it on to
    uvicorn, which logs it whole."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            log_unexpected(exc)
            if not started:
                await error_response(500, f"internal error: {type(exc).__name__}")(
                    scope, receive, send
                )


class BodySizeLimit:
    """ASGI middleware: refuse bodies over ``max_bytes`` with 413 before reading them all,
    and bodies not received within ``body_timeout_s`` of the request's start with 408.

    A declared ``Content-Length`` over the limit is answered at once (no body byte read);
    a chunked body is counted as it streams in and cut off at the limit. The deadline
    bounds a slowloris client that trickles its body (each byte in time for any per-read
    timeout); it applies only until the body is complete, so receiving
    ``http.disconnect`` later (the servers watch for a client that leaves) is not limited.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        seen = 0
        complete = False
        loop = asyncio.get_running_loop()
        deadline = None if self.body_timeout_s is None else loop.time() + self.body_timeout_s

        async def limited() -> Message:
            # Chunked bodies have no Content-Length: count as they stream in. FastAPI lets
            # an HTTPException raised while reading the body through to the handlers.
            nonlocal seen, complete
            if complete or deadline is None:
                msg = await receive()
            else:
                try:
                    # A timeout scope, not wait_for: no task per message.
                    async with asyncio.timeout_at(deadline):
                        msg = await receive()
                except TimeoutError:
                    raise StarletteHTTPException(
                        408, f"request body not received within {self.body_timeout_s:g} s"
                    ) from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                complete = not msg.get("more_body", False)
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, self._message())
            return msg

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"request body is larger than {self.max_bytes} bytes"

    async def _reject(self, send: Send) -> None:
        resp = error_response(413, self._message())
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(resp.body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": resp.body})
