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
    # The work runs in this task and one watcher cancels it: a task for the work and
    # asyncio.wait around the pair would cost more than the rest of a short request's
    # bookkeeping. The cancellation is ours only when the watcher saw the disconnect and
    # nobody else cancelled too (uncancel() == 0).
    task = asyncio.current_task()
    assert task is not None, "unless_disconnected runs inside a task"
    gone = False

    async def disconnected() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(disconnected())
    try:
        result = await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            raise ClientDisconnected("client disconnected") from None
        raise
    finally:
        watcher.cancel()
    # The work swallowed the cancellation and finished anyway: the client is still gone.
    if gone and task.uncancel() == 0:
        raise ClientDisconnected("client disconnected")
    return result
