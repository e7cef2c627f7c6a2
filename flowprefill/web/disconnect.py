"""Stop waiting for work whose client has gone.

Both servers answer only after a long wait (a queued prefill, an upstream call); a client
that disconnects meanwhile must cancel that work, not leave it running for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed its connection before the answer was ready (answered 499)."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``; if the client disconnects first, cancel ``work`` and raise
    :class:`ClientDisconnected`.

    The request body must have been read already (FastAPI has, for a body parameter):
    the watcher reads the connection's remaining messages, of which only
    ``http.disconnect`` is left.
    """
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled ourselves: take the work down with us
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        raise ClientDisconnected("client disconnected")
    return task.result()
