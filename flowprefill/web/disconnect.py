"""Stop waiting for work whose client has gone.

Both servers answer only after a long wait (a queued prefill, an upstream call); a client
that disconnects meanwhile must cancel that work, not leave it running for nobody.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed its connection before the answer was ready (answered 499)."""


class DisconnectWatch:
    """One request's watch for its client leaving: one task reads the connection's
    messages (``receive``; the request body must have been read already) and, at
    ``http.disconnect``, sets :attr:`gone` and cancels the task it follows. A request
    that waits (for its first token) and then streams follows both with the one watcher
    (:func:`unless_disconnected`, then the streaming response) instead of one each."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.gone = False
        """The client has left."""
        self._target: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Future[None] | None = None

    def follow(self, task: asyncio.Task[Any] | None) -> None:
        """Cancel ``task`` when the client leaves (None: nobody, for now)."""
        self._target = task
        if task is not None and self._watcher is None and not self.gone:
            self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._target is not None:
            self._target.cancel()

    def close(self) -> None:
        """Stop watching."""
        self._target = None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None


async def unless_disconnected(
    request: Request, work: Awaitable[T], watch: DisconnectWatch | None = None
) -> T:
    """``await work``; if the client disconnects first, cancel ``work`` and raise
    :class:`ClientDisconnected`. ``watch``: the request's watch, to follow on with (it is
    left running, following nobody); None: one of its own, closed after.

    The request body must have been read already (FastAPI has, for a body parameter):
    the watcher reads the connection's remaining messages, of which only
    ``http.disconnect`` is left.
    """
    # The work runs in this task and the watcher cancels it: a task for the work and
    # asyncio.wait around the pair would cost more than the rest of a short request's
    # bookkeeping. The cancellation is ours only when the watcher saw the disconnect and
    # nobody else cancelled too (uncancel() == 0).
    task = asyncio.current_task()
    assert task is not None, "unless_disconnected runs inside a task"
    own = watch is None
    if watch is None:
        watch = DisconnectWatch(request.receive)
    if watch.gone:
        if inspect.iscoroutine(work):
            work.close()  # never started
        raise ClientDisconnected("client disconnected")
    watch.follow(task)
    try:
        result = await work
    except asyncio.CancelledError:
        if watch.gone and task.uncancel() == 0:
            raise ClientDisconnected("client disconnected") from None
        raise
    finally:
        if own:
            watch.close()
        else:
            watch.follow(None)
    # The work swallowed the cancellation and finished anyway: the client is still gone.
    if watch.gone and task.uncancel() == 0:
        raise ClientDisconnected("client disconnected")
    return result
