"""``HEAD`` as ``GET`` without the body (:mod:`flowprefill.web.head`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from flowprefill.web.head import head_as_get, is_head


def _app() -> Any:
    app = FastAPI()

    @app.get("/text")
    async def text() -> PlainTextResponse:
        return PlainTextResponse("hello", headers={"x-mine": "1"})

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def parts() -> AsyncIterator[str]:
            for part in ("a", "b", "c"):
                yield part

        return StreamingResponse(parts(), media_type="text/plain")

    @app.post("/only-post")
    async def only_post() -> dict[str, str]:
        return {}

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if is_head(scope):
            await head_as_get(app, scope, receive, send)
        else:
            await app(scope, receive, send)

    return wrapped


async def test_head_is_get_without_the_body() -> None:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=_app()), base_url="http://t"
    ) as c:
        for path in ("/text", "/stream", "/only-post", "/missing"):
            head, get = await c.head(path), await c.get(path)
            assert head.status_code == get.status_code, path
            assert head.content == b"" and get.content, path
            assert dict(head.headers) == dict(get.headers), path
        assert (await c.head("/only-post")).status_code == 405
        assert (await c.head("/text")).headers["content-length"] == "5"


async def test_a_streamed_get_becomes_one_empty_body_message() -> None:
    sent: list[Message] = []
    scope = {
        "type": "http",
        "method": "HEAD",
        "path": "/stream",
        "headers": [],
        "query_string": b"",
        "root_path": "",
        "scheme": "http",
        "server": ("t", 80),
        "http_version": "1.1",
    }

    requests = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> Message:
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    await _app()(scope, receive, send)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert scope["method"] == "HEAD"  # the server's scope is left as it was
