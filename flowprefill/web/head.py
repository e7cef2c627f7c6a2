"""``HEAD`` answered as ``GET`` is, without the body (RFC 9110 9.3.2), on every path.

FastAPI's ``@app.get`` routes answer ``GET`` only (Starlette's plain routes add ``HEAD``,
FastAPI's do not), so a ``HEAD /metrics`` — aiperf sends one before it scrapes — was a 405.
:func:`head_as_get` serves a ``HEAD`` request as the app serves ``GET`` on the same path:
the same status and headers (``content-type``, ``content-length`` of the body ``GET``
sends, and the rest), and no body. A path without ``GET`` answers ``HEAD`` with ``GET``'s
404 or 405, bodiless too.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def is_head(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["method"] == "HEAD"


async def head_as_get(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Run ``app`` on the ``HEAD`` request ``scope`` as a ``GET``; send its answer's start
    as it is, and one empty body in place of its body messages."""
    ended = False

    async def without_body(message: Message) -> None:
        nonlocal ended
        if message["type"] != "http.response.body":
            await send(message)
        elif not message.get("more_body", False) and not ended:
            ended = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    # A copy: the server's own scope still says HEAD (uvicorn then sends no body either).
    await app({**scope, "method": "GET"}, receive, without_body)
