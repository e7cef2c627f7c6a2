"""``unless_disconnected``: the work's result, or the work cancelled and
:class:`ClientDisconnected` once the client leaves; a cancellation from elsewhere stays a
cancellation, and the caller's task is left with no cancellation pending."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from starlette.requests import Request

from flowprefill.web.disconnect import ClientDisconnected, DisconnectWatch, unless_disconnected


def _request(leave: asyncio.Event) -> Request:
    async def receive() -> dict[str, Any]:
        await leave.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


class Work:
    def __init__(self, *, swallow: bool = False) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False
        self.swallow = swallow

    async def __call__(self) -> str:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            if not self.swallow:
                raise
        return "done"


async def test_the_work_s_result_when_the_client_stays() -> None:
    work, leave = Work(), asyncio.Event()
    work.release.set()
    assert await unless_disconnected(_request(leave), work()) == "done"
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)  # nothing pending for this task either
    assert not work.cancelled


@pytest.mark.parametrize("swallow", [False, True])
async def test_a_client_that_leaves_cancels_the_work(swallow: bool) -> None:
    work, leave = Work(swallow=swallow), asyncio.Event()

    async def serve() -> str:
        try:
            return await unless_disconnected(_request(leave), work())
        except ClientDisconnected:
            task = asyncio.current_task()
            assert task is not None and task.cancelling() == 0
            await asyncio.sleep(0.01)  # the caller goes on: no cancellation left over
            return "499"

    served = asyncio.create_task(serve())
    await work.started.wait()
    leave.set()
    assert await served == "499"
    assert work.cancelled


async def test_a_cancellation_from_elsewhere_is_not_a_disconnect() -> None:
    work, leave = Work(), asyncio.Event()
    served = asyncio.create_task(unless_disconnected(_request(leave), work()))
    await work.started.wait()
    served.cancel()
    leave.set()  # and the client leaves at the same time
    with pytest.raises(asyncio.CancelledError):
        await served
    assert work.cancelled


async def test_a_shared_watch_is_left_running_and_a_gone_one_refuses_at_once() -> None:
    work, leave = Work(), asyncio.Event()
    work.release.set()
    request = _request(leave)
    watch = DisconnectWatch(request.receive)
    assert await unless_disconnected(request, work(), watch) == "done"
    leave.set()  # the client leaves after the work: seen, nobody cancelled
    await asyncio.sleep(0.01)
    task = asyncio.current_task()
    assert watch.gone and task is not None and task.cancelling() == 0
    late = Work()
    coroutine = late()
    with pytest.raises(ClientDisconnected):
        await unless_disconnected(request, coroutine, watch)
    assert inspect.getcoroutinestate(coroutine) == "CORO_CLOSED"  # no "never awaited"
    assert not late.started.is_set()
    watch.close()
