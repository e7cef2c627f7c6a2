"""The gateway's ASGI entry: the two completion endpoints without FastAPI's request path.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are most of what a gateway
serves, and FastAPI's way to them — Starlette's middleware stack, the router, FastAPI's
dependency solving and body parsing, a wrapper around every ASGI ``send`` at each layer —
cost about as much CPU per request as classification, routing and both upstream calls
together. :class:`GatewayApp` serves a well-formed request to those endpoints itself, the
way FastAPI would, and hands everything else to the FastAPI app.

What stays identical, by construction:

- The body is read, parsed and validated as FastAPI does it (``json.loads``, then the
  model's validation with ``from_attributes``), and only when the request is ``POST`` to
  one of the two paths exactly (no ``root_path``), with ``content-type:
  application/json`` and a body that is a JSON object the model accepts. Any other
  request, and any body that fails, is handed to the FastAPI app with what was read
  replayed (messages, then the exception ``receive`` raised: a body over the limit, a
  body deadline): FastAPI answers it with its own errors and handlers.
- The endpoint's work is the same function the FastAPI routes call (``serve``).
- ``HEAD`` on any path is answered as the FastAPI app answers ``GET`` there, without
  the body (:mod:`flowprefill.web.head`: FastAPI's ``GET`` routes have no ``HEAD``).
- Exceptions go to the FastAPI app's own exception handlers (looked up by class, as
  Starlette's ``ExceptionMiddleware`` does, with the same rule once the answer started),
  and one no handler takes is answered and logged as
  :class:`~flowprefill.web.errors.UnexpectedErrors` does.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from starlette._utils import is_async_callable
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ExceptionHandler, Message, Receive, Scope, Send

from flowprefill.gateway.openai_api import ChatCompletionRequest, CompletionRequest
from flowprefill.web.errors import error_response, log_unexpected
from flowprefill.web.head import head_as_get, is_head

Body = CompletionRequest | ChatCompletionRequest
Serve = Callable[[Request, Body, str], Awaitable[Response]]
"""The endpoint: (request, validated body, path) -> the answer."""

JSON = "application/json"


class Replay:
    """``receive`` that gives the messages already read, then raises what reading them
    raised (if anything), then reads on."""

    def __init__(self, messages: list[Message], error: Exception | None, receive: Receive) -> None:
        self.messages = messages
        self.error = error
        self.receive = receive

    async def __call__(self) -> Message:
        if self.messages:
            return self.messages.pop(0)
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return await self.receive()


class GatewayApp:
    """ASGI app: ``app`` (FastAPI) for everything, but well-formed completion requests,
    which go to ``serve`` directly (see the module docstring)."""

    def __init__(self, app: FastAPI, serve: Serve) -> None:
        self.app = app
        self.serve = serve
        self.models: dict[str, type[Body]] = {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
        }
        # As Starlette.build_middleware_stack hands them to ExceptionMiddleware.
        self.handlers: dict[Any, ExceptionHandler] = {}
        self.status_handlers: dict[int, ExceptionHandler] = {}
        for key, handler in app.exception_handlers.items():
            if key in (500, Exception):
                continue
            if isinstance(key, int):
                self.status_handlers[key] = handler
            else:
                self.handlers[key] = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in self.models
            and not scope.get("root_path")
        ):
            await self._direct(scope, receive, send)
        elif is_head(scope):
            await head_as_get(self.app, scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _direct(self, scope: Scope, receive: Receive, send: Send) -> None:
        messages: list[Message] = []
        chunks: list[bytes] = []
        try:
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request":
                    break  # the client left: FastAPI says what that becomes
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except Exception as e:
            await self.app(scope, Replay(messages, e, receive), send)
            return
        body = (
            self._parse(scope, b"".join(chunks)) if messages[-1]["type"] == "http.request" else None
        )
        if body is None:
            await self.app(scope, Replay(messages, None, receive), send)
            return
        await self._answer(scope, receive, send, body)

    def _parse(self, scope: Scope, raw: bytes) -> Body | None:
        """The validated body, or None: FastAPI answers (content type, JSON, validation)."""
        content_type = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
                break
        if content_type != JSON.encode() or not raw:
            return None
        try:
            data = json.loads(raw)
        except Exception:  # not JSON, not UTF-8, nested too deep (RecursionError): as FastAPI
            return None
        if not isinstance(data, dict):
            return None
        model: type[BaseModel] = self.models[scope["path"]]
        try:
            parsed = model.model_validate(data, from_attributes=True)
        except Exception:  # ValidationError, or what FastAPI would meet too
            return None
        assert isinstance(parsed, CompletionRequest | ChatCompletionRequest)
        return parsed

    async def _answer(self, scope: Scope, receive: Receive, send: Send, body: Body) -> None:
        started = False

        async def sender(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        request = Request(scope, receive)
        try:
            try:
                response = await self.serve(request, body, scope["path"])
                await response(scope, receive, sender)
            except Exception as exc:
                handler = self._handler(exc)
                if handler is None:
                    raise
                if started:
                    raise RuntimeError(
                        "Caught handled exception, but response already started."
                    ) from exc
                if is_async_callable(handler):
                    answer = await handler(request, exc)  # type: ignore[arg-type]
                else:
                    answer = await run_in_threadpool(handler, request, exc)
                if answer is not None:
                    await answer(scope, receive, sender)
                exc.__traceback__ = None
        except Exception as exc:
            log_unexpected(exc)
            if not started:
                await error_response(500, f"internal error: {type(exc).__name__}")(
                    scope, receive, send
                )

    def _handler(self, exc: Exception) -> ExceptionHandler | None:
        """The FastAPI app's handler for ``exc``, as Starlette looks it up."""
        if isinstance(exc, HTTPException):
            handler = self.status_handlers.get(exc.status_code)
            if handler is not None:
                return handler
        for cls in type(exc).__mro__:
            if cls in self.handlers:
                return self.handlers[cls]
        return None
